"""The MX element codecs without a torch dtype: E2M1 (FP4), E2M3 and E3M2 (FP6), as uint8 codes.

The executable spec of these elements, in plain torch; every backend gives the same bits.

* Cast (`encode`): round to nearest, ties to even, onto the format's grid (subnormals
  included); |x| above the max normal saturates to ±max (E2M1 6, E2M3 7.5, E3M2 28): these
  formats have no inf and no NaN codes, so +-inf becomes ±max. A NaN becomes +0 (code 0),
  whatever its sign and payload (sign-independent, like the canonical FP8 NaN; in a
  quantized tensor a NaN always sits in a block whose E8M0 scale is the NaN code 255, so the
  block still dequantizes to NaN). -0.0 and negative values that round to zero keep the sign
  bit (the negative-zero code), as the FP8 casts do.
* Codes: sign bit at bit (e + m), then the biased exponent, then the mantissa; E2M1 codes
  are 4 bits, FP6 codes 6 bits (the two high bits of an FP6 byte are zero).
* Packing (`pack`/`unpack`): along the last dim of the data. E2M1 holds two elements per
  byte, element 2i in the low nibble and 2i+1 in the high nibble (Transformer Engine's and
  torchao's order); an odd last dim ends in a byte whose high nibble is 0. E2M3 and E3M2 are
  one element per byte (torchao's unpacked layout: simple, byte-addressable; 4-in-3 packing
  would save 25% more but splits elements across bytes).
"""

from __future__ import annotations

import functools

import torch
from torch._subclasses.fake_tensor import is_fake

from engine.formats import FloatFormat


def code_bits(fmt: FloatFormat) -> int:
    return fmt.bits


def per_byte(fmt: FloatFormat) -> int:
    """Elements per stored byte: 2 for the 4-bit E2M1, else 1."""
    return 2 if fmt.bits == 4 else 1


def packed_cols(cols: int, fmt: FloatFormat) -> int:
    """Bytes along the last dim that hold `cols` elements."""
    return -(-cols // per_byte(fmt))


def encode(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """uint8 codes of fp32 `x` (any shape): saturating round-to-nearest-even; NaN -> 0 (see the module doc)."""
    xf = x.float()
    a = xf.abs().clamp(max=fmt.max)  # inf -> max; NaN stays NaN (handled at the end)
    emin = 1 - fmt.bias
    _, e = torch.frexp(a)  # a = m * 2^e, m in [0.5, 1): floor(log2 a) = e - 1 (frexp(0) gives e = 0)
    exponent = torch.where(a > 0, e - 1, emin).clamp(min=emin)
    quantum = torch.ldexp(torch.ones_like(a), exponent - fmt.mantissa_bits)  # the grid step at a (a power of 2)
    steps = torch.round(a / quantum)  # exact division; torch.round ties to even
    # the code of steps * quantum: (exponent - emin) whole binades of 2^m codes, then the steps (a step count
    # of 2^m at emin is the smallest normal, 2^(m+1) the next binade: both fall out of the sum)
    magnitude = (exponent - emin).to(torch.int32) * (1 << fmt.mantissa_bits) + steps.to(torch.int32)
    sign = torch.signbit(xf).to(torch.int32) << (fmt.exponent_bits + fmt.mantissa_bits)
    code = (magnitude | sign).masked_fill(torch.isnan(xf), 0)
    return code.to(torch.uint8)


@functools.cache
def _table(fmt: FloatFormat) -> torch.Tensor:
    """fp32 value of every code of `fmt` (exact: at most 4 significant bits)."""
    return fmt.decode(torch.arange(1 << fmt.bits)).float()


def decode(codes: torch.Tensor, fmt: FloatFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of unpacked uint8 codes, in `dtype` (exact in fp32 and bf16); bits above the code's are ignored.
    On FakeTensors (a custom op's fake implementation under torch.compile) by the format's rules, as the cached
    table is a real tensor a fake op may not read."""
    if is_fake(codes):
        return fmt.decode(codes & ((1 << fmt.bits) - 1)).float().to(dtype)
    table = _table(fmt).to(dtype=dtype, device=codes.device)
    return table[(codes & ((1 << fmt.bits) - 1)).long()]


def pack(codes: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Unpacked codes [..., cols] -> stored bytes [..., packed_cols(cols)] (E2M1: two per byte, low nibble first)."""
    if per_byte(fmt) == 1:
        return codes.contiguous()
    cols = codes.shape[-1]
    if cols % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)  # explicit sizes: empty tensors too
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def unpack(data: torch.Tensor, fmt: FloatFormat, cols: int) -> torch.Tensor:
    """Stored bytes [..., packed_cols(cols)] -> unpacked codes [..., cols]."""
    if per_byte(fmt) == 1:
        return data
    both = torch.stack((data & 0x0F, data >> 4), dim=-1)
    return both.reshape(*data.shape[:-1], 2 * data.shape[-1])[..., :cols]


def elements_to_bf16(data: torch.Tensor, fmt: FloatFormat, cols: int | None = None) -> torch.Tensor:
    """Stored bytes -> the elements' values as bf16 [..., cols] (exact), without the block scales.

    `cols` is the unpacked last dim (default: every element the bytes hold).
    """
    if cols is None:
        cols = data.shape[-1] * per_byte(fmt)
    return decode(unpack(data, fmt, cols), fmt, torch.bfloat16)
