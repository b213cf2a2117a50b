"""The autograd function behind every engine linear layer: fprop, dgrad and wgrad.

In FP8 the input and weight are quantized once in forward (input rowwise for fprop and
columnwise for wgrad; weight rowwise for fprop and columnwise for dgrad), and only the
columnwise FP8 buffers are saved for backward (`prepare_for_saving`), so FP8 bytes - not
high precision - wait for backward. Backward quantizes the output gradient (rowwise for
dgrad, columnwise for wgrad) and runs the two GEMMs. In high precision the same function
runs plain matmuls, so `fuse_wgrad_accumulation` behaves alike in both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine import autocast
from engine.autocast import AutocastStep
from engine.ops.gemm import general_gemm
from engine.recipes import RecipeState, Role
from engine.tensors import QuantizedTensor, QuantizedTensorBase


@dataclass
class WeightCache:
    """A weight quantized at the first micro-batch, reused while `is_first_microbatch=False`."""

    value: QuantizedTensorBase | None = None


@dataclass
class LinearArgs:
    """Everything the linear function needs besides its tensors."""

    fp8: bool
    fwd: RecipeState | None = None
    bwd: RecipeState | None = None
    gemm: int = 0
    cache: WeightCache | None = None
    is_first_microbatch: bool | None = None
    fuse_wgrad_accumulation: bool = False
    backward_step: AutocastStep | None = None
    grad_enabled: bool = True  # grad mode at the call (inside forward it is always off)


def without(storage: QuantizedTensorBase, usage: str) -> QuantizedTensorBase:
    """A new storage object sharing `storage`'s buffers, minus one usage (the original is untouched)."""
    return storage.replace(**{f"{usage}_data": None, f"{usage}_scale_inv": None})


def quantize_weight(weight: torch.Tensor, args: LinearArgs, need_columnwise: bool) -> QuantizedTensorBase:
    """The weight's FP8 form: an FP8 primary weight as it is, the micro-batch cache, or a fresh quantization."""
    if isinstance(weight, QuantizedTensor):
        storage = weight.qstorage
        if need_columnwise and not storage.has_columnwise:
            storage.update_usage(columnwise_usage=True)
        return storage
    cached = args.cache.value
    if args.is_first_microbatch is False and cached is not None and (cached.has_columnwise or not need_columnwise):
        if args.fwd.needs_update:
            args.fwd.hold(args.fwd.slot(Role.WEIGHT, args.gemm))  # nothing new was seen for this weight
        return cached
    # no cache yet, or one made without gradients (no columnwise data): quantize afresh with the same scale
    quantizer = args.fwd.quantizer(Role.WEIGHT, args.gemm)
    quantizer.set_usage(rowwise=True, columnwise=need_columnwise)
    storage = quantizer.quantize_storage(weight)
    if args.is_first_microbatch is not None:
        args.cache.value = storage
    return storage


def main_grad_of(weight: torch.Tensor) -> torch.Tensor:
    main_grad = getattr(weight, "main_grad", None)
    if not isinstance(main_grad, torch.Tensor) or main_grad.dtype != torch.float32 or main_grad.shape != weight.shape:
        raise ValueError("fuse_wgrad_accumulation=True needs weight.main_grad: an fp32 tensor of the weight's shape "
                         f"{tuple(weight.shape)}; got {type(main_grad).__name__}")
    return main_grad


def linear(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, args: LinearArgs) -> torch.Tensor:
    """LinearFunction on `inp`; under torch.autocast, in the autocast dtype (as torch.nn.Linear computes).

    The input is cast once here and torch.autocast is off inside, so the FP8 GEMMs' own
    dtypes (fp32 partial sums, bf16 operands) are not recast op by op.
    """
    device_type = inp.device.type
    if not torch.is_autocast_enabled(device_type):
        return LinearFunction.apply(inp, weight, bias, args)
    inp = inp.to(torch.get_autocast_dtype(device_type))
    with torch.autocast(device_type, enabled=False):
        return LinearFunction.apply(inp, weight, bias, args)


