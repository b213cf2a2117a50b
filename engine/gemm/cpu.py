"""The exact CPU emulation of FP8 GEMMs (also the fallback on CUDA for pairs without a GPU kernel here).

Every FP8 value is exact in bf16, and so is an FP8 value times a power of two. So:

* per-tensor pairs upcast to bf16 and run one GEMM with the product of the two scales as
  `addmm`'s alpha (rescaled without flushing when that product is not a normal fp32 number);
* pairs with power-of-2 tile scales (MXFP8's E8M0, block scaling's default) dequantize
  exactly to bf16 and run one GEMM;
* fp32 tile scales are applied to each K block's fp32 partial product (as DeepSeek-V3 does).

bf16 GEMMs accumulate in fp32 and round once; an fp32 (or fp16) output uses an fp32 GEMM, and so
does a bf16 output on a CPU whose bf16 GEMM is not native (`engine.ops.exact_gemm.native_bf16_gemm`).

Numerics (the contract of engine/ops/exact_gemm.py): the decode and every product are exact; the
fp32 accumulation order is unspecified (torch's addmm, or the native small-GEMM kernel below its
size threshold, whose order depends on K alone), so results are within the fp32 reassociation
bound gamma_K * sum_k |a_k b_k| * |alpha| of the exact value (plus the fp32 roundings of the alpha
product and the bias add, and the rounding to the output dtype), not bitwise equal to torch.matmul.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from engine.gemm.operand import GemmOperand
from engine.gemm.scales import split_scales, times_nvfp4_factor, times_pow2
from engine.ops import backend as ops_backend
from engine.ops import quantize as ops
from engine.ops import registry

FP32 = torch.finfo(torch.float32)


def per_k_block(a: GemmOperand, b: GemmOperand) -> torch.Tensor:
    """fp32 out with block scales applied to each 128-wide K block's fp32 partial product."""
    sa = a.tile_scales().repeat_interleave(a.tile_rows, 0)[: a.rows]  # [rows_a, kb]
    sb = b.tile_scales().repeat_interleave(b.tile_rows, 0)[: b.rows]
    out = torch.zeros(a.rows, b.rows, dtype=torch.float32, device=a.data.device)
    for kb, start in enumerate(range(0, a.k, a.tile_cols)):
        stop = min(start + a.tile_cols, a.k)
        partial = a.data[:, start:stop].float() @ b.data[:, start:stop].float().t()
        out.addcmul_(partial, sa[:, kb : kb + 1] * sb[:, kb].unsqueeze(0))
    return out


def _per_tensor_rescaled(a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """A per-tensor GEMM whose fp32 scale product is not a normal number: fp32 GEMM * ma * mb, then * 2**e."""
    ma, mb, e = split_scales(a, b)
    lhs, rhs = ops.fp8_to_bf16(a.data).float(), ops.fp8_to_bf16(b.data).float()
    out = times_pow2(torch.mm(lhs, rhs.t()).mul_(ma * mb), e)
    if bias is not None:
        out += bias.float()
    return out.to(out_dtype)


def exact_gemm_fn() -> Callable:
    """The exact GEMM's kernel: the C++ one unless a backend other than "native" is forced (or it did not build)."""
    forced = ops_backend.forced_backend()
    if forced not in (None, "native"):
        return registry.REFERENCE["exact_gemm"]
    fn = registry.kernel_for("exact_gemm", registry.ANY, "cpu", forced)
    if type(fn) is functools.partial and fn.func is registry.exact_gemm_kernel and not fn.keywords:
        return fn.args[0].exact_gemm  # what the registry's entry calls, without its two Python frames per GEMM
    return fn


def per_tensor(a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """One scale each: bf16-exact upcast, one GEMM, the scale product as alpha (rescaled when not normal)."""
    out = exact_gemm_fn()(a.data, a.scale_inv, (0, 0), b.data, b.scale_inv, (0, 0), bias, out_dtype)
    return _per_tensor_rescaled(a, b, out_dtype, bias) if out is None else out


def pow2_tiles(a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """Power-of-2 tile scales on both sides: exact bf16 values, one GEMM."""
    return exact_gemm_fn()(a.data, a.scale_inv, a.tile, b.data, b.scale_inv, b.tile, bias, out_dtype)


def nvfp4(a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """NVFP4 x NVFP4: each side decoded exactly to bf16 (an E2M1 value times an E4M3 scale has at most 6
    significant bits), one GEMM with fp32 accumulation, then amax_a * amax_b / 2688^2 as one scale.

    That factor (TE's GEMM alpha) is applied as frexp mantissas times a power of two (`times_nvfp4_factor`),
    so tiny amaxes do not flush it to zero. Everything stays on the device: no host sync.
    """
    # E4M3 block scales are not powers of two, but each product has at most 6 significant bits: the exact
    # decode to bf16 holds; an fp32 GEMM (products of bf16 values are exact in fp32, fp32 accumulation)
    y = exact_gemm_fn()(a.data, a.tile_scales(), a.tile, b.data, b.tile_scales(), b.tile, None, torch.float32)
    out = times_nvfp4_factor(y, a, b)
    if bias is not None:
        out += bias.float()
    return out.to(out_dtype)


def fp32_tiles(a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 tile scales: scaled per K block."""
    out = per_k_block(a, b)
    if bias is not None:
        out += bias.float()
    return out.to(out_dtype)
