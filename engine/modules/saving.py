"""What an engine module saves: its `_extra_state` as bytes, and a state dict a plain model loads.

`_extra_state` (format version 2) is a record (`engine.tensors.records`: magic, version,
a JSON header, raw little-endian tensor bytes) with magic b"ENGXSTAT":

    header  {"recipe": {"name": ..., "fields": {...}},     # engine.recipes.recipe_to_plain
             "tensors": [["forward.scale", "float32", [n]],
                         ["forward.amax_history", "float32", [history_len, n]],
                         ["backward.scale", ...], ["backward.amax_history", ...]]}

The tensors are the delayed-scaling state in Transformer Engine's column layout (forward
n = 3 per GEMM, backward n = 2 per GEMM), or NVFP4's stochastic-rounding counters
("backward.rng_counter", int64 [gemms, 2]); other recipes have none. A module that has run
(or holds FP8 weights) saves its recipe whatever the recipe, as Transformer Engine does, so
that loading under another recipe can say so; a module that never ran saves no
`_extra_state` key at all, so a converted model that never ran FP8 loads strictly into the
original torch model. Version 1 (checkpoints from before) was a Python dict
{"version": 1, "recipe": ..., "forward": {...}, "backward": {...}}; it still loads.

Both versions are read into one plain form, {"recipe": ..., "forward": {...}, "backward": {...}},
which the module checks against its recipe at load time.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping

import torch

from engine.tensors import QuantizedTensor
from engine.tensors.records import decode_record, encode_record, is_record
from engine.tensors.serialization import META_SUFFIX, QUANTIZED_MAGIC, pop_components

EXTRA_STATE_MAGIC = b"ENGXSTAT"
EXTRA_STATE_VERSION = 2
DICT_VERSION = 1  # the Python dict of checkpoints written before version 2
EXTRA_STATE_KEY = "_extra_state"
DIRECTIONS = ("forward", "backward")
STATE_TENSORS = ("scale", "amax_history", "rng_counter")  # rng_counter: NVFP4's stochastic rounding
CHOICE_KEY = "choice"  # a module's pick from a per-layer recipe map (engine.set_recipe_map)
_WHERE = "_extra_state"


def encode_extra_state(state: dict[str, Any]) -> torch.Tensor:
    """The plain form {"recipe": plain | None, "choice"?: plain, "forward"?: {name: tensor}, "backward"?: {...}}
    as a record. "choice" is the module's own pick of a per-layer recipe map (a recipe's plain form, or
    {"high_precision": true}); a module without one writes no "choice" key."""
    unknown = sorted(set(state) - {"recipe", CHOICE_KEY, *DIRECTIONS})
    if unknown:
        raise ValueError(f"{_WHERE}: unknown keys {unknown}")
    tensors = {f"{direction}.{name}": t for direction in DIRECTIONS if direction in state
               for name, t in state[direction].items()}
    header = {k: state[k] for k in ("recipe", CHOICE_KEY) if k in state}
    return encode_record(EXTRA_STATE_MAGIC, EXTRA_STATE_VERSION, header, tensors)


def read_extra_state(value: Any) -> dict[str, Any] | None:
    """A saved `_extra_state` of either version in the plain form; None when it holds nothing (None, an empty
    tensor as Transformer Engine saves for a module that never ran FP8, or a recipe of None).

    Only the container is checked here (ValueError naming the key); the recipe and its state are
    checked by the module, against its own number of GEMMs.
    """
    if value is None or (isinstance(value, torch.Tensor) and value.numel() == 0):
        return None
    if isinstance(value, dict):
        state = _read_dict(value)
    elif isinstance(value, torch.Tensor):
        state = _read_record(value)
    else:
        raise ValueError(f"{_WHERE}: expected a uint8 tensor (an engine record) or, from older checkpoints, a dict "
                         f"with version {DICT_VERSION}; got {type(value).__name__} {value!r:.200}")
    return None if state["recipe"] is None and CHOICE_KEY not in state else state


def _read_dict(value: dict) -> dict[str, Any]:
    if value.get("version") != DICT_VERSION or "recipe" not in value:
        raise ValueError(f"{_WHERE}: expected a dict with version {DICT_VERSION} and a recipe (or a uint8 tensor), "
                         f"got {value!r:.200}")
    unknown = set(value) - {"version", "recipe", *DIRECTIONS}
    if unknown:
        raise ValueError(f"{_WHERE}: unknown keys {sorted(unknown)}")
    return {k: v for k, v in value.items() if k != "version"}


def _read_record(value: torch.Tensor) -> dict[str, Any]:
    _, header, tensors = decode_record(value, EXTRA_STATE_MAGIC, (EXTRA_STATE_VERSION,), _WHERE)
    unknown = set(header) - {"recipe", CHOICE_KEY}
    if unknown or "recipe" not in header:
        raise ValueError(f"{_WHERE}: expected a header with a 'recipe', 'tensors' and maybe a '{CHOICE_KEY}', got the "
                         f"keys {sorted(header)}")
    state: dict[str, Any] = {k: header[k] for k in ("recipe", CHOICE_KEY) if k in header}
    for name, t in tensors.items():
        direction, _, part = name.partition(".")
        if direction not in DIRECTIONS or part not in STATE_TENSORS:
            raise ValueError(f"{_WHERE}: unknown tensor {name!r}; expected some of "
                             f"{[f'{d}.{p}' for d in DIRECTIONS for p in STATE_TENSORS]}")
        state.setdefault(direction, {})[part] = t
    if state["recipe"] is None and any(d in state for d in DIRECTIONS):
        raise ValueError(f"{_WHERE}: scaling state {sorted(tensors)} without a recipe")
    return state


def is_engine_extra_state(value: Any) -> bool:
    """`value` is what an engine module saves as `_extra_state` (either version, or an empty tensor)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 0 or is_record(value, EXTRA_STATE_MAGIC)
    return isinstance(value, dict) and value.get("version") == DICT_VERSION and "recipe" in value


