"""QuantizedTensorBase: the buffers of one quantized value, for every scheme, without being a torch.Tensor.

A quantized value may carry two representations, because the three GEMMs of a linear
layer read it along different dims: *rowwise* data (for fprop / dgrad's left operand)
and *columnwise* data (for wgrad / dgrad's right operand), each with its scale_inv.
Modules keep only what backward needs (`update_usage`) and hand the buffers to autograd
(`prepare_for_saving` / `restore_from_saved`), so quantized bytes, not high precision,
wait for backward.

There is one storage type: which buffers it holds (a scheme with a tensor-level scale adds one
fp32 amax per usage), buffer shapes, views, deriving one usage from the other, dequantizing and
serialization are all functions of the storage's `Scheme`. The public names (`Float8TensorStorage`,
`NVFP4TensorStorage`, ...: `engine.tensors.named`) are the same type seen per scheme family, so
`isinstance` keeps working.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, ClassVar

import torch

from engine.hooks import Hook
from engine.ops import mx_elements, nvfp4
from engine.ops import reference as ref
from engine.ops.reference import dequantize_blocked
from engine.schemes import AMAX_FIELDS, BUFFER_FIELDS, ScaleEncoding, Scheme, dims_2d

BufferSpecs = dict[str, tuple[tuple[int, ...], torch.dtype]]
#: dtypes a quantized value can be dequantized into (float64 too, for `.double()` and checks)
DEQUANTIZE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
#: what a pickled storage is rebuilt by (`engine.tensors.serialization.rebuild_storage`, which imports this module)
REBUILD_STORAGE: Hook = Hook("QuantizedTensorBase.__reduce__", "engine.tensors.serialization")

__all__ = ["BUFFER_FIELDS", "QuantizedTensorBase", "check_dequantize_dtype", "compact", "dims_2d"]
NO_BUFFERS = dict.fromkeys(BUFFER_FIELDS + AMAX_FIELDS)
#: the rowwise fields of a scheme without / with a tensor-level scale (`Scheme.usage_fields(False)`, which
#: `without_rowwise` would otherwise build for every saved operand), each as a dict of Nones
#: `Scheme.fields` of a scheme without / with a tensor-level scale, read without the property's tuple sum
FIELDS = {tensor_scale: BUFFER_FIELDS + (AMAX_FIELDS if tensor_scale else ()) for tensor_scale in (False, True)}
NO_ROWWISE = {tensor_scale: dict.fromkeys(f for f in BUFFER_FIELDS + (AMAX_FIELDS if tensor_scale else ())
                                          if f.startswith("rowwise") or f.endswith("rowwise"))
              for tensor_scale in (False, True)}


def _usage_fields(parts: dict[str, torch.Tensor | None], columnwise: bool) -> dict[str, torch.Tensor | None]:
    """{"data", "scale_inv", "amax"} of one usage as the storage's field names for `columnwise` or rowwise."""
    usage = "columnwise" if columnwise else "rowwise"
    return {(f"amax_{usage}" if part == "amax" else f"{usage}_{part}"): t for part, t in parts.items()}


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


def buffer_specs(scheme: Scheme, shape: torch.Size, *, rowwise: bool, columnwise: bool) -> BufferSpecs:
    """Shape and dtype of each buffer a tensor of `shape` needs under `scheme` for the given usages."""
    return scheme.buffer_specs(shape, rowwise=rowwise, columnwise=columnwise)


