"""`torch.distributed.checkpoint` into engine modules that have not run: `_extra_state` sized as saved.

An engine module's `_extra_state` is a uint8 record whose length depends on what the module holds (its
recipe, delayed-scaling history, NVFP4 counters, its pick of a per-layer RecipeMap); a module that has not
run has a shorter one, or none. `dcp.load` fills the tensors of the state dict it is given in place, by
key: it skips the keys that state dict lacks (a fresh model's modules lose their saved picks and scaling
state, silently) and refuses a tensor of another size. `load_model_state_dict(model, checkpoint_id)`
does `get_model_state_dict` / `dcp.load` / `set_model_state_dict` with every engine module's
`_extra_state` given the size the checkpoint's metadata records; a module the checkpoint holds none for
keeps its own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.checks import check_instance
from engine.modules.base import FP8Module
from engine.modules.saving import EXTRA_STATE_KEY


def extra_state_keys(model: nn.Module) -> list[str]:
    """The state-dict key of every engine module's `_extra_state`."""
    return [f"{name}.{EXTRA_STATE_KEY}" if name else EXTRA_STATE_KEY
            for name, module in model.named_modules() if isinstance(module, FP8Module)]


def with_saved_extra_states(model: nn.Module, state_dict: dict[str, Any],
                            metadata: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the state dict for `dcp.load`, the module's own `_extra_state` entries it leaves out): each engine
    module's `_extra_state` an empty uint8 tensor of the saved size where the checkpoint (its `Metadata`) holds
    one, else left out of the load and kept as the module has it."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = metadata.state_dict_metadata
    to_load, kept = dict(state_dict), {}
    for key in extra_state_keys(model):
        entry = saved.get(key)
        if isinstance(entry, TensorStorageMetadata):
            to_load[key] = torch.empty(entry.size, dtype=entry.properties.dtype or torch.uint8)
        elif key in to_load:
            kept[key] = to_load.pop(key)
    return to_load, kept


def load_model_state_dict(model: nn.Module, checkpoint_id: Any = None, *, storage_reader: Any = None,
                          options: Any = None) -> None:
    """Load a `dcp.save` of a model's state dict into `model` (FSDP2-sharded or not, any number of ranks), its
    engine modules' `_extra_state` (recipe picks, scaling state) included whether or not they have run.
    `checkpoint_id` / `storage_reader` as `dcp.load` takes them; `options`: `StateDictOptions`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    check_instance(model, nn.Module, "model", "a torch.nn.Module")
    if storage_reader is None:
        if checkpoint_id is None:
            raise ValueError("checkpoint_id: expected the checkpoint's path (or a storage_reader), got None")
        storage_reader = dcp.FileSystemReader(checkpoint_id)
    state, kept = with_saved_extra_states(model, get_model_state_dict(model, options=options),
                                          storage_reader.read_metadata())
    dcp.load(state, checkpoint_id=checkpoint_id, storage_reader=storage_reader)
    set_model_state_dict(model, {**state, **kept}, options=options)
