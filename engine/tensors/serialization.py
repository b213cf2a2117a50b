"""Quantized tensors as plain data: for `torch.load(weights_only=True)` and for safetensors.

Two forms, both read back by `rebuild_storage`:

* Pickled: a quantized tensor is a call to one of the two rebuild functions below with a
  dict of plain tensors, strings, numbers and lists (`QuantizedTensorBase.to_plain`). Both
  are registered as safe globals when `engine` is imported; no other code is unpickled.
  Checkpoints written before the component keys below hold this form; it still loads.
* Component keys (what modules put in `state_dict()`): plain tensors under keys derived
  from the parameter's key, so files that hold only tensors (safetensors) can hold them.
  See `to_components`.

A checkpoint is untrusted input, so everything is checked here, at `torch.load`, not at
first use: dtypes and shapes, that every buffer is dense (a stride-0 or overlapping
buffer could make a small file stand for gigabytes), that the layout's buffers are all
there and no others, and the values of the scales (and of the quantizer's state).
"""

from __future__ import annotations

from typing import Any, Callable, MutableMapping

import torch

from engine.formats import FP8_DTYPES
from engine.ops.reference import HIGH_PRECISION_DTYPES
from engine.tensors.quantized import REBUILD_QUANTIZED_TENSOR, QuantizedTensor, storage_of
from engine.schemes import Scheme, fp8_scheme, get_scheme
from engine.tensors.records import decode_record, encode_record
from engine.tensors.storage import BUFFER_FIELDS, REBUILD_STORAGE, QuantizedTensorBase, buffer_specs, compact


