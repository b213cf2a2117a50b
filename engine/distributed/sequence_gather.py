"""Moving a sequence-sharded activation between ranks: all-gather (quantized or not) and reduce-scatter.

Sequence parallelism shards an activation `[..., S, ..., K]` along its sequence dim. In the 2D
view every GEMM reads (`[M, K]`, M = the leading dims flattened), a rank's shard is `outer`
runs of `rows` consecutive rows (`outer` = the product of the dims before the sequence dim,
`rows` = the local sequence length times the dims between it and K), and the whole tensor puts
each run of rank r after rank r-1's. Gathering a buffer therefore means: split its M axis into
(outer, rows / rows-per-entry), gather, and interleave the ranks' runs.

A quantized tensor gathers exactly when every block of its scales lies inside one run: per
tensor (the scale is agreed across ranks before quantizing, so only the FP8 bytes move),
per-row scales (1x128 blocks, MX's 1x32 rowwise blocks), or blocks along M of a size that
divides `rows` (MX's 32x1 and 1D block scaling's 128x1 columnwise blocks). Everything a
rank sends goes as bytes in one `all_gather_single`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.schemes import Scheme
from engine.tensors import QuantizedTensorBase


@dataclass(frozen=True)
class SeqSplit:
    """Where a rank's rows sit in the whole tensor (see the module docstring)."""

    outer: int
    rows: int
    world: int
    seq_dim: int
    local_shape: torch.Size

    @staticmethod
    def of(local_shape: torch.Size, seq_dim: int, world: int) -> SeqSplit:
        return SeqSplit(math.prod(local_shape[:seq_dim]), math.prod(local_shape[seq_dim:-1]), world, seq_dim,
                        torch.Size(local_shape))

    @property
    def full_shape(self) -> torch.Size:
        full = list(self.local_shape)
        full[self.seq_dim] *= self.world
        return torch.Size(full)


def _m_extent(scheme: Scheme, columnwise: bool) -> tuple[int, int]:
    """(axis of M in the stored 2D scale buffer, rows of M one scale covers; 0: the whole dim)."""
    block = scheme.stored_block(columnwise)
    if columnwise and scheme.columnwise_transposed:
        return 1, block.cols
    return 0, block.rows


def gatherable(scheme: Scheme, columnwise: bool, split: SeqSplit) -> bool:
    """Whether one usage of a tensor of `scheme` gathers exactly (a per-tensor scale must also be agreed)."""
    if not scheme.gatherable(columnwise):
        return False  # per-usage amaxes or transformed data: not gathered quantized
    if scheme.stored_block(columnwise).is_tensor:
        return True
    _, extent = _m_extent(scheme, columnwise)
    return extent > 0 and split.rows % extent == 0


def gather_buffers(buffers: list[tuple[torch.Tensor, int]], split: SeqSplit,
                   group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Each 2D buffer (tensor, axis of M) gathered along M over `group`, in one collective."""
    flats = [b.contiguous().reshape(-1).view(torch.uint8) for b, _ in buffers]
    sizes = [f.numel() for f in flats]
    send = torch.cat(flats) if len(flats) > 1 else flats[0]
    recv = torch.empty(split.world * send.numel(), dtype=torch.uint8, device=send.device)
    dist.all_gather_single(recv, send, group=group)
    recv = recv.view(split.world, -1)
    out, offset = [], 0
    for (b, axis), n in zip(buffers, sizes):
        pieces = recv[:, offset:offset + n].contiguous().view(b.dtype)
        offset += n
        if axis == 0:  # [entries, C]: entries = outer * per-rank run
            pieces = pieces.view(split.world, split.outer, -1, b.shape[1]).transpose(0, 1)
            out.append(pieces.reshape(-1, b.shape[1]))
        else:  # [C, entries]
            pieces = pieces.view(split.world, b.shape[0], split.outer, -1).permute(1, 2, 0, 3)
            out.append(pieces.reshape(b.shape[0], -1))
    return out


def gather_tensor(x: torch.Tensor, split: SeqSplit, group: dist.ProcessGroup) -> torch.Tensor:
    """A high-precision shard `[..., S_l, ..., K]` gathered into the whole `[..., S, ..., K]`."""
    (full,) = gather_buffers([(x.reshape(-1, x.shape[-1]), 0)], split, group)
    return full.view(split.full_shape)


def gather_storage(local: QuantizedTensorBase, columnwise: bool, split: SeqSplit,
                   group: dist.ProcessGroup) -> QuantizedTensorBase:
    """One usage of a quantized shard gathered into the whole tensor (`gatherable` must hold; a per-tensor
    scale must be the same on every rank, and is not sent)."""
    scheme, usage = local.scheme, "columnwise" if columnwise else "rowwise"
    data, scale = getattr(local, f"{usage}_data"), getattr(local, f"{usage}_scale_inv")
    if data is None:
        raise ValueError(f"gather_storage: the shard holds no {usage} data")
    data_axis = 1 if columnwise and scheme.columnwise_transposed else 0
    data2d = data if data_axis == 1 else data.reshape(-1, data.shape[-1])
    buffers = [(data2d, data_axis)]
    per_tensor = scheme.stored_block(columnwise).is_tensor
    if not per_tensor:
        buffers.append((scale, _m_extent(scheme, columnwise)[0]))
    gathered = gather_buffers(buffers, split, group)
    full_data = gathered[0] if data_axis == 1 else gathered[0].view(scheme.data_shape(split.full_shape, False))
    full_scale = scale if per_tensor else gathered[1]
    return QuantizedTensorBase(scheme=scheme, shape=split.full_shape, nominal_dtype=local.nominal_dtype,
                               quantizer=local.quantizer, **{f"{usage}_data": full_data,
                                                             f"{usage}_scale_inv": full_scale})


def reduce_scatter_tensor(full: torch.Tensor, split: SeqSplit, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over ranks of `full` `[..., S, ..., N]`, each rank keeping its own sequence shard."""
    n = full.shape[-1]
    chunks = full.reshape(split.outer, split.world, split.rows, n).transpose(0, 1).contiguous()
    out = torch.empty(split.outer, split.rows, n, dtype=full.dtype, device=full.device)
    dist.reduce_scatter_single(out, chunks.view(-1, split.rows, n), group=group)
    return out.view(*split.local_shape[:-1], n)
