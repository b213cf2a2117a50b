"""Quantizer: turns a high-precision tensor into a quantized one for chosen usages.

A quantizer holds the scheme's settings (and, for delayed scaling, references to the
scale and amax state it reads and records into). `quantize` is an autograd-transparent
cast: the gradient passes through unchanged. With `internal=True` it returns the bare
storage (no torch.Tensor wrapper), for use inside autograd functions.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from engine.formats import FP8_DTYPES
from engine.ops import backend as ops
from engine.ops import reference as ref
from engine.tensors.quantized import QuantizedTensor, storage_of
from engine.tensors.storage import BUFFER_FIELDS, QuantizedTensorBase

Buffers = dict[str, torch.Tensor | None]


def check_fp8_dtype(fp8_dtype: Any) -> torch.dtype:
    if fp8_dtype not in FP8_DTYPES:
        raise TypeError(f"fp8_dtype: expected torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}")
    return fp8_dtype


def check_epsilon(amax_epsilon: Any) -> float:
    if (isinstance(amax_epsilon, bool) or not isinstance(amax_epsilon, (int, float))
            or not (0 <= amax_epsilon < float("inf"))):
        raise ValueError(f"amax_epsilon: expected a finite number >= 0, got {amax_epsilon!r}")
    return float(amax_epsilon)


def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {value!r}")
    return value


class Quantizer(ABC):
    """Base of every quantizer. Subclasses compute the buffers; the base manages usages and outputs."""

    storage_class: ClassVar[type[QuantizedTensorBase]]
    _by_name: ClassVar[dict[str, type[Quantizer]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        Quantizer._by_name[cls.__name__] = cls

    def __init__(self, *, rowwise: bool = True, columnwise: bool = True, internal: bool = False) -> None:
        self.rowwise_usage = check_bool(rowwise, "rowwise")
        self.columnwise_usage = check_bool(columnwise, "columnwise")
        self.internal = check_bool(internal, "internal")
        self.fp8_dtype: torch.dtype

    # ------------------------------------------------------------------ settings
    @abstractmethod
    def config(self) -> dict[str, Any]:
        """The scheme's settings as plain data (what makes two quantizers quantize alike)."""

    def state(self) -> dict[str, torch.Tensor]:
        """Tensors the quantizer reads or records into (delayed scaling: scale, amax)."""
        return {}

    def to_plain(self) -> dict[str, Any]:
        """Plain data that `quantizer_from_plain` rebuilds an equal quantizer from."""
        return {"quantizer_class": type(self).__name__, **self.config(), **self.state(),
                "rowwise": self.rowwise_usage, "columnwise": self.columnwise_usage, "internal": self.internal}

    def storage_kwargs(self) -> dict[str, Any]:
        """Scheme-specific constructor arguments of the storage it makes."""
        return {}

    def set_usage(self, *, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        if rowwise is not None:
            self.rowwise_usage = check_bool(rowwise, "rowwise")
        if columnwise is not None:
            self.columnwise_usage = check_bool(columnwise, "columnwise")

    def copy(self) -> Quantizer:
        """A shallow copy: settings are its own, state tensors (scale, amax) are shared."""
        return copy.copy(self)

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v}" for k, v in self.config().items())
        return f"{type(self).__name__}({settings})"

    # ------------------------------------------------------------------ quantizing
    @abstractmethod
    def compute_buffers(self, x: torch.Tensor, *, rowwise: bool, columnwise: bool) -> Buffers:
        """The four buffers (None for a usage not asked for) of x quantized by this scheme."""

    def _check_usages(self, rowwise: bool, columnwise: bool) -> None:
        if not (rowwise or columnwise):
            raise ValueError(f"{type(self).__name__}: both usages are off; set_usage(rowwise=True) or columnwise")

    def _checked_buffers(self, x: torch.Tensor, *, rowwise: bool, columnwise: bool) -> Buffers:
        ref.check_input(x, "x")
        self._check_usages(rowwise, columnwise)
        return self.compute_buffers(x.detach(), rowwise=rowwise, columnwise=columnwise)

    def quantize_storage(self, x: torch.Tensor) -> QuantizedTensorBase:
        """x quantized, as a bare storage."""
        buffers = self._checked_buffers(x, rowwise=self.rowwise_usage, columnwise=self.columnwise_usage)
        return self.storage_class(shape=x.shape, nominal_dtype=x.dtype, fp8_dtype=self.fp8_dtype, quantizer=self,
                                  **self.storage_kwargs(), **buffers)

    def quantize(
        self, x: torch.Tensor, *, out: QuantizedTensor | QuantizedTensorBase | None = None
    ) -> QuantizedTensor | QuantizedTensorBase:
        """x quantized: into `out` if given, else a new tensor (a storage if `internal`)."""
        ref.check_input(x, "x")
        if out is not None:
            return self.update_quantized(x, out)
        if self.internal:
            return self.quantize_storage(x)
        if torch.is_grad_enabled() and x.requires_grad:
            return _Quantize.apply(x, self)
        return QuantizedTensor.wrap(self.quantize_storage(x))

    __call__ = quantize

    def update_quantized(
        self,
        src: torch.Tensor,
        dst: QuantizedTensor | QuantizedTensorBase,
        *,
        noop_flag: torch.Tensor | None = None,
    ) -> QuantizedTensor | QuantizedTensorBase:
        """Quantize src into dst's buffers in place (skipped when noop_flag is non-zero).

        dst keeps the usages it holds (the quantizer's, if it holds none) and takes the
        quantizer's settings (fp8 dtype, block dim) and the quantizer itself.
        """
        if noop_flag is not None and bool(noop_flag.reshape(-1)[0] != 0):
            return dst
        storage = storage_of(dst, "dst")
        if type(storage) is not self.storage_class:
            raise TypeError(f"dst: expected a {self.storage_class.__name__} (or its tensor), got {type(storage).__name__}")
        if tuple(src.shape) != tuple(storage.shape):
            raise ValueError(f"src: expected shape {tuple(storage.shape)} (the shape of dst), got {tuple(src.shape)}")
        rowwise, columnwise = storage.has_rowwise, storage.has_columnwise
        if not (rowwise or columnwise):
            rowwise, columnwise = self.rowwise_usage, self.columnwise_usage
        fresh = self._checked_buffers(src, rowwise=rowwise, columnwise=columnwise)
        storage.fp8_dtype = self.fp8_dtype
        for key, value in self.storage_kwargs().items():
            setattr(storage, key, value)
        storage.quantizer = self
        for name in BUFFER_FIELDS:
            new, old = fresh[name], getattr(storage, name)
            if new is None:
                setattr(storage, name, None)
            elif old is not None and old.shape == new.shape and old.dtype == new.dtype:
                old.copy_(new)
            else:
                setattr(storage, name, new)
        return dst

    def make_empty(
        self,
        shape: torch.Size | tuple[int, ...],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        requires_grad: bool = False,
    ) -> QuantizedTensor | QuantizedTensorBase:
        """Uninitialised quantized tensor with this quantizer's usages."""
        self._check_usages(self.rowwise_usage, self.columnwise_usage)
        storage = self.storage_class.empty(
            shape, nominal_dtype=dtype, fp8_dtype=self.fp8_dtype, device=device, rowwise=self.rowwise_usage,
            columnwise=self.columnwise_usage, quantizer=self, **self.storage_kwargs(),
        )
        return storage if self.internal else QuantizedTensor.wrap(storage, requires_grad=requires_grad)


