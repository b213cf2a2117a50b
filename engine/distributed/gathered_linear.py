"""The column-parallel linear of sequence parallelism: gather the sequence-sharded input, then y = x W^T + b.

Forward quantizes this rank's shard of x and all-gathers the quantized bytes, so the gather
moves FP8 (`sequence_gather`): with a per-tensor scale agreed across the group first (current
scaling's amax is all-reduced (MAX) over the group; delayed scaling's scales are the same on every
rank), or per-row / per-block scales that travel with the data. Only x's shard waits for
backward, which gathers it again for wgrad (the columnwise copy: derived by transposing for per
tensor scales, gathered as it is for blocks along M). A scheme whose scale blocks straddle two
ranks' rows, or a recipe giving x's two uses different quantizers, gathers x in high
precision instead (one warning per scheme) and runs as `LinearFunction` does.

Backward: dgrad's output is this rank's partial sum for the whole sequence; it is
reduce-scattered (in the activation dtype, as Transformer Engine does) back to sequence shards.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from engine.distributed.sequence_gather import (
    SeqSplit, gather_storage, gather_tensor, gatherable, reduce_scatter_tensor,
)
from engine.gemm import general_gemm
from engine.modules.linear_function import LinearArgs, bprop, fprop, restore, save_for_backward, weight_uses
from engine.quantizers import Quantizer
from engine.quantizers.rules import CurrentRule, DelayedRule
from engine.recipes import Role
from engine.tensors import QuantizedTensorBase


def gather_quantizer(args: LinearArgs, split: SeqSplit) -> Quantizer | None:
    """The quantizer x's shard is quantized with before the gather, or None: gather in high precision."""
    q_fprop, q_wgrad = (args.fwd.operand(use, args.gemm) for use in Role.INPUT.uses)
    reason = None
    if q_fprop is None or q_fprop is not q_wgrad:
        reason = "x's fprop and wgrad uses have different quantizers"
    elif not (gatherable(q_fprop.scheme, False, split) and gatherable(q_fprop.scheme, True, split)):
        reason = (f"its scale blocks would straddle two ranks' rows ({split.rows} local rows of the GEMM's "
                  "[M, K] view per sequence run)")
    elif q_fprop.scheme.rowwise_block.is_tensor and not agreed_scale(q_fprop, args):
        reason = "its per-tensor scale is not agreed across ranks (amax reduction is off)"
    if reason is None:
        return q_fprop
    name = "high precision" if q_fprop is None else q_fprop.scheme.name
    warnings.warn(f"sequence parallel: the input of a column-parallel layer ({name}) is all-gathered in high "
                  f"precision, not quantized: {reason}", UserWarning, stacklevel=2)
    return None


def agreed_scale(quantizer: Quantizer, args: LinearArgs) -> bool:
    """Whether every rank quantizes with the same per-tensor scale."""
    rule = quantizer.rule
    if isinstance(rule, DelayedRule):
        return bool(getattr(args.fwd.recipe, "reduce_amax", False))
    return isinstance(rule, CurrentRule) and rule.amax_reduction_group is not None


class GatheredLinear(torch.autograd.Function):
    """y [..., S, ..., N_l] = gather(x) W^T + b for x [..., S_l, ..., K] sharded along `seq_dim` over `group`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, args: LinearArgs,
                group: dist.ProcessGroup, seq_dim: int) -> torch.Tensor:
        split = SeqSplit.of(x.shape, seq_dim, dist.get_world_size(group))
        need_dgrad = args.grad_enabled and ctx.needs_input_grad[0]
        need_wgrad = args.grad_enabled and ctx.needs_input_grad[1]
        ctx.args, ctx.split, ctx.group, ctx.inp_dtype, ctx.weight_dtype = args, split, group, x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        x = x.contiguous()
        m, k = split.full_shape.numel() // x.shape[-1], x.shape[-1]
        quantizer = gather_quantizer(args, split) if args.fp8 else None
        ctx.mode = "plain" if not args.fp8 else "gathered" if quantizer is not None else "hp_gathered"
        if ctx.mode == "plain":
            full = gather_tensor(x, split, group).view(m, k)
            w = weight.to(x.dtype)
            out = torch.nn.functional.linear(full, w, None if bias is None else bias.to(x.dtype))
            ctx.save_for_backward(x if need_wgrad else None, w if need_dgrad else None)
        elif ctx.mode == "hp_gathered":
            full = gather_tensor(x, split, group).view(m, k)
            out, x_wgrad, w_dgrad = fprop(full, weight, bias, args, need_dgrad, need_wgrad)
            saved_x, ctx.restore_x = save_for_backward(x_wgrad)
            saved_w, ctx.restore_w = save_for_backward(w_dgrad)
            ctx.save_for_backward(*saved_x, *saved_w)
        else:
            per_tensor = quantizer.scheme.rowwise_block.is_tensor
            quantizer.set_usage(rowwise=True, columnwise=need_wgrad and not per_tensor)
            local = quantizer.quantize_storage(x)
            x_fprop = gather_storage(local, False, split, group).view(torch.Size((m, k)))
            w_fprop, w_dgrad = weight_uses(weight, args, need_dgrad)
            if not isinstance(w_fprop, QuantizedTensorBase):
                w_fprop = w_fprop.to(x.dtype)
            out = general_gemm(x_fprop, w_fprop, out_dtype=x.dtype, bias=None if bias is None else bias.to(x.dtype))
            # x's shard waits for backward: its rowwise bytes (per tensor) or its columnwise copy (blocks)
            saved_x, ctx.restore_x = [], None
            if need_wgrad:
                kept = local if per_tensor else local.replace(rowwise_data=None, rowwise_scale_inv=None)
                saved_x, ctx.restore_x = kept.prepare_for_saving()
            saved_w, ctx.restore_w = save_for_backward(w_dgrad)
            ctx.save_for_backward(*saved_x, *saved_w)
        return out.view(*split.full_shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        args, split, group = ctx.args, ctx.split, ctx.group
        dy = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        m, k = dy.shape[0], split.local_shape[-1]
        dx_full = dw = None
        if ctx.mode == "plain":
            x_local, w = ctx.saved_tensors
            if need_dgrad:
                dx_full = dy @ w.to(dy.dtype)
            if need_wgrad:
                full = gather_tensor(x_local, split, group).view(m, k)
                dw = (dy.t() @ full.to(dy.dtype)).to(ctx.weight_dtype)
        else:
            saved = list(ctx.saved_tensors)
            if ctx.mode == "hp_gathered":
                x_wgrad, rest = restore(saved, ctx.restore_x)
            elif ctx.restore_x is not None:
                local = ctx.restore_x
                rest = local.restore_from_saved(saved)
                per_tensor = local.scheme.rowwise_block.is_tensor
                x_wgrad = gather_storage(local, not per_tensor, split, group).view(torch.Size((m, k)))
                if per_tensor:  # the columnwise copy of one scale per tensor is the transposed rowwise bytes
                    x_wgrad.update_usage(rowwise_usage=False, columnwise_usage=True)
            else:
                x_wgrad, rest = None, saved
            w_dgrad, _ = restore(rest, ctx.restore_w)
            dx_full, dw = bprop(dy, x_wgrad, w_dgrad, args, need_dgrad=need_dgrad, need_wgrad=need_wgrad,
                                inp_dtype=ctx.inp_dtype, weight_dtype=ctx.weight_dtype)
        dx = None
        if dx_full is not None:
            dx = reduce_scatter_tensor(dx_full.to(ctx.inp_dtype).view(*split.full_shape), split, group)
        dbias = dy.sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
        return dx, dw, dbias, None, None, None
