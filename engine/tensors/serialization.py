"""Rebuilding quantized tensors from plain data, so `torch.load(weights_only=True)` works.

A pickled quantized tensor is a call to one of the two functions below with a dict of
plain tensors, strings, numbers and lists (`QuantizedTensorBase.to_plain`). Both are
registered as safe globals when `engine` is imported; no other code is unpickled.
"""

from __future__ import annotations

from typing import Any

import torch

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
    for name, t in buffers.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a tensor or None, got {type(t).__name__}")
    quantizer = None
    if quantizer_state is not None:
        from engine.quantizers import quantizer_from_plain

        quantizer = quantizer_from_plain(quantizer_state)
    return cls(shape=shape, nominal_dtype=nominal_dtype, fp8_dtype=fp8_dtype, quantizer=quantizer,
               **buffers, **fields)


def rebuild_quantized_tensor(plain: dict[str, Any], requires_grad: bool) -> QuantizedTensor:
    return QuantizedTensor.wrap(rebuild_storage(plain), requires_grad=bool(requires_grad))


torch.serialization.add_safe_globals([rebuild_storage, rebuild_quantized_tensor])
