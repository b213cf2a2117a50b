"""Engine linear layers on DTensors: the quantized GEMMs run on this rank's shards, outputs go back as DTensors.

Which computation runs follows the weight's placement on a 1-D mesh (a plain tensor counts as
replicated), as torch's own tensor-parallel `nn.Linear` does:

* `Shard(0)` (column parallel): y = x W_r^T + b_r is this rank's slice of the output, `Shard(-1)`.
  x replicated: dx is a partial sum (`Partial`, reduced where x came from). x sharded along a
  sequence dim (sequence parallel): x is all-gathered first, in FP8 where the recipe allows, and
  dx is reduce-scattered back (`gathered_linear`).
* `Shard(1)` (row parallel): x must be `Shard(-1)`; y = x_r W_r^T is a `Partial` sum; the bias
  is added on the mesh's first rank only, so the reduction (all-reduce to `Replicate`, or
  reduce-scatter to a sequence shard) adds it once. Its gradient is the full output gradient's
  sum on every rank (replicated).
* `Replicate`: y = x W^T + b on x's local piece, with x's placement (e.g. a batch or sequence
  shard); the weight's gradient is then a partial sum over ranks.

Per-tensor scales are agreed across the mesh wherever a rank quantizes a shard of a tensor
(`tp_quantizers`: weights, sharded inputs, sharded output gradients), so a column-parallel
layer computes exactly the columns the single-process layer does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from engine import autocast
from engine.dtensor import is_dtensor, settled
from engine.distributed.gathered_linear import GatheredLinear
from engine.distributed.tp_quantizers import reducing_state
from engine.modules.linear_function import LinearArgs, LinearFunction
from engine.recipes import DelayedScaling, Role
from engine.tensors import QuantizedTensor

INPUT, WEIGHT, GRAD = frozenset({Role.INPUT}), frozenset({Role.WEIGHT}), frozenset({Role.GRAD_OUTPUT})
NONE: frozenset[Role] = frozenset()


def dtensor_linear(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   args: LinearArgs) -> torch.Tensor:
    """y = inp W^T + b where at least one of them is a DTensor; returns a DTensor (see the module docstring)."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = _common_mesh(inp, weight, bias)
    if mesh.ndim != 1:
        raise NotImplementedError(f"engine linear layers take DTensors on a 1-D device mesh (the tensor-parallel "
                                  f"mesh), got a {mesh.ndim}-D mesh {mesh}")
    if isinstance(weight, QuantizedTensor):
        raise NotImplementedError("engine linear layers with FP8 primary weights (fp8_model_init) do not take "
                                  "DTensor inputs; build the model without fp8_model_init for tensor parallelism")
    if args.fuse_wgrad_accumulation:
        raise NotImplementedError("fuse_wgrad_accumulation=True: not supported with DTensor weights or inputs")
    if torch.compiler.is_compiling():
        raise NotImplementedError("engine linear layers on DTensors do not run under torch.compile yet")

    def as_dtensor(t: torch.Tensor | None) -> Any:
        if t is None or is_dtensor(t):
            return t
        return DTensor.from_local(t, mesh, [Replicate()], run_check=False)

    x, w, b = as_dtensor(inp), as_dtensor(weight), as_dtensor(bias)
    if w.ndim != 2:
        raise ValueError(f"weight: expected a 2-D DTensor [out_features, in_features], got shape {tuple(w.shape)}")
    group = mesh.get_group()
    _check_fp8_group(args, group)
    placement = w.placements[0]
    if placement.is_replicate():
        return _replicated(x, w, b, args, group)
    if placement.is_shard(0):
        return _colwise(x, w, b, args, group)
    if placement.is_shard(1) or placement.is_shard(-1):
        return _rowwise(x, w, b, args, group)
    raise ValueError(f"weight: expected placement Shard(0) (column parallel), Shard(1) (row parallel) or "
                     f"Replicate(), got {placement}")


def _common_mesh(*ts: torch.Tensor | None) -> Any:
    meshes = [t.device_mesh for t in ts if is_dtensor(t)]
    for other in meshes[1:]:
        if other != meshes[0]:
            raise ValueError(f"inp, weight and bias: DTensors on different device meshes ({meshes[0]} and {other})")
    return meshes[0]


def _check_fp8_group(args: LinearArgs, group: dist.ProcessGroup) -> None:
    """Delayed scaling agrees on scales by reducing amaxes over fp8_autocast's fp8_group: it must hold the mesh."""
    recipe = args.fwd.recipe if args.fwd is not None else None
    fp8_group = autocast.get_fp8_group()
    if not isinstance(recipe, DelayedScaling) or not recipe.reduce_amax or fp8_group is None:
        return
    missing = set(dist.get_process_group_ranks(group)) - set(dist.get_process_group_ranks(fp8_group))
    if missing:
        raise ValueError(f"fp8_group: delayed scaling reduces amaxes over fp8_autocast's fp8_group, which must "
                         f"contain every rank of the tensor-parallel mesh; ranks {sorted(missing)} are missing")


def _tp_args(args: LinearArgs, group: dist.ProcessGroup, forward: frozenset[Role],
             backward: frozenset[Role]) -> LinearArgs:
    return dataclasses.replace(args, fwd=reducing_state(args.fwd, group, forward),
                               bwd=reducing_state(args.bwd, group, backward))


