"""Rebuilding quantized tensors from plain data, so `torch.load(weights_only=True)` works.

A pickled quantized tensor is a call to one of the two functions below with a dict of
plain tensors, strings, numbers and lists (`QuantizedTensorBase.to_plain`). Both are
registered as safe globals when `engine` is imported; no other code is unpickled.

A checkpoint is untrusted input, so everything is checked here, at `torch.load`, not at
first use: dtypes and shapes, that every buffer is dense (a stride-0 or overlapping
buffer could make a small file stand for gigabytes), that the layout's buffers are all
there and no others, and the values of the scales (and of the quantizer's state).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from engine.formats import FP8_DTYPES
from engine.ops.reference import HIGH_PRECISION_DTYPES
from engine.tensors.quantized import QuantizedTensor
from engine.schemes import Scheme, fp8_scheme, get_scheme
from engine.tensors.storage import BUFFER_FIELDS, QuantizedTensorBase, buffer_specs


def parse_dtype(name: Any, field: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{field}: expected the name of a torch dtype, got {name!r}")
    return dtype


#: rebuilds a quantizer from its plain state; `engine.quantizers` fills it in when imported (the
#: quantizers sit above the tensors, which must not import them)
QUANTIZER_LOADERS: dict[str, Callable[[Any], Any]] = {}

_LEGACY_LAYOUTS = {"Float8TensorStorage": "tensor", "Float8BlockwiseTensorStorage": "block", "MXFP8TensorStorage": "mx"}


def _scheme_of(fields: dict[str, Any], quantizer_state: Any) -> Scheme:
    """The scheme named in the state, or the one a pre-scheme checkpoint's class and settings imply."""
    if "scheme" in fields:
        return get_scheme(fields.pop("scheme"))
    if "storage_class" not in fields:
        raise ValueError("scheme: missing (and no storage_class of a checkpoint from before schemes either)")
    name = fields.pop("storage_class")
    fp8_dtype = parse_dtype(fields.pop("fp8_dtype"), "fp8_dtype")
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_dtype: expected float8_e4m3fn or float8_e5m2, got {fp8_dtype}")
    if name not in _LEGACY_LAYOUTS:
        raise ValueError(f"storage_class: expected one of {sorted(_LEGACY_LAYOUTS)}, got {name!r}")
    layout = _LEGACY_LAYOUTS[name]
    if layout == "block":
        dim = fields.pop("block_scaling_dim", 1)
        if dim not in (1, 2) or isinstance(dim, bool):
            raise ValueError(f"block_scaling_dim: expected 1 or 2, got {dim!r}")
        layout = f"block{dim}d"
    pow2 = isinstance(quantizer_state, dict) and quantizer_state.get("force_pow_2_scales") is True
    return fp8_scheme(layout, fp8_dtype, pow2=pow2 and layout != "mx")


def rebuild_storage(plain: dict[str, Any]) -> QuantizedTensorBase:
    """Inverse of `QuantizedTensorBase.to_plain` (and of the pre-scheme format); malformed input raises ValueError."""
    if not isinstance(plain, dict):
        raise ValueError(f"quantized tensor state: expected a dict, got {type(plain).__name__}")
    fields = dict(plain)
    try:
        quantizer_state = fields.pop("quantizer")
        scheme = _scheme_of(fields, quantizer_state)
        shape = torch.Size(fields.pop("shape"))
        nominal_dtype = parse_dtype(fields.pop("nominal_dtype"), "nominal_dtype")
        buffers = {name: fields.pop(name) for name in BUFFER_FIELDS}
    except (KeyError, TypeError) as err:
        raise ValueError(f"quantized tensor state is malformed ({err!r}); keys: {sorted(plain)}") from err
    if fields:
        raise ValueError(f"quantized tensor state: unknown keys {sorted(fields)}")
    if any(s < 0 for s in shape):
        raise ValueError(f"shape: expected sizes >= 0, got {list(shape)}")
    if nominal_dtype not in HIGH_PRECISION_DTYPES:
        raise ValueError(f"nominal_dtype: expected float32, bfloat16 or float16, got {nominal_dtype}")
    _check_buffers(scheme, shape, buffers)
    quantizer = None
    if quantizer_state is not None:
        quantizer = QUANTIZER_LOADERS["quantizer"](quantizer_state)
        if quantizer.scheme.layout != scheme.layout or quantizer.scheme.element != scheme.element:
            raise ValueError(f"quantizer: a {type(quantizer).__name__} ({quantizer.scheme.name}) cannot quantize "
                             f"into a {scheme.name} tensor")
        scheme = quantizer.scheme  # a pre-scheme block checkpoint learns its scale encoding from its quantizer
    storage = QuantizedTensorBase(scheme=scheme, shape=shape, nominal_dtype=nominal_dtype, quantizer=quantizer,
                                  **buffers)
    if not any(t is not None and t.is_meta for t in buffers.values()):  # map_location="meta" has no values
        storage.check_values()
    return storage


def _check_buffers(scheme: Scheme, shape: torch.Size, buffers: dict[str, Any]) -> None:
    """Every buffer is a dense tensor of the shape and dtype the scheme prescribes, or None where it has none."""
    for name, t in buffers.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or type(t) is not torch.Tensor:
            raise ValueError(f"{name}: expected a plain torch.Tensor or None, got {type(t).__name__}")
        _check_dense(t, name)
    rowwise, columnwise = buffers["rowwise_data"] is not None, buffers["columnwise_data"] is not None
    specs = buffer_specs(scheme, shape, rowwise=rowwise, columnwise=columnwise)
    for name, (size, dtype) in specs.items():
        t = buffers[name]
        if t is None or tuple(t.shape) != tuple(size) or t.dtype != dtype:
            got = None if t is None else f"{t.dtype} {tuple(t.shape)}"
            raise ValueError(f"{name}: expected {dtype} of shape {tuple(size)} for a {scheme.name} tensor of shape "
                             f"{tuple(shape)}, got {got}")
    for name, t in buffers.items():
        if name not in specs and t is not None:
            usage = name.split("_")[0]
            raise ValueError(f"{name}: expected None, as {usage}_data is None; got {t.dtype} {tuple(t.shape)}")


def _check_dense(t: torch.Tensor, name: str) -> None:
    """t is contiguous and is its whole storage: it holds exactly numel elements' bytes, no more, no less."""
    needed = t.numel() * t.element_size()
    if not t.is_contiguous() or t.storage_offset() != 0 or t.untyped_storage().nbytes() != needed:
        raise ValueError(
            f"{name}: expected a dense tensor (contiguous, storage offset 0, storage of {needed} bytes for "
            f"{t.numel()} elements), got strides {t.stride()}, offset {t.storage_offset()} and a storage of "
            f"{t.untyped_storage().nbytes()} bytes"
        )


def rebuild_quantized_tensor(plain: dict[str, Any], requires_grad: bool) -> QuantizedTensor:
    return QuantizedTensor.wrap(rebuild_storage(plain), requires_grad=bool(requires_grad))


torch.serialization.add_safe_globals([rebuild_storage, rebuild_quantized_tensor])
