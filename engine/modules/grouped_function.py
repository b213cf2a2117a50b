"""grouped_linear(): every expert's linear over its group of tokens, as one output [T, N].

Two paths, the same bits (tests/test_grouped_linear.py checks both against per-expert engine.Linear modules):

- per expert: `linear()` (the function engine.Linear runs: eager, compiled, DTensor, inspect) once per expert on its
  rows; always correct, and what torch.compile, tensor parallel, engine.inspect, calibration and
  `fuse_wgrad_accumulation` take.
- grouped (eager, quantized, every recipe): one autograd node for all experts. Where the recipe's rowwise
  quantizer of the input (fprop) or of the output gradient (dgrad) scales each row on its own (MX 1x32, block
  scaling's 1x128, torchao's rowwise: no per-tensor scale, no state, no stochastic rounding, the same quantizer
  config for every expert), that operand is quantized in ONE pass over all tokens and each expert reads its rows
  as a slice (the bits of a per-expert quantization: no scale block spans two tokens). Per-tensor scaling (delayed, current) and NVFP4 (a per-tensor amax)
  need one scale per expert: those operands are quantized per expert. On the CPU each pass's GEMMs (fprop, dgrad,
  the wgrads) run in one native call for every pair general_gemm runs there (per-tensor FP8, power-of-2 tiles,
  NVFP4, fp32 tiles, per-tensor by tiles; engine.gemm.grouped.cpu_grouped_gemm: each group's general_gemm bits,
  fprop and dgrad written into one output, no concatenation); a pass mixing numerics over its experts, or with
  a high-precision operand, runs one general_gemm per expert.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

import torch

from engine import autocast
from engine.dtensor import any_dtensor
from engine.gemm import general_gemm
from engine.gemm.grouped import cpu_grouped_gemm, grouped_gemm, uses_triton
from engine.modules.linear_function import (
    GemmInput, LinearArgs, quantize_uses, restore, same_rows, save_for_backward, torch_autocast_on, weight_uses,
)
from engine.quantizers.registry import RULE_ENTRIES
from engine.recipes import RecipeState, Role
from engine.tensors import QuantizedTensorBase
from engine.tensors.sharding import slice_rows

PerExpert = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", LinearArgs], torch.Tensor]


def grouped_linear(inp2d: torch.Tensor, m_splits: Sequence[int], weights: Sequence[torch.Tensor],
                   biases: Sequence[torch.Tensor | None], args: Sequence[LinearArgs], *,
                   per_expert: PerExpert) -> torch.Tensor:
    """out [T, N]: rows of expert e = per_expert(inp rows of e, weights[e], biases[e], args[e]), in one grouped
    call where that is the same (see the module docstring)."""
    if _groupable(inp2d, weights, biases, args):
        device_type = inp2d.device.type
        if torch_autocast_on(device_type):  # as linear(): the input cast once, the GEMMs' own dtypes inside
            inp2d = inp2d.to(torch.get_autocast_dtype(device_type))
            with torch.autocast(device_type, enabled=False):
                return GroupedLinearFunction.apply(inp2d, tuple(m_splits), tuple(args), *weights, *biases)
        return GroupedLinearFunction.apply(inp2d, tuple(m_splits), tuple(args), *weights, *biases)
    outs = [per_expert(x, w, b, a) for x, w, b, a in zip(torch.split(inp2d, list(m_splits)), weights, biases, args)]
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _groupable(inp2d: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None],
               args: Sequence[LinearArgs]) -> bool:
    first = args[0]
    if not first.fp8 or first.fuse_wgrad_accumulation or torch.compiler.is_compiling():
        return False
    if autocast.inspector() is not None:  # engine.inspect watches each linear call
        return False
    if "torch.distributed.tensor" in sys.modules and any_dtensor(inp2d, *weights, *[b for b in biases if b is not None]):
        return False
    return True


def row_local(state: RecipeState, role: Role, gemms: Sequence[int]) -> bool:
    """Whether `role`'s rowwise quantizer scales each row by itself, the same for every GEMM of `gemms` (the
    experts' indices in the recipe state): then one pass over all tokens gives every expert's bits."""
    first = state.uses(role, gemms[0])[0]
    if first is None:
        return False
    scheme, rule = first.scheme, first.rule
    block = scheme.rowwise_block
    if scheme.tensor_scale or block.is_tensor or block.rows != 1 or getattr(rule, "stochastic_rounding", False):
        return False
    if any(entry.stateful and isinstance(rule, entry.rule) for entry in RULE_ENTRIES.values()):
        return False  # delayed scaling: a scale and an amax record per expert
    config = first.config()
    return all((q := state.uses(role, g)[0]) is not None and q.config() == config for g in gemms[1:])


def _offsets(m_splits: Sequence[int]) -> list[int]:
    out = [0]
    for m in m_splits:
        out.append(out[-1] + m)
    return out


def rowwise_slices(t: torch.Tensor, state: RecipeState, role: Role, gemm: int,
                   m_splits: Sequence[int]) -> list[GemmInput]:
    """t [T, K] quantized rowwise in one pass by GEMM `gemm`'s quantizer (row-local: `row_local`, so any expert's
    gives the same bits), cut into each expert's rows (views)."""
    quantizer = state.uses(role, gemm)[0]
    quantizer.set_usage(rowwise=True, columnwise=False)
    storage = quantizer.quantize_storage(t)
    bounds = _offsets(m_splits)
    return [slice_rows(storage, bounds[e], bounds[e + 1]) for e in range(len(m_splits))]


