"""
MXFP8: blocks of 32 with E8M0 shared scales
===========================================

OCP MX quantization splits a tensor into blocks of 32 consecutive elements, gives each
block a power-of-two scale stored as an 8-bit exponent (E8M0, bias 127) and stores the
elements as FP8::

    code = e8m0(max|block|)                   (RCEIL or FLOOR, below)
    q    = saturate(RNE(x * 2^(127 - code)))

* **Rowwise**: 1x32 blocks along the last dim; codes ``[M, ceil(K/32)]``.
* **Columnwise**: 32x1 blocks along the first dim; the data keeps ``x``'s shape (it is *not*
  transposed) and the codes are ``[ceil(M/32), K]``.
* A blocked dim that is not a multiple of 32 ends in a partial block whose scale comes
  from the elements it has (as the reference's zero padding: masked loads read 0.0,
  which cannot raise a block's amax).

In this file you will find:

* :func:`_e8m0_code`: both shared-exponent rules on the integer bits of the block amax,
* :func:`_element_scale`: the multiplier ``2^(127 - code)`` built from its bit pattern,
* ``_mxfp8_kernel``: one program per ``[BLOCK_M, BLOCK_K]`` tile; the tile is reshaped to
  ``[BLOCK_M, BLOCK_K/32, 32]`` (rowwise) or ``[BLOCK_M/32, 32, BLOCK_K]`` (columnwise) so
  that each 32-element block is one slice of a 3D tensor and its amax is one ``tl.max``,
* :func:`quantize_mxfp8`: the launcher.

Shared exponent rules
---------------------

*RCEIL* (NVIDIA hardware, Transformer Engine; the default). ``d = amax * fp32(1/fp8_max)``:
a *product* with the fp32-rounded reciprocal, not a division. The code is ``d``'s biased
exponent, plus one when ``d``'s mantissa is non-zero (round up to a power of two), except
at exponent 254 (no round-up) and for a subnormal ``d`` up to 2^-127 (code 0). ``inf``
gives 254 and NaN 255.

*FLOOR* (the OCP MX v1.0 spec). ``floor(log2(amax)) - emax`` read from amax's exponent
field (emax = 8 for E4M3, 15 for E5M2), clamped to [-127, 127] and biased by 127; a zero
or subnormal amax counts as 2^-127; inf or NaN gives 255. Elements that overflow the
format after scaling saturate.

The element multiplier
----------------------

``2^(127 - code)`` spans 2^127 (code 0) down to 2^-127 (code 254), which is an fp32
*subnormal*: it is built from bits (``(254 - code) << 23``, or ``0x00400000`` for 2^-127),
never from ``exp2``. The multiply ``x * 2^(127 - code)`` is exact unless the product is
an fp32 subnormal, and then it is rounded once, like the reference's (GPUs: ``mul.f32``
keeps subnormals; Triton does not flush them).

Code 255 gives NaN, so a block whose amax is NaN comes out all NaN, as in the reference.
Which NaN a product of two NaNs returns is up to the hardware (and, on CPUs, the operand
order the compiler picked), which does not matter: the cast maps every NaN to the
canonical code ``0x7F``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops import reference
from engine.ops.triton.tiles import load_tile
from engine.ops.triton.fp8_bits import abs_bits, f32_bits, fp8_params, fp32_to_fp8_bits

MX_BLOCK: tl.constexpr = tl.constexpr(reference.MX_BLOCK)

# %%
# Shared exponent and element multiplier
# --------------------------------------


@triton.jit
def _e8m0_code(amax_bits, rcp_bits, FLOOR: tl.constexpr, EMAX: tl.constexpr):
    """E8M0 codes (int32 in [0, 255]) of blocks whose amax is given as int32 bits."""
    if FLOOR:
        biased = (amax_bits >> 23) & 0xFF
        shared = tl.minimum(tl.maximum(biased - (127 + EMAX), -127), 127)
        code = tl.where(biased == 0xFF, 0xFF, shared + 127)
    else:
        rcp = (tl.zeros_like(amax_bits) + rcp_bits).to(tl.float32, bitcast=True)
        d = amax_bits.to(tl.float32, bitcast=True) * rcp
        bits = d.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        exponent = bits >> 23
        mantissa = bits & 0x7FFFFF
        round_up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
        code = exponent + round_up.to(tl.int32)
        code = tl.where(bits == 0x7F800000, 0xFE, code)
        code = tl.where(bits > 0x7F800000, 0xFF, code)
    return code


@triton.jit
def _element_scale(code):
    """2^(127 - code) as fp32 (exactly; 2^-127 is the subnormal 0x00400000), NaN for code 255."""
    e = 254 - code
    bits = tl.where(e >= 1, e << 23, 0x00400000)
    bits = tl.where(code == 0xFF, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


# %%
# The kernel
# ----------


@triton.jit
def _mxfp8_kernel(
    x_ptr, out_ptr, code_ptr,
    M, K, stride_xm, stride_xk, rcp_bits,
    MAN_BITS: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr, EMAX: tl.constexpr,
    FLOOR: tl.constexpr, COLUMNWISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    x, offs_m, offs_k, mask = load_tile(x_ptr, M, K, stride_xm, stride_xk, BLOCK_M, BLOCK_K)
    tiles_k = tl.cdiv(K, BLOCK_K)
    pid_m, pid_k = tl.program_id(0) // tiles_k, tl.program_id(0) % tiles_k  # for the scale offsets

    if COLUMNWISE:
        # 32x1 blocks: [BLOCK_M/32, 32, BLOCK_K], reduce over the middle axis
        xb = tl.reshape(x, [BLOCK_M // MX_BLOCK, MX_BLOCK, BLOCK_K])
        code = _e8m0_code(tl.max(abs_bits(xb), axis=1), rcp_bits, FLOOR, EMAX)  # [BLOCK_M/32, BLOCK_K]
        q = fp32_to_fp8_bits(xb * _element_scale(code)[:, None, :], MAN_BITS, BIAS, MAX_CODE)
        cm = pid_m.to(tl.int64) * (BLOCK_M // MX_BLOCK) + tl.arange(0, BLOCK_M // MX_BLOCK)
        cmask = (cm[:, None] < tl.cdiv(M, MX_BLOCK)) & (offs_k[None, :] < K)
        tl.store(code_ptr + cm[:, None] * K + offs_k[None, :], code.to(tl.uint8), mask=cmask)
    else:
        # 1x32 blocks: [BLOCK_M, BLOCK_K/32, 32], reduce over the last axis
        xb = tl.reshape(x, [BLOCK_M, BLOCK_K // MX_BLOCK, MX_BLOCK])
        code = _e8m0_code(tl.max(abs_bits(xb), axis=2), rcp_bits, FLOOR, EMAX)  # [BLOCK_M, BLOCK_K/32]
        q = fp32_to_fp8_bits(xb * _element_scale(code)[:, :, None], MAN_BITS, BIAS, MAX_CODE)
        ck = pid_k.to(tl.int64) * (BLOCK_K // MX_BLOCK) + tl.arange(0, BLOCK_K // MX_BLOCK)
        n_codes = tl.cdiv(K, MX_BLOCK)
        cmask = (offs_m[:, None] < M) & (ck[None, :] < n_codes)
        tl.store(code_ptr + offs_m[:, None] * n_codes + ck[None, :], code.to(tl.uint8), mask=cmask)
    q = tl.reshape(q, [BLOCK_M, BLOCK_K])
    tl.store(out_ptr + offs_m[:, None] * K + offs_k[None, :], q, mask=mask)


# %%
# Launcher
# --------

BLOCK_M = 64
BLOCK_K = 128
NUM_WARPS = 4


def quantize_mxfp8(
    x: torch.Tensor, fp8_dtype: torch.dtype, *, scale_mode: str = "rceil", columnwise: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 of ``x`` (any shape, read as ``[M, K]``): (data with x's shape, uint8 E8M0 codes
    ``[M, ceil(K/32)]``, or ``[ceil(M/32), K]`` when ``columnwise``)."""
    reference.check_input(x)
    if scale_mode not in reference.SCALE_MODES:
        raise ValueError(f"scale_mode: expected one of {sorted(reference.SCALE_MODES)}, got {scale_mode!r}")
    p = fp8_params(fp8_dtype)
    x2d = reference.as_2d(x)
    m, k = x2d.shape
    dev = x.device
    data = torch.empty((m, k), dtype=torch.uint8, device=dev)
    if columnwise:
        codes = torch.empty((reference.mx_blocks(m), k), dtype=torch.uint8, device=dev)
    else:
        codes = torch.empty((m, reference.mx_blocks(k)), dtype=torch.uint8, device=dev)
    if m and k:
        grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(k, BLOCK_K),)
        _mxfp8_kernel[grid](
            x2d, data, codes, m, k, x2d.stride(0), x2d.stride(1), f32_bits(1.0 / p.max_value),
            MAN_BITS=p.man_bits, BIAS=p.bias, MAX_CODE=p.max_code, EMAX=p.max_exponent,
            FLOOR=scale_mode == "floor", COLUMNWISE=bool(columnwise),
            BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS,
        )
    return data.view(fp8_dtype).reshape(x.shape), codes
