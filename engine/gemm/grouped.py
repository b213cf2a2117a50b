"""grouped_gemm: out[rows of group g] = op(a_g) @ op(b_g)^T (+ bias_g) for all groups in one Triton launch;
cpu_grouped_gemm: the same in one native call on the CPU (below), for every pair general_gemm runs there.

A mixture of experts' fprop and dgrad: each expert's row group of the activation against that expert's
weight. On CUDA tensors (or with ENGINE_BACKEND=triton, which is how the CPU tests run it under
TRITON_INTERPRET=1) the pairs the kernel covers - per-tensor FP8 on both sides (delayed, current
scaling), power-of-two tile scales on both sides (MXFP8's E8M0 1x32, block scaling's power-of-two
1x128 activations against 128x128 or 1x128 tiles) - run `engine.ops.triton.grouped_gemm`; the
caller runs anything else per group through general_gemm (`grouped_gemm` returns None). Numerics:
those of the per-group general_gemm (engine.ops.exact_gemm's contract: exact decode and products,
fp32 sum in an unspecified order, the scale product and bias in fp32, one rounding to out_dtype).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Sequence

import torch

from engine.gemm.mixed import as_tiles
from engine.gemm.operand import GemmOperand, gemm_operand
from engine.gemm.scales import pow2
from engine.ops import backend as ops_backend
from engine.tensors.quantized import QuantizedTensor
from engine.tensors.storage import QuantizedTensorBase

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
TILE_COLS_MULTIPLE = 32  # the kernel's BLOCK_K


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def uses_triton(device: torch.device) -> bool:
    """Whether grouped GEMMs on `device` run the Triton kernel: CUDA tensors (where Triton is installed; else the
    per-group GEMMs, torch._scaled_mm on CUDA), or ENGINE_BACKEND=triton."""
    forced = ops_backend.forced_backend()
    return forced == "triton" or (device.type == "cuda" and forced is None and triton_installed())


def _fp8(op: GemmOperand) -> bool:
    return op.data.dtype in FP8_DTYPES and op.amax is None and op.stored_codes is None


def _kind(ops: Sequence[GemmOperand]) -> str | None:
    """"tensor" or "pow2" when every operand is plain FP8 of that kind with the same K tiling, else None."""
    first = ops[0]
    if not all(_fp8(op) for op in ops):
        return None
    if all(op.per_tensor for op in ops):
        return "tensor"
    if all(not op.per_tensor and op.kind == "pow2" and op.tile_cols == first.tile_cols
           and op.tile_rows == first.tile_rows and op.data.dtype == first.data.dtype for op in ops) \
            and first.tile_cols % TILE_COLS_MULTIPLE == 0:
        return "pow2"
    return None


def _per_tensor_factors(a_ops: Sequence[GemmOperand], b_ops: Sequence[GemmOperand]) -> torch.Tensor:
    """[E, 3] fp32: the frexp mantissas' product and 2^e in two exact factors, as engine.gemm.scales.times_pow2."""
    ma, ea = torch.frexp(torch.stack([op.scale_inv.float().reshape(()) for op in a_ops]))
    mb, eb = torch.frexp(torch.stack([op.scale_inv.float().reshape(()) for op in b_ops]))
    e = ea + eb
    e1 = e.clamp(-90, 67)
    return torch.stack([ma * mb, pow2(e1), pow2(e - e1)], dim=1)