def _grouped_gemms(a: list[GemmInput], b: list[GemmInput], m_splits: Sequence[int], b_transposed: bool,
                   out_dtype: torch.dtype, biases: Sequence[torch.Tensor | None] | None) -> torch.Tensor:
    """Row group e of the output = a[e] @ op(b[e])^T (+ biases[e]): on CUDA (or ENGINE_BACKEND=triton) one Triton
    launch where it covers the pair (engine.gemm.grouped), on the CPU one native call where all pairs have one
    numerics (each group's general_gemm bits, written into the output), else one general_gemm per group."""
    if uses_triton(a[0].device if isinstance(a[0], torch.Tensor) else _device_of(a[0])):
        out = grouped_gemm(a, b, m_splits, b_transposed=b_transposed, out_dtype=out_dtype, biases=biases)
        if out is not None:
            return out
    else:
        out = cpu_grouped_gemm(a, b, b_transposed=b_transposed, out_dtype=out_dtype, biases=biases)
        if out is not None:
            return out
    outs = [general_gemm(a_e, b_e, b_transposed=b_transposed, out_dtype=out_dtype,
                         bias=None if biases is None else biases[e]) for e, (a_e, b_e) in enumerate(zip(a, b))]
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _wgrads(pairs: list[tuple[GemmInput, GemmInput]], out_dtype: torch.dtype) -> list[torch.Tensor]:
    """dW_e = dy_e^T x_e of each (dy_e, x_e) pair (their columnwise copies): one native call on the CPU where all
    pairs have one numerics, else one general_gemm each."""
    if not pairs:
        return []
    dys, xs = [p[0] for p in pairs], [p[1] for p in pairs]
    outs = None
    if not uses_triton(dys[0].device if isinstance(dys[0], torch.Tensor) else _device_of(dys[0])):
        outs = cpu_grouped_gemm(dys, xs, a_transposed=True, b_transposed=True, out_dtype=out_dtype, concat=False)
    if outs is None:
        outs = [general_gemm(dy, x, a_transposed=True, b_transposed=True, out_dtype=out_dtype) for dy, x in pairs]
    return outs


def _device_of(t: QuantizedTensorBase) -> torch.device:
    data = t.rowwise_data if t.rowwise_data is not None else t.columnwise_data
    return data.device


