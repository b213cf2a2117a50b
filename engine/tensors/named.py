"""The public names of the one storage type, per scheme family: `Float8TensorStorage`, `NVFP4Tensor`, ...

Each name class says which schemes it stands for by their fields (`holds`), so `isinstance(t,
NVFP4Tensor)` keeps working and a storage is built through its name. They add no behaviour: a
name class that needs a method of its own means the scheme lacks a field. The FP8 names also
accept the constructor arguments they had before schemes (`fp8_dtype`, `block_scaling_dim`).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.schemes import Block, ScaleEncoding, Scheme, SCHEMES, fp8_scheme
from engine.tensors.quantized import QuantizedTensor
from engine.tensors.storage import QuantizedTensorBase


class Float8TensorStorage(QuantizedTensorBase):
    """Per-tensor FP8 (delayed and current scaling): one fp32 scale_inv, columnwise data `[K, M]`."""

    @classmethod
    def holds(cls, scheme: Scheme) -> bool:
        return scheme.rowwise_block.is_tensor

    @classmethod
    def _legacy_scheme(cls, *, fp8_dtype: torch.dtype | None = None, **kw: Any) -> Scheme:
        return fp8_scheme("tensor", fp8_dtype, **kw)


class Float8BlockwiseTensorStorage(QuantizedTensorBase):
    """FP8 with an fp32 scale_inv per 1x128 (1D) or 128x128 (2D) tile, columnwise data `[K, M]`."""

    @classmethod
    def holds(cls, scheme: Scheme) -> bool:
        return scheme.block_scaling_dim is not None

    @classmethod
    def _legacy_scheme(cls, *, fp8_dtype: torch.dtype | None = None, block_scaling_dim: int = 1,
                       **kw: Any) -> Scheme:
        if block_scaling_dim not in (1, 2) or isinstance(block_scaling_dim, bool):
            raise ValueError(f"block_scaling_dim: expected 1 (1x128 tiles) or 2 (128x128 tiles), "
                             f"got {block_scaling_dim!r}")
        return fp8_scheme(f"block{block_scaling_dim}d", fp8_dtype, **kw)


class MXTensorStorage(QuantizedTensorBase):
    """OCP MX (MXFP8, MXFP6, MXFP4): an E8M0 scale per 1x32 (rowwise) / 32x1 (columnwise) block; columnwise
    data keeps x's shape (E2M1 codes packed two per byte along the last dim)."""

    @classmethod
    def holds(cls, scheme: Scheme) -> bool:
        return scheme.scale is ScaleEncoding.E8M0

    @classmethod
    def _legacy_scheme(cls, *, fp8_dtype: torch.dtype | None = None, **kw: Any) -> Scheme:
        return fp8_scheme("mx", fp8_dtype, **kw)


class Float8RowwiseTensorStorage(QuantizedTensorBase):
    """FP8 with one scale_inv per row of the 2D view (`[M, 1]`); columnwise data `[K, M]`, scale_inv `[K, 1]`."""

    @classmethod
    def holds(cls, scheme: Scheme) -> bool:
        return scheme.rowwise_block == Block(1, 0) and isinstance(scheme.element, torch.dtype) and \
            scheme.element.is_floating_point

    @classmethod
    def _legacy_scheme(cls, *, fp8_dtype: torch.dtype | None = None, **kw: Any) -> Scheme:
        return fp8_scheme("axiswise", fp8_dtype, **kw)


class NVFP4TensorStorage(QuantizedTensorBase):
    """NVFP4 (TE's NVFP4BlockScaling): E2M1 per 16 with an E4M3 scale, and a per-tensor fp32 amax per usage
    (`amax_rowwise` / `amax_columnwise`, as TE's `amax` / `amax_columnwise`)."""

    @classmethod
    def holds(cls, scheme: Scheme) -> bool:
        return scheme.tensor_scale


class IntTensorStorage(QuantizedTensorBase):
    """Integer elements (int8 per channel, int4 per group with zero points): `engine.quantize_`'s weights."""

    @classmethod
    def holds(cls, scheme: Scheme) -> bool:
        return scheme.integer


#: the name from before MXFP4/MXFP6: the same class
MXFP8TensorStorage = MXTensorStorage


class Float8Tensor(QuantizedTensor):
    """A per-tensor FP8 value (delayed or current scaling) as a torch.Tensor."""

    storage_class = Float8TensorStorage


class Float8BlockwiseTensor(QuantizedTensor):
    """A 1x128 / 128x128 block-scaled FP8 value as a torch.Tensor."""

    storage_class = Float8BlockwiseTensorStorage


class MXTensor(QuantizedTensor):
    """An OCP MX value (MXFP8, MXFP6 or MXFP4: the scheme's element says which) as a torch.Tensor."""

    storage_class = MXTensorStorage


class Float8RowwiseTensor(QuantizedTensor):
    """An axiswise-scaled FP8 value as a torch.Tensor."""

    storage_class = Float8RowwiseTensorStorage


class NVFP4Tensor(QuantizedTensor):
    """An NVFP4 value as a torch.Tensor."""

    storage_class = NVFP4TensorStorage


#: the name from before MXFP4/MXFP6: the same class
MXFP8Tensor = MXTensor


def _every_scheme_has_one_name() -> None:
    """Import-time check: the name classes' `holds` do not overlap (a scheme is seen through one name)."""
    for scheme in SCHEMES.values():
        names = [cls.__name__ for cls in QuantizedTensorBase._named if cls.holds(scheme)]
        if len(names) > 1:
            raise AssertionError(f"{scheme.name} is held by {names}: their `holds` must not overlap")


_every_scheme_has_one_name()
