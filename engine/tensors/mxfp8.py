"""MXFP8 (OCP MX): FP8 elements with one E8M0 scale (stored as uint8 codes) per 32 elements.

* Rowwise: 1x32 blocks along the last dim; data `x.shape`, scale `[M, ceil(K/32)]`.
* Columnwise: 32x1 blocks along M; data `x.shape` (not transposed), scale `[ceil(M/32), K]`.
* A dim that is not a multiple of 32 ends in a partial block (as if zero padded).

Each usage is quantized from the high-precision tensor; neither can be made from the other.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.ops import reference as ref
from engine.tensors.quantized import QuantizedTensor
from engine.tensors.storage import BufferSpecs, QuantizedTensorBase, dims_2d


class MXFP8TensorStorage(QuantizedTensorBase):
    scheme = "MXFP8"

    @classmethod
    def buffer_specs(
        cls, shape: torch.Size, fp8_dtype: torch.dtype, *, rowwise: bool, columnwise: bool, **extra: Any
    ) -> BufferSpecs:
        m, k = dims_2d(shape)
        specs: BufferSpecs = {}
        if rowwise:
            specs["rowwise_data"] = (tuple(shape), fp8_dtype)
            specs["rowwise_scale_inv"] = ((m, ref.mx_blocks(k)), torch.uint8)
        if columnwise:
            specs["columnwise_data"] = (tuple(shape), fp8_dtype)
            specs["columnwise_scale_inv"] = ((ref.mx_blocks(m), k), torch.uint8)
        return specs

    def _view_columnwise(self, shape: torch.Size) -> torch.Tensor:
        return self.columnwise_data.view(shape)

    def check_values(self) -> None:
        """The NaN code 255 only for a block whose data holds a NaN (what quantizing a NaN or inf makes)."""
        for usage, columnwise in (("rowwise", False), ("columnwise", True)):
            data, codes = getattr(self, f"{usage}_data"), getattr(self, f"{usage}_scale_inv")
            if data is None:
                continue
            nan = torch.isnan(ref.as_2d(data).float())
            if columnwise:
                nan = nan.t()
            rows, cols = nan.shape
            padded = torch.nn.functional.pad(nan, (0, ref.mx_blocks(cols) * ref.MX_BLOCK - cols))
            block_has_nan = padded.reshape(rows, -1, ref.MX_BLOCK).any(dim=2)
            if columnwise:
                block_has_nan = block_has_nan.t()
            bad = (codes == ref.E8M0_NAN) & ~block_has_nan
            if bool(bad.any()):
                where = [tuple(i) for i in bad.nonzero()[:4].tolist()]
                raise ValueError(f"{usage}_scale_inv: E8M0 code 255 (NaN) in blocks whose data holds no NaN, "
                                 f"at {where} ({int(bad.sum())} blocks)")

    def _dequantize_rowwise(self, dtype: torch.dtype) -> torch.Tensor:
        return ref.dequantize_mxfp8(self.rowwise_data, self.rowwise_scale_inv, dtype=dtype)

    def _dequantize_columnwise(self, dtype: torch.dtype) -> torch.Tensor:
        return ref.dequantize_mxfp8(self.columnwise_data, self.columnwise_scale_inv, dtype=dtype, columnwise=True)


class MXFP8Tensor(QuantizedTensor):
    storage_class = MXFP8TensorStorage
