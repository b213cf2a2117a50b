"""The 8-bit codebooks of blockwise dynamic quantization (bitsandbytes' "dynamic tree" idea, our construction).

A value is divided by its block's absmax and replaced by the index of the nearest code (ties to the lower
index). The codes are decades of linearly spaced values: decade d (d = 0 the top one, [0.1, 1]) holds
2^(D-1-d) codes for D decades, so large values get many codes (relative step up to 0.9 / 2^(D-1) / 0.1 at the bottom of the top
decade, and each lower decade half as many: a few digits kept down to 10^-D of the block's absmax).

* SIGNED (first moments, momentum): 7 decades, 127 magnitudes per sign (the top one 1.0), 0 and 10^-7/2.
* UNSIGNED (the square root of the second moment): 8 decades, 255 magnitudes, plus 0. Storing sqrt(v) instead
  of v halves its log range: 8 decades of sqrt(v) span 16 decades of v, so a tiny second moment next to a
  large one in the same block keeps a nonzero code instead of flushing to 0, which would turn its
  update lr * m / (sqrt(v) + eps) into lr * m / eps.
"""

from __future__ import annotations

import functools

import torch


def _decades(count: int) -> list[float]:
    """Positive codes below 1: decade d (scale 10^-d) split into 2^(count-1-d) equal steps over (0.1, 1]."""
    values: list[float] = []
    for d in range(count):
        n = 2 ** (count - 1 - d)
        scale = 10.0 ** (-d)
        values += [scale * (0.1 + 0.9 * (i + 0.5) / n) for i in range(n)]  # bin midpoints: none is 0.1 or 1
    return values


@functools.cache
def signed_codes() -> torch.Tensor:
    """256 sorted fp32 codes in [-1, 1]: 0, 127 magnitudes per sign (the top one 1.0: a block's absmax is exact
    whatever its sign, so decoding and encoding again gives the same codes), and one more positive, 10^-7 / 2."""
    pos = sorted(_decades(7))
    pos[-1] = 1.0
    return torch.tensor(sorted([-v for v in pos] + [0.0, 0.5e-7] + pos), dtype=torch.float32)


@functools.cache
def unsigned_codes() -> torch.Tensor:
    """256 sorted fp32 codes in [0, 1]: 0 and 255 magnitudes (the top one is 1.0)."""
    pos = sorted(_decades(8))
    pos[-1] = 1.0  # the block's absmax itself is exact
    return torch.tensor([0.0] + pos, dtype=torch.float32)


@functools.cache
def midpoints(signed: bool) -> torch.Tensor:
    """The 255 fp32 decision points between neighbouring codes (their mean, rounded to fp32)."""
    codes = (signed_codes() if signed else unsigned_codes()).double()
    return ((codes[1:] + codes[:-1]) / 2).float()
