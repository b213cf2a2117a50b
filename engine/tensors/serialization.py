"""Rebuilding quantized tensors from plain data, so `torch.load(weights_only=True)` works.

A pickled quantized tensor is a call to one of the two functions below with a dict of
plain tensors, strings, numbers and lists (`QuantizedTensorBase.to_plain`). Both are
registered as safe globals when `engine` is imported; no other code is unpickled.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.formats import FP8_DTYPES
from engine.tensors.quantized import QuantizedTensor
from engine.tensors.storage import BUFFER_FIELDS, QuantizedTensorBase


def parse_dtype(name: Any, field: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{field}: expected the name of a torch dtype, got {name!r}")
    return dtype


def rebuild_storage(plain: dict[str, Any]) -> QuantizedTensorBase:
    """Inverse of `QuantizedTensorBase.to_plain`; malformed input raises ValueError."""
    if not isinstance(plain, dict):
        raise ValueError(f"quantized tensor state: expected a dict, got {type(plain).__name__}")
    fields = dict(plain)
    try:
        cls = QuantizedTensorBase._by_name[fields.pop("storage_class")]
        shape = torch.Size(fields.pop("shape"))
        nominal_dtype = parse_dtype(fields.pop("nominal_dtype"), "nominal_dtype")
        fp8_dtype = parse_dtype(fields.pop("fp8_dtype"), "fp8_dtype")
        quantizer_state = fields.pop("quantizer")
        buffers = {name: fields.pop(name) for name in BUFFER_FIELDS}
    except (KeyError, TypeError) as err:
        raise ValueError(f"quantized tensor state is malformed ({err!r}); keys: {sorted(plain)}") from err
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_dtype: expected float8_e4m3fn or float8_e5m2, got {fp8_dtype}")
    _check_buffers(cls, shape, fp8_dtype, buffers, fields)
    quantizer = None
    if quantizer_state is not None:
        from engine.quantizers import quantizer_from_plain

        quantizer = quantizer_from_plain(quantizer_state)
    try:
        return cls(shape=shape, nominal_dtype=nominal_dtype, fp8_dtype=fp8_dtype, quantizer=quantizer,
                   **buffers, **fields)
    except TypeError as err:
        raise ValueError(f"quantized tensor state for {cls.__name__} is malformed: {err}") from err


def _check_buffers(cls: type[QuantizedTensorBase], shape: torch.Size, fp8_dtype: torch.dtype,
                   buffers: dict[str, Any], extra: dict[str, Any]) -> None:
    """Every buffer is a tensor (or None) of the shape and dtype the layout prescribes."""
    for name, t in buffers.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a tensor or None, got {type(t).__name__}")
    rowwise, columnwise = buffers["rowwise_data"] is not None, buffers["columnwise_data"] is not None
    try:
        specs = cls.buffer_specs(shape, fp8_dtype, rowwise=rowwise, columnwise=columnwise, **extra)
    except TypeError as err:
        raise ValueError(f"quantized tensor state for {cls.__name__} is malformed: {err}") from err
    for name, (size, dtype) in specs.items():
        t = buffers[name]
        if t is None or tuple(t.shape) != tuple(size) or t.dtype != dtype:
            got = None if t is None else f"{t.dtype} {tuple(t.shape)}"
            raise ValueError(f"{name}: expected {dtype} of shape {tuple(size)} for a {cls.__name__} of shape "
                             f"{tuple(shape)}, got {got}")


def rebuild_quantized_tensor(plain: dict[str, Any], requires_grad: bool) -> QuantizedTensor:
    return QuantizedTensor.wrap(rebuild_storage(plain), requires_grad=bool(requires_grad))


torch.serialization.add_safe_globals([rebuild_storage, rebuild_quantized_tensor])
