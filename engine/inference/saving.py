"""Quantized weights in state dicts as plain tensors (torch.save with weights_only=True, safetensors).

A module whose weight `quantize_` swapped saves, instead of the weight (`weight` here; a LayerNormMLP's
`fc1_weight` and `fc2_weight` alike, e.g. `fc1_weight_scale`, `fc1_weight_qformat`):

    <prefix>weight             the main part ("data": int8 [N, K]; int4 packed uint8 [N16, K/2];
                               FP8 bytes, MX or NVFP4 codes as uint8)
    <prefix>weight_<part>      each other part (scale, scale_and_zero, scale_inv, amax)
    <prefix>weight_qformat     a uint8 record (engine.tensors.records, magic ENGQWGHT, version 2):
                               {"config": config.to_plain(), "shape": [N, K], "dtype": "bfloat16",
                               "parts": [names]}

The parts are the weight's storage (`QuantizedWeight.storage`, a storage of the config's scheme) as the
format saves it (`WeightFormat.to_parts` / `from_parts`). Loading (`load_state_dict` into a model quantized
the same way) checks the record, the config (it must equal the model's), every part's shape and dtype and
that it is dense, and the values of the scales (the storage's `check_values`: finite scales > 0 and finite
zero points, E8M0 and E4M3 codes as the storage checks them; NVFP4's amax finite; int4's padding as
quantize_ makes it), then copies the storage in; each error names the state-dict key it came from. A plain (unquantized) `weight` without a record is quantized with the model's config
as it is copied in. Never a pickle.

Version 2 changed Int4WeightOnly's "data" from torch's packed CPU layout to engine's (two codes a
byte along K, low nibble first; the shapes are the same): a version-1 record of an int4 weight is
refused (re-quantize from the float weights); version-1 records of the other configs load as before.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.inference.configs import Int4WeightOnly, config_from_plain
from engine.inference.formats import format_of
from engine.inference.weight import HIGH_PRECISION, QuantizedWeight
from engine.tensors.records import decode_record, encode_record

MAGIC = b"ENGQWGHT"
VERSION = 2
READS = (1, 2)
RECORD_SUFFIX = "_qformat"
_FIELDS = {"config", "shape", "dtype", "parts"}


def part_key(key: str, part: str) -> str:
    return key if part == "data" else f"{key}_{part}"


def to_plain_tensors(key: str, w: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The state-dict entries of a quantized weight saved under `key` (no two share memory)."""
    parts = w.plain_parts()
    out = {part_key(key, name): t.detach().contiguous() for name, t in parts.items()}
    header = {"config": w.config.to_plain(), "shape": list(w.weight_shape),
              "dtype": str(w.dtype).removeprefix("torch."), "parts": list(parts)}
    out[key + RECORD_SUFFIX] = encode_record(MAGIC, VERSION, header, {})
    return out


def save_hook(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """state_dict post-hook: each QuantizedWeight parameter becomes its plain entries (live Parameters, asked
    for with keep_vars=True, stay)."""
    for name, param in module._parameters.items():
        key = prefix + name
        value = state_dict.get(key)
        if isinstance(param, QuantizedWeight) and isinstance(value, QuantizedWeight) \
                and not isinstance(value, torch.nn.Parameter):
            entries = to_plain_tensors(key, value)
            clash = sorted(k for k in entries if k in state_dict and k != key)
            if clash:
                raise ValueError(f"{clash[0]}: the quantized weight {key} is saved under this key, which another "
                                 "entry of the state dict already has")
            del state_dict[key]
            state_dict.update(entries)


def load_hook(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: Any, strict: bool,
              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    """load_state_dict pre-hook: a saved quantized weight's entries become one QuantizedWeight under its key."""
    for name, param in module._parameters.items():
        key = prefix + name
        if not isinstance(param, QuantizedWeight) or key + RECORD_SUFFIX not in state_dict:
            continue
        state_dict[key] = from_plain_tensors(state_dict, key, param)


def from_plain_tensors(state_dict: dict, key: str, like: QuantizedWeight) -> QuantizedWeight:
    """Pop `key`'s entries from state_dict and rebuild the weight, checked against `like` (the model's)."""
    where = key + RECORD_SUFFIX
    version, header, tensors = decode_record(state_dict[where], MAGIC, READS, where)
    if tensors or set(header) != _FIELDS:
        raise ValueError(f"{where}: expected the fields {sorted(_FIELDS)} and no tensors, got {sorted(header)}")
    config = config_from_plain(header["config"], f"{where}['config']")
    if version == 1 and isinstance(config, Int4WeightOnly):
        raise ValueError(f"{where}: an Int4WeightOnly weight saved in torch's packed int4 layout (record version 1); "
                         "this engine stores int4 codes in its own layout (version 2): re-quantize the model from "
                         "its float weights")
    if config != like.config:
        raise ValueError(f"{where}: the weight was saved quantized with {config!r}; this model's {key} is "
                         f"quantized with {like.config!r}: quantize the model with the saved config")
    shape = header["shape"]
    if not (isinstance(shape, list) and len(shape) == 2 and all(type(s) is int for s in shape)) \
            or tuple(shape) != like.weight_shape:
        raise ValueError(f"{where}: expected shape {list(like.weight_shape)}, got {shape!r}")
    dtype = getattr(torch, header["dtype"], None) if isinstance(header["dtype"], str) else None
    if dtype not in HIGH_PRECISION:
        raise ValueError(f"{where}: 'dtype' must name float32, bfloat16 or float16, got {header['dtype']!r}")
    specs = like.fmt.part_specs(like.weight_shape)
    if header["parts"] != list(specs):
        raise ValueError(f"{where}: expected the parts {sorted(specs)}, got {header['parts']!r}")
    parts = {}
    for part in header["parts"]:
        pkey = part_key(key, part)
        t = state_dict.get(pkey)
        size, dtypes = specs[part]
        if type(t) is not torch.Tensor:
            raise ValueError(f"{pkey}: missing or not a plain tensor (got {type(t).__name__}), though {where} lists "
                             f"the part {part!r}")
        if tuple(t.shape) != tuple(size) or t.dtype not in dtypes:
            raise ValueError(f"{pkey}: expected {' or '.join(map(str, dtypes))} of shape {tuple(size)}, got "
                             f"{t.dtype} {tuple(t.shape)}")
        if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            raise ValueError(f"{pkey}: expected a dense tensor (contiguous, its whole storage)")
        parts[part] = t
    fmt = format_of(config)  # the weight's own (formats hold quantizers, never shared)
    storage = fmt.from_parts(parts, like.weight_shape, dtype)
    try:
        fmt.check(storage, parts)
    except ValueError as err:  # the format names the part: name its key
        part, _, rest = str(err).partition(": ")
        raise ValueError(f"{part_key(key, part)}: {rest}" if part in parts else f"{where}: {err}") from None
    for part in header["parts"]:
        if part != "data":
            del state_dict[part_key(key, part)]
    del state_dict[where]
    return QuantizedWeight(storage, config, dtype, fmt=fmt, operands=fmt.prepare(parts))
