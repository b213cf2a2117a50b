"""Per-tensor FP8 (delayed and current scaling): one fp32 scale_inv for the whole tensor.

Rowwise data has the input's shape; columnwise data is the 2D transpose `[K, M]`. With a
single scale both are the same values, so either can be made from the other exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.ops import reference as ref
from engine.tensors.quantized import QuantizedTensor
from engine.tensors.storage import BufferSpecs, QuantizedTensorBase, dims_2d


class Float8TensorStorage(QuantizedTensorBase):
    scheme = "per-tensor FP8"
    shares_scale_inv = True

    @classmethod
    def buffer_specs(
        cls, shape: torch.Size, fp8_dtype: torch.dtype, *, rowwise: bool, columnwise: bool, **extra: Any
    ) -> BufferSpecs:
        m, k = dims_2d(shape)
        specs: BufferSpecs = {}
        if rowwise:
            specs["rowwise_data"] = (tuple(shape), fp8_dtype)
            specs["rowwise_scale_inv"] = ((1,), torch.float32)
        if columnwise:
            specs["columnwise_data"] = ((k, m), fp8_dtype)
            specs["columnwise_scale_inv"] = ((1,), torch.float32)
        return specs

    def check_values(self) -> None:
        """Finite scales > 0, and one scale for both usages."""
        super().check_values()
        row, col = self.rowwise_scale_inv, self.columnwise_scale_inv
        if row is not None and col is not None and row is not col and not torch.equal(row, col):
            raise ValueError(f"columnwise_scale_inv: expected the rowwise scale_inv {row.tolist()} "
                             f"(one scale per tensor), got {col.tolist()}")

    def _derive_columnwise(self) -> tuple[torch.Tensor, torch.Tensor]:
        return ref.transpose_2d(self.rowwise_data), self.rowwise_scale_inv

    def _derive_rowwise(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.columnwise_data.t().contiguous().view(self.shape), self.columnwise_scale_inv

    def _dequantize_rowwise(self, dtype: torch.dtype) -> torch.Tensor:
        return ref.dequantize_per_tensor(self.rowwise_data, self.rowwise_scale_inv, dtype)

    def _dequantize_columnwise(self, dtype: torch.dtype) -> torch.Tensor:
        value_t = ref.dequantize_per_tensor(self.columnwise_data, self.columnwise_scale_inv, dtype)
        return value_t.t().contiguous().view(self.shape)

    def view(self, shape: torch.Size) -> QuantizedTensorBase | None:
        """Any view of the rowwise data; the columnwise copy is kept only if the last dim stays."""
        kept = super().view(shape)
        if kept is not None or not self.has_rowwise:
            return kept
        return self.replace(shape=shape, rowwise_data=self.rowwise_data.view(shape),
                            columnwise_data=None, columnwise_scale_inv=None)

    def transpose(self) -> QuantizedTensorBase | None:
        if len(self.shape) != 2 or not (self.has_rowwise or self.has_columnwise):
            return None
        rows = self.columnwise_data if self.has_columnwise else ref.transpose_2d(self.rowwise_data)
        scale_inv = self.rowwise_scale_inv if self.has_rowwise else self.columnwise_scale_inv
        return self.replace(
            shape=torch.Size((self.shape[1], self.shape[0])),
            rowwise_data=rows, rowwise_scale_inv=scale_inv,
            columnwise_data=self.rowwise_data, columnwise_scale_inv=self.rowwise_scale_inv,
        )


class Float8Tensor(QuantizedTensor):
    """Per-tensor FP8 value as a torch.Tensor (supports `t()` without dequantizing)."""

    storage_class = Float8TensorStorage
