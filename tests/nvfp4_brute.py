"""Independent per-element brute force of NVFP4 (no engine imports), from TE's definitions.

numpy float32 scalars give the fp32 roundings of each step; the E4M3 and E2M1 casts search
their grids for the nearest value (ties to the even code); codes are packed by hand.
"""

from __future__ import annotations

import numpy as np

F = np.float32
FLT_MAX = F(np.finfo(np.float32).max)
E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e4m3_grid() -> list[float]:
    out = [m / 8 * 2.0**-6 for m in range(8)]  # exponent 0: subnormals
    out += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)]
    return out[:127]  # code 127 (S.1111.111) is NaN


E4M3_GRID = e4m3_grid()


def nearest_code(a: float, grid: list[float]) -> int:
    """Index of the grid value nearest to a >= 0 (saturating; ties to the even index)."""
    a = min(a, grid[-1])
    best = min(range(len(grid)), key=lambda c: (abs(grid[c] - a), c % 2))
    return best


def e4m3(v: F) -> tuple[int, float]:
    """(code, value) of the saturating RNE E4M3 cast of a non-negative fp32 (NaN -> 0x7F)."""
    if np.isnan(v):
        return 0x7F, float("nan")
    c = nearest_code(float(v), E4M3_GRID)
    return c, E4M3_GRID[c]


def e2m1_code(v: F) -> int:
    if np.isnan(v):
        return 0
    c = nearest_code(abs(float(v)), E2M1_GRID)
    return c | (8 if np.signbit(v) else 0)


def fmin(a: F, b: F) -> F:
    return b if np.isnan(a) else (a if a < b else b)


def quantize_rows(x: np.ndarray, amax: F, tile_rows: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(packed codes, E4M3 scale codes per row) of a 2D float32 array, element by element."""
    m, k = x.shape
    with np.errstate(all="ignore"):
        s_enc = fmin(F(2688.0) / amax, FLT_MAX)
        if amax == 0 or s_enc == 0:
            s_enc = F(1.0)
        s_dec = F(1.0) / s_enc
        mult = s_enc * F(1.0 / 6.0)
        nb = -(-k // 16)
        scales = np.zeros((m, nb), dtype=np.uint8)
        codes = np.zeros((m, k), dtype=np.uint8)
        for i in range(m):
            r0 = i - i % tile_rows
            for b in range(nb):
                block = [x[r, c] for r in range(r0, min(r0 + tile_rows, m)) for c in range(16 * b, min(16 * b + 16, k))]
                bmax = F(0.0)
                for v in block:
                    if np.isnan(v) or np.isnan(bmax):
                        bmax = F(np.nan)
                    else:
                        bmax = max(bmax, F(abs(v)))
                code, value = e4m3(bmax * mult)
                scales[i, b] = code
                enc = fmin(F(1.0) / (F(value) * s_dec), FLT_MAX)
                for c in range(16 * b, min(16 * b + 16, k)):
                    codes[i, c] = e2m1_code(x[i, c] * enc)
    if k % 2:
        codes = np.concatenate([codes, np.zeros((m, 1), np.uint8)], axis=1)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8), scales


def amax_of(x: np.ndarray) -> F:
    return F(np.nan) if np.isnan(x).any() else F(np.abs(x).max(initial=0.0))
