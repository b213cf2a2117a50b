"""FSDP2 over FP8 primary weights: all-gather the FP8 bytes and scales, not a high-precision copy.

`torch.distributed.fsdp.fully_shard` shards an engine quantized weight by rows without
dequantizing it (the row-slice ops in `engine/tensors/sharding.py`), so every shard stays an
engine quantized tensor and the optimizer updates it as before (dequantize, update, quantize back
with the weight's quantizer). Before each forward FSDP2 calls the tensor's
`fsdp_pre_all_gather`, which hands it plain uint8 tensors to all-gather, and after the
collective `fsdp_post_all_gather`, which builds the unsharded quantized weight from them:

* one scale per tensor (delayed and current scaling): only the rowwise FP8 bytes are gathered
  (1 byte per element); every rank holds the same scale, which travels in the metadata. The
  columnwise (transposed) copy is made from the gathered bytes, exactly. Shards may be uneven
  (e.g. 30 rows on 4 ranks): the short shard is padded to FSDP2's chunk size.
  Current scaling needs the amax of the whole weight when the optimizer requantizes a shard:
  the shard's quantizer gets the shard group as `amax_reduction_group` here (at the first
  all-gather), so each requantization all-reduces its amax, and every shard is quantized with
  the scale the whole weight would get. A multi-tensor update (`foreach=True` optimizers) agrees
  on all its weights' amaxes in one all-reduce (`engine.tensors.quantized`); a for-loop
  optimizer makes one 4-byte all-reduce per weight update.
  Delayed scaling quantizes with the shared delayed scale; the amax each shard records is
  all-reduced with the other amaxes at the autocast's update, as without FSDP.
* block scales (128x128 tiles, MX): the bytes and the scales of the rows a rank holds are
  gathered together; a 128x128 weight's columnwise copy is made from the gathered rows, MX's
  (not derivable) is gathered too. Shards hold whole scale blocks of rows, and all shards are
  equal: `rows` must be a multiple of `world_size * block rows` (128 for tiles, 32 for MX).

Weights FSDP2 cannot shard that way are kept whole on every rank instead (`replicated_weights`:
pass them to `fully_shard(..., ignored_params=...)`, and `average_gradients` all-reduces their
gradients as DDP would). FSDP2 cuts dim 0 where `torch.chunk` does (every ceil(rows / N) rows;
another dim only into equal parts), so a 384-row weight of 128-row blocks on 2 ranks would be cut
at row 192, inside a block; and a block's scale cannot be split: after the optimizer step each
rank requantizes its own rows, and the scale of a block depends on all of its rows (making the
ranks agree would take a per-block amax exchange and shards that start inside a block, which no
storage has). A weight whose layout has no row slices (`engine/tensors/sharding.py`: NVFP4, FP8
rowwise) is kept whole on any number of ranks. Such a weight costs its full size (and its
optimizer state) on every rank and is never gathered; the model's other weights are sharded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.quantizers.rules import CurrentRule
from engine.tensors.quantized import QuantizedTensor
from engine.tensors.sharding import row_block
from engine.tensors.storage import QuantizedTensorBase

__all__ = ["all_gather_fields", "average_gradients", "post_all_gather", "pre_all_gather", "replicated_weights",
           "shard_refusal"]


@dataclass
class GatherMetadata:
    """What `post_all_gather` needs besides the gathered bytes (local to the rank)."""

    shape: torch.Size
    storage: QuantizedTensorBase  # the shard (scheme, quantizer, nominal dtype)
    fields: tuple[str, ...]  # the buffers gathered, in order
    scale_inv: torch.Tensor | None  # the per-tensor scale (the same on every rank)


def all_gather_fields(storage: QuantizedTensorBase) -> tuple[str, ...]:
    """The buffers FSDP2 gathers for a quantized weight: the rowwise data (with its scales unless there is one
    per tensor), and the columnwise buffers where the scheme cannot derive them from the rowwise ones."""
    scheme = storage.scheme
    fields = ["rowwise_data"] + ([] if scheme.rowwise_block.is_tensor else ["rowwise_scale_inv"])
    if storage.has_columnwise and not scheme.derivable:
        fields += ["columnwise_data", "columnwise_scale_inv"]
    return tuple(fields)


def shard_refusal(weight: torch.Tensor, world_size: int) -> str | None:
    """Why FSDP2 cannot shard `weight`, an FP8 primary weight, over `world_size` ranks and all-gather it as FP8
    (None if it can, and for any tensor that is not an engine quantized tensor: FSDP2 shards those as they are)."""
    if not isinstance(weight, QuantizedTensor) or world_size == 1:
        return None
    return _refusal(weight.qstorage, weight.shape, world_size)


def _refusal(storage: QuantizedTensorBase, shape: torch.Size, world_size: int) -> str | None:
    if not storage.scheme.sliceable or len(shape) != 2:
        return (f"a {len(shape)}D {storage.scheme.name} weight has no row shards (FSDP2 all-gathers 2D weights whose "
                f"scheme has row slices: `Scheme.sliceable`)")
    if not storage.has_rowwise:
        return f"a {storage.scheme.name} weight without rowwise data"
    block = row_block(storage)
    if block > 1 and shape[0] % (world_size * block):
        return (f"its {shape[0]} rows do not split into {world_size} equal shards of whole {block}-row scale blocks "
                f"(rows must be a multiple of world_size * {block} = {world_size * block})")
    return None


def _check_shardable(storage: QuantizedTensorBase, shape: torch.Size, world_size: int) -> None:
    reason = _refusal(storage, shape, world_size)
    if reason is not None:
        raise ValueError(f"FSDP2 over a {'x'.join(map(str, shape))} {storage.scheme.name} weight on {world_size} "
                         f"ranks: {reason}; keep it whole on every rank: fully_shard(..., ignored_params=...) with "
                         "engine.distributed.fsdp.replicated_weights and average_gradients")


def _agree_on_amax(storage: QuantizedTensorBase, group: Any) -> None:
    """A per-tensor current-scaling shard requantizes with the amax of the whole weight (all-reduced over `group`)."""
    q = storage.quantizer
    if q is None or not isinstance(q.rule, CurrentRule) or not storage.scheme.rowwise_block.is_tensor:
        return
    if q.rule.amax_reduction_group is not group:
        q = q.copy()
        q.rule = CurrentRule(q.rule.amax_epsilon, group)
        storage.quantizer = q


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def pre_all_gather(shard: QuantizedTensor, mesh: Any, outer_size: torch.Size) -> tuple[tuple[torch.Tensor, ...],
                                                                                       GatherMetadata]:
    """(uint8 tensors FSDP2 all-gathers, metadata): this rank's FP8 bytes and scales, padded to the chunk size."""
    storage, world_size = shard.qstorage, mesh.size()
    shape = torch.Size(outer_size)
    _check_shardable(storage, shape, world_size)
    _agree_on_amax(storage, mesh.get_group())
    chunk = -(-shape[0] // world_size)
    fields = all_gather_fields(storage)
    inputs = []
    for name in fields:
        t = getattr(storage, name)
        if name == "columnwise_data" or name == "columnwise_scale_inv":
            if storage.scheme.columnwise_transposed:  # [K, rows]: gather the rows' columns as rows of [rows, K]
                t = t.t()
        t = _as_bytes(t)
        if name == "rowwise_data" and t.shape[0] < chunk:  # an uneven (per-tensor) shard: pad to FSDP2's chunk
            padded = t.new_zeros((chunk, *t.shape[1:]))
            padded[: t.shape[0]] = t
            t = padded
        inputs.append(t)
    scale = storage.rowwise_scale_inv.clone() if storage.scheme.rowwise_block.is_tensor else None
    return tuple(inputs), GatherMetadata(shape, storage, fields, scale)


def _unsharded_buffers(outputs: tuple[torch.Tensor, ...], meta: GatherMetadata) -> dict[str, torch.Tensor]:
    """The gathered buffers in the unsharded layout (views of FSDP2's outputs, or copies for transposed ones)."""
    storage, n = meta.storage, meta.shape[0]
    buffers = {}
    for name, out in zip(meta.fields, outputs):
        dtype = storage.scheme.data_dtype if name.endswith("_data") else storage.scheme.scale.dtype
        t = out.view(dtype)
        if name == "rowwise_data":
            t = t[:n]
        elif name.startswith("columnwise") and storage.scheme.columnwise_transposed:
            t = t.t().contiguous()
        buffers[name] = t
    return buffers


def post_all_gather(outputs: tuple[torch.Tensor, ...], meta: GatherMetadata, param_dtype: torch.dtype, *,
                    out: QuantizedTensor | None = None) -> tuple[QuantizedTensor, tuple[torch.Tensor, ...]] | None:
    """The unsharded weight (nominal dtype `param_dtype`) and the tensors FSDP2 frees with it; with `out`,
    that weight (from an earlier call) is refreshed in place: the gathered bytes are already in its buffers."""
    storage = meta.storage
    buffers = _unsharded_buffers(outputs, meta)
    if meta.scale_inv is not None:
        buffers["rowwise_scale_inv"] = meta.scale_inv
    full = QuantizedTensorBase(scheme=storage.scheme, shape=meta.shape, nominal_dtype=param_dtype,
                               quantizer=storage.quantizer, **buffers)
    derived: list[torch.Tensor] = []  # made here, not views of FSDP2's outputs: FSDP2 frees them at reshard
    if storage.scheme.derivable:
        full.update_usage(columnwise_usage=True)
        derived.append(full.columnwise_data)
        if not full.shares_scale_inv:
            derived.append(full.columnwise_scale_inv)
    elif "columnwise_data" in buffers and storage.scheme.columnwise_transposed:
        derived += [full.columnwise_data, full.columnwise_scale_inv]
    if out is None:
        return QuantizedTensor.wrap(full), tuple(derived)
    target = out.qstorage
    for name, t in full.buffers().items():
        mine = getattr(target, name)
        if t is not None and mine is not t and mine.data_ptr() != t.data_ptr():
            # a derived copy or the per-tensor scale, into the buffer FSDP2 re-allocated: the same values a
            # backward may have saved, so their version stays (as FSDP2 keeps its all-gather outputs')
            with torch.autograd._unsafe_preserve_version_counter(mine):
                mine.copy_(t)
    target.quantizer = storage.quantizer
    return None


def replicated_weights(module: torch.nn.Module, world_size: int) -> dict[str, tuple[torch.nn.Parameter, str]]:
    """The FP8 primary weights of `module` that FSDP2 cannot shard over `world_size` ranks (`shard_refusal`), by
    name, with the reason: pass them to every `fully_shard(..., ignored_params=...)` call, so that each rank keeps
    them whole, and average their gradients over the ranks (`average_gradients`)."""
    out = {}
    for name, param in module.named_parameters():
        reason = shard_refusal(param, world_size)
        if reason is not None:
            out[name] = (param, reason)
    return out


def average_gradients(params: list[torch.nn.Parameter], group: Any) -> list[Any]:
    """For parameters every rank holds whole (FSDP2's `ignored_params`): once a gradient is accumulated in backward,
    all-reduce it over `group` and divide by the group's size, as DDP (or FSDP2, for its own parameters) does, so
    every rank's optimizer makes the same update. One collective per parameter and backward; returns the hook
    handles."""
    import torch.distributed as dist

    size = dist.get_world_size(group)

    def average(param: torch.Tensor) -> None:
        if param.grad is not None:
            dist.all_reduce(param.grad, group=group)
            param.grad.div_(size)

    return [p.register_post_accumulate_grad_hook(average) for p in params]
