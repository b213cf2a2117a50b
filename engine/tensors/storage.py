"""QuantizedTensorBase: the buffers of one quantized value, without being a torch.Tensor.

A quantized value may carry two representations, because the three GEMMs of a linear
layer read it along different dims: *rowwise* data (for fprop / dgrad's left operand)
and *columnwise* data (for wgrad / dgrad's right operand), each with its scale_inv.
Modules keep only what backward needs (`update_usage`) and hand the buffers to autograd
(`prepare_for_saving` / `restore_from_saved`), so FP8 bytes, not high precision, wait for
backward. Subclasses say how to dequantize and whether one representation can be
derived from the other.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from typing import Any

import torch

BUFFER_FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
BufferSpecs = dict[str, tuple[tuple[int, ...], torch.dtype]]
#: dtypes a quantized value can be dequantized into (float64 too, for `.double()` and checks)
DEQUANTIZE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_dequantize_dtype(dtype: Any) -> torch.dtype:
    """`dtype` if a quantized value can be dequantized into it; TypeError naming `dtype` otherwise."""
    if not isinstance(dtype, torch.dtype) or dtype not in DEQUANTIZE_DTYPES:
        raise TypeError(f"dtype: expected a floating dtype (float32, bfloat16, float16 or float64), got {dtype!r}")
    return dtype


def compact(t: torch.Tensor | None) -> torch.Tensor | None:
    """t itself if it is the whole of a dense storage, else a dense copy (what a checkpoint may hold)."""
    if t is None or (t.is_contiguous() and t.storage_offset() == 0
                     and t.untyped_storage().nbytes() == t.numel() * t.element_size()):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def dims_2d(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """(M, K) of the 2D view every scheme quantizes: M = prod(leading dims), K = last dim."""
    if len(shape) == 0:
        return 1, 1
    m = 1
    for s in shape[:-1]:
        m *= s
    return m, shape[-1]


class QuantizedTensorBase(ABC):
    """Rowwise/columnwise data and scale_inv buffers plus the metadata to read them."""

    #: short name used in messages
    scheme: str = "quantized"
    #: per-tensor schemes use one scale_inv for both usages (the same tensor object)
    shares_scale_inv: bool = False
    _by_name: dict[str, type[QuantizedTensorBase]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        QuantizedTensorBase._by_name[cls.__name__] = cls

    def __init__(
        self,
        *,
        shape: torch.Size | tuple[int, ...],
        nominal_dtype: torch.dtype,
        fp8_dtype: torch.dtype,
        rowwise_data: torch.Tensor | None = None,
        rowwise_scale_inv: torch.Tensor | None = None,
        columnwise_data: torch.Tensor | None = None,
        columnwise_scale_inv: torch.Tensor | None = None,
        quantizer: Any = None,
    ) -> None:
        self.shape = torch.Size(shape)
        self.nominal_dtype = nominal_dtype
        self.fp8_dtype = fp8_dtype
        self.rowwise_data = rowwise_data
        self.rowwise_scale_inv = rowwise_scale_inv
        self.columnwise_data = columnwise_data
        self.columnwise_scale_inv = columnwise_scale_inv
        self.quantizer = quantizer

    # ------------------------------------------------------------------ metadata
    @property
    def dtype(self) -> torch.dtype:
        return self.nominal_dtype

    @property
    def device(self) -> torch.device:
        for name in BUFFER_FIELDS:
            t = getattr(self, name)
            if t is not None:
                return t.device
        raise ValueError(f"{type(self).__name__} holds no data (it was emptied by prepare_for_saving)")

    @property
    def has_rowwise(self) -> bool:
        return self.rowwise_data is not None

    @property
    def has_columnwise(self) -> bool:
        return self.columnwise_data is not None

    def buffers(self) -> dict[str, torch.Tensor | None]:
        return {name: getattr(self, name) for name in BUFFER_FIELDS}

    def extra_metadata(self) -> dict[str, Any]:
        """Scheme-specific constructor arguments (plain data)."""
        return {}

    def metadata(self) -> dict[str, Any]:
        """Everything but the buffers, as keyword arguments of the constructor."""
        return {"shape": self.shape, "nominal_dtype": self.nominal_dtype, "fp8_dtype": self.fp8_dtype,
                "quantizer": self.quantizer, **self.extra_metadata()}

    def replace(self, **changes: Any) -> QuantizedTensorBase:
        """A new storage of the same kind with some fields changed (buffers are shared)."""
        return type(self)(**{**self.metadata(), **self.buffers(), **changes})

    def nbytes(self) -> int:
        """Bytes held by the buffers (a buffer shared by both usages counts once)."""
        seen: dict[int, int] = {}
        for t in self.buffers().values():
            if t is not None:
                seen[id(t)] = t.numel() * t.element_size()
        return sum(seen.values())

    # ------------------------------------------------------------------ allocation and views
    @classmethod
    @abstractmethod
    def buffer_specs(
        cls, shape: torch.Size, fp8_dtype: torch.dtype, *, rowwise: bool, columnwise: bool, **extra: Any
    ) -> BufferSpecs:
        """Shape and dtype of each buffer a tensor of `shape` needs for the given usages."""

    @classmethod
    def empty(
        cls,
        shape: torch.Size | tuple[int, ...],
        *,
        nominal_dtype: torch.dtype,
        fp8_dtype: torch.dtype,
        device: torch.device | str | None = None,
        rowwise: bool = True,
        columnwise: bool = True,
        quantizer: Any = None,
        **extra: Any,
    ) -> QuantizedTensorBase:
        """Uninitialised buffers for the requested usages."""
        shape = torch.Size(shape)
        specs = cls.buffer_specs(shape, fp8_dtype, rowwise=rowwise, columnwise=columnwise, **extra)
        buffers = {name: torch.empty(size, dtype=dt, device=device) for name, (size, dt) in specs.items()}
        if cls.shares_scale_inv and rowwise and columnwise:
            buffers["columnwise_scale_inv"] = buffers["rowwise_scale_inv"]
        return cls(shape=shape, nominal_dtype=nominal_dtype, fp8_dtype=fp8_dtype, quantizer=quantizer,
                   **buffers, **extra)

    def empty_like(self, shape: torch.Size, device: torch.device | str | None = None) -> QuantizedTensorBase:
        """Uninitialised storage of the same kind and usages at `shape`."""
        rowwise = self.has_rowwise or not self.has_columnwise
        return type(self).empty(
            shape, nominal_dtype=self.nominal_dtype, fp8_dtype=self.fp8_dtype, device=device or self.device,
            rowwise=rowwise, columnwise=self.has_columnwise, quantizer=self.quantizer, **self.extra_metadata(),
        )

    def view(self, shape: torch.Size) -> QuantizedTensorBase | None:
        """The same value seen with another shape, or None when the layout does not allow it.

        Every scheme blocks along the last dim (rowwise) or the flattened leading dims
        (columnwise), so any view that keeps the last dim keeps all the data valid.
        """
        if len(shape) == 0 or len(self.shape) == 0 or shape[-1] != self.shape[-1]:
            return None
        return self.replace(
            shape=shape,
            rowwise_data=None if self.rowwise_data is None else self.rowwise_data.view(shape),
            columnwise_data=None if self.columnwise_data is None else self._view_columnwise(shape),
        )

    def _view_columnwise(self, shape: torch.Size) -> torch.Tensor:
        """Columnwise data for a view that keeps the last dim (default: the 2D `[K, M]` layout stays)."""
        return self.columnwise_data

    def transpose(self) -> QuantizedTensorBase | None:
        """The quantized transpose of a 2D tensor, or None where the scheme cannot give it exactly."""
        return None

    # ------------------------------------------------------------------ usages
    def update_usage(self, rowwise_usage: bool | None = None, columnwise_usage: bool | None = None) -> None:
        """Keep, drop or create each representation. None leaves a usage as it is.

        Creating one from the other is possible only where the scheme allows it
        (`_derive_rowwise` / `_derive_columnwise`); otherwise a ValueError says why.
        """
        want_row = self.has_rowwise if rowwise_usage is None else bool(rowwise_usage)
        want_col = self.has_columnwise if columnwise_usage is None else bool(columnwise_usage)
        if not (want_row or want_col):
            raise ValueError("update_usage: at least one of rowwise_usage / columnwise_usage must stay True")
        if not (self.has_rowwise or self.has_columnwise):
            raise ValueError(f"update_usage: {type(self).__name__} holds no data (emptied by prepare_for_saving)")
        if want_row and not self.has_rowwise:
            self.rowwise_data, self.rowwise_scale_inv = self._derive_rowwise()
        if want_col and not self.has_columnwise:
            self.columnwise_data, self.columnwise_scale_inv = self._derive_columnwise()
        if not want_row:
            self.rowwise_data = self.rowwise_scale_inv = None
        if not want_col:
            self.columnwise_data = self.columnwise_scale_inv = None

    def _derive_rowwise(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise ValueError(
            f"{self.scheme}: rowwise data cannot be derived from columnwise data (the scales run along "
            "the other dim); quantize the high-precision tensor with rowwise usage instead"
        )

    def _derive_columnwise(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise ValueError(
            f"{self.scheme}: columnwise data cannot be derived from rowwise data (the scales run along "
            "the other dim); quantize the high-precision tensor with columnwise usage instead"
        )

    # ------------------------------------------------------------------ saving for backward
    def prepare_for_saving(self) -> tuple[list[torch.Tensor | None], QuantizedTensorBase]:
        """Hand the buffers to autograd's saved tensors and empty self. Returns (buffers, self)."""
        tensors = [getattr(self, name) for name in BUFFER_FIELDS]
        for name in BUFFER_FIELDS:
            setattr(self, name, None)
        return tensors, self

    def restore_from_saved(self, tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Take back this storage's buffers from the front of `tensors`; return the rest."""
        if len(tensors) < len(BUFFER_FIELDS):
            raise ValueError(f"restore_from_saved: expected at least {len(BUFFER_FIELDS)} tensors, got {len(tensors)}")
        for name, t in zip(BUFFER_FIELDS, tensors):
            setattr(self, name, t)
        return list(tensors[len(BUFFER_FIELDS):])

    # ------------------------------------------------------------------ values
    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The high-precision value (from rowwise data when present, else columnwise)."""
        dtype = self.nominal_dtype if dtype is None else check_dequantize_dtype(dtype)
        if self.has_rowwise:
            return self._dequantize_rowwise(dtype)
        if self.has_columnwise:
            return self._dequantize_columnwise(dtype)
        raise ValueError(f"dequantize: {type(self).__name__} holds no data (emptied by prepare_for_saving)")

    @abstractmethod
    def _dequantize_rowwise(self, dtype: torch.dtype) -> torch.Tensor: ...

    @abstractmethod
    def _dequantize_columnwise(self, dtype: torch.dtype) -> torch.Tensor: ...

    # ------------------------------------------------------------------ quantizer
    def update_quantizer(self, quantizer: Any) -> None:
        """Attach another quantizer of the same scheme; warn when its settings differ.

        The data already held stays valid (it carries its own scales); the new quantizer
        is used the next time the tensor is quantized into (`quantize_`, `copy_`).
        """
        expected = getattr(quantizer, "storage_class", None)
        if quantizer is not None and expected is not type(self):
            raise TypeError(
                f"quantizer: expected a quantizer that makes {type(self).__name__}, got {type(quantizer).__name__}"
            )
        old = self.quantizer
        if old is not None and quantizer is not None and old.config() != quantizer.config():
            warnings.warn(
                f"{type(self).__name__}: quantizer changed from {old!r} to {quantizer!r}",
                UserWarning,
                stacklevel=2,
            )
        self.quantizer = quantizer

    # ------------------------------------------------------------------ serialization
    def check_values(self) -> None:
        """ValueError naming the buffer if it holds scales the scheme never makes (checked at load; syncs).

        Default: fp32 scale_inv buffers must be finite and > 0.
        """
        for name in ("rowwise_scale_inv", "columnwise_scale_inv"):
            t = getattr(self, name)
            if t is None or t.dtype != torch.float32:
                continue
            bad = ~((t > 0) & torch.isfinite(t))
            if bool(bad.any()):
                raise ValueError(f"{name}: expected finite scales > 0, got {t[bad][:4].tolist()} "
                                 f"({int(bad.sum())} of {t.numel()})")

    def to_plain(self) -> dict[str, Any]:
        """Plain tensors and data that `engine.tensors.serialization` rebuilds this storage from.

        Buffers are saved dense (a view into a larger storage is copied), which the loader requires.
        """
        done: dict[int, torch.Tensor | None] = {}
        for t in self.buffers().values():
            if t is not None and id(t) not in done:
                done[id(t)] = compact(t)
        return {
            "storage_class": type(self).__name__,
            "shape": list(self.shape),
            "nominal_dtype": str(self.nominal_dtype).removeprefix("torch."),
            "fp8_dtype": str(self.fp8_dtype).removeprefix("torch."),
            "quantizer": None if self.quantizer is None else self.quantizer.to_plain(),
            **self.extra_metadata(),
            **{name: None if t is None else done[id(t)] for name, t in self.buffers().items()},
        }

    def __reduce__(self) -> tuple:
        from engine.tensors.serialization import rebuild_storage

        return rebuild_storage, (self.to_plain(),)

    def __repr__(self) -> str:
        usages = [u for u, on in (("rowwise", self.has_rowwise), ("columnwise", self.has_columnwise)) if on]
        return (f"{type(self).__name__}(shape={tuple(self.shape)}, fp8_dtype={self.fp8_dtype}, "
                f"nominal_dtype={self.nominal_dtype}, usages={usages})")
