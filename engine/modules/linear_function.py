"""The autograd function behind every engine linear layer: fprop, dgrad and wgrad.

Under a recipe each GEMM operand gets the quantizer the recipe's operand map names, or
stays in high precision (None). The input and weight are quantized once in forward when
both their uses share a quantizer (input rowwise for fprop and columnwise for wgrad;
weight rowwise for fprop and columnwise for dgrad), and only what backward reads is saved
(`prepare_for_saving`), so quantized bytes wait for backward. Backward quantizes the output
gradient (rowwise for dgrad, columnwise for wgrad) and runs the two GEMMs. Outside FP8 the
same function runs plain matmuls, so `fuse_wgrad_accumulation` behaves alike in both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import torch

from engine.gemm import general_gemm
from engine.recipes import RecipeState, Role
from engine.tensors import QuantizedTensor, QuantizedTensorBase


#: what a GEMM reads for one operand: quantized buffers, or a high-precision tensor (the recipe said None)
GemmInput = Union[QuantizedTensorBase, torch.Tensor]


@dataclass
class WeightCache:
    """A weight's two uses (fprop, dgrad) quantized at the first micro-batch, reused while `is_first_microbatch=False`."""

    value: tuple[GemmInput | None, GemmInput | None] | None = None


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
    grad_enabled: bool = True  # grad mode at the call (inside forward it is always off)


