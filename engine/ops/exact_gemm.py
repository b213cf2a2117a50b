"""The exact CPU GEMM of FP8 operands, in torch ops: the reference of the native `exact_gemm`.

Every FP8 value is exact in bf16, and so is an FP8 value times a power of two (bf16 has
fp32's exponent range). So a pair of per-tensor operands upcasts to bf16 and runs one
`addmm` with the fp32 product of the two scale_inv as alpha, and a pair with power-of-2
tile scales (MXFP8's E8M0, block scaling's power-of-2 default) decodes each operand to
bf16 exactly and runs one `addmm`. bf16 GEMMs accumulate in fp32 and round once; an fp32
or fp16 output uses an fp32 GEMM. Decoded NaNs are 0x7FC0 (torch's own bf16 multiply
gives other NaN bits in its vector loop), so both backends agree bit for bit.
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
