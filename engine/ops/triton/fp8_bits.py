"""
Bit-exact FP8 rounding
======================

This module holds the `@triton.jit` helpers every other kernel of the package uses to
turn fp32 values into FP8 codes (and back), using integer arithmetic only.

In it you will find:

* :func:`fp32_to_fp8_bits`: the saturating round-to-nearest-even cast of an fp32 value
  to E4M3 / E5M2, returning the 8-bit code as ``tl.uint8``,
* :func:`fp8_bits_to_bf16_bits`: the exact decode of an FP8 code into bf16 bits,
* :func:`abs_bits`: NaN-propagating ``|x|`` as ordered integers (for amax reductions),
* :func:`canonical_amax_bits`: any NaN amax as the canonical fp32 NaN ``0x7FC00000``,
* :func:`f32_bits` (Python side): the fp32 bit pattern of a constant, so kernels get exact
  constants as int32 arguments,
* :func:`fp8_params`: the per-format constants (Python side) the kernels are
  specialised on.

Why not ``x.to(tl.float8e4nv)``?
--------------------------------

The reference (``engine.ops.reference.cast_to_fp8``) is ``x.clamp(-max, max).to(fp8)``:
saturation, then round-to-nearest-even (RNE) including FP8 subnormals, and every NaN
becomes the canonical code ``0x7F``. Triton's own downcast does not give those bits everywhere:

* under ``TRITON_INTERPRET=1`` (how this package is tested on machines without a GPU) it is
  plainly wrong: no carry into the exponent when the mantissa rounds up (7.98 becomes 4.0
  in E4M3 instead of 8.0), round-half-up instead of half-to-even, NaN for unclamped large
  values;
* on GPUs it depends on the architecture (native ``cvt`` on sm_89+, software emulation
  elsewhere), and a clamp written with ``tl.minimum``/``tl.maximum`` silently drops NaN
  (``maxnum`` semantics).

So we round ourselves. An fp32 value is ``(-1)^s * 1.m * 2^(e-127)``; with the fp32 bits
``u = |x|`` as an integer:

* **Normal target** (the FP8 biased exponent ``e + bias - 127`` is >= 1): re-bias the
  exponent field by adding ``(bias - 127) << 23``, then round the 23-bit mantissa to
  ``MAN_BITS`` bits with the classic RNE trick ``r += (half - 1) + lsb; r >>= shift``. A
  round-up that overflows the mantissa carries into the exponent by itself, because
  exponent and mantissa are adjacent fields of one integer.
* **Subnormal target** (FP8 exponent <= 0): shift the 24-bit significand (implicit 1
  included) right by ``24 - MAN_BITS - e8`` and round half to even by comparing the
  dropped bits with half a unit. A round-up into the smallest normal gives the right code
  (``1 << MAN_BITS``) with no special case.
* **Saturation**: every non-NaN code above the largest finite code (this includes
  +inf and every value that rounds past the max) becomes the max code: exactly what
  clamping to ``±max`` before the cast does.
* **NaN** becomes ``0x7F`` whatever its sign and payload (the canonical NaN of
  ``engine.ops.reference``; NVIDIA's cvt instructions give it too), so it does not matter
  which NaN a multiply returns: CPUs return a NaN operand, GPUs a canonical positive NaN.

Only ``&``, ``|``, shifts, adds, compares and selects on int32 are used: the result is
the same on the interpreter and on any GPU, and is tested against torch on all 2^16
bf16 bit patterns and a dense fp32 sample (``tests/test_triton.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.ops.triton.tiles import to_fp32


class FP8Params(NamedTuple):
    """Compile-time constants of an FP8 format, as the kernels take them."""

    man_bits: int  # mantissa bits (E4M3: 3, E5M2: 2)
    exp_bits: int  # exponent bits (E4M3: 4, E5M2: 5)
    bias: int  # exponent bias (E4M3: 7, E5M2: 15)
    max_code: int  # code of the largest finite value (E4M3: 0x7E = 448, E5M2: 0x7B = 57344)
    ieee_like: bool  # the all-ones exponent is inf/NaN (E5M2) rather than normal numbers (E4M3)
    max_value: float  # the largest finite value
    max_exponent: int  # unbiased exponent of the largest finite value ("emax" of the OCP MX spec)


_PARAMS = {
    torch.float8_e4m3fn: FP8Params(3, 4, 7, 0x7E, False, 448.0, 8),
    torch.float8_e5m2: FP8Params(2, 5, 15, 0x7B, True, 57344.0, 15),
}


def fp8_params(fp8_dtype: torch.dtype) -> FP8Params:
    """The constants of `fp8_dtype` (torch.float8_e4m3fn or torch.float8_e5m2)."""
    try:
        return _PARAMS[fp8_dtype]
    except (KeyError, TypeError):
        raise TypeError(
            f"fp8_dtype: expected torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}"
        ) from None


def f32_bits(value: float) -> int:
    """The fp32 bit pattern (as a signed int32) of a Python float, rounded the way torch does."""
    return int(torch.tensor(value, dtype=torch.float32).view(torch.int32).item())


# %%
# Helpers
# -------


@triton.jit
def abs_bits(x):
    """|x| of an fp32 tensor as int32 bits.

    Non-negative floats are ordered like their bit patterns, and every NaN (any sign, any
    payload) has |bits| > 0x7F800000 (+inf): an integer max of these is a NaN-propagating
    max|x|. (`tl.max` on floats lowers to `maxnum` on GPUs, which drops NaN.)
    """
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def canonical_amax_bits(bits):
    """An amax given as `abs_bits` (>= 0) with every NaN made the canonical 0x7FC00000.

    Canonical NaNs still compare above +inf, so an integer max over canonical values stays
    canonical (a program canonicalizes its own amax before the cross-program atomic max).
    """
    return tl.where(bits > 0x7F800000, 0x7FC00000, bits)


# %%
# fp32 -> FP8
# -----------


@triton.jit
def e4m3_scale_value(code):
    """fp32 value of non-negative E4M3 codes (int32): normal by its bits, subnormal m * 2^-9, 0x7F NaN (exact)."""
    e = code >> 3
    m = code & 7
    normal = ((e + 120) << 23 | (m << 20)).to(tl.float32, bitcast=True)
    value = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    nan = (code * 0 + 0x7FC00000).to(tl.float32, bitcast=True)
    return tl.where(code == 0x7F, nan, value)


@triton.jit
def fp32_to_fp8_bits(x, MAN_BITS: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr):
    """Saturating RNE cast of fp32 `x` to an FP8 code (uint8), bit-identical to
    ``x.clamp(-max, max).to(fp8_dtype)`` in torch.

    `MAN_BITS`, `BIAS`, `MAX_CODE` describe the format (see `fp8_params`).
    """
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80  # arithmetic shift: 0x80 for negative values, incl. -0.0 and -NaN
    u = bits & 0x7FFFFFFF
    is_nan = u > 0x7F800000

    # normal FP8 result: re-bias the exponent, RNE on the low (23 - MAN_BITS) mantissa bits
    SHIFT: tl.constexpr = 23 - MAN_BITS
    r = u + ((BIAS - 127) << 23)
    r = r + ((1 << (SHIFT - 1)) - 1) + ((r >> SHIFT) & 1)
    normal_code = r >> SHIFT

    # subnormal FP8 result: significand (with its implicit 1) shifted right with RNE
    e32 = u >> 23
    sig = tl.where(e32 == 0, u & 0x7FFFFF, (u & 0x7FFFFF) | 0x800000)
    e8 = tl.maximum(e32, 1) + (BIAS - 127)  # FP8 biased exponent (<= 0 means subnormal)
    # for e8 <= 0 the shift is >= 24 - MAN_BITS; past 25 every 24-bit significand rounds to 0.
    # The clamps keep the shift amounts in [1, 25] (no out-of-range shifts on GPUs).
    shift = tl.minimum(tl.maximum((24 - MAN_BITS) - e8, 1), 25)
    q = sig >> shift
    rem = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    round_up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    sub_code = q + round_up.to(tl.int32)

    code = tl.where(e8 <= 0, sub_code, normal_code)
    code = tl.minimum(code, MAX_CODE)  # saturation (also maps +-inf to +-max)
    code = tl.where(is_nan, 0x7F, code | sign)  # the canonical NaN has no sign
    return code.to(tl.uint8)


# %%
# FP8 -> bf16
# -----------


@triton.jit
def fp8_bits_to_bf16_bits(c, MAN_BITS: tl.constexpr, EXP_BITS: tl.constexpr, BIAS: tl.constexpr,
                          IEEE_LIKE: tl.constexpr):
    """Exact decode of FP8 codes (int32 in [0, 255]) to bf16 bit patterns (int32 in [0, 0xFFFF]).

    Every E4M3/E5M2 value is a bf16 value. NaN codes give 0x7FC0 and ±inf (E5M2) ±inf, as
    torch's CPU conversion does.
    """
    MMASK: tl.constexpr = (1 << MAN_BITS) - 1
    EMASK: tl.constexpr = (1 << EXP_BITS) - 1
    sign = (c & 0x80) << 8
    e = (c >> MAN_BITS) & EMASK
    m = c & MMASK
    normal = sign | ((e + (127 - BIAS)) << 7) | (m << (7 - MAN_BITS))
    # subnormal: m * 2^(1 - BIAS - MAN_BITS); p = position of m's leading one
    p = tl.zeros_like(m)
    for i in tl.static_range(1, MAN_BITS):
        p += (m >= (1 << i)).to(tl.int32)
    sub = sign | ((p + (128 - BIAS - MAN_BITS)) << 7) | (((m - (1 << p)) << (7 - p)) & 0x7F)
    sub = tl.where(m == 0, sign, sub)
    out = tl.where(e == 0, sub, normal)
    if IEEE_LIKE:
        out = tl.where((e == EMASK) & (m == 0), sign | 0x7F80, out)
        out = tl.where((e == EMASK) & (m != 0), 0x7FC0, out)
    else:
        out = tl.where((e == EMASK) & (m == MMASK), 0x7FC0, out)
    return out


# %%
# A test kernel: the helper applied elementwise
# ---------------------------------------------
# Used by the tests to check `fp32_to_fp8_bits` against torch on every bf16 bit pattern.


@triton.jit
def _fp32_to_fp8_kernel(x_ptr, out_ptr, n, MAN_BITS: tl.constexpr, BIAS: tl.constexpr,
                        MAX_CODE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = to_fp32(tl.load(x_ptr + offs, mask=mask, other=0.0))
    tl.store(out_ptr + offs, fp32_to_fp8_bits(x, MAN_BITS, BIAS, MAX_CODE), mask=mask)


def cast_to_fp8(x: torch.Tensor, fp8_dtype: torch.dtype, *, block: int = 1024) -> torch.Tensor:
    """Elementwise saturating RNE cast (any float dtype) with the integer helper; same shape.

    (`block`, a power of 2, is the number of elements per program.)
    """
    p = fp8_params(fp8_dtype)
    xc = x.contiguous().reshape(-1)
    out = torch.empty(xc.shape, dtype=torch.uint8, device=x.device)
    n = xc.numel()
    if n:
        _fp32_to_fp8_kernel[(triton.cdiv(n, block),)](xc, out, n, p.man_bits, p.bias, p.max_code, BLOCK=block)
    return out.view(fp8_dtype).reshape(x.shape)
