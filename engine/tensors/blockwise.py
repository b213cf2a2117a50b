"""Float8 block scaling (DeepSeek-V3 style): fp32 scale_inv per 1x128 or 128x128 tile.

Layouts (compact: one scale per tile, edge tiles partial, no padding):

* 1D rowwise: data `x.shape`, scale_inv `[M, ceil(K/128)]`.
* 1D columnwise: the transposed tensor in 1x128 tiles (128x1 tiles of x):
  data `[K, M]`, scale_inv `[K, ceil(M/128)]`.
* 2D rowwise: data `x.shape`, scale_inv `[ceil(M/128), ceil(K/128)]`; 2D columnwise is
  its exact transpose, so for 2D either usage can be derived from the other.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.ops import reference as ref
from engine.tensors.quantized import QuantizedTensor
from engine.tensors.storage import BufferSpecs, QuantizedTensorBase, dims_2d


def _tiles(count: int) -> int:
    return -(-count // ref.BLOCK_128)


def check_block_scaling_dim(block_scaling_dim: Any) -> int:
    if block_scaling_dim not in (1, 2) or isinstance(block_scaling_dim, bool):
        raise ValueError(f"block_scaling_dim: expected 1 (1x128 tiles) or 2 (128x128 tiles), got {block_scaling_dim!r}")
    return int(block_scaling_dim)


class Float8BlockwiseTensorStorage(QuantizedTensorBase):
    scheme = "float8 block scaling"

    def __init__(self, *, block_scaling_dim: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.block_scaling_dim = check_block_scaling_dim(block_scaling_dim)

    def extra_metadata(self) -> dict[str, Any]:
        return {"block_scaling_dim": self.block_scaling_dim}

    @property
    def tile(self) -> tuple[int, int]:
        return (1, ref.BLOCK_128) if self.block_scaling_dim == 1 else (ref.BLOCK_128, ref.BLOCK_128)

    @classmethod
    def buffer_specs(
        cls, shape: torch.Size, fp8_dtype: torch.dtype, *, rowwise: bool, columnwise: bool,
        block_scaling_dim: int = 1, **extra: Any,
    ) -> BufferSpecs:
        m, k = dims_2d(shape)
        two_d = check_block_scaling_dim(block_scaling_dim) == 2
        specs: BufferSpecs = {}
        if rowwise:
            specs["rowwise_data"] = (tuple(shape), fp8_dtype)
            specs["rowwise_scale_inv"] = ((_tiles(m) if two_d else m, _tiles(k)), torch.float32)
        if columnwise:
            specs["columnwise_data"] = ((k, m), fp8_dtype)
            specs["columnwise_scale_inv"] = ((_tiles(k) if two_d else k, _tiles(m)), torch.float32)
        return specs

    def _derive_columnwise(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.block_scaling_dim == 1:
            return super()._derive_columnwise()
        return ref.transpose_2d(self.rowwise_data), self.rowwise_scale_inv.t().contiguous()

    def _derive_rowwise(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.block_scaling_dim == 1:
            return super()._derive_rowwise()
        return self.columnwise_data.t().contiguous().view(self.shape), self.columnwise_scale_inv.t().contiguous()

    def _dequantize_rowwise(self, dtype: torch.dtype) -> torch.Tensor:
        tr, tc = self.tile
        out = ref.dequantize_block(ref.as_2d(self.rowwise_data), self.rowwise_scale_inv,
                                   tile_rows=tr, tile_cols=tc, dtype=dtype)
        return out.reshape(self.shape)

    def _dequantize_columnwise(self, dtype: torch.dtype) -> torch.Tensor:
        tr, tc = self.tile
        out_t = ref.dequantize_block(self.columnwise_data, self.columnwise_scale_inv,
                                     tile_rows=tr, tile_cols=tc, dtype=dtype)
        return out_t.t().contiguous().view(self.shape)


class Float8BlockwiseTensor(QuantizedTensor):
    storage_class = Float8BlockwiseTensorStorage
