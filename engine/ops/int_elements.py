"""Integer elements (int8, packed int4) and the reference quantization of the integer schemes: the executable spec.

* Storage. int8 codes are torch.int8 values. A packed element (int4) is stored as code + 2^(bits-1) (offset
  binary: int4's codes -8..7 as the nibbles 0..15), two a byte along the last dim, element 2i in the low nibble
  (`mx_elements.pack`, E2M1's packing; an odd last dim ends in a byte whose high nibble is 0).
* Symmetric blocks (no zero point): scale = amax / max (int8: 127) per block, at least fp32's smallest normal (an
  all-zero block gets a tiny scale, not 0), rounded to the scheme's scale encoding (fp32 or bf16); code =
  round(x / scale) clamped to [-max, max], with the stored scale. The value is code * scale.
* Asymmetric blocks (`Scheme.zero_point`): scale = (max - min) / (2^bits - 1), at least fp32's smallest normal,
  rounded to the encoding; zero = min + 2^(bits-1) * scale (the value of code 0), rounded to it too; code =
  round((x - zero) / scale) clamped to [-2^(bits-1), 2^(bits-1) - 1], with the stored scale and zero. The value
  is code * scale + zero; scale_inv holds (scale, zero) pairs along its last dim.
* Arithmetic in fp32, rounding half to even (`torch.round`); a partial last block is read with zeros up to the
  whole block, as the GEMM kernels read it (with a zero point, those zeros count in min and max). A block
  holding a NaN gets a NaN scale (its codes are undefined); a checkpoint with one is refused at load.
"""

from __future__ import annotations

import torch

from engine.formats import IntFormat
from engine.ops import mx_elements
from engine.schemes import Scheme, dims_2d

#: fp32's smallest normal: the least scale (an all-zero block's)
FP32_TINY = torch.finfo(torch.float32).tiny


def offset(element: IntFormat) -> int:
    """2^(bits-1): what a packed code is stored plus (int4: 8), and the magnitude of the most negative code."""
    return 1 << (element.bits - 1)


def store(codes: torch.Tensor, element: IntFormat) -> torch.Tensor:
    """Integer-valued fp32 codes [..., cols] as stored: int8 values, or packed uint8 bytes [..., ceil(cols / 2)]."""
    if element.torch_dtype is not None:
        return codes.to(element.torch_dtype)
    return mx_elements.pack((codes + offset(element)).to(torch.uint8), element)  # packing reads only `.bits`


def load(data: torch.Tensor, element: IntFormat, cols: int) -> torch.Tensor:
    """The fp32 codes [..., cols] stored in `data` (`store` undone)."""
    if element.torch_dtype is not None:
        return data.float()
    return mx_elements.unpack(data, element, cols).float() - offset(element)


def encode(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, element: IntFormat) -> torch.Tensor:
    """The fp32 codes of fp32 `x` under stored scales (and zero points), broadcast against x: round((x - zero) /
    scale) clamped to [-2^(bits-1), 2^(bits-1) - 1], or without a zero round(x / scale) in [-max, max]."""
    if zero is None:
        return torch.round(x / scale).clamp_(-element.max, element.max)
    return torch.round((x - zero) / scale).clamp_(-offset(element), offset(element) - 1)


def quantize(x: torch.Tensor, scheme: Scheme, *, columnwise: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x quantized by an integer `scheme` for one usage: (data, scale_inv) as the scheme stores them (the module
    docstring's rules)."""
    element = scheme.element
    if not isinstance(element, IntFormat):
        raise TypeError(f"scheme: expected an integer scheme, got {scheme.name}")
    x2d = x.reshape(dims_2d(x.shape))
    transposed = columnwise and scheme.columnwise_transposed
    if transposed:
        x2d = x2d.t()
    m, k = x2d.shape
    block = scheme.stored_block(columnwise)
    tile_rows, tile_cols = block.tile(m, k)
    rows = 1 if block.rows == 0 else -(-m // tile_rows)  # a whole dim is one block, even an empty one
    cols = 1 if block.cols == 0 else -(-k // tile_cols)
    xf = x2d.float()
    if (rows * tile_rows, cols * tile_cols) != (m, k):  # a partial last block: read with zeros
        xf = torch.nn.functional.pad(xf, (0, cols * tile_cols - k, 0, rows * tile_rows - m))
    tiles = xf.reshape(rows, tile_rows, cols, tile_cols)
    dtype = scheme.scale.dtype
    if scheme.zero_point:
        lo, hi = tiles.amin(dim=(1, 3)), tiles.amax(dim=(1, 3))
        scale = ((hi - lo) / ((1 << element.bits) - 1)).clamp_min(FP32_TINY).to(dtype)
        zero = (lo + offset(element) * scale.float()).to(dtype)
        codes = encode(tiles, scale.float()[:, None, :, None], zero.float()[:, None, :, None], element)
        scale_inv = torch.stack([scale, zero], dim=-1)
    else:
        scale = (tiles.abs().amax(dim=(1, 3)) / element.max).clamp_min(FP32_TINY).to(dtype)
        codes = encode(tiles, scale.float()[:, None, :, None], None, element)
        scale_inv = scale
    data = store(codes.reshape(rows * tile_rows, cols * tile_cols)[:m, :k], element)
    if not transposed:
        data = data.reshape(scheme.data_shape(x.shape, columnwise))
    return data, scale_inv.reshape(scheme.scale_shape(x.shape, columnwise))