def parse_dtype(name: Any, field: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{field}: expected the name of a torch dtype, got {name!r}")
    return dtype


#: "quantizer": rebuilds a quantizer from its plain state; "class": the quantizer class of a name (ValueError
#: listing the known ones); `engine.quantizers` fills it in when imported (the quantizers sit above the
#: tensors, which must not import them)
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
    if name == "Float8BlockwiseTensorStorage":
        dim = fields.pop("block_scaling_dim", 1)
        if dim not in (1, 2) or isinstance(dim, bool):
            raise ValueError(f"block_scaling_dim: expected 1 or 2, got {dim!r}")
        layout = f"block{dim}d"
    pow2 = isinstance(quantizer_state, dict) and quantizer_state.get("force_pow_2_scales") is True
    return fp8_scheme(layout, fp8_dtype, pow2=pow2 and name != "MXFP8TensorStorage")


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
        extras = {name: fields.pop(name, None) for name in scheme.fields if name not in BUFFER_FIELDS}
    except (KeyError, TypeError) as err:
        raise ValueError(f"quantized tensor state is malformed ({err!r}); keys: {sorted(plain)}") from err
    if fields:
        raise ValueError(f"quantized tensor state: unknown keys {sorted(fields)}")
    if any(s < 0 for s in shape):
        raise ValueError(f"shape: expected sizes >= 0, got {list(shape)}")
    if nominal_dtype not in HIGH_PRECISION_DTYPES:
        raise ValueError(f"nominal_dtype: expected float32, bfloat16 or float16, got {nominal_dtype}")
    _check_buffers(scheme, shape, buffers)
    for name, t in extras.items():  # a layout's own buffers (NVFP4's amaxes): dense; the storage checks values
        if t is not None:
            if type(t) is not torch.Tensor:
                raise ValueError(f"{name}: expected a plain torch.Tensor or None, got {type(t).__name__}")
            _check_dense(t, name)
    quantizer = None
    if quantizer_state is not None:
        quantizer = QUANTIZER_LOADERS["quantizer"](quantizer_state)
        if not quantizer.scheme.same_layout(scheme) or quantizer.scheme.element != scheme.element:
            raise ValueError(f"quantizer: a {type(quantizer).__name__} ({quantizer.scheme.name}) cannot quantize "
                             f"into a {scheme.name} tensor")
        scheme = quantizer.scheme  # a pre-scheme block checkpoint learns its scale encoding from its quantizer
    storage = QuantizedTensorBase(scheme=scheme, shape=shape, nominal_dtype=nominal_dtype, quantizer=quantizer,
                                  **buffers, **extras)
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
        if name not in buffers:  # the tensor-level amaxes: checked with their values (`check_values`)
            continue
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
REBUILD_STORAGE.register(rebuild_storage)  # what the pickled forms call (storage.py, quantized.py)
REBUILD_QUANTIZED_TENSOR.register(rebuild_quantized_tensor)


# ---------------------------------------------------------------------------- component keys
QUANTIZED_MAGIC = b"ENGQTENS"
QUANTIZED_VERSION = 1
#: a quantized tensor saved under `key` puts each buffer under key + suffix (its data under `key` itself,
#: as FP8 checkpoints on the Hugging Face Hub do: `weight` in FP8 next to `weight_scale_inv`)
COMPONENT_SUFFIXES = {"rowwise_data": "", "rowwise_scale_inv": "_scale_inv",
                      "columnwise_data": "_columnwise_data", "columnwise_scale_inv": "_columnwise_scale_inv"}
#: ... and how it was quantized under key + META_SUFFIX (a record, see engine.tensors.records)
META_SUFFIX = "_quantization"
_META_FIELDS = ("scheme", "shape", "nominal_dtype", "rowwise", "columnwise", "quantizer")


def _saved_usages(scheme: Scheme, rowwise: bool, columnwise: bool) -> tuple[bool, bool]:
    """The usages a checkpoint holds: rowwise, and columnwise unless it derives exactly from rowwise."""
    return rowwise, columnwise and not (rowwise and scheme.derivable)


def to_components(key: str, tensor: QuantizedTensor | QuantizedTensorBase) -> dict[str, torch.Tensor]:
    """A quantized tensor as plain tensors under keys made from `key`, for files that hold only tensors.

        key                        rowwise data: FP8 (the tensor's shape)
        key_scale_inv              rowwise scale_inv: fp32, or uint8 E8M0 codes (MXFP8)
        key_columnwise_data        columnwise data and scale_inv, only where they cannot be derived
        key_columnwise_scale_inv   exactly from the rowwise ones (1x128 blocks, MXFP8)
        key_quantization           uint8 record (version 1): {"scheme", "shape", "nominal_dtype",
                                   "rowwise", "columnwise", "quantizer"}: the scheme's name, the
                                   nominal shape and dtype, which usages the tensor had (so both
                                   come back), and the kind and settings of its quantizer
                                   ({"class": name, "config": Quantizer.config()} or null); the
                                   quantizer's state (delayed scaling's) is the module's to save.
                                   Its tensors are the scheme's buffers beside the four above
                                   (`scheme.fields`: NVFP4's fp32 [1] `amax_rowwise` /
                                   `amax_columnwise`), by field name; other layouts have none (their
                                   records are as they always were)

    No buffer is shared between two keys (safetensors refuses that).
    """
    st = storage_of(tensor, key)
    if not (st.has_rowwise or st.has_columnwise):
        raise ValueError(f"{key}: this {type(st).__name__} holds no data (emptied by prepare_for_saving)")
    rowwise, columnwise = _saved_usages(st.scheme, st.has_rowwise, st.has_columnwise)
    out: dict[str, torch.Tensor] = {}
    for usage, saved in (("rowwise", rowwise), ("columnwise", columnwise)):
        if saved:
            for part in ("data", "scale_inv"):
                field = f"{usage}_{part}"
                t = compact(getattr(st, field))
                if any(t is other for other in out.values()):
                    t = t.clone()
                out[key + COMPONENT_SUFFIXES[field]] = t.detach()
    header = {"scheme": st.scheme.name, "shape": list(st.shape),
              "nominal_dtype": str(st.nominal_dtype).removeprefix("torch."),
              "rowwise": st.has_rowwise, "columnwise": st.has_columnwise,
              "quantizer": None if st.quantizer is None else {"class": type(st.quantizer).__name__,
                                                               "config": st.quantizer.config()}}
    extras = {name: t.detach() for name, t in st.buffers().items() if name not in BUFFER_FIELDS and t is not None}
    out[key + META_SUFFIX] = encode_record(QUANTIZED_MAGIC, QUANTIZED_VERSION, header, extras)
    return out


def has_components(state_dict: Any, key: str) -> bool:
    """`state_dict` holds a quantized tensor saved under `key` as component keys."""
    return key + META_SUFFIX in state_dict


def pop_components(state_dict: MutableMapping[str, Any], key: str) -> tuple[QuantizedTensorBase, dict | None]:
    """Take the component keys of `key` out of `state_dict`: (the storage, checked; its saved quantizer's
    {"class", "config"} or None). The storage has no quantizer object; it gets back the usages it had
    when saved (a columnwise copy that was not saved is derived, bit for bit). Anything malformed is a
    ValueError naming the key.
    """
    meta_key = key + META_SUFFIX
    _, header, extras = decode_record(state_dict[meta_key], QUANTIZED_MAGIC, (QUANTIZED_VERSION,), meta_key)
    if set(header) != set(_META_FIELDS):
        raise ValueError(f"{meta_key}: expected the fields {list(_META_FIELDS)}, got {sorted(header)}")
    had = header["rowwise"], header["columnwise"]
    if not all(type(h) is bool for h in had) or not any(had):
        raise ValueError(f"{meta_key}: 'rowwise' and 'columnwise' must be bools, at least one true; got {had}")
    saved_quantizer = header["quantizer"]
    if saved_quantizer is not None and not (
            isinstance(saved_quantizer, dict) and set(saved_quantizer) == {"class", "config"}
            and isinstance(saved_quantizer["class"], str) and isinstance(saved_quantizer["config"], dict)):
        raise ValueError(f"{meta_key}: 'quantizer' must be null or {{'class': str, 'config': dict}}, "
                         f"got {saved_quantizer!r:.200}")
    if saved_quantizer is not None:  # an unknown class would silently requantize the weight with another one
        try:
            QUANTIZER_LOADERS["class"](saved_quantizer["class"])
        except ValueError as err:
            raise ValueError(f"{meta_key}: 'quantizer' class: {err}") from None
    try:
        scheme = get_scheme(header["scheme"])
    except (ValueError, TypeError) as err:
        raise ValueError(f"{meta_key}: {err}") from None
    _check_extras(extras, scheme, meta_key)
    rowwise, columnwise = _saved_usages(scheme, *had)
    names = {field: key + suffix for field, suffix in COMPONENT_SUFFIXES.items()}
    wanted = [f"{usage}_{part}" for usage, saved in (("rowwise", rowwise), ("columnwise", columnwise)) if saved
              for part in ("data", "scale_inv")]
    missing = [names[f] for f in wanted if names[f] not in state_dict]
    if missing:
        raise ValueError(f"{missing[0]}: missing, though {meta_key} says the tensor was saved with "
                         f"rowwise={had[0]}, columnwise={had[1]}")
    plain = {"scheme": header["scheme"], "shape": header["shape"], "nominal_dtype": header["nominal_dtype"],
             "quantizer": None, **{field: None for field in BUFFER_FIELDS}}
    plain.update({field: state_dict[names[field]] for field in wanted})
    device = plain[wanted[0]].device if isinstance(plain[wanted[0]], torch.Tensor) else None
    plain.update({name: t.to(device) for name, t in extras.items()})
    try:
        storage = rebuild_storage(plain)
    except ValueError as err:
        field = str(err).split(":", 1)[0]
        where = names[field] + str(err)[len(field):] if field in names else f"{meta_key}: {err}"
        raise ValueError(where) from None
    if had[1] and not storage.has_columnwise:
        storage.update_usage(columnwise_usage=True)
    for field in wanted:
        del state_dict[names[field]]
    del state_dict[meta_key]
    return storage, saved_quantizer


def _check_extras(extras: dict[str, torch.Tensor], scheme: Scheme, meta_key: str) -> None:
    """A record's tensors are some of the layout's own buffers (their values are the storage's to check)."""
    declared = [name for name in scheme.fields if name not in BUFFER_FIELDS]
    unknown = sorted(set(extras) - set(declared))
    if unknown:
        raise ValueError(f"{meta_key}: unknown tensors {unknown}; a {scheme.name} tensor keeps "
                         f"{list(declared) or 'none'} beside its data")
    if declared and not extras:
        raise ValueError(f"{meta_key}: a {scheme.name} tensor keeps {list(declared)} beside its data, and this "
                         "record holds none (engine saved NVFP4 weights without their amaxes before; such a "
                         "checkpoint cannot be read: save the model again)")