class LinearFunction(torch.autograd.Function):
    """y = x W^T + b over the last dim of x, in FP8 (args.fp8) or in x's dtype."""

    @staticmethod
    def forward(ctx: Any, inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, args: LinearArgs) -> torch.Tensor:
        inp2d = inp.reshape(-1, inp.shape[-1])
        ctx.args, ctx.inp_shape, ctx.inp_dtype = args, inp.shape, inp.dtype
        ctx.weight_dtype, ctx.bias_dtype = weight.dtype, None if bias is None else bias.dtype
        ctx.weight_ref = weight if args.fuse_wgrad_accumulation else None
        need_dgrad = args.grad_enabled and ctx.needs_input_grad[0]
        need_wgrad = args.grad_enabled and ctx.needs_input_grad[1]
        if not args.fp8:
            w = weight.dequantize() if isinstance(weight, QuantizedTensor) else weight
            w = w.to(inp.dtype)
            out = torch.nn.functional.linear(inp2d, w, None if bias is None else bias.to(inp.dtype))
            ctx.save_for_backward(inp2d if need_wgrad else None, w if need_dgrad else None)
            return out.view(*inp.shape[:-1], out.shape[-1])
        input_quantizer = args.fwd.quantizer(Role.INPUT, args.gemm)
        input_quantizer.set_usage(rowwise=True, columnwise=need_wgrad)
        xq = input_quantizer.quantize_storage(inp2d)
        wq = quantize_weight(weight, args, need_columnwise=need_dgrad)
        out = general_gemm(xq, wq, out_dtype=inp.dtype, bias=None if bias is None else bias.to(inp.dtype))
        saved: list[torch.Tensor | None] = []
        ctx.saved_x = ctx.saved_w = None
        if need_wgrad:
            xq.update_usage(rowwise_usage=False)
            tensors, ctx.saved_x = xq.prepare_for_saving()
            saved += tensors
        if need_dgrad:
            tensors, ctx.saved_w = without(wq, "rowwise").prepare_for_saving()
            saved += tensors
        ctx.save_for_backward(*saved)
        return out.view(*inp.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        device_type = grad_out.device.type
        if torch.is_autocast_enabled(device_type):  # backward called inside torch.autocast: compute as forward did
            with torch.autocast(device_type, enabled=False):
                return LinearFunction._backward(ctx, grad_out)
        return LinearFunction._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        args: LinearArgs = ctx.args
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        fuse = args.fuse_wgrad_accumulation and need_wgrad
        dx = dw = None  # with fuse_wgrad_accumulation the weight gradient goes into weight.main_grad
        if not args.fp8:
            inp2d, w = ctx.saved_tensors
            if need_dgrad:
                dx = (dy @ w.to(dy.dtype)).view(ctx.inp_shape).to(ctx.inp_dtype)
            if fuse:
                main_grad_of(ctx.weight_ref).add_(dy.t().float() @ inp2d.float())
            elif need_wgrad:
                dw = (dy.t() @ inp2d.to(dy.dtype)).to(ctx.weight_dtype)
        else:
            saved = list(ctx.saved_tensors)
            if ctx.saved_x is not None:
                saved = ctx.saved_x.restore_from_saved(saved)
            if ctx.saved_w is not None:
                saved = ctx.saved_w.restore_from_saved(saved)
            grad_quantizer = args.bwd.quantizer(Role.GRAD_OUTPUT, args.gemm)
            grad_quantizer.set_usage(rowwise=need_dgrad, columnwise=need_wgrad)
            if need_dgrad or need_wgrad:
                dyq = grad_quantizer.quantize_storage(dy.contiguous())
            if need_dgrad:
                dx = general_gemm(dyq, ctx.saved_w, b_transposed=True, out_dtype=ctx.inp_dtype).view(ctx.inp_shape)
            if need_wgrad:
                if fuse:
                    general_gemm(dyq, ctx.saved_x, a_transposed=True, b_transposed=True,
                                 out=main_grad_of(ctx.weight_ref), accumulate=True)
                else:
                    dw = general_gemm(dyq, ctx.saved_x, a_transposed=True, b_transposed=True,
                                      out_dtype=ctx.weight_dtype)
        dbias = dy.sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
        if args.backward_step is not None:
            autocast.finish_backward(args.backward_step)
        return dx, dw, dbias, None
