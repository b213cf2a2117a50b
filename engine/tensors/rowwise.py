"""The axiswise ("rowwise") FP8 layout by name: one fp32 scale per row (rowwise) / per column (columnwise).

The same storage type as every scheme (`QuantizedTensorBase`), seen through a class named for
the layout, as `Float8BlockwiseTensorStorage` is for block scaling.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.schemes import Scheme, fp8_scheme
from engine.tensors.quantized import QuantizedTensor
from engine.tensors.storage import QuantizedTensorBase


class Float8RowwiseTensorStorage(QuantizedTensorBase):
    """FP8 with one scale_inv per row of the 2D view (`[M, 1]`); columnwise data `[K, M]`, scale_inv `[K, 1]`."""

    layouts = ("axiswise",)

    @classmethod
    def _legacy_scheme(cls, *, fp8_dtype: torch.dtype | None = None, **kw: Any) -> Scheme:
        return fp8_scheme("axiswise", fp8_dtype, **kw)


class Float8RowwiseTensor(QuantizedTensor):
    """An axiswise-scaled FP8 value as a torch.Tensor."""

    storage_class = Float8RowwiseTensorStorage