class GroupedLinearFunction(torch.autograd.Function):
    """Every expert's y_e = x_e W_e^T + b_e as one autograd node, on quantized operands (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, inp2d: torch.Tensor, m_splits: tuple[int, ...], args: tuple[LinearArgs, ...],
                *params: torch.Tensor | None) -> torch.Tensor:
        n = len(args)
        weights, biases = params[:n], params[n:]
        ctx.m_splits, ctx.args, ctx.inp_dtype = m_splits, args, inp2d.dtype
        ctx.weight_dtypes = [w.dtype for w in weights]
        ctx.bias_dtypes = [None if b is None else b.dtype for b in biases]
        grad = args[0].grad_enabled
        need_dgrad = grad and ctx.needs_input_grad[0]
        need_wgrads = [grad and ctx.needs_input_grad[3 + e] for e in range(n)]
        fwd = args[0].fwd
        gemms = [a.gemm for a in args]  # the experts' GEMM indices in the module's states
        x_rows = rowwise_slices(inp2d, fwd, Role.INPUT, gemms[0], m_splits) \
            if row_local(fwd, Role.INPUT, gemms) else None
        bounds = _offsets(m_splits)
        x_fprops, w_fprops, saved, hows = [], [], [], []
        for e in range(n):
            x_e = inp2d[bounds[e]:bounds[e + 1]]
            if x_rows is not None:
                x_fprop = x_rows[e]
                x_wgrad = quantize_uses(x_e, fwd, Role.INPUT, gemms[e], rowwise=False,
                                        columnwise=need_wgrads[e])[1]
            else:
                x_fprop, x_wgrad = quantize_uses(x_e, fwd, Role.INPUT, gemms[e], rowwise=True,
                                                 columnwise=need_wgrads[e])
            w_fprop, w_dgrad = weight_uses(weights[e], args[e], need_dgrad)
            if not isinstance(w_fprop, QuantizedTensorBase):
                w_fprop = w_fprop.to(inp2d.dtype)
            x_fprops.append(x_fprop)
            w_fprops.append(w_fprop)
            for operand in (x_wgrad, w_dgrad):
                tensors, how = save_for_backward(operand)
                saved += tensors
                hows.append((how, len(tensors)))
        ctx.hows = hows
        ctx.save_for_backward(*saved)
        return _grouped_gemms(x_fprops, w_fprops, m_splits, False, inp2d.dtype,
                              [None if b is None else b.to(inp2d.dtype) for b in biases])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        device_type = grad_out.device.type
        if torch_autocast_on(device_type):  # backward called inside torch.autocast: compute as forward did
            with torch.autocast(device_type, enabled=False):
                return GroupedLinearFunction._backward(ctx, grad_out)
        return GroupedLinearFunction._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        args, m_splits = ctx.args, ctx.m_splits
        n, bwd = len(args), args[0].bwd
        dy = grad_out.contiguous()
        need_dgrad = ctx.needs_input_grad[0]
        need_wgrads = [ctx.needs_input_grad[3 + e] for e in range(n)]
        saved, operands = list(ctx.saved_tensors), []
        for how, count in ctx.hows:
            operands.append(restore(saved[:count], how)[0])
            saved = saved[count:]
        gemms = [a.gemm for a in args]
        dy_rows = rowwise_slices(dy, bwd, Role.GRAD_OUTPUT, gemms[0], m_splits) \
            if need_dgrad and row_local(bwd, Role.GRAD_OUTPUT, gemms) else None
        bounds = _offsets(m_splits)
        dy_dgrads, w_dgrads, dbs, wgrad_pairs = [], [], [], {}
        for e in range(n):
            dy_e = dy[bounds[e]:bounds[e + 1]]
            x_wgrad, w_dgrad = operands[2 * e], operands[2 * e + 1]
            if dy_rows is not None:
                dy_dgrad = dy_rows[e]
                dy_wgrad = quantize_uses(dy_e, bwd, Role.GRAD_OUTPUT, gemms[e], rowwise=False,
                                         columnwise=need_wgrads[e])[1]
            else:
                dy_dgrad, dy_wgrad = quantize_uses(dy_e, bwd, Role.GRAD_OUTPUT, gemms[e], rowwise=need_dgrad,
                                                   columnwise=need_wgrads[e])
            if need_dgrad:
                dy_dgrads.append(dy_dgrad)
                w_dgrads.append(w_dgrad)
            if need_wgrads[e]:
                wgrad_pairs[e] = same_rows(dy_wgrad, x_wgrad)
            bias_dtype = ctx.bias_dtypes[e]
            dbs.append(dy_e.sum(0).to(bias_dtype) if bias_dtype is not None and ctx.needs_input_grad[3 + n + e]
                       else None)
        dx = _grouped_gemms(dy_dgrads, w_dgrads, m_splits, True, ctx.inp_dtype, None) if need_dgrad else None
        dws = [None] * n
        for e, dw in zip(wgrad_pairs, _wgrads(list(wgrad_pairs.values()), ctx.inp_dtype)):
            dws[e] = dw.to(ctx.weight_dtypes[e])
        return (dx, None, None, *dws, *dbs)