class _Quantize(torch.autograd.Function):
    """Quantize in forward; in backward the gradient passes straight through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, quantizer: Quantizer) -> QuantizedTensor:
        return QuantizedTensor.wrap(quantizer.quantize_storage(x))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def quantizer_from_plain(plain: dict[str, Any]) -> Quantizer:
    """Inverse of `Quantizer.to_plain`; malformed input raises ValueError."""
    if not isinstance(plain, dict) or plain.get("quantizer_class") not in Quantizer._by_name:
        raise ValueError(f"quantizer state: expected a dict naming one of {sorted(Quantizer._by_name)}, got {plain!r}")
    from engine.tensors.serialization import parse_dtype

    kwargs = dict(plain)
    cls = Quantizer._by_name[kwargs.pop("quantizer_class")]
    for key, value in list(kwargs.items()):
        if key.endswith("dtype"):
            kwargs[key] = parse_dtype(value, key)
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise ValueError(f"quantizer state for {cls.__name__} is malformed: {err}") from err


def per_tensor_buffers(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, *, rowwise: bool, columnwise: bool
) -> tuple[Buffers, torch.Tensor]:
    """x cast with one scale (one pass: rowwise data, its 2D transpose, amax). Returns (buffers, amax)."""
    data, data_t, amax = ops.cast_transpose(ref.as_2d(x), scale, fp8_dtype, rowwise=rowwise, columnwise=columnwise)
    scale_inv = ref.reciprocal(scale).reshape(1).to(x.device)  # one tensor shared by both usages
    buffers = {
        "rowwise_data": None if data is None else data.view(x.shape),
        "rowwise_scale_inv": scale_inv if rowwise else None,
        "columnwise_data": data_t,
        "columnwise_scale_inv": scale_inv if columnwise else None,
    }
    return buffers, amax


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
