"""
Float8 block scaling (1x128 and 128x128 tiles)
==============================================

DeepSeek-V3 style block scaling gives every tile of a 2D tensor its own fp32 scale:
1x128 tiles (along the last dim) for activations and gradients, 128x128 tiles for
weights. For each tile::

    amax  = max|x_tile|                         (NaN-propagating)
    scale = compute_scale(amax)                 (reference.compute_scale, below)
    q     = saturate(RNE(x * scale))            (FP8 codes, data [M, K])
    scale_inv = 1 / scale                       (fp32 [ceil(M/TR), ceil(K/TC)])

Edge tiles are partial: their missing elements count as zeros for the amax (as in the
reference, which zero-pads) and are not stored.

In this file you will find:

* :func:`_tile_scale`: the current-scaling rule of ``reference.compute_scale`` in fp32,
* ``_block_rows_kernel``: 1-row tiles; one program quantizes ``ROWS`` rows of one column
  tile, each row with its own scale (a per-row reduction, ``axis=1``),
* ``_block_tiles_kernel``: multi-row tiles (128x128); one program owns one tile and walks
  it twice in chunks of ``CHUNK`` rows: first for the amax, then to quantize (so the
  tile never has to sit in registers whole),
* :func:`quantize_block`: the launcher.

The scale rule
--------------

``compute_scale`` works in fp32::

    a = eps if a < eps else a
    scale = fp8_max / a                 # IEEE division
    scale = value_for_inf if scale == inf
    scale = 1 if a is 0, inf or NaN
    pow2: scale = bits(scale) & 0xFF800000   # clear the mantissa: round down to 2^k

The division must be correctly rounded: Triton's ``/`` on fp32 lowers to the
approximate ``div.full.f32`` on NVIDIA GPUs (up to 2 ulp off), which would change
non-power-of-2 scales and, at a power-of-2 boundary, even pow2 ones. We use
``tl.math.div_rn`` (``div.rn.f32``), for ``scale`` and for ``scale_inv = 1 / scale``
alike. Constants that must be exact (``eps``, ``value_for_inf``) are passed as their fp32
bit patterns, converted with torch on the host exactly as the reference converts them.

Strides
-------

The input may be any strided 2D view: in particular the columnwise 1D layout quantizes
``x.t()`` (128x1 tiles of ``x``), which the launcher takes as is without a copy. The
output is contiguous ``[M, K]`` of the view.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops import reference
from engine.ops.triton.fp8_bits import abs_bits, f32_bits, fp8_params, fp32_to_fp8_bits
from engine.ops.triton.tiles import to_fp32

FLT_MAX = reference.FLT_MAX


# %%
# The scale rule
# --------------


@triton.jit
def _tile_scale(amax_bits, eps_bits, vfi_bits, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """(scale, scale_inv) of tiles with amax given as int32 bits (>= 0, NaN above 0x7F800000)."""
    a = amax_bits.to(tl.float32, bitcast=True)
    zero = tl.zeros_like(amax_bits)  # scalar args become tensors of amax's shape (works for constexprs too)
    eps = (zero + eps_bits).to(tl.float32, bitcast=True)
    a = tl.where(a < eps, eps, a)
    ab = a.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    degenerate = (a == 0.0) | (ab >= 0x7F800000)  # 0, inf or NaN
    # (degenerate tiles divide by 1 instead of 0/inf/NaN: their scale is replaced by 1 below anyway)
    scale = tl.math.div_rn(zero.to(tl.float32) + FP8_MAX, tl.where(degenerate, 1.0, a))
    vfi = (zero + vfi_bits).to(tl.float32, bitcast=True)
    scale = tl.where(scale.to(tl.int32, bitcast=True) == 0x7F800000, vfi, scale)
    scale = tl.where(degenerate, 1.0, scale)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)  # 0xFF800000
    scale_inv = tl.math.div_rn(zero.to(tl.float32) + 1.0, scale)
    return scale, scale_inv


# %%
# 1-row tiles
# -----------


@triton.jit
def _block_rows_kernel(
    x_ptr, out_ptr, sinv_ptr,
    M, K, stride_xm, stride_xk, n_tiles_k, eps_bits, vfi_bits,
    MAN_BITS: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr, FP8_MAX: tl.constexpr,
    POW2: tl.constexpr, TILE_C: tl.constexpr, TILE_C_P2: tl.constexpr, ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_r = pid // n_tiles_k
    pid_c = pid % n_tiles_k
    rows = pid_r.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    in_tile = tl.arange(0, TILE_C_P2)
    cols = pid_c.to(tl.int64) * TILE_C + in_tile
    row_ok = rows < M
    mask = row_ok[:, None] & ((in_tile < TILE_C) & (cols < K))[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
    x = to_fp32(x)

    row_amax = tl.max(abs_bits(x), axis=1)  # [ROWS], NaN-propagating (integer max)
    scale, scale_inv = _tile_scale(row_amax, eps_bits, vfi_bits, FP8_MAX, POW2)
    q = fp32_to_fp8_bits(x * scale[:, None], MAN_BITS, BIAS, MAX_CODE)  # NaN -> the canonical 0x7F
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], q, mask=mask)
    tl.store(sinv_ptr + rows * n_tiles_k + pid_c, scale_inv, mask=row_ok)


# %%
# Multi-row tiles
# ---------------


@triton.jit
def _block_tiles_kernel(
    x_ptr, out_ptr, sinv_ptr,
    M, K, stride_xm, stride_xk, n_tiles_k, eps_bits, vfi_bits,
    MAN_BITS: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr, FP8_MAX: tl.constexpr,
    POW2: tl.constexpr, TILE_R: tl.constexpr, TILE_C: tl.constexpr, TILE_C_P2: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_r = pid // n_tiles_k
    pid_c = pid % n_tiles_k
    in_tile_c = tl.arange(0, TILE_C_P2)
    cols = pid_c.to(tl.int64) * TILE_C + in_tile_c
    col_ok = (in_tile_c < TILE_C) & (cols < K)
    row0 = pid_r.to(tl.int64) * TILE_R

    # pass 1: the tile's amax
    acc = tl.zeros([CHUNK, TILE_C_P2], dtype=tl.int32)
    for r in range(0, TILE_R, CHUNK):
        in_tile_r = r + tl.arange(0, CHUNK)
        rows = row0 + in_tile_r
        mask = ((in_tile_r < TILE_R) & (rows < M))[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
        acc = tl.maximum(acc, abs_bits(to_fp32(x)))
    tile_amax = tl.max(tl.max(acc, axis=1), axis=0)
    scale, scale_inv = _tile_scale(tile_amax, eps_bits, vfi_bits, FP8_MAX, POW2)

    # pass 2: quantize (the second read of the tile is mostly served by L2 on a GPU)
    for r in range(0, TILE_R, CHUNK):
        in_tile_r = r + tl.arange(0, CHUNK)
        rows = row0 + in_tile_r
        mask = ((in_tile_r < TILE_R) & (rows < M))[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
        x = to_fp32(x)
        q = fp32_to_fp8_bits(x * scale, MAN_BITS, BIAS, MAX_CODE)
        tl.store(out_ptr + rows[:, None] * K + cols[None, :], q, mask=mask)
    tl.store(sinv_ptr + pid, scale_inv)


# %%
# Launcher
# --------

ROWS_1D = 32  # rows per program for 1-row tiles
CHUNK_2D = 32  # rows per step for multi-row tiles
NUM_WARPS = 4


def quantize_block(
    x2d: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    tile_rows: int,
    tile_cols: int,
    force_pow_2_scales: bool = True,
    amax_epsilon: float = 0.0,
    value_for_inf: float = FLT_MAX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x2d`` in ``tile_rows x tile_cols`` tiles (any positive sizes; 1x128 and 128x128
    are the recipes'). Returns (data ``[M, K]``, scale_inv fp32 ``[ceil(M/tile_rows), ceil(K/tile_cols)]``).
    """
    if not isinstance(x2d, torch.Tensor):
        raise TypeError(f"x2d: expected a torch.Tensor, got {type(x2d).__name__}")
    if x2d.dtype not in reference.HIGH_PRECISION_DTYPES:
        x2d = x2d.float()  # like the reference, which computes on x2d.float() (its callers check the dtype)
    if x2d.dim() != 2:
        raise ValueError(f"x2d: expected a 2D tensor, got shape {tuple(x2d.shape)}")
    tile_rows, tile_cols = int(tile_rows), int(tile_cols)
    if tile_rows < 1 or tile_cols < 1:
        raise ValueError(f"tile sizes must be positive, got {tile_rows}x{tile_cols}")
    p = fp8_params(fp8_dtype)
    m, k = x2d.shape
    dev = x2d.device
    tm, tk = triton.cdiv(m, tile_rows), triton.cdiv(k, tile_cols)
    data = torch.empty((m, k), dtype=torch.uint8, device=dev)
    scale_inv = torch.empty((tm, tk), dtype=torch.float32, device=dev)
    if m and k:
        common = dict(
            MAN_BITS=p.man_bits, BIAS=p.bias, MAX_CODE=p.max_code, FP8_MAX=p.max_value,
            POW2=bool(force_pow_2_scales), TILE_C=tile_cols, TILE_C_P2=triton.next_power_of_2(tile_cols),
            num_warps=NUM_WARPS,
        )
        args = (x2d, data, scale_inv, m, k, x2d.stride(0), x2d.stride(1), tk,
                f32_bits(amax_epsilon), f32_bits(value_for_inf))
        if tile_rows == 1:
            _block_rows_kernel[(triton.cdiv(m, ROWS_1D) * tk,)](*args, ROWS=ROWS_1D, **common)
        else:
            chunk = min(CHUNK_2D, triton.next_power_of_2(tile_rows))
            _block_tiles_kernel[(tm * tk,)](*args, TILE_R=tile_rows, CHUNK=chunk, **common)
    return data.view(fp8_dtype), scale_inv
