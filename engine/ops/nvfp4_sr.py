"""Stochastic rounding to E2M1 for NVFP4 gradients, and the counter-based random bits it uses.

Rounding (TE's `cvt.rs.satfinite.e2m1x4.f32` with 8 random bits per element): `a = min(|x|, 6)`,
`step` = the E2M1 grid step at a (0.5 below 2, 1 in [2, 4), 2 in [4, 6]), `u = rbits / 256`;
`t = a + u * step` (exact arithmetic), truncated down to the grid at t's step: the result is
`lo = floor(a / step) * step` or the next grid value, the latter iff `256 * (a - lo) / step >=
256 - rbits`, which is what this computes (every term exact in fp32, so no backend rounds it
differently). E[q] = a up to step/256. The sign is kept; NaN -> code 0, +-inf -> +-6, as RNE.

Random bits: a stateless counter-based hash of element i of the row-major tensor, from a `[2]` int64
tensor `(seed, offset)`: with `j = offset + i` (mod 2^64) and its word `w = j >> 2`,
`key = h(seed mod 2^32) ^ (seed >> 32)`, `mix(w) = h(h(w mod 2^32) ^ key ^ ((w >> 32) * 0x9E3779B9 mod 2^32))`
and `rbits[i]` = byte `j mod 4` of `mix(w)` (`(mix(w) >> (8 * (j mod 4))) & 0xFF`), `h` the 32-bit
"lowbias32" mixer: one mix gives four elements their bytes, so the kernels hash once per 4 elements.
The caller owns
that tensor (a recipe state's counter) and advances `offset` by the element count after each
call (`advance`), in place on the device: no global generator, no host sync; the same seed gives
the same bits run to run.
"""

from __future__ import annotations

import torch

from engine.formats import E2M1
from engine.ops import mx_elements

_MASK32 = 0xFFFFFFFF


def _hash32(v: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (the "lowbias32" finaliser) on int64 tensors holding uint32 values."""
    v = v & _MASK32
    v = v ^ (v >> 16)
    v = (v * 0x7FEB352D) & _MASK32
    v = v ^ (v >> 15)
    v = (v * 0x846CA68B) & _MASK32
    return v ^ (v >> 16)


def random_bits(shape: tuple[int, ...], counter: torch.Tensor) -> torch.Tensor:
    """uint8 random bits of `shape` for the `[2]` int64 `counter` = (seed, offset) (see the module doc)."""
    if not isinstance(counter, torch.Tensor) or counter.dtype != torch.int64 or tuple(counter.shape) != (2,):
        raise TypeError(f"counter: expected an int64 tensor of shape (2,) holding (seed, offset), got {counter!r}")
    n = 1
    for d in shape:
        n *= d
    index = torch.arange(n, dtype=torch.int64, device=counter.device) + counter[1]
    word = (index >> 2) & ((1 << 62) - 1)  # j >> 2 of j = index mod 2^64 (a logical shift)
    key = _hash32(counter[0] & _MASK32) ^ ((counter[0] >> 32) & _MASK32)
    mixed = _hash32(_hash32(word & _MASK32) ^ key ^ ((word >> 32) * 0x9E3779B9))
    return ((mixed >> (8 * (index & 3))) & 0xFF).to(torch.uint8).reshape(shape)


def advance(counter: torch.Tensor, count: int) -> None:
    """Move the counter's offset past `count` used elements, in place (no host sync)."""
    counter[1:].add_(count)


def encode_e2m1_stochastic(x: torch.Tensor, rbits: torch.Tensor) -> torch.Tensor:
    """Unpacked uint8 E2M1 codes of fp32 `x`, stochastically rounded with `rbits` (uint8, x's shape)."""
    if rbits.dtype != torch.uint8 or rbits.shape != x.shape:
        raise TypeError(f"rbits: expected uint8 of shape {tuple(x.shape)}, got {rbits.dtype} {tuple(rbits.shape)}")
    xf = x.float()
    a = xf.abs().clamp(max=E2M1.max)
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    lo = torch.floor(a / step) * step
    frac256 = (a - lo) / step * 256  # exact: a - lo is exact (same binade), the divisions are by powers of 2
    up = (frac256 >= (256 - rbits.to(torch.int32)).float()) & (lo < E2M1.max)
    value = torch.where(up, lo + step, lo)  # a grid value: the RNE encoder returns its exact code
    value = torch.where(torch.isnan(xf), 0.0, torch.where(torch.signbit(xf), -value, value))
    return mx_elements.encode(value, E2M1)
