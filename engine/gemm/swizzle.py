"""The "blocked" (swizzled) layout of block scales that cuBLAS's MXFP8 / MXFP4 / NVFP4 GEMMs read.

A K-major operand `[rows, K]` with one scale per 1 x `block` run along K (E8M0 per 32 for MX,
E4M3 per 16 for NVFP4) has a compact scale matrix `S[rows, cols]`, `cols = ceil(K / block)`.
cuBLAS (and so `torch._scaled_mm`) wants it as a flat, contiguous buffer of 128 x 4 tiles:

* `S` is zero-padded to `rows_p = ceil(rows / 128) * 128` rows and `cols_p = ceil(cols / 4) * 4`
  columns (a zero scale times zero padding data adds nothing), then cut into 128 x 4 tiles.
* Tiles are stored one after another, row-major over the tile grid: tile `(tr, tc)` =
  `(r // 128, c // 4)` starts at `512 * (tr * (cols_p // 4) + tc)`.
* Inside a tile the 128 rows are 4 groups of 32 (`q = (r % 128) // 32`); the tile is stored as
  32 x 16 bytes: line `r % 32` holds, for q = 0..3, that group's 4 scales of the row. So

      offset(r, c) = 512 * (tr * (cols_p // 4) + tc) + 16 * (r % 32) + 4 * ((r % 128) // 32) + (c % 4)

  (cuBLAS's "1D block scaling factors layout", the 32 x 4 x 4 swizzle torch calls SWIZZLE_32_4_4).

The result has `rows_p * cols_p` elements, the count `torch._scaled_mm` checks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TILE_ROWS = 128
TILE_COLS = 4
SCALE_DTYPES = tuple(d for d in (torch.uint8, torch.float8_e4m3fn, getattr(torch, "float8_e8m0fnu", None)) if d)


def blocked_numel(rows: int, cols: int) -> int:
    """Elements of the blocked layout of a `[rows, cols]` scale matrix (rows padded to 128, cols to 4)."""
    return -(-rows // TILE_ROWS) * TILE_ROWS * (-(-cols // TILE_COLS) * TILE_COLS)


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """The flat blocked layout (module doc) of a 2D one-byte scale matrix, zero-padded; same dtype, contiguous."""
    if not isinstance(scales, torch.Tensor) or scales.dim() != 2:
        raise TypeError(f"scales: expected a 2D tensor, got {getattr(scales, 'shape', type(scales).__name__)}")
    if scales.dtype not in SCALE_DTYPES:
        raise TypeError(f"scales: expected one of {SCALE_DTYPES} (one-byte E8M0 / E4M3 scales), got {scales.dtype}")
    rows, cols = scales.shape
    row_tiles, col_tiles = -(-rows // TILE_ROWS), -(-cols // TILE_COLS)
    codes = scales.view(torch.uint8) if scales.is_contiguous() else scales.contiguous().view(torch.uint8)
    padded = F.pad(codes, (0, col_tiles * TILE_COLS - cols, 0, row_tiles * TILE_ROWS - rows))
    # [tr, q, r % 32, tc, c % 4] -> [tr, tc, r % 32, q, c % 4]: strides 512 * col_tiles, 512, 16, 4, 1
    tiles = padded.view(row_tiles, TILE_ROWS // 32, 32, col_tiles, TILE_COLS).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().view(-1).view(scales.dtype)
