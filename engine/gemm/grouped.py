"""grouped_gemm: out[rows of group g] = op(a_g) @ op(b_g)^T (+ bias_g) for all groups in one Triton launch.

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
Tiles = tuple[tuple[int, int], tuple[int, int]]


def _exact_pair(a_ops: Sequence[GemmOperand], b_ops: Sequence[GemmOperand]) -> Tiles | None:
    """(a's tile, b's tile) when every pair is one general_gemm runs as the native exact GEMM (per-tensor FP8 both
    sides, or power-of-2 tiles both sides: engine.gemm.cpu.per_tensor / pow2_tiles) with one tile shape per side;
    else None."""
    first_a, first_b = a_ops[0], b_ops[0]
    a_tile, b_tile = first_a.tile, first_b.tile
    for a, b in zip(a_ops, b_ops):
        if a.amax is not None or b.amax is not None or a.tile != a_tile or b.tile != b_tile or a.k != b.k:
            return None
        if not ((a.per_tensor and b.per_tensor) or (a.kind == "pow2" and b.kind == "pow2")):
            return None
    if not first_a.per_tensor and (a_tile[1] != b_tile[1] or (a_tile[0] > 1 and b_tile[0] > 1)):
        return None  # general_gemm refuses these pairs: let it say so
    return a_tile, b_tile


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
    None where a pair is not the native exact GEMM's (then run general_gemm per group)."""
    from engine.gemm import general_gemm
    from engine.ops import native

    if not a or not all(isinstance(t, (QuantizedTensor, QuantizedTensorBase)) for t in (*a, *b)) \
            or not _native_exact():
        return None
    a_ops = [gemm_operand(t, transposed=a_transposed, name="a") for t in a]
    b_ops = [gemm_operand(t, transposed=b_transposed, name="b") for t in b]
    if any(op.data.device.type != "cpu" for op in (*a_ops, *b_ops)):
        return None
    tiles = _exact_pair(a_ops, b_ops)
    n = b_ops[0].rows
    if tiles is None or (concat and any(op.rows != n for op in b_ops)):
        return None
    if biases is not None and all(x is None for x in biases):
        biases = None
    if biases is not None and (any(x is None for x in biases)
                               or any(tuple(x.shape) != (op.rows,) for x, op in zip(biases, b_ops))):
        return None
    out = torch.empty(sum(op.rows for op in a_ops), n, dtype=out_dtype) if concat else None
    results = native.grouped_exact_gemm([op.data for op in a_ops], [op.scale_inv for op in a_ops], tiles[0],
                                        [op.data for op in b_ops], [op.scale_inv for op in b_ops], tiles[1],
                                        biases, out_dtype, out)
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