def grouped_gemm(a: Sequence[QuantizedTensor | QuantizedTensorBase], b: Sequence[QuantizedTensor | QuantizedTensorBase],
                 m_splits: Sequence[int], *, b_transposed: bool = False, out_dtype: torch.dtype,
                 biases: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor | None:
    """[sum(m_splits), N]: rows of group g = a[g] @ op(b[g])^T (+ biases[g]) in one launch, or None where the
    kernel does not cover these operands (then run general_gemm per group)."""
    if not all(isinstance(t, (QuantizedTensor, QuantizedTensorBase)) for t in (*a, *b)):
        return None
    a_ops = [gemm_operand(t, transposed=False, name="a") for t in a]
    b_ops = [gemm_operand(t, transposed=b_transposed, name="b") for t in b]
    kind_a, kind_b = _kind(a_ops), _kind(b_ops)
    if kind_a is None or kind_a != kind_b or len({op.data.dtype for op in a_ops}) != 1:
        return None
    if kind_a == "pow2" and (a_ops[0].tile_rows != 1 or a_ops[0].tile_cols != b_ops[0].tile_cols):
        return None
    if len({tuple(op.data.shape) for op in b_ops}) != 1:
        return None
    from engine.ops.triton.grouped_gemm import grouped_gemm as kernel  # Triton: imported on first use

    lhs = torch.cat([op.data for op in a_ops]).contiguous()
    rhs = torch.stack([op.data for op in b_ops]).contiguous()
    bias = None
    if biases is not None and any(x is not None for x in biases):
        if any(x is None for x in biases):
            return None
        bias_dtype = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32  # as exact_gemm rounds it
        bias = torch.stack([x.to(bias_dtype) for x in biases]).float()
    if kind_a == "tensor":
        out = kernel(lhs, rhs, list(m_splits), factors=_per_tensor_factors(a_ops, b_ops), bias=bias)
    else:
        out = kernel(lhs, rhs, list(m_splits), a_scale=torch.cat([op.scale_inv for op in a_ops]),
                     b_scale=torch.stack([op.scale_inv for op in b_ops]), a_tile_rows=1,
                     b_tile_rows=b_ops[0].tile_rows, tile_cols=a_ops[0].tile_cols, bias=bias)
    return out.to(out_dtype)


# ------------------------------------------------------------------------------ the CPU: one native call
def _cpu_numerics(a: GemmOperand, b: GemmOperand) -> tuple[str, GemmOperand, GemmOperand] | None:
    """(numerics, a, b) of the CPU GEMM general_gemm runs for this pair (engine.gemm.PAIRINGS on the CPU): "exact"
    (cpu.per_tensor, cpu.pow2_tiles), "nvfp4" (cpu.nvfp4) or "fp32_tiles" (cpu.fp32_tiles), with a per-tensor side
    of a mixed pair read as tiles (mixed.tensor_by_tiles); None for a pair general_gemm refuses (let it say so)."""
    if a.k != b.k:
        return None
    if a.kind == "nvfp4" or b.kind == "nvfp4":
        nvfp4 = a.kind == b.kind == "nvfp4" and a.tile == b.tile and a.amax is not None and b.amax is not None
        return ("nvfp4", a, b) if nvfp4 else None
    if a.per_tensor and b.per_tensor:
        return "exact", a, b
    if a.per_tensor or b.per_tensor:
        a, b = (as_tiles(a, b), b) if a.per_tensor else (a, as_tiles(b, a))
    elif a.tile_cols != b.tile_cols or (a.tile_rows > 1 and b.tile_rows > 1):
        return None  # general_gemm's _check_pair refuses these
    return ("exact" if a.kind == b.kind == "pow2" else "fp32_tiles"), a, b


def _native_exact() -> bool:
    """Whether general_gemm's exact GEMM is the native one here (no other backend forced, the extension built)."""
    from engine.ops import native

    return ops_backend.forced_backend() in (None, "native") and native.available() and \
        hasattr(native._ext(), "grouped_exact_gemm")


def cpu_grouped_gemm(a: Sequence[QuantizedTensor | QuantizedTensorBase],
                     b: Sequence[QuantizedTensor | QuantizedTensorBase], *, a_transposed: bool = False,
                     b_transposed: bool = False, out_dtype: torch.dtype,
                     biases: Sequence[torch.Tensor | None] | None = None,
                     concat: bool = True) -> torch.Tensor | list[torch.Tensor] | None:
    """general_gemm(a[g], b[g], ...) of every group g in one native call, the same bits: with `concat` the groups'
    outputs one after the other in one [sum of rows, N] tensor (written in place, no concatenation), else a list.
    Every pair general_gemm runs on the CPU takes it (per-tensor FP8, power-of-2 tiles, NVFP4, fp32 tiles, and
    per-tensor by tiles), when all groups' pairs have one numerics; None otherwise (then run general_gemm per group)."""
    from engine.gemm import general_gemm
    from engine.ops import native

    if not a or not all(isinstance(t, (QuantizedTensor, QuantizedTensorBase)) for t in (*a, *b)) \
            or not _native_exact():
        return None
    a_ops = [gemm_operand(t, transposed=a_transposed, name="a") for t in a]
    b_ops = [gemm_operand(t, transposed=b_transposed, name="b") for t in b]
    if any(op.data.device.type != "cpu" for op in (*a_ops, *b_ops)):
        return None
    pairs = [_cpu_numerics(x, y) for x, y in zip(a_ops, b_ops)]
    if any(p is None for p in pairs) or len({p[0] for p in pairs}) != 1:
        return None
    numerics = pairs[0][0]
    a_ops, b_ops = [p[1] for p in pairs], [p[2] for p in pairs]
    n = b_ops[0].rows
    if concat and any(op.rows != n for op in b_ops):
        return None
    if biases is not None and all(x is None for x in biases):
        biases = None
    if biases is not None and (any(x is None for x in biases)
                               or any(tuple(x.shape) != (op.rows,) for x, op in zip(biases, b_ops))):
        return None
    kwargs = {"numerics": numerics}
    if numerics == "nvfp4":
        divisors = {(x.amax_divisor, y.amax_divisor) for x, y in zip(a_ops, b_ops)}
        if len(divisors) != 1:
            return None
        kwargs.update(amax_divisors=divisors.pop(),
                      amaxes=([op.amax.float() for op in a_ops], [op.amax.float() for op in b_ops]))
    scales = (lambda op: op.tile_scales()) if numerics == "fp32_tiles" else (lambda op: op.scale_inv)
    a_scales, b_scales = [scales(op) for op in a_ops], [scales(op) for op in b_ops]
    out = torch.empty(sum(op.rows for op in a_ops), n, dtype=out_dtype) if concat else None
    results = native.grouped_exact_gemm([op.data for op in a_ops], a_scales, [op.tile for op in a_ops],
                                        [op.data for op in b_ops], b_scales, [op.tile for op in b_ops],
                                        biases, out_dtype, out, **kwargs)
    first = 0
    outs = []
    for g, result in enumerate(results):
        rows = a_ops[g].rows
        if (concat and result is not None) or (not concat and result is None):  # not computed: the rescaled path
            result = general_gemm(a[g], b[g], a_transposed=a_transposed, b_transposed=b_transposed, out_dtype=out_dtype,
                                  bias=None if biases is None else biases[g])
            if concat:
                out[first:first + rows] = result
        outs.append(result)
        first += rows
    return out if concat else outs
