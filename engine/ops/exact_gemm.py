"""The exact CPU GEMM of FP8 operands, in torch ops: the reference of the native `exact_gemm`.

Every FP8 value is exact in bf16, and so is an FP8 value times a power of two (bf16 has
fp32's exponent range). So a pair of per-tensor operands upcasts to bf16 and runs one
`addmm` with the fp32 product of the two scale_inv as alpha, and a pair with power-of-2
tile scales (MXFP8's E8M0, block scaling's power-of-2 default) decodes each operand to
bf16 exactly and runs one `addmm`. Decoded NaNs are 0x7FC0 (torch's own bf16 multiply
gives other NaN bits in its vector loop).

Which GEMM: a bf16 output on a CPU whose bf16 GEMM is native (`native_bf16_gemm()`: torch runs
bf16 matmuls on AVX512-BF16 or AMX-BF16 through oneDNN) runs a bf16 GEMM (fp32 accumulation,
one rounding); every other output, and a bf16 output elsewhere (AVX2 CPUs such as AMD Zen 3,
AVX-512 without BF16, or oneDNN capped by ONEDNN_MAX_CPU_ISA), runs the fp32 GEMM on the
same decoded values (exact in fp32 as in bf16), rounded to bf16 at the end. Without bf16
hardware torch's bf16 matmul converts to fp32 inside and is 3-6x slower than its fp32 one;
there a bf16 output has exactly the bits of the fp32 output of the same call (bias rounded
to bf16 first) rounded to bf16.

The contract both implementations meet (tests/test_exact_gemm.py, tests/test_registry.py):

* the decode is exact: bf16(value * tile scale), rounded once (only under/overflow rounds),
  bit for bit on every FP8 code and E8M0 code (0, 254, 255: NaN), subnormals included;
* every product of two decoded values is exact in fp32 (unless it underflows fp32);
* the sum over K is fp32 in an unspecified order, so with alpha the fp32 scale product
  (1 for tile pairs), S = sum_k |a_k b_k| and gamma_K = K 2^-24 / (1 - K 2^-24), the output
  is within |alpha| (gamma_K S + K 2^-149) of alpha * sum_k a_k b_k computed exactly, plus one
  fp32 rounding each for the alpha product and the bias add (the bias rounded to bf16 first
  for a bf16 output, else to fp32), plus the final rounding to out_dtype; NaN and inf as IEEE arithmetic gives
  them (NaN bits unspecified). Subnormals are kept, whatever the caller's flush-to-zero state,
  by the native small kernel and the fp32 GEMM; a native bf16 GEMM (addmm with a bf16 output
  where `native_bf16_gemm()`: this reference, the baseline ISA, large native calls) reads
  subnormal operands as zero and flushes subnormal results, as the hardware's bf16 dot
  products do.
* Run to run on one machine (same shapes, thread count, ISA level and torch), the bits are the same.
* So a machine without native bf16 GEMMs loses nothing by the fp32 GEMM: the same exact products, fp32
  accumulation in both, and the bf16 output one rounding of the fp32 sum, as a bf16 GEMM's is. Every emulated
  GEMM path runs this way there: this function and the native exact_gemm (per-tensor FP8, power-of-2 tiles:
  MXFP8, MXFP4/MXFP6 as decoded elements, block scaling's default), NVFP4 (an fp32 output always),
  `engine.gemm.cpu.per_k_block` (fp32 tile scales, fp32 partial products) and a quantized operand paired with a
  plain one (dequantized to fp32).
* The native small kernel (csrc/gemm/small_gemm_kernels.cpp, one source compiled per ISA level; run at avx2 and
  avx512: bf16 output up to M * N * K = 2^21 (avx512) / 2^20 (avx2) where the bf16 GEMM is native, every fp32
  GEMM for K <= 512 whatever M and N: csrc/gemm/exact_gemm_glue.cpp) sums each output as one fp32 fma chain over
  k = 0..K-1 (csrc/gemm/small_gemm.h): its order depends on K alone, so a GEMM on a slice of A's or B's rows gives
  the same bits as the matching slice of the whole GEMM (for fp32 GEMMs always, as the choice itself depends on K
  alone), and avx2 and avx512 give the same bits. addmm (this reference, the baseline ISA, larger native calls)
  makes no such promise, nor does it match the small kernel's bits.
* A per-tensor pair whose fp32 scale product is not a normal number returns None.
"""

from __future__ import annotations

import functools
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


@functools.cache
def native_bf16_gemm() -> bool:
    """Whether torch's CPU bf16 GEMM runs on bf16 hardware here: decided once per process.

    The CPU must have AVX512-BF16 or AMX-BF16 (torch.cpu.get_capabilities()), and a bf16 GEMM of a size torch
    sends to oneDNN must read a subnormal operand as zero, as vdpbf16ps and AMX do and every emulation (torch's
    own loops, oneDNN capped below AVX512_CORE_BF16 by ONEDNN_MAX_CPU_ISA) does not: the CPU flags alone do
    not say what oneDNN runs.
    """
    caps = torch.cpu.get_capabilities()
    if not (caps.get("avx512_bf16") or caps.get("amx_bf16")):
        return False
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad():
        subnormal = torch.full((64, 256), 2.0**-130, dtype=torch.bfloat16)  # 2^-130 * 2^100 * 256 = 2^-22 exactly
        big = torch.full((128, 256), 2.0**100, dtype=torch.bfloat16)
        out = torch.addmm(torch.empty(64, 128, dtype=torch.bfloat16), subnormal, big.t(), beta=0)
        return bool((out == 0).all())


def gemm_dtype(out_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The GEMM's dtype for an output dtype: bf16 for a bf16 output where the bf16 GEMM is native (a GPU, or
    `native_bf16_gemm()` on the CPU), else fp32."""
    if out_dtype != torch.bfloat16:
        return torch.float32
    return torch.bfloat16 if device.type != "cpu" or native_bf16_gemm() else torch.float32


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
    dtype = gemm_dtype(out_dtype, a.device)
    lhs = decode_bf16(a, a_scale_inv, a_tile).to(dtype)
    rhs = decode_bf16(b, b_scale_inv, b_tile).to(dtype)
    if bias is None:
        out = torch.addmm(torch.empty(lhs.shape[0], rhs.shape[0], dtype=dtype), lhs, rhs.t(), beta=0, alpha=alpha)
    else:  # the bias rounded to bf16 for a bf16 output (whatever the GEMM's dtype), else to fp32
        bias = bias.to(torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32)
        out = torch.addmm(bias.to(dtype).expand(lhs.shape[0], rhs.shape[0]), lhs, rhs.t(), alpha=alpha)
    return out if out.dtype == out_dtype else out.to(out_dtype)
