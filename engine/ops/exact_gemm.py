"""The exact CPU GEMM of FP8 operands, in torch ops: the reference of the native `exact_gemm`.

Every FP8 value is exact in bf16, and so is an FP8 value times a power of two (bf16 has
fp32's exponent range). So a pair of per-tensor operands upcasts to bf16 and runs one
`addmm` with the fp32 product of the two scale_inv as alpha, and a pair with power-of-2
tile scales (MXFP8's E8M0, block scaling's power-of-2 default) decodes each operand to
bf16 exactly and runs one `addmm`. bf16 GEMMs accumulate in fp32 and round once; an fp32
or fp16 output uses an fp32 GEMM. Decoded NaNs are 0x7FC0 (torch's own bf16 multiply
gives other NaN bits in its vector loop).

The contract both implementations meet (tests/test_exact_gemm.py, tests/test_registry.py):

* the decode is exact: bf16(value * tile scale), rounded once (only under/overflow rounds),
  bit for bit on every FP8 code and E8M0 code (0, 254, 255: NaN), subnormals included;
* every product of two decoded values is exact in fp32 (unless it underflows fp32);
* the sum over K is fp32 in an unspecified order, so with alpha the fp32 scale product
  (1 for tile pairs), S = sum_k |a_k b_k| and gamma_K = K 2^-24 / (1 - K 2^-24), the output
  is within |alpha| (gamma_K S + K 2^-149) of alpha * sum_k a_k b_k computed exactly, plus one
  fp32 rounding each for the alpha product and the bias add (the bias rounded to the GEMM
  dtype first), plus the final rounding to out_dtype; NaN and inf as IEEE arithmetic gives
  them (NaN bits unspecified). Subnormals are kept, whatever the caller's flush-to-zero state,
  by the native small kernel; oneDNN's bf16 GEMM (addmm with a bf16 output: this reference,
  the portable ISA, large native calls) flushes subnormal products and sums to zero.
* The native small kernel (AVX-512; bf16 output up to M * N * K = 2^21, fp32 and fp16
  outputs for K <= 512 whatever M and N: csrc/bindings.cpp) sums each output as one fp32 fma
  chain over k = 0..K-1 (csrc/small_gemm.h): its order depends on K alone, so a GEMM on a slice
  of A's or B's rows gives the same bits as the matching slice of the whole GEMM (for fp32
  outputs always, as the choice itself depends on K alone). addmm (this reference, the portable
  ISA, larger native calls) makes no such promise, nor does it match the small kernel's bits.
* A per-tensor pair whose fp32 scale product is not a normal number returns None.
"""

from __future__ import annotations

import math
import struct

import torch

from engine.ops import reference as ref

FP32 = torch.finfo(torch.float32)
Tile = tuple[int, int]  # (rows, cols) sharing one scale; (0, 0) = one scale for the tensor


def scale_product(sa: torch.Tensor, sb: torch.Tensor) -> float:
    """fp32(sa * sb) as a host number, for addmm's alpha (an mm then a multiply by a tensor changes the bits).

    Two fp32 values multiply exactly in a double; packing it as fp32 rounds once (to nearest
    even), as an fp32 multiply would.
    """
    product = sa.item() * sb.item()  # 1-element tensors (the operands' per-tensor scale_inv)
    try:
        return struct.unpack("f", struct.pack("f", product))[0]
    except OverflowError:  # rounds past FLT_MAX: the fp32 product is inf
        return math.copysign(math.inf, product)


def decode_bf16(data: torch.Tensor, scale_inv: torch.Tensor, tile: Tile) -> torch.Tensor:
    """The exact bf16 value of FP8 `data` [rows, K] times its power-of-2 tile scales (per tensor: the data)."""
    values = ref.fp8_to_bf16(data)
    if tile == (0, 0) or data.numel() == 0:
        return values
    rows, k = data.shape
    tr, tc = tile
    scales = ref.e8m0_to_float(scale_inv) if scale_inv.dtype == torch.uint8 else scale_inv.float()
    per_element = scales.repeat_interleave(tr, 0)[:rows].repeat_interleave(tc, 1)[:, :k]
    decoded = (values.float() * per_element).to(torch.bfloat16)  # exact but for overflow/underflow, RNE
    return torch.where(decoded.isnan(), torch.full_like(decoded, math.nan), decoded)


def exact_gemm(a: torch.Tensor, a_scale_inv: torch.Tensor, a_tile: Tile, b: torch.Tensor, b_scale_inv: torch.Tensor,
               b_tile: Tile, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor | None:
    """decode(a) @ decode(b)^T * alpha (+ bias) in out_dtype; None for a per-tensor pair whose scale
    product is not a normal fp32 number (the caller rescales it without flushing)."""
    alpha = 1.0
    if a_tile == (0, 0):
        alpha = scale_product(a_scale_inv, b_scale_inv)
        if not FP32.tiny <= abs(alpha) <= FP32.max:  # subnormal/0 (tiny operands), inf, NaN
            return None
    gemm_dtype = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
    lhs = decode_bf16(a, a_scale_inv, a_tile).to(gemm_dtype)
    rhs = decode_bf16(b, b_scale_inv, b_tile).to(gemm_dtype)
    if bias is None:
        out = torch.addmm(torch.empty(lhs.shape[0], rhs.shape[0], dtype=gemm_dtype), lhs, rhs.t(), beta=0, alpha=alpha)
    else:
        out = torch.addmm(bias.to(gemm_dtype).expand(lhs.shape[0], rhs.shape[0]), lhs, rhs.t(), alpha=alpha)
    return out if out.dtype == out_dtype else out.to(out_dtype)