class QuantizedTensorBase:
    """The buffers of one value (`scheme.fields`: data and scale_inv per usage, and an amax per usage with a
    tensor-level scale), laid out as `scheme` says."""

    #: the public name classes (`engine.tensors.named`), in the order their `holds` is asked
    _named: ClassVar[list[type[QuantizedTensorBase]]] = []
    _by_name: ClassVar[dict[str, type[QuantizedTensorBase]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        QuantizedTensorBase._by_name[cls.__name__] = cls
        QuantizedTensorBase._named.append(cls)
        QuantizedTensorBase.class_for.cache_clear()

    @classmethod
    def holds(cls, scheme: Scheme) -> bool:
        """Whether a storage of `scheme` is seen through this class (a name class says it from the fields)."""
        return True

    def __new__(cls, *args: Any, scheme: Scheme | None = None, **kwargs: Any) -> QuantizedTensorBase:
        # one type, seen through the class named for the scheme's family
        target = cls.class_for(scheme) if scheme is not None and cls is QuantizedTensorBase else cls
        return super().__new__(target)

    def __init__(
        self,
        *,
        shape: torch.Size | tuple[int, ...],
        nominal_dtype: torch.dtype,
        scheme: Scheme | None = None,
        rowwise_data: torch.Tensor | None = None,
        rowwise_scale_inv: torch.Tensor | None = None,
        columnwise_data: torch.Tensor | None = None,
        columnwise_scale_inv: torch.Tensor | None = None,
        amax_rowwise: torch.Tensor | None = None,
        amax_columnwise: torch.Tensor | None = None,
        quantizer: Any = None,
        **legacy: Any,
    ) -> None:
        if scheme is None:
            # pre-scheme arguments: the quantizer's scheme when there is one (it knows the scale encoding)
            scheme = quantizer.scheme if quantizer is not None else self._legacy_scheme(**legacy)
        elif legacy:
            raise TypeError(f"{type(self).__name__}: unexpected arguments {sorted(legacy)} next to scheme=")
        if not self.holds(scheme):
            raise TypeError(f"scheme: a {type(self).__name__} cannot hold {scheme!r}")
        if not scheme.tensor_scale and (amax_rowwise is not None or amax_columnwise is not None):
            raise TypeError(f"amax_rowwise / amax_columnwise: {scheme.name} has no tensor-level scale")
        self.scheme = scheme
        self.shape = torch.Size(shape)
        self.nominal_dtype = nominal_dtype
        self.rowwise_data = rowwise_data
        self.rowwise_scale_inv = rowwise_scale_inv
        self.columnwise_data = columnwise_data
        self.columnwise_scale_inv = columnwise_scale_inv
        self.amax_rowwise = amax_rowwise
        self.amax_columnwise = amax_columnwise
        self.quantizer = quantizer

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def class_for(scheme: Scheme) -> type[QuantizedTensorBase]:
        """The class a storage of `scheme` is seen through (the first name class that holds it)."""
        return next((cls for cls in QuantizedTensorBase._named if cls.holds(scheme)), QuantizedTensorBase)

    @classmethod
    def _legacy_scheme(cls, *, fp8_dtype: torch.dtype | None = None, **kw: Any) -> Scheme:
        """The scheme of a storage built with the pre-scheme arguments of a name class."""
        raise TypeError(f"{cls.__name__}: expected scheme= (an engine.schemes.Scheme)")

    # ------------------------------------------------------------------ metadata
    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.scheme.element

    @property
    def block_scaling_dim(self) -> int | None:
        """1 or 2 for 1x128 / 128x128 block scaling (None for other schemes)."""
        return self.scheme.block_scaling_dim

    @property
    def shares_scale_inv(self) -> bool:
        """One scale per tensor: both usages hold the same scale_inv tensor."""
        return self.scheme.rowwise_block.is_tensor

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
        """The scheme's fields and what each holds (None: a usage not held)."""
        return {name: getattr(self, name) for name in self.scheme.fields}

    def metadata(self) -> dict[str, Any]:
        """Everything but the buffers, as keyword arguments of the constructor."""
        return {"scheme": self.scheme, "shape": self.shape, "nominal_dtype": self.nominal_dtype,
                "quantizer": self.quantizer}

    def replace(self, **changes: Any) -> QuantizedTensorBase:
        """A new storage with some fields changed (buffers are shared)."""
        return QuantizedTensorBase(**{**self.metadata(), **self.buffers(), **changes})

    @classmethod
    def made(cls, scheme: Scheme, shape: torch.Size, nominal_dtype: torch.dtype, quantizer: Any,
             buffers: dict[str, torch.Tensor | None], kind: type[QuantizedTensorBase] | None = None
             ) -> QuantizedTensorBase:
        """A storage of buffers a quantizer has just made for `scheme` (so the constructor's argument checks are
        skipped: this runs for every quantized operand). `shape` must be a torch.Size; `kind`, if given, is
        `class_for(scheme)` (looked up once by the caller: hashing a scheme costs ~1 us)."""
        storage = object.__new__(QuantizedTensorBase.class_for(scheme) if kind is None else kind)
        fields = storage.__dict__
        fields.update(scheme=scheme, shape=shape, nominal_dtype=nominal_dtype, quantizer=quantizer)
        fields.update(NO_BUFFERS)
        fields.update(buffers)
        return storage

    def without_rowwise(self) -> QuantizedTensorBase:
        """A new storage without this one's rowwise data and scales (what backward reads of fprop's operands)."""
        storage = object.__new__(QuantizedTensorBase.class_for(self.scheme))
        mine, fields = self.__dict__, storage.__dict__
        fields.update(scheme=self.scheme, shape=self.shape, nominal_dtype=self.nominal_dtype, quantizer=self.quantizer)
        fields.update({name: mine.get(name) for name in NO_BUFFERS})
        fields.update(NO_ROWWISE[bool(self.scheme.tensor_scale)])
        return storage

    def nbytes(self) -> int:
        """Bytes held by the buffers (a buffer shared by both usages counts once)."""
        seen = {id(t): t.numel() * t.element_size() for t in self.buffers().values() if t is not None}
        return sum(seen.values())

    # ------------------------------------------------------------------ allocation and views
    @staticmethod
    def empty(
        shape: torch.Size | tuple[int, ...],
        *,
        scheme: Scheme,
        nominal_dtype: torch.dtype,
        device: torch.device | str | None = None,
        rowwise: bool = True,
        columnwise: bool = True,
        quantizer: Any = None,
    ) -> QuantizedTensorBase:
        """Uninitialised buffers for the requested usages."""
        shape = torch.Size(shape)
        specs = buffer_specs(scheme, shape, rowwise=rowwise, columnwise=columnwise)
        buffers = {name: torch.empty(size, dtype=dt, device=device) for name, (size, dt) in specs.items()}
        if scheme.rowwise_block.is_tensor and rowwise and columnwise:
            buffers["columnwise_scale_inv"] = buffers["rowwise_scale_inv"]
        if scheme.tensor_scale and scheme.derivable and rowwise and columnwise:
            buffers["amax_columnwise"] = buffers["amax_rowwise"]
        return QuantizedTensorBase(scheme=scheme, shape=shape, nominal_dtype=nominal_dtype, quantizer=quantizer,
                                   **buffers)

    def empty_like(self, shape: torch.Size, device: torch.device | str | None = None) -> QuantizedTensorBase:
        """Uninitialised storage of the same scheme and usages at `shape`."""
        return QuantizedTensorBase.empty(
            shape, scheme=self.scheme, nominal_dtype=self.nominal_dtype, device=device or self.device,
            rowwise=self.has_rowwise or not self.has_columnwise, columnwise=self.has_columnwise,
            quantizer=self.quantizer,
        )

    def view(self, shape: torch.Size) -> QuantizedTensorBase | None:
        """The same value seen with another shape, or None when the layout does not allow it.

        Blocks run along the last dim (rowwise) or the flattened leading dims (columnwise),
        so a view that keeps the last dim keeps every buffer valid. With one scale per
        tensor any view of the rowwise data is valid (the columnwise copy is dropped then).
        """
        transposed = self.scheme.columnwise_transposed
        if len(shape) and len(self.shape) and shape[-1] == self.shape[-1]:
            columnwise = self.columnwise_data
            if columnwise is not None and not transposed:
                columnwise = columnwise.view(self.scheme.data_shape(shape, True))
            rowwise = None if self.rowwise_data is None else self.rowwise_data.view(self.scheme.data_shape(shape, False))
            return self.replace(shape=shape, rowwise_data=rowwise, columnwise_data=columnwise)
        if self.scheme.rowwise_block.is_tensor and self.has_rowwise:
            return self.replace(shape=shape, rowwise_data=self.rowwise_data.view(shape),
                                columnwise_data=None, columnwise_scale_inv=None)
        return None

    def transpose(self) -> QuantizedTensorBase | None:
        """The quantized transpose of a 2D tensor where the scheme gives it exactly (derivable schemes)."""
        if len(self.shape) != 2 or not self.scheme.derivable or not (self.has_rowwise or self.has_columnwise):
            return None
        row = {n.removeprefix("rowwise_").removesuffix("_rowwise"): getattr(self, n)
               for n in self.scheme.usage_fields(False)}
        if self.columnwise_data is None:
            col = self._derived(columnwise=True)
        else:
            col = {n.removeprefix("columnwise_").removesuffix("_columnwise"): getattr(self, n)
                   for n in self.scheme.usage_fields(True)}
        return self.replace(shape=torch.Size((self.shape[1], self.shape[0])), **_usage_fields(col, False),
                            **_usage_fields(row, True))

    # ------------------------------------------------------------------ usages
    def update_usage(self, rowwise_usage: bool | None = None, columnwise_usage: bool | None = None) -> None:
        """Keep, drop or create each representation. None leaves a usage as it is.

        Creating one from the other is possible only where the scheme says it is exact
        (`scheme.derivable`: the same blocks seen transposed); otherwise a ValueError says why.
        """
        want_row = self.has_rowwise if rowwise_usage is None else bool(rowwise_usage)
        want_col = self.has_columnwise if columnwise_usage is None else bool(columnwise_usage)
        if not (want_row or want_col):
            raise ValueError("update_usage: at least one of rowwise_usage / columnwise_usage must stay True")
        if not (self.has_rowwise or self.has_columnwise):
            raise ValueError(f"update_usage: {type(self).__name__} holds no data (emptied by prepare_for_saving)")
        for columnwise, want, has in ((False, want_row, self.has_rowwise), (True, want_col, self.has_columnwise)):
            if want and not has:
                self.__dict__.update(_usage_fields(self._derived(columnwise=columnwise), columnwise))
        for columnwise, want in ((False, want_row), (True, want_col)):
            if not want:
                self.__dict__.update(dict.fromkeys(self.scheme.usage_fields(columnwise)))

    def _derived(self, *, columnwise: bool) -> dict[str, torch.Tensor]:
        """One usage made from the other: {"data", "scale_inv"(, "amax")}, the transposed data and scales (exact
        for derivable schemes)."""
        usage, other = ("columnwise", "rowwise") if columnwise else ("rowwise", "columnwise")
        if not self.scheme.derivable:
            raise ValueError(
                f"{self.scheme.name}: {usage} data cannot be derived from {other} data (the scales run along "
                f"the other dim); quantize the high-precision tensor with {usage} usage instead"
            )
        if columnwise:
            data, scale, amax = ref.transpose_2d(self.rowwise_data), self.rowwise_scale_inv, self.amax_rowwise
        else:
            data = self.columnwise_data.t().contiguous().view(self.shape)
            scale, amax = self.columnwise_scale_inv, self.amax_columnwise
        out = {"data": data, "scale_inv": scale if self.shares_scale_inv else scale.t().contiguous()}
        return {**out, "amax": amax} if self.scheme.tensor_scale else out

    # ------------------------------------------------------------------ saving for backward
    def prepare_for_saving(self) -> tuple[list[torch.Tensor | None], QuantizedTensorBase]:
        """Hand the buffers to autograd's saved tensors and empty self. Returns (buffers, self)."""
        fields = FIELDS[bool(self.scheme.tensor_scale)]
        tensors = [getattr(self, name) for name in fields]
        self.__dict__.update(dict.fromkeys(fields))
        return tensors, self

    def restore_from_saved(self, tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Take back this storage's buffers (`scheme.fields`) from the front of `tensors`; return the rest."""
        fields = FIELDS[bool(self.scheme.tensor_scale)]
        if len(tensors) < len(fields):
            raise ValueError(f"restore_from_saved: expected at least {len(fields)} tensors for a {self.scheme.name} "
                             f"storage, got {len(tensors)}")
        self.__dict__.update(zip(fields, tensors))
        return list(tensors[len(fields):])

    # ------------------------------------------------------------------ values
    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The high-precision value (from rowwise data when present, else columnwise)."""
        dtype = self.nominal_dtype if dtype is None else check_dequantize_dtype(dtype)
        for usage, columnwise in (("rowwise", False), ("columnwise", True)):
            data = getattr(self, f"{usage}_data")
            if data is None:
                continue
            scale_inv = getattr(self, f"{usage}_scale_inv")
            if self.scheme.tensor_scale:  # two scale levels (and the transform undone): NVFP4's reference
                return nvfp4.dequantize_usage(data, scale_inv, getattr(self, f"amax_{usage}"), self.scheme,
                                              self.shape, columnwise, dtype)
            return dequantize_blocked(data, scale_inv, self.scheme, shape=self.shape, columnwise=columnwise,
                                      dtype=dtype)
        raise ValueError(f"dequantize: {type(self).__name__} holds no data (emptied by prepare_for_saving)")

    # ------------------------------------------------------------------ quantizer
    def update_quantizer(self, quantizer: Any) -> None:
        """Attach another quantizer of the same layout; warn when its settings differ.

        The data already held stays valid (it carries its own scales); the new quantizer
        is used the next time the tensor is quantized into (`quantize_`, `copy_`).
        """
        scheme = getattr(quantizer, "scheme", None)
        if quantizer is not None and (scheme is None or self.class_for(scheme) is not self.class_for(self.scheme)):
            raise TypeError(f"quantizer: expected a quantizer that makes {type(self).__name__}, got {quantizer!r}")
        old = self.quantizer
        if old is not None and quantizer is not None and old.config() != quantizer.config():
            warnings.warn(f"{type(self).__name__}: quantizer changed from {old!r} to {quantizer!r}",
                          UserWarning, stacklevel=2)
        self.quantizer = quantizer

    # ------------------------------------------------------------------ checks and serialization
    def check_values(self) -> None:
        """ValueError naming the buffer if it holds scales the scheme never makes (checked at load; syncs).

        fp32 and bf16 scales are finite and > 0 (and one per tensor is the same for both usages), zero points
        finite; an E8M0 scale is the NaN code 255 only for a block whose data holds a NaN (for elements
        without a NaN code, E2M1/E2M3/E3M2: a block whose codes are all +0, what NaN blocks get).
        """
        for usage, columnwise in (("rowwise", False), ("columnwise", True)):
            data, scale = getattr(self, f"{usage}_data"), getattr(self, f"{usage}_scale_inv")
            if data is None:
                if self.scheme.tensor_scale and getattr(self, f"amax_{usage}") is not None:
                    raise ValueError(f"amax_{usage}: expected None, as {usage}_data is None")
                continue
            if self.scheme.tensor_scale:
                nvfp4.check_scales(scale, getattr(self, f"amax_{usage}"), usage)
                continue
            if self.scheme.scale is ScaleEncoding.E8M0:
                _check_e8m0_nan(data, scale, self.scheme, columnwise, f"{usage}_scale_inv")
                continue
            if self.scheme.zero_point:  # (scale, zero) pairs: any finite zero
                scale, zero = scale[..., 0], scale[..., 1]
                bad = ~torch.isfinite(zero)
                if bool(bad.any()):
                    raise ValueError(f"{usage}_scale_inv: expected finite zeros ([..., 1]), got "
                                     f"{zero[bad][:4].tolist()} ({int(bad.sum())} of {zero.numel()})")
            bad = ~((scale > 0) & torch.isfinite(scale))
            if bool(bad.any()):
                raise ValueError(f"{usage}_scale_inv: expected finite scales > 0, got {scale[bad][:4].tolist()} "
                                 f"({int(bad.sum())} of {scale.numel()})")
        row, col = self.rowwise_scale_inv, self.columnwise_scale_inv
        if self.shares_scale_inv and row is not None and col is not None and row is not col and not torch.equal(row, col):
            raise ValueError(f"columnwise_scale_inv: expected the rowwise scale_inv {row.tolist()} "
                             f"(one scale per tensor), got {col.tolist()}")

    def to_plain(self) -> dict[str, Any]:
        """Plain tensors and data that `engine.tensors.serialization` rebuilds this storage from.

        Buffers are saved dense (a view into a larger storage is copied), which the loader requires.
        """
        done = {id(t): compact(t) for t in self.buffers().values() if t is not None}
        return {
            "scheme": self.scheme.name,
            "shape": list(self.shape),
            "nominal_dtype": str(self.nominal_dtype).removeprefix("torch."),
            "quantizer": None if self.quantizer is None else self.quantizer.to_plain(),
            **{name: None if t is None else done[id(t)] for name, t in self.buffers().items()},
        }

    def __reduce__(self) -> tuple:
        return REBUILD_STORAGE.impl, (self.to_plain(),)

    def __repr__(self) -> str:
        usages = [u for u, on in (("rowwise", self.has_rowwise), ("columnwise", self.has_columnwise)) if on]
        return (f"{type(self).__name__}(scheme={self.scheme.name}, shape={tuple(self.shape)}, "
                f"nominal_dtype={self.nominal_dtype}, usages={usages})")


def _check_e8m0_nan(data: torch.Tensor, codes: torch.Tensor, scheme: Scheme, columnwise: bool, name: str) -> None:
    block = scheme.stored_block(columnwise)
    if scheme.coded:  # no NaN code: a block with the NaN scale holds only +0 codes (what a NaN block quantizes to)
        stored = ref.as_2d(data)
        unpacked = mx_elements.unpack(stored, scheme.element, stored.shape[-1] * scheme.elements_per_byte)
        flag = unpacked[:, : codes.shape[-1] * block.cols] != 0  # (an odd last dim's padding nibble is 0)
    else:
        flag = torch.isnan(ref.as_2d(data).float())
    rows, cols = flag.shape
    padded = torch.nn.functional.pad(flag, (0, -(-cols // block.cols) * block.cols - cols,
                                            0, -(-rows // block.rows) * block.rows - rows))
    any_flag = padded.reshape(padded.shape[0] // block.rows, block.rows, padded.shape[1] // block.cols,
                              block.cols).any(dim=(1, 3))  # no -1: a tensor with no rows has no elements
    bad = (codes == ref.E8M0_NAN) & (any_flag if scheme.coded else ~any_flag)
    if bool(bad.any()):
        where = [tuple(i) for i in bad.nonzero()[:4].tolist()]
        what = "element codes are not all +0" if scheme.coded else "data holds no NaN"
        raise ValueError(f"{name}: E8M0 code 255 (NaN) in blocks whose {what}, at {where} ({int(bad.sum())} blocks)")
