"""Independent brute force for MX quantization with E2M1 / E2M3 / E3M2 elements (no engine imports).

From the OCP MX v1.0 definitions and engine's documented choices (README, ops/mx_elements.py):
blocks of 32 along K (rowwise) or M (columnwise) of x's [M, K] view, partial at the edges;
E8M0 scale codes by FLOOR (floor(log2 amax) - emax_elem) or RCEIL (fp32 amax * fp32(1/max_elem)
rounded up to a power of two), clamped, NaN amax (and FLOOR's inf) -> 255; each element
x * 2^(127 - code) in fp32, cast to the nearest grid value (ties to the even code), saturating,
NaN -> code 0; E2M1 packed two per byte along the last dim, element 0 in the low nibble.
"""

from __future__ import annotations

import math

import numpy as np
import torch

# name: (exponent bits, mantissa bits, bias, max normal, emax)
SPEC = {"e2m1": (2, 1, 1, 6.0, 2), "e2m3": (2, 3, 1, 7.5, 2), "e3m2": (3, 2, 3, 28.0, 4)}
BLOCK = 32


def grid(name: str) -> np.ndarray:
    e_bits, m_bits, bias, _, _ = SPEC[name]
    out = []
    for c in range(1 << (e_bits + m_bits)):
        exponent, mantissa = c >> m_bits, c & ((1 << m_bits) - 1)
        if exponent == 0:
            out.append(mantissa / (1 << m_bits) * 2.0 ** (1 - bias))
        else:
            out.append((1 + mantissa / (1 << m_bits)) * 2.0 ** (exponent - bias))
    return np.array(out)


def codes_of(v: np.ndarray, name: str) -> np.ndarray:
    """Nearest-even saturating codes of fp32 values (any shape), NaN -> 0, sign bit from the sign."""
    g = grid(name)
    e_bits, m_bits = SPEC[name][:2]
    flat = v.astype(np.float64).reshape(-1)
    a = np.minimum(np.abs(flat), g[-1])
    dist = np.abs(a[:, None] - g[None, :])
    best = dist.min(axis=1, initial=np.inf) if flat.size else np.zeros(0)
    candidates = dist == best[:, None]
    # among the (at most two) nearest, the even code
    even = candidates & (np.arange(len(g))[None, :] % 2 == 0)
    idx = np.where(even.any(axis=1), even.argmax(axis=1), candidates.argmax(axis=1)) if flat.size else np.zeros(0, int)
    code = idx | (np.signbit(flat).astype(np.int64) << (e_bits + m_bits))
    code = np.where(np.isnan(flat), 0, code)
    return code.reshape(v.shape).astype(np.uint8)


def scale_code(amax: float, name: str, mode: str) -> int:
    top, emax = SPEC[name][3], SPEC[name][4]
    if math.isnan(amax):
        return 255
    if mode == "floor":
        if math.isinf(amax):
            return 255
        if amax == 0:
            return 0
        floor_log2 = math.frexp(amax)[1] - 1
        return max(-127, min(127, floor_log2 - emax)) + 127
    d = float(np.float32(amax) * np.float32(1.0 / top))  # one fp32 multiply
    if math.isinf(d):
        return 254
    if d == 0:
        return 0
    m, e = math.frexp(d)
    ceil_log2 = e - 1 if m == 0.5 else e
    return max(0, min(254, ceil_log2 + 127))


def element_multiplier(code: int) -> np.float32:
    return np.float32(np.nan) if code == 255 else np.float32(2.0 ** (127 - code))


def quantize(x: torch.Tensor, name: str, mode: str, columnwise: bool) -> tuple[np.ndarray, np.ndarray]:
    """(stored data bytes, scale codes) of one usage, by the rules above."""
    shape = tuple(x.shape)
    m, k = (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)
    a = x.float().reshape(m, k).numpy()
    blocks_m, blocks_k = (-(-m // BLOCK), k) if columnwise else (m, -(-k // BLOCK))
    scales = np.zeros((blocks_m, blocks_k), dtype=np.uint8)
    codes = np.zeros((m, k), dtype=np.uint8)
    for bi in range(blocks_m):
        for bj in range(blocks_k):
            rows = slice(bi * BLOCK, (bi + 1) * BLOCK) if columnwise else slice(bi, bi + 1)
            cols = slice(bj, bj + 1) if columnwise else slice(bj * BLOCK, (bj + 1) * BLOCK)
            block = a[rows, cols]
            amax = math.nan if np.isnan(block).any() else float(np.abs(block).max(initial=0.0))
            code = scale_code(amax, name, mode)
            scales[bi, bj] = code
            with np.errstate(invalid="ignore", over="ignore", under="ignore"):
                codes[rows, cols] = codes_of(block.astype(np.float32) * element_multiplier(code), name)
    if name == "e2m1":
        if k % 2:
            codes = np.pad(codes, ((0, 0), (0, 1)))
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    data_shape = (*shape[:-1], codes.shape[1]) if shape else ()
    return codes.reshape(data_shape), scales


def dequantize(data: np.ndarray, scales: np.ndarray, name: str, shape, columnwise: bool) -> np.ndarray:
    """float64 value of one usage: each element's grid value times 2^(code - 127) (NaN for 255)."""
    m, k = (math.prod(shape[:-1]), shape[-1]) if len(shape) else (1, 1)
    stored = np.asarray(data).reshape(m, data.shape[-1] if np.ndim(data) else 1)
    if name == "e2m1":
        codes = np.stack([stored & 15, stored >> 4], axis=-1).reshape(m, 2 * stored.shape[1])[:, :k]
    else:
        codes = stored
    e_bits, m_bits = SPEC[name][:2]
    g = grid(name)
    values = g[codes & ((1 << (e_bits + m_bits)) - 1)] * np.where(codes >> (e_bits + m_bits) & 1, -1.0, 1.0)
    i, j = np.meshgrid(np.arange(m), np.arange(k), indexing="ij")
    s = scales[i // BLOCK, j] if columnwise else scales[i, j // BLOCK]
    factor = np.where(s == 255, np.nan, np.ldexp(1.0, s.astype(np.int64) - 127))
    return (values * factor).reshape(shape)


def edge_input(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values over many binades, with the edge cases of MX blocks planted at fixed places:
    an all-zero block, fp32/bf16 subnormals, one outlier per block, +-max and beyond, inf, NaN, -0."""
    gen = torch.Generator().manual_seed(seed)
    m, k = (math.prod(shape[:-1]), shape[-1]) if len(shape) else (1, 1)
    x = torch.randn(m, k, generator=gen) * torch.pow(2.0, torch.randint(-8, 8, (m, k), generator=gen).float())
    flat = x.reshape(-1)
    n = flat.numel()
    if m >= 4 and k >= 40:
        x[0, :32] = 0.0                     # an all-zero rowwise block
        x[1, :32] = torch.linspace(-1e-40, 1e-40, 32)  # fp32 subnormals
        x[2, 5] = 3e5                       # one outlier in a block
        x[3, :4] = torch.tensor([6.0, -7.5, 28.0, -448.0])
        x[3, 33] = float("inf")
        x[m - 1, k - 1] = float("nan")
        x[m - 2, 0] = -float("inf")
        x[m - 3, 1] = -0.0
        x[m - 4, 2] = 3.0e38
        if m > 33:
            x[:32, 6] = 0.0                 # an all-zero columnwise block
    elif n:
        flat[0] = 0.0
    return x.reshape(shape).to(dtype)
