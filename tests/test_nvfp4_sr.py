"""Stochastic rounding to E2M1 (engine/ops/nvfp4_sr.py): the rule element by element, its statistics, and the
counter-based random bits."""

from __future__ import annotations

import math

import pytest
import torch

from engine.ops import mx_elements, nvfp4, nvfp4_sr
from engine.formats import E2M1

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def sr_value(x: float, r: int) -> float:
    """TE's rule in plain Python floats: t = |x| + (r/256) * step(|x|), truncated to the grid at t's step."""
    if math.isnan(x):
        return 0.0
    a = min(abs(x), 6.0)
    step = 0.5 if a < 2 else (1.0 if a < 4 else 2.0)
    t = a + r / 256 * step  # exact in float64 for these operands
    t_step = 0.5 if t < 2 else (1.0 if t < 4 else 2.0)
    q = min(math.floor(t / t_step) * t_step, 6.0)
    return math.copysign(q, x)


def test_rule_element_by_element():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(3000, generator=g) * 2, torch.tensor(
        [0.0, -0.0, 0.25, 0.5, 1.99, 2.0, 3.999, 5.0, 5.999, 6.0, 7.0, -7.0, 1e-30, -1e-8, math.inf, -math.inf,
         math.nan, 1.0 + 2**-20, 4 - 2**-21])]).float()
    for r in (0, 1, 127, 128, 255):
        rbits = torch.full(x.shape, r, dtype=torch.uint8)
        got = mx_elements.decode(nvfp4_sr.encode_e2m1_stochastic(x, rbits), E2M1)
        want = torch.tensor([sr_value(v, r) for v in x.tolist()])
        assert torch.equal(got, want), r
        assert torch.equal(got.signbit(), want.signbit())
    rbits = nvfp4_sr.random_bits(x.shape, torch.tensor([3, 0]))
    got = mx_elements.decode(nvfp4_sr.encode_e2m1_stochastic(x, rbits), E2M1)
    assert torch.equal(got, torch.tensor([sr_value(v, r) for v, r in zip(x.tolist(), rbits.tolist())]))


def test_mean_of_many_roundings_is_x():
    x = torch.tensor([0.1, 0.3, 0.74, 1.2, 1.9, 2.2, 2.7, 3.3, 4.5, 5.9, -0.6, -3.1]).float()
    n = 20000
    counter = torch.tensor([1234, 0])
    total = torch.zeros_like(x, dtype=torch.float64)
    xs = x.repeat(n, 1)
    rbits = nvfp4_sr.random_bits(xs.shape, counter)
    q = mx_elements.decode(nvfp4_sr.encode_e2m1_stochastic(xs, rbits), E2M1).double()
    total = q.mean(0)
    step = torch.where(x.abs() < 2, 0.5, torch.where(x.abs() < 4, 1.0, 2.0)).double()
    # E[q] = x up to step/256 (8 random bits); the sample mean of a two-point variable has std <= step/(2 sqrt(n))
    assert ((total - x.double()).abs() <= step / 256 + 5 * step / (2 * math.sqrt(n))).all()
    # round-to-nearest would be biased by far more for these x (e.g. 0.1 -> 0)
    assert (total[0] - 0.1).abs() < 0.02


def test_random_bits_reproducible_and_advance():
    c = torch.tensor([7, 0])
    a = nvfp4_sr.random_bits((64, 64), c)
    assert torch.equal(a, nvfp4_sr.random_bits((64, 64), torch.tensor([7, 0])))  # run to run
    nvfp4_sr.advance(c, 64 * 64)
    assert c.tolist() == [7, 4096]
    b = nvfp4_sr.random_bits((64, 64), c)
    assert (a != b).float().mean() > 0.98  # fresh bits after advancing
    assert torch.equal(nvfp4_sr.random_bits((2 * 4096,), torch.tensor([7, 0]))[4096:], b.reshape(-1))
    assert (nvfp4_sr.random_bits((4096,), torch.tensor([8, 0])) != a.reshape(-1)).float().mean() > 0.98
    counts = torch.bincount(nvfp4_sr.random_bits((1 << 16,), torch.tensor([1, 0])).long(), minlength=256)
    assert counts.min() > 150 and counts.max() < 370  # ~uniform bytes (mean 256)
    with pytest.raises(TypeError, match="counter"):
        nvfp4_sr.random_bits((4,), torch.tensor([1.0, 2.0]))


def test_quantize_with_sr_and_rne():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(32, 48, generator=g)
    rne = nvfp4.quantize(x)
    zero_bits = nvfp4.quantize(x, rbits=torch.zeros(32, 48, dtype=torch.uint8),
                               rbits_t=torch.zeros(48, 32, dtype=torch.uint8))
    # rbits 0 truncates toward zero: never above RNE's magnitude, scales unchanged
    assert torch.equal(zero_bits["rowwise_scale_inv"].view(torch.uint8), rne["rowwise_scale_inv"].view(torch.uint8))
    up = lambda d: mx_elements.unpack(d, E2M1, 48) & 7  # noqa: E731
    assert (up(zero_bits["rowwise_data"]) <= up(rne["rowwise_data"])).all()
    assert (up(zero_bits["rowwise_data"]) != up(rne["rowwise_data"])).any()


def _lowbias32(v: int) -> int:
    v &= 0xFFFFFFFF
    v ^= v >> 16
    v = (v * 0x7FEB352D) & 0xFFFFFFFF
    v ^= v >> 15
    v = (v * 0x846CA68B) & 0xFFFFFFFF
    return v ^ (v >> 16)


@pytest.mark.parametrize("seed,offset", [(0, 0), (12345, 99), (2**40 + 3, 2**33 - 5), (5, 2**34 - 9), (-7, -6)])
def test_random_bits_are_the_documented_hash(seed, offset):
    """The bits a backend must reproduce, from the module doc's formula in plain Python ints (offsets whose
    words carry into the next 2^32, and a negative one: j is taken mod 2^64)."""
    got = nvfp4_sr.random_bits((37,), torch.tensor([seed, offset])).tolist()
    key = (_lowbias32(seed & 0xFFFFFFFF) ^ (seed >> 32)) & 0xFFFFFFFF
    want = []
    for i in range(37):
        j = (offset + i) % 2**64
        w = j // 4
        mix = _lowbias32(_lowbias32(w) ^ key ^ (((w >> 32) * 0x9E3779B9) & 0xFFFFFFFF))
        want.append((mix >> (8 * (j % 4))) & 0xFF)
    assert got == want
