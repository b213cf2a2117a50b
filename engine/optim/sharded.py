"""FSDP2 (DTensor) parameters: the optimizer steps each rank's local shard, and keeps states as DTensors.

As torch.optim does with `fully_shard`, a state of a sharded parameter is a DTensor placed like the parameter
(the ops run on the local shards). A compressed state is encoded per local shard: its blocks (1x128 FP8, 256 int8,
32 MX) start at the shard's first element. When every shard starts on a block boundary of the whole flattened
parameter (and DCP's even split of the block scales puts them on the same rank), the shards' blocks ARE the whole
tensor's blocks: the scales are then a DTensor sharded along dim 0 (`aligned`), and a checkpoint reshards
exactly. Otherwise the scales stay local tensors (a rank's blocks are its own), and `checkpoint_states` writes
such a state decoded to fp32 (its exact values) for the checkpoint. Stochastic-rounding counters run over the
whole tensor: a shard draws the random bits of its elements' global positions, so sharding does not change them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

#: a key of a local state view: the parameter's whole element count, by which random-bit counters advance
GLOBAL_NUMEL = "_global_numel"
#: a key of a local state view: the flat position of the shard's first element in the whole parameter
SHARD_OFFSET = "_shard_offset"
VIEW_KEYS = (GLOBAL_NUMEL, SHARD_OFFSET)
COUNTERS = ("state_counter", "sr_counter")


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed
        return None
    return DTensor


def is_sharded(t: object) -> bool:
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def local(t: object) -> object:
    """The local shard of a DTensor, anything else as it is."""
    return t._local_tensor if is_sharded(t) else t


def shard_offset(p: torch.Tensor) -> int:
    """The flat (row-major) position in the whole parameter of the local shard's first element."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    strides = [math.prod(p.shape[i + 1:]) for i in range(len(p.shape))]
    return sum(o * s for o, s in zip(offset, strides))


def aligned(p: torch.Tensor, block: int) -> bool:
    """Whether, on EVERY rank (the answer must agree for the checkpoint to have one layout), the local shard's
    blocks of `block` elements are those of the whole flattened parameter and DCP's even split of the whole
    tensor's block scales gives the rank exactly its own. Computed for all ranks without communication: FSDP2
    cuts dim 0 as torch.chunk does (ceil(rows / N) rows a rank, the last ones shorter or empty)."""
    from torch.distributed.tensor import Shard

    if p.device_mesh.ndim != 1 or list(p.placements) != [Shard(0)] or p.dim() == 0:
        return False
    return whole_blocks(tuple(p.shape), p.device_mesh.size(), block)


def whole_blocks(shape: tuple[int, ...], world: int, block: int) -> bool:
    """`aligned` for a tensor of `shape` cut along dim 0 over `world` ranks (torch.chunk's split)."""
    rows, numel = shape[0], math.prod(shape)
    row = numel // rows if rows else 0
    blocks = -(-numel // block)
    chunk, scale_chunk = -(-rows // world), -(-blocks // world)
    for r in range(world):
        start = min(r * chunk, rows) * row
        n = min(chunk, rows - min(r * chunk, rows)) * row
        scale_start = min(r * scale_chunk, blocks)
        scales = min(scale_chunk, blocks - scale_start)
        if n == 0 and scales == 0:
            continue
        if start % block or scale_start != start // block or scales != -(-n // block):
            return False
        if n % block and start + n != numel:
            return False
    return True


def unwrap(p: torch.Tensor, state: dict) -> dict:
    """The state of `p`'s local shard: local tensors; counters moved to the shard's first element."""
    view = {k: local(v) for k, v in state.items()}
    start = shard_offset(p)
    for key in COUNTERS:
        if key in view:
            view[key] = view[key].clone()
            view[key][1:].add_(start)
    view[GLOBAL_NUMEL], view[SHARD_OFFSET] = p.numel(), start
    return view


def has_states(state: dict) -> bool:
    """Whether a parameter's state (or local view) holds anything yet."""
    return any(k not in VIEW_KEYS for k in state)


def rewrap(p: torch.Tensor, view: dict, blocks: dict[str, int]) -> dict:
    """The DTensor state of `p` from its local view: states of p's shape placed like p; the scales of state
    `name` (`blocks[name]` elements a block) sharded along dim 0 when `aligned`, else kept local."""
    from torch.distributed.tensor import DTensor, Shard

    view = {k: v for k, v in view.items() if k not in VIEW_KEYS}
    start = shard_offset(p)
    shape = local(p).shape
    out = {}
    for key, v in view.items():
        if key in COUNTERS:
            v = v.clone()
            v[1:].sub_(start)
        elif key.endswith("_scale") and isinstance(v, torch.Tensor):
            block = blocks.get(key[: -len("_scale")], 0)
            if block and aligned(p, block):
                v = DTensor.from_local(v, p.device_mesh, [Shard(0)], run_check=False,
                                       shape=torch.Size([-(-p.numel() // block)]), stride=(1,))
        elif isinstance(v, torch.Tensor) and not is_sharded(v) and v.shape == shape and key != "step":
            v = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
        out[key] = v
    return out


@contextlib.contextmanager
def local_params(opt: torch.optim.Optimizer, group: dict, params: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """`params` with each DTensor replaced by its local shard, which carries the local gradient and, in
    `opt.state`, the local state view, for the duration of the block; then the states are DTensors again."""
    swapped = []
    out = []
    try:
        for p in params:
            if not is_sharded(p):
                out.append(p)
                continue
            lp = local(p)
            lp.grad = local(p.grad) if p.grad is not None else None
            opt.state[lp] = unwrap(p, opt.state.get(p, {}))
            swapped.append((p, lp))
            out.append(lp)
        yield out
    finally:
        for p, lp in swapped:
            view = opt.state.pop(lp)
            lp.grad = None
            if any(k not in VIEW_KEYS for k in view):
                opt.state[p] = rewrap(p, view, opt.blocks(group))