def plain_state_dict(source: torch.nn.Module | Mapping[str, Any]) -> OrderedDict[str, Any]:
    """A state dict the original (unconverted) torch model loads with `strict=True`.

    From a model or a state dict of one: engine's `_extra_state` entries are dropped and FP8
    weights (component keys, or QuantizedTensor objects of older checkpoints) are dequantized to
    their nominal dtype under the parameter's own key. Everything else is passed on as it is.
    """
    state = source.state_dict() if isinstance(source, torch.nn.Module) else source
    if not isinstance(state, Mapping):
        raise TypeError(f"source: expected a torch.nn.Module or a state dict (a mapping), got {type(source).__name__}")
    pending = OrderedDict(state)
    quantized = [key[: -len(META_SUFFIX)] for key, value in state.items()
                 if key.endswith(META_SUFFIX) and is_record(value, QUANTIZED_MAGIC)]
    rebuilt = {key: pop_components(pending, key)[0] for key in quantized}
    out: OrderedDict[str, Any] = OrderedDict()
    for key, value in state.items():  # in the order of the source; a weight where its data (or metadata) was
        if key in rebuilt:
            out[key] = rebuilt.pop(key).dequantize()
        elif key.endswith(META_SUFFIX) and key[: -len(META_SUFFIX)] in rebuilt:
            base = key[: -len(META_SUFFIX)]
            out[base] = rebuilt.pop(base).dequantize()
        elif key not in pending:
            continue  # a component of a rebuilt weight
        elif key.rsplit(".", 1)[-1] == EXTRA_STATE_KEY and is_engine_extra_state(value):
            continue
        elif isinstance(value, QuantizedTensor):
            out[key] = value.dequantize().detach()
        else:
            out[key] = value
    return out
