"""Per-GEMM gradient sensitivity: one GEMM (fprop, dgrad or wgrad) of one engine layer under a candidate recipe,
every other GEMM of the model in high precision, and the error of the gradient training then follows.

The loss sensitivity (sensitivity.py) runs forward only, so it cannot see the backward GEMMs (two thirds of the
FLOPs), and it weighs a forward's noise by the loss, not by what training follows: the gradient. Here each
(layer, GEMM) runs a forward and a backward with that GEMM alone quantized (`Debug(candidate,
high_precision=<the other two>)`; both GEMMs of a LayerNormMLP), and its error is the relative error of the
Adam-normalized gradient:

    sqrt( sum_t numel_t * (||g_t - g_t,hp|| / ||g_t,hp||)^2 / sum_t numel_t )

over the parameter tensors t (Adam scales each element by its own running RMS, about alike within a tensor, so
a tensor's relative error is what its update feels, and a tensor weighs by its elements), averaged over the
batches. A dgrad error reaches every earlier layer's gradient, a wgrad error only its own weight's, a fprop
error the loss and every gradient. Each measurement runs on its own copy of the model (the model's scaling state,
picks and gradients are untouched), with torch's generator seeded with 0 for it (stochastic rounding's streams
are drawn from it when the layer's state is made; the caller's generator is restored): the numbers repeat.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch

from engine import autocast
from engine.modules import FP8Module
from engine.recipes import Debug, Recipe

#: the GEMMs of a layer, each a third of its FLOPs
GEMMS = ("fprop", "dgrad", "wgrad")


def alone(candidate: Recipe, gemm: str) -> Recipe:
    """`candidate` for `gemm` only, the layer's other GEMMs in high precision (a Debug candidate keeps its
    switches on `gemm`; its dumps are left out)."""
    others = tuple(g for g in GEMMS if g != gemm)
    if not isinstance(candidate, Debug):
        return Debug(candidate, high_precision=others)
    return Debug(candidate.recipe, high_precision=tuple(g for g in GEMMS if g in others + candidate.high_precision),
                 fake_quantize=tuple(g for g in candidate.fake_quantize if g == gemm),
                 current_scaling=tuple(g for g in candidate.current_scaling if g == gemm))


def _gradients(model: torch.nn.Module, batch: Any, loss_fn: Callable, recipe: Recipe) -> list[torch.Tensor | None]:
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    with autocast.fp8_autocast(recipe=recipe):
        loss_fn(model, batch).backward()
    return [None if p.grad is None else p.grad.detach().float().clone() for p in params]


def gradient_error(grads: list[torch.Tensor | None], reference: list[torch.Tensor | None]) -> float:
    """The relative error of the Adam-normalized gradient (module docstring); tensors without a gradient in the
    reference, or with a zero one, are left out."""
    weighted = count = 0.0
    for g, ref in zip(grads, reference):
        if ref is None:
            continue
        norm = float(ref.norm())
        if norm == 0:
            continue
        diff = float((ref if g is None else g - ref).norm())
        weighted += ref.numel() * (diff / norm) ** 2
        count += ref.numel()
    return math.sqrt(weighted / count) if count else 0.0


def gradient_sensitivity(model: torch.nn.Module, batches: list, candidates: list[Recipe],
                         loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
                         ) -> dict[tuple[str, str], tuple[float, ...]]:
    """Per (engine module name, GEMM): the mean gradient error with that GEMM alone under each candidate."""
    base = copy.deepcopy(model)
    names = [name for name, m in base.named_modules() if isinstance(m, FP8Module)]
    for name in names:
        base.get_submodule(name).set_recipe_choice((None,))
    reference = [_gradients(copy.deepcopy(base), batch, loss_fn, candidates[0]) for batch in batches]
    errors: dict[tuple[str, str], list[float]] = {(name, g): [] for name in names for g in GEMMS}
    for candidate in candidates:
        for name in names:
            for gemm in GEMMS:
                work = copy.deepcopy(base)
                work.get_submodule(name).set_recipe_choice((alone(candidate, gemm),))
                with torch.random.fork_rng(devices=[]):  # stochastic rounding's streams: alike for every measurement
                    torch.manual_seed(0)
                    found = [gradient_error(_gradients(work, batch, loss_fn, candidate), ref)
                             for batch, ref in zip(batches, reference)]
                mean = sum(found) / len(found)
                errors[(name, gemm)].append(math.inf if math.isnan(mean) else mean)
    return {key: tuple(e) for key, e in errors.items()}
