"""MX element codecs (E2M1, E2M3, E3M2) against independent brute force.

Every code is decoded here from its bits alone (sign, exponent, mantissa, bias: the OCP MX
v1.0 definitions), in float64; the expected code of a value is found by searching that grid
for the nearest value, ties to the even code, saturating at the max normal. Nothing here
reads engine's format table.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.formats import MX_ELEMENTS
from engine.ops import mx_elements as mx

# name: (exponent bits, mantissa bits, bias, max normal) from the OCP MX v1.0 spec, section 5.3
SPEC = {"e2m1": (2, 1, 1, 6.0), "e2m3": (2, 3, 1, 7.5), "e3m2": (3, 2, 3, 28.0)}


def bits_value(code: int, e_bits: int, m_bits: int, bias: int) -> float:
    sign = -1.0 if (code >> (e_bits + m_bits)) & 1 else 1.0
    exponent = (code >> m_bits) & ((1 << e_bits) - 1)
    mantissa = code & ((1 << m_bits) - 1)
    if exponent == 0:
        return sign * mantissa / (1 << m_bits) * 2.0 ** (1 - bias)
    return sign * (1 + mantissa / (1 << m_bits)) * 2.0 ** (exponent - bias)


def grid(name: str) -> list[float]:
    """Magnitudes of the codes 0 .. 2^(e+m) - 1 (increasing: the magnitude's code is its index)."""
    e_bits, m_bits, bias, _ = SPEC[name]
    return [bits_value(c, e_bits, m_bits, bias) for c in range(1 << (e_bits + m_bits))]


def expected_code(v: float, name: str) -> int:
    e_bits, m_bits, _, _ = SPEC[name]
    if math.isnan(v):
        return 0
    sign = (1 << (e_bits + m_bits)) if math.copysign(1.0, v) < 0 else 0
    a, g = abs(v), grid(name)
    if a >= g[-1]:
        return sign | (len(g) - 1)
    hi = next(i for i, value in enumerate(g) if value >= a)
    if g[hi] == a:
        return sign | hi
    lo = hi - 1
    d_lo, d_hi = a - g[lo], g[hi] - a
    if d_lo != d_hi:
        return sign | (lo if d_lo < d_hi else hi)
    return sign | (lo if lo % 2 == 0 else hi)  # a tie: the even code


def probe_values(name: str) -> list[float]:
    """Every code's value (both signs), every midpoint and the fp32 numbers next to it, beyond max, specials."""
    g = grid(name)
    out = []
    for i, value in enumerate(g):
        out += [value, np.nextafter(np.float32(value), np.float32(np.inf)).item(),
                np.nextafter(np.float32(value), np.float32(0)).item()]
        if i + 1 < len(g):
            mid = np.float32((value + g[i + 1]) / 2)  # exact in fp32
            out += [mid.item(), np.nextafter(mid, np.float32(np.inf)).item(), np.nextafter(mid, np.float32(0)).item()]
    top = g[-1]
    out += [top * 1.01, top * 2, 1e30, 3.4028234663852886e38, math.inf, 1e-45, 1e-38, 1e-7, 0.0]
    return out + [-v for v in out] + [math.nan, -math.nan]


@pytest.mark.parametrize("name", sorted(SPEC))
def test_format_facts_match_the_spec(name):
    e_bits, m_bits, bias, top = SPEC[name]
    fmt = MX_ELEMENTS[name]
    assert (fmt.exponent_bits, fmt.mantissa_bits, fmt.bias, fmt.max) == (e_bits, m_bits, bias, top)
    assert max(grid(name)) == top
    assert fmt.max_exponent == {"e2m1": 2, "e2m3": 2, "e3m2": 4}[name]  # emax of the OCP spec (FLOOR rule)


@pytest.mark.parametrize("name", sorted(SPEC))
def test_every_code_decodes_to_its_bits(name):
    fmt = MX_ELEMENTS[name]
    e_bits, m_bits, bias, _ = SPEC[name]
    codes = torch.arange(1 << fmt.bits, dtype=torch.uint8)
    want = torch.tensor([bits_value(c, e_bits, m_bits, bias) for c in range(1 << fmt.bits)], dtype=torch.float64)
    got32 = mx.decode(codes, fmt)
    got16 = mx.decode(codes, fmt, torch.bfloat16)
    assert torch.equal(got32.double(), want) and torch.equal(got16.double(), want)
    assert torch.equal(torch.signbit(got32), want.signbit())  # -0 codes decode to -0.0


@pytest.mark.parametrize("name", sorted(SPEC))
def test_cast_is_nearest_even_saturating_at_every_code_midpoint_and_special(name):
    values = probe_values(name)
    x = torch.tensor(values, dtype=torch.float32)
    got = mx.encode(x, MX_ELEMENTS[name]).tolist()
    want = [expected_code(float(v), name) for v in x.tolist()]
    bad = [(v, g, w) for v, g, w in zip(x.tolist(), got, want) if g != w]
    assert not bad, bad[:10]


@pytest.mark.parametrize("name", sorted(SPEC))
def test_cast_of_random_values_across_the_range(name):
    gen = torch.Generator().manual_seed(1)
    top = SPEC[name][3]
    x = torch.randn(4000, generator=gen) * torch.pow(2.0, torch.randint(-12, 6, (4000,), generator=gen).float())
    x = torch.cat([x, torch.rand(2000, generator=gen) * 2 * top - top])
    got = mx.encode(x, MX_ELEMENTS[name]).tolist()
    want = [expected_code(v, name) for v in x.tolist()]
    assert got == want


def test_pack_puts_element_zero_in_the_low_nibble_and_pads_odd_rows():
    fmt = MX_ELEMENTS["e2m1"]
    codes = torch.tensor([[1, 2, 3], [15, 0, 9]], dtype=torch.uint8)
    packed = mx.pack(codes, fmt)
    assert packed.tolist() == [[0x21, 0x03], [0x0F, 0x09]]
    assert torch.equal(mx.unpack(packed, fmt, 3), codes)
    every = torch.arange(256, dtype=torch.uint8).reshape(4, 64)  # every byte: low nibble first
    unpacked = mx.unpack(every, fmt, 128)
    assert torch.equal(unpacked[:, 0::2], every & 15) and torch.equal(unpacked[:, 1::2], every >> 4)
    assert torch.equal(mx.pack(unpacked, fmt), every)
    fp6 = torch.tensor([[63, 0, 33]], dtype=torch.uint8)
    assert torch.equal(mx.pack(fp6, MX_ELEMENTS["e3m2"]), fp6)  # FP6: one element per byte


def test_elements_to_bf16_unpacks_and_decodes():
    fmt = MX_ELEMENTS["e2m1"]
    data = torch.tensor([[0x21, 0xF7]], dtype=torch.uint8)  # 0.5, 1.0 | 6.0, -6.0
    assert mx.elements_to_bf16(data, fmt, 4).tolist() == [[0.5, 1.0, 6.0, -6.0]]
    assert mx.elements_to_bf16(data, fmt, 3).tolist() == [[0.5, 1.0, 6.0]]
    assert mx.elements_to_bf16(data, fmt).dtype == torch.bfloat16