def _last(p: Any, ndim: int) -> bool:
    return p.is_shard() and p.dim % ndim == ndim - 1


def _out_meta(x: Any, w: Any) -> dict[str, Any]:
    shape = torch.Size((*x.shape[:-1], w.shape[0]))
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return {"shape": shape, "stride": tuple(reversed(stride))}


def _replicated(x: Any, w: Any, b: Any, args: LinearArgs, group: dist.ProcessGroup) -> Any:
    from torch.distributed.tensor import Partial, Replicate

    p = x.placements[0]
    if p.is_partial() or _last(p, x.ndim):
        x = x.redistribute(placements=[Replicate()])
    sharded = x.placements[0].is_shard()
    grad = [Partial()] if sharded else None  # each rank's weight gradient covers its rows of x only
    y = LinearFunction.apply(_local(x), _local(w, grad), _local(b, grad),
                             _tp_args(args, group, INPUT if sharded else NONE, GRAD if sharded else NONE))
    return _Output.apply(y, x.device_mesh, tuple(x.placements), _out_meta(x, w))


def _colwise(x: Any, w: Any, b: Any, args: LinearArgs, group: dist.ProcessGroup) -> Any:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if b is not None and not b.placements[0].is_shard(0):
        b = b.redistribute(placements=[Shard(0)])
    p = x.placements[0]
    uneven = p.is_shard() and x.shape[p.dim] % x.device_mesh.size() != 0  # the gather sends equal pieces
    if p.is_partial() or _last(p, x.ndim) or uneven:
        x = x.redistribute(placements=[Replicate()])
        p = x.placements[0]
    w_l, b_l = _local(w), _local(b)
    if p.is_replicate():
        y = LinearFunction.apply(_local(x, [Partial()]), w_l, b_l, _tp_args(args, group, WEIGHT, GRAD))
    else:  # sequence parallel: x sharded along a dim before the features
        y = GatheredLinear.apply(_local(x), w_l, b_l, _tp_args(args, group, INPUT | WEIGHT, GRAD), group,
                                 p.dim % x.ndim)
    return _Output.apply(y, x.device_mesh, (Shard(x.ndim - 1),), _out_meta(x, w))


def _rowwise(x: Any, w: Any, b: Any, args: LinearArgs, group: dist.ProcessGroup) -> Any:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if not _last(x.placements[0], x.ndim):
        x = x.redistribute(placements=[Shard(x.ndim - 1)])
    if b is not None and not b.placements[0].is_replicate():
        b = b.redistribute(placements=[Replicate()])
    y = LinearFunction.apply(_local(x), _local(w), None, _tp_args(args, group, INPUT | WEIGHT, NONE))
    if b is not None:
        y = _AddOnce.apply(y, _local(b), x.device_mesh.get_local_rank() == 0)
    return _Output.apply(y, x.device_mesh, (Partial(),), _out_meta(x, w))


class _AddOnce(torch.autograd.Function):
    """y + b on one rank (y + 0 elsewhere); b's gradient is the output gradient's sum on every rank."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, b: torch.Tensor, here: bool) -> torch.Tensor:
        ctx.bias_dtype = b.dtype
        return y + b.to(y.dtype) if here else y.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype), None


def _local(t: Any, grad_placements: list[Any] | None = None) -> torch.Tensor | None:
    """This rank's piece of DTensor `t` as a plain tensor (its gradient goes back with `grad_placements`,
    default `t`'s own)."""
    return None if t is None else _ToLocal.apply(t, None if grad_placements is None else tuple(grad_placements))


class _ToLocal(torch.autograd.Function):
    """`DTensor.to_local` whose result, and whose gradient, are plain tensors even when a collective of torch's
    (an asynchronous redistribution) is still writing them."""

    @staticmethod
    def forward(ctx: Any, t: Any, grad_placements: tuple[Any, ...] | None) -> torch.Tensor:
        ctx.mesh, ctx.shape, ctx.stride = t.device_mesh, t.shape, t.stride()
        ctx.placements = grad_placements or tuple(t.placements)
        local = settled(t.to_local())
        return local.view_as(local)  # a new tensor object: autograd must not mark the DTensor's own piece

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None]:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(settled(grad), ctx.mesh, ctx.placements, run_check=False, shape=ctx.shape,
                                  stride=ctx.stride), None


class _Output(torch.autograd.Function):
    """This rank's result as a DTensor with `placements`. Its gradient comes back with those placements (a
    `Partial` output's as `Replicate`: each rank's partial output needs the whole gradient), as a plain tensor."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, mesh: Any, placements: tuple[Any, ...], meta: dict[str, Any]) -> Any:
        from torch.distributed.tensor import DTensor, Replicate

        ctx.grad_placements = tuple(Replicate() if p.is_partial() else p for p in placements)
        return DTensor.from_local(y, mesh, placements, run_check=False, **meta)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[torch.Tensor, None, None, None]:
        if is_dtensor(grad):
            if tuple(grad.placements) != ctx.grad_placements:
                grad = grad.redistribute(placements=ctx.grad_placements)
            grad = grad.to_local()
        return settled(grad), None, None, None
