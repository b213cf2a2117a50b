"""The checkpoint a run of `python -m engine train` writes, read back: for `--resume` and `engine eval`.

It is a dict of plain data and tensors (`torch.load(..., weights_only=True)`, no pickled objects):
`model` (the state dict), `optimizer`, `step`, `recipe`, `seed` and `model_config`, the model's
shape as `GPTConfig` fields. A resumed run takes its model's shape from there, so the flags of the
run need not be repeated; checkpoints of older versions lack `model_config` and need them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from engine.train.model import GPTConfig

#: the GPTConfig fields `engine train` sets from flags
SHAPE_FLAGS = {"d_model": "--d-model", "n_layers": "--layers", "n_heads": "--heads", "seq_len": "--seq-len"}
#: the GPTConfig fields of the MoE flags: a checkpoint without model_config was dense (their defaults)
MOE_FLAGS = {"moe_experts": "--moe", "moe_top_k": "--top-k"}
#: what `train` reads from a checkpoint to resume
RESUME_KEYS = ("model", "optimizer", "step")


def load_run_checkpoint(path: str, what: str, keys: tuple[str, ...] = ("model",)) -> dict[str, Any]:
    """The checkpoint at `path`; a ValueError that starts with `what` (the argument) if there is none, it does not
    load without pickled objects, or a key of `keys` is missing."""
    if not Path(path).is_file():
        raise ValueError(f"{what}: no checkpoint at {path}")
    try:
        checkpoint = torch.load(path, weights_only=True)
    except Exception as err:  # torch raises RuntimeError, pickle.UnpicklingError, EOFError, ... for a bad file
        raise ValueError(f"{what}: cannot load {path} as a checkpoint of `python -m engine train`: "
                         f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None
    missing = [k for k in keys if not isinstance(checkpoint, dict) or k not in checkpoint]
    if missing:
        raise ValueError(f"{what}: {path} is not a checkpoint of `python -m engine train` (no {missing[0]!r} key)")
    return checkpoint


def saved_model_config(checkpoint: dict[str, Any], path: str) -> GPTConfig | None:
    """The checkpoint's `model_config` (None in checkpoints of older versions); ValueError if it is not a valid one."""
    saved = checkpoint.get("model_config")
    if saved is None:
        return None
    try:
        return GPTConfig.model_validate(saved)
    except ValidationError as err:
        raise ValueError(f"--resume: {path}: model_config: {_first_error(err)}") from None


def model_config_for_resume(checkpoint: dict[str, Any], path: str, given: dict[str, int | None]) -> GPTConfig:
    """The model shape to resume `checkpoint` with: its `model_config`, which a given flag (a GPTConfig field in
    `given`, None when not given) may repeat but not contradict. An older checkpoint without it needs every
    flag of SHAPE_FLAGS. The state dict must fit the shape (width, positions, blocks)."""
    saved = saved_model_config(checkpoint, path)
    if saved is None:
        missing = [flag for field, flag in SHAPE_FLAGS.items() if given.get(field) is None]
        if missing:
            raise ValueError(f"--resume: {path} holds no model_config (a checkpoint of an older engine train): "
                             f"pass the run's {', '.join(missing)} (its model's shape)")
        config = GPTConfig(**{field: given[field] for field in SHAPE_FLAGS})
    else:
        for field, flag in {**SHAPE_FLAGS, **MOE_FLAGS}.items():
            value, kept = given.get(field), getattr(saved, field)
            if value is not None and value != kept:
                raise ValueError(f"{flag} {value}: {path} holds a model with {flag} {kept}, and a resumed run keeps "
                                 f"the checkpoint's model; leave {flag} out (or pass {kept})")
        config = saved
    _check_fits(checkpoint["model"], config, path)
    return config


def _check_fits(state: dict[str, Any], config: GPTConfig, path: str) -> None:
    """The state dict's position embedding and blocks against the config (the heads leave no trace in shapes)."""
    pos = state.get("pos_emb.weight")
    if not isinstance(pos, torch.Tensor) or tuple(pos.shape) != (config.seq_len, config.d_model):
        got = tuple(pos.shape) if isinstance(pos, torch.Tensor) else pos
        raise ValueError(f"--resume: {path}: pos_emb.weight: expected shape ({config.seq_len}, {config.d_model}) "
                         f"for --seq-len {config.seq_len} --d-model {config.d_model}, got {got}")
    blocks = {int(key.split(".")[1]) for key in state if key.startswith("blocks.")}
    if blocks != set(range(config.n_layers)):
        raise ValueError(f"--resume: {path}: the model has {len(blocks)} blocks, not --layers {config.n_layers}")


def _first_error(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(map(str, first["loc"]))
    return f"{where + ': ' if where else ''}{first['msg']}, got {first['input']!r}"