def torch_autocast_on(device_type: str) -> bool:
    """torch.autocast is on for `device_type` (False where torch has no autocast for it). A CPU tensor asks
    torch's flag directly (`torch.amp.is_autocast_available` is a Python call more, twice per layer step)."""
    if device_type == "cpu":
        return torch.is_autocast_enabled("cpu")
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t [M, K] with zero rows appended up to `rows` rows."""
    return torch.nn.functional.pad(t, (0, 0, 0, rows - t.shape[0]))


def quantize_uses(
    t: torch.Tensor, state: RecipeState, role: Role, gemm: int, *, rowwise: bool, columnwise: bool
) -> tuple[GemmInput | None, GemmInput | None]:
    """t [M, K] for its rowwise use and its columnwise use (None where not needed): quantized by each use's
    quantizer - one quantization when both uses share a quantizer - or t itself where the recipe says None.

    For x and dy, a columnwise (wgrad) quantizer that needs whole groups of rows (NVFP4's RHT mixes 16
    tokens) gets t with zero rows appended, so the wgrad operands then have M' > M rows: the padding rows
    meet each other's zeros in the wgrad GEMM. The rowwise use is always quantized from t itself (first, so stochastic
    rounding draws the same bits as in one call for both usages), so fprop and dgrad never see the padding."""
    q_row, q_col = state.uses(role, gemm)
    # (a scheme without a columnwise transform takes any row count: its `columnwise_row_multiple` is 1)
    if columnwise and role is not Role.WEIGHT and q_col is not None and q_col.scheme.columnwise_transform is not None \
            and t.shape[0] % q_col.columnwise_row_multiple:
        row_use = quantize_uses(t, state, role, gemm, rowwise=rowwise, columnwise=False)[0]
        multiple = q_col.columnwise_row_multiple
        q_col.set_usage(rowwise=False, columnwise=True)
        return row_use, q_col.quantize_storage(pad_rows(t, -(-t.shape[0] // multiple) * multiple))
    if q_row is not None and q_row is q_col:
        if not (rowwise or columnwise):
            return None, None
        q_row.rowwise_usage, q_row.columnwise_usage = rowwise, columnwise  # bools: no set_usage checks
        storage = q_row.quantize_storage(t)
        return (storage if rowwise else None), (storage if columnwise else None)
    uses = []
    for quantizer, wanted, usage in ((q_row, rowwise, "rowwise"), (q_col, columnwise, "columnwise")):
        if not wanted or quantizer is None:
            uses.append(t if wanted else None)
            continue
        quantizer.set_usage(rowwise=usage == "rowwise", columnwise=usage == "columnwise")
        uses.append(quantizer.quantize_storage(t))
    return uses[0], uses[1]


def weight_uses(weight: torch.Tensor, args: LinearArgs, need_dgrad: bool) -> tuple[GemmInput, GemmInput | None]:
    """The weight for fprop and (if needed) dgrad: an FP8 primary weight as it is, the micro-batch cache,
    or a fresh quantization."""
    if isinstance(weight, QuantizedTensor):
        q_fprop, q_dgrad = (args.fwd.operand(use, args.gemm) for use in Role.WEIGHT.uses)
        storage = weight.qstorage
        if need_dgrad and q_dgrad is not None and not storage.has_columnwise:
            storage.update_usage(columnwise_usage=True)
        plain = weight.dequantize() if q_fprop is None or (need_dgrad and q_dgrad is None) else None
        w_fprop = storage if q_fprop is not None else plain
        w_dgrad = None if not need_dgrad else storage if q_dgrad is not None else plain
        return w_fprop, w_dgrad
    cached = None if args.cache is None else args.cache.value
    if args.is_first_microbatch is False and cached is not None and (cached[1] is not None or not need_dgrad):
        return cached  # nothing recorded for this weight: delayed scaling leaves its slot as it is
    # no cache yet, or one made without gradients (no dgrad form): quantize afresh with the same scale
    uses = quantize_uses(weight, args.fwd, Role.WEIGHT, args.gemm, rowwise=True, columnwise=need_dgrad)
    if args.is_first_microbatch is not None and args.cache is not None:
        args.cache.value = uses
    return uses


def save_for_backward(operand: GemmInput | None) -> tuple[list, Any]:
    """(tensors for autograd, how to get the operand back). Quantized buffers go as their columnwise
    buffers only (the rowwise copy was fprop's), through a new storage object: a cached or primary
    weight's own storage is never emptied."""
    if operand is None:
        return [], None
    if isinstance(operand, torch.Tensor):
        return [operand], "tensor"
    return operand.without_rowwise().prepare_for_saving()


def restore(saved: list, how: Any) -> tuple[GemmInput | None, list]:
    if how is None:
        return None, saved
    if how == "tensor":
        return saved[0], saved[1:]
    return how, how.restore_from_saved(saved)


def main_grad_of(weight: torch.Tensor) -> torch.Tensor:
    main_grad = getattr(weight, "main_grad", None)
    if not isinstance(main_grad, torch.Tensor) or main_grad.dtype != torch.float32 or main_grad.shape != weight.shape:
        raise ValueError("fuse_wgrad_accumulation=True needs weight.main_grad: an fp32 tensor of the weight's shape "
                         f"{tuple(weight.shape)}; got {type(main_grad).__name__}")
    return main_grad


def fprop(inp2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, args: LinearArgs,
          need_dgrad: bool, need_wgrad: bool) -> tuple[torch.Tensor, GemmInput | None, GemmInput | None]:
    """The quantized forward: (out [M, N], x for wgrad, W for dgrad) - what backward needs, or None."""
    x_fprop, x_wgrad = quantize_uses(inp2d, args.fwd, Role.INPUT, args.gemm, rowwise=True, columnwise=need_wgrad)
    w_fprop, w_dgrad = weight_uses(weight, args, need_dgrad)
    if not isinstance(w_fprop, QuantizedTensorBase):
        w_fprop = w_fprop.to(inp2d.dtype)
    if bias is not None and bias.dtype != inp2d.dtype:
        bias = bias.to(inp2d.dtype)
    out = general_gemm(x_fprop, w_fprop, out_dtype=inp2d.dtype, bias=bias)
    return out, x_wgrad, w_dgrad


def bprop(dy: torch.Tensor, x_wgrad: GemmInput | None, w_dgrad: GemmInput | None, args: LinearArgs, *,
          need_dgrad: bool, need_wgrad: bool, inp_dtype: torch.dtype, weight_dtype: torch.dtype,
          main_grad: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The quantized backward: (dx [M, K], dW [N, K]) for a dy [M, N]; dW is added into `main_grad` if given.

    Both GEMMs output the activation dtype (dW then takes the weight's dtype), except that a fused
    wgrad accumulates into the fp32 `main_grad` directly.
    """
    dy_dgrad, dy_wgrad = quantize_uses(dy, args.bwd, Role.GRAD_OUTPUT, args.gemm,
                                       rowwise=need_dgrad, columnwise=need_wgrad)
    dx = dw = None
    if need_dgrad:
        dx = general_gemm(dy_dgrad, w_dgrad, b_transposed=True, out_dtype=inp_dtype)
    if need_wgrad:
        dy_wgrad, x_wgrad = same_rows(dy_wgrad, x_wgrad)
        if main_grad is not None:
            general_gemm(dy_wgrad, x_wgrad, a_transposed=True, b_transposed=True, out=main_grad, accumulate=True)
        else:
            # in the activation dtype, as Transformer Engine does (and torch.autocast's Linear): an fp32 GEMM
            # would cost 2.2x a bf16 one on the CPU; accumulation is fp32 either way, then one rounding
            dw = general_gemm(dy_wgrad, x_wgrad, a_transposed=True, b_transposed=True, out_dtype=inp_dtype)
            if dw.dtype != weight_dtype:
                dw = dw.to(weight_dtype)
    return dx, dw


def same_rows(a: GemmInput, b: GemmInput) -> tuple[GemmInput, GemmInput]:
    """The wgrad operands with as many rows (tokens): a high-precision one padded with zero rows where the
    other's quantizer padded its tokens (`quantize_uses`)."""
    rows_a, rows_b = a.shape[0], b.shape[0]
    if rows_a < rows_b and isinstance(a, torch.Tensor) and not isinstance(a, QuantizedTensor):
        a = pad_rows(a, rows_b)
    elif rows_b < rows_a and isinstance(b, torch.Tensor) and not isinstance(b, QuantizedTensor):
        b = pad_rows(b, rows_a)
    return a, b


def unviewed(out: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The contiguous `out` [M, N] seen with `shape`, as a tensor of its own (not a view: no copy, shared storage).

    A module's output that is a view makes FSDP2 warn (an in-place op on it would skip FSDP2's
    pre-backward hook), and `out.view(...)` of the GEMM's [M, N] result is one.
    """
    if tuple(out.shape) == tuple(shape) and not out._is_view():
        return out
    fresh = out.new_empty(0)
    return fresh.set_(out.untyped_storage(), out.storage_offset(), shape, torch.empty(shape, device="meta").stride())


class LinearFunction(torch.autograd.Function):
    """y = x W^T + b over the last dim of x, on quantized operands (args.fp8) or in x's dtype."""

    @staticmethod
    def forward(ctx: Any, inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, args: LinearArgs) -> torch.Tensor:
        inp2d = inp if inp.dim() == 2 else inp.reshape(-1, inp.shape[-1])  # a same-shape reshape still costs a view
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
            return unviewed(out, (*inp.shape[:-1], out.shape[-1]))
        out, x_wgrad, w_dgrad = fprop(inp2d, weight, bias, args, need_dgrad, need_wgrad)
        saved_x, ctx.restore_x = save_for_backward(x_wgrad)
        saved_w, ctx.restore_w = save_for_backward(w_dgrad)
        ctx.save_for_backward(*saved_x, *saved_w)
        return unviewed(out, (*inp.shape[:-1], out.shape[-1]))

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        device_type = grad_out.device.type
        if torch_autocast_on(device_type):  # backward called inside torch.autocast: compute as forward did
            with torch.autocast(device_type, enabled=False):
                return LinearFunction._backward(ctx, grad_out)
        return LinearFunction._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        args: LinearArgs = ctx.args
        dy = grad_out if grad_out.dim() == 2 else grad_out.reshape(-1, grad_out.shape[-1])
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
            x_wgrad, rest = restore(list(ctx.saved_tensors), ctx.restore_x)
            w_dgrad, _ = restore(rest, ctx.restore_w)
            dx, dw = bprop(dy.contiguous(), x_wgrad, w_dgrad, args, need_dgrad=need_dgrad, need_wgrad=need_wgrad,
                           inp_dtype=ctx.inp_dtype, weight_dtype=ctx.weight_dtype,
                           main_grad=main_grad_of(ctx.weight_ref) if fuse else None)
            if dx is not None and dx.shape != ctx.inp_shape:
                dx = dx.view(ctx.inp_shape)
        dbias = dy.sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
        return dx, dw, dbias, None
