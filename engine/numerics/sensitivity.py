"""Per-layer loss sensitivity: each engine layer quantized alone under a candidate recipe, the rest in high precision.

The statistic practitioners use to pick the layers to keep in higher precision: a layer's error is the
relative change of the loss, |loss(layer under candidate) - loss(high precision)| / |loss(high precision)|,
averaged over the batches (forward only, in `torch.no_grad`). Unlike the GEMM errors of the inspector,
which are about alike for every layer of a well-scaled model (NVFP4's element noise), it weighs each
layer's noise by how much the loss feels it. It runs on a copy of the model, so the model's scaling state
(delayed scaling's amax history), picks and gradients are untouched.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch

from engine import autocast
from engine.modules import FP8Module
from engine.recipes import Recipe


def _loss(model: torch.nn.Module, batches: list, loss_fn: Callable, recipe: Recipe) -> list[float]:
    with torch.no_grad(), autocast.fp8_autocast(recipe=recipe):
        return [float(loss_fn(model, batch)) for batch in batches]


def loss_sensitivity(model: torch.nn.Module, batches: list, candidates: list[Recipe],
                     loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]) -> dict[str, tuple[float, ...]]:
    """Per engine module name: the mean relative loss change with that module alone under each candidate."""
    work = copy.deepcopy(model)
    modules = [(name, m) for name, m in work.named_modules() if isinstance(m, FP8Module)]
    for _, m in modules:
        m.set_recipe_choice((None,))
    reference = _loss(work, batches, loss_fn, candidates[0])
    errors: dict[str, list[float]] = {name: [] for name, _ in modules}
    for candidate in candidates:
        for name, m in modules:
            m.set_recipe_choice((candidate,))
            losses = _loss(work, batches, loss_fn, candidate)
            m.set_recipe_choice((None,))
            changes = [abs(q - r) / abs(r) if r != 0 else abs(q - r) for q, r in zip(losses, reference)]
            mean = sum(changes) / len(changes)
            errors[name].append(math.inf if math.isnan(mean) else mean)
    return {name: tuple(e) for name, e in errors.items()}
