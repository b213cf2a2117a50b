"""engine.recommend: a per-layer RecipeMap picked from the inspector's measurements.

    recipe_map = engine.recommend(model, batches, candidates=[NVFP4BlockScaling(), MXFP8BlockScaling()],
                                  budget=0.2, threshold=0.15)
    engine.set_recipe_map(model, recipe_map)

The model runs each batch in high precision (forward and backward, gradients restored afterwards) under
`engine.inspect(model, what_if=candidate)`, once per candidate. A layer's error under a candidate is the
largest relative error ||out - ref|| / ||ref|| of its GEMMs (fprop, dgrad, wgrad; both GEMMs of a
LayerNormMLP) against the same GEMMs in high precision, over the batches (the inspector's `rel_error`;
for wgrad, 1 / the grad-to-noise ratio). Candidates go from the lowest precision up; each layer gets the
first one whose error is under `threshold`, else None (high precision). Then the budget: the share of
GEMM FLOPs not in the first candidate (a later one or None) may be at most `budget`: going from the largest
error under the first candidate down, a promoted layer keeps its promotion if its FLOPs still fit, else
goes back to the first candidate. The table it decided from is printed (`show=False`: not).

`statistic="loss"` measures instead each layer's loss sensitivity (engine/numerics/sensitivity.py): the
relative change of the loss with that layer alone under the candidate, the others in high precision,
averaged over the batches; `threshold` is then a relative loss change (e.g. 0.002).

`statistic="grad"` decides per layer AND per GEMM (engine/numerics/grad_sensitivity.py): each (layer, GEMM)
- fprop, dgrad, wgrad, a third of the layer's FLOPs each - is measured alone under the candidate by the
relative error of the Adam-normalized gradient it causes, and goes to high precision if over `threshold`
(within the budget, largest first); a layer with some GEMMs kept gets `Debug(candidate, high_precision=those)`.
It takes one candidate (the choice per GEMM is that candidate or high precision).

With `switch_at=F` it returns a `RecipeSchedule` instead: the map for the first F of the run's steps, then
`switch_to` (default None, high precision) for every layer the map does not already keep in high precision,
the late switch of the NVFP4 paper (arXiv 2509.25149, appendix D). The table then says which share of the
run's GEMM FLOPs stays in 4-bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from engine import autocast
from engine.modules import FP8Module
from engine.numerics.grad_sensitivity import GEMMS, gradient_sensitivity
from engine.numerics.sensitivity import loss_sensitivity
from engine.numerics.session import inspect
from engine.recipes import Debug, Recipe, RecipeMap, RecipeSchedule
from engine.recipes.schedule import four_bit_gemms


@dataclass(frozen=True)
class Row:
    """One layer (or one GEMM of a layer: `gemm`) of the decision: its share of GEMM FLOPs, its error per
    candidate, its pick and why."""

    layer: str
    gemm: str  # "all" (the statistic is per layer) or the GEMM the row decides for
    flop_share: float
    errors: tuple[float, ...]
    pick: Recipe | None
    reason: str


#: the statistics recommend can decide from, and what the table calls them
STATISTICS = {"gemm": "max relative GEMM error (fprop, dgrad, wgrad)",
              "loss": "relative loss change with the layer alone quantized (mean over the batches)",
              "grad": "relative error of the Adam-normalized gradient with the GEMM alone quantized (mean over the "
                      "batches)"}


def default_loss(output: Any) -> torch.Tensor:
    """A scalar to backpropagate: the output itself if it is one, else the mean square of the output."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    if isinstance(output, torch.Tensor):
        return output.float().square().mean()
    raise TypeError(f"loss_fn: the model returned a {type(output).__name__}; pass loss_fn(model, batch) -> a "
                    "scalar tensor")


def _call(model: torch.nn.Module, batch: Any) -> Any:
    return model(*batch) if isinstance(batch, tuple) else model(batch)


def _checked(model: Any, batches: Any, candidates: Any, budget: Any, threshold: Any) -> tuple[list, list]:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    modules = [(name, m) for name, m in model.named_modules() if isinstance(m, FP8Module)]
    if not modules:
        raise ValueError("model: expected a model with engine layers (engine.Linear, ...; see engine.convert), "
                         "it has none")
    if isinstance(batches, (torch.Tensor, str)) or not isinstance(batches, Iterable):
        raise TypeError(f"batches: expected an iterable of batches (a list of inputs), got {type(batches).__name__}")
    batches = list(batches)
    if not batches:
        raise ValueError("batches: expected at least one batch, got none")
    if not isinstance(candidates, (list, tuple)) or not candidates:
        raise ValueError(f"candidates: expected a non-empty list of engine recipes, lowest precision first, got "
                         f"{candidates!r:.200}")
    for i, c in enumerate(candidates):
        if not isinstance(c, Recipe):
            raise TypeError(f"candidates[{i}]: expected an engine recipe (None, high precision, is always the last "
                            f"choice), got {type(c).__name__}")
    if len(set(candidates)) != len(candidates):
        raise ValueError("candidates: a recipe is listed twice")
    for value, name, low, high in ((budget, "budget", 0.0, 1.0), (threshold, "threshold", 0.0, math.inf)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high \
                or math.isinf(value) or (name == "threshold" and value == 0):
            want = "a share of GEMM FLOPs in [0, 1]" if name == "budget" else "a finite relative error > 0"
            raise ValueError(f"{name}: expected {want}, got {value!r}")
    return modules, batches


def _measure(model: torch.nn.Module, batches: list, candidate: Recipe, loss_fn: Callable) -> list[dict]:
    """The inspector's records of every batch run in high precision with `candidate` as the what-if."""
    saved = {p: p.grad for p in model.parameters()}
    try:
        with inspect(model, what_if=candidate) as inspector, autocast.fp8_autocast(enabled=False):
            for batch in batches:
                for p in saved:
                    p.grad = None
                loss_fn(model, batch).backward()
    finally:
        for p, grad in saved.items():
            p.grad = grad
    return inspector.records


def _gemm_flops(model: torch.nn.Module, modules: list, records: list[dict]) -> dict[str, float]:
    """Each module's GEMM FLOPs over the batches: 3 GEMMs x 2 M N K per call, M K from its fprop input's numel."""
    label_of = {}
    for name, m in modules:
        for gemm, weight_name in enumerate(m.weight_names):
            label = name if m.num_gemms == 1 else f"{name}.{m.gemm_names[gemm]}"
            label_of[label] = (name, getattr(m, weight_name).shape[0])
    flops = {name: 0.0 for name, _ in modules}
    for r in records:
        if r["kind"] == "operand" and r.get("operand") == "fprop_input" and r.get("usage") == "rowwise":
            name, n = label_of[r["layer"]]
            flops[name] += 6.0 * r["numel"] * n
    return flops


def _errors(modules: list, records: list[dict]) -> dict[str, float]:
    """Each module's largest what-if relative GEMM error (over its GEMMs and the batches)."""
    names = [name for name, _ in modules]
    worst = {name: 0.0 for name in names}
    for r in records:
        if r["kind"] != "gemm" or r["source"] != "what_if":
            continue
        layer = r["layer"]
        name = layer if layer in worst else layer.rsplit(".", 1)[0]
        worst[name] = max(worst[name], r["rel_error"]) if not math.isnan(r["rel_error"]) else math.inf
    return worst


def recommend(model: torch.nn.Module, batches: Iterable[Any], candidates: list[Recipe], *, budget: float = 0.2,
              threshold: float = 0.15, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
              show: bool = True, switch_at: float | None = None,
              switch_to: Recipe | None = None,
              statistic: Literal["gemm", "loss", "grad"] = "gemm") -> RecipeMap | RecipeSchedule:
    """A RecipeMap with one rule per engine module of `model` (module docstring). `batches`: inputs for
    `model(batch)` (`model(*batch)` for a tuple); `loss_fn(model, batch)`: the scalar to backpropagate (default:
    the output if scalar, else its mean square). `show`: print the table. `switch_at`: a fraction in (0, 1] of
    the run's steps; the map then comes in a RecipeSchedule that switches to `switch_to` there. `statistic`:
    "gemm" (the largest relative GEMM error), "loss" (the relative loss change, one layer at a time) or "grad"
    (the gradient error, one GEMM of one layer at a time; picks per GEMM)."""
    modules, batches = _checked(model, batches, candidates, budget, threshold)
    _check_switch(switch_at, switch_to)
    if not isinstance(statistic, str) or statistic not in STATISTICS:
        raise ValueError(f"statistic: expected one of {', '.join(map(repr, STATISTICS))} (the largest relative GEMM "
                         f"error, the loss change with the layer alone quantized, or the gradient error with one "
                         f"GEMM alone quantized), got {statistic!r:.100}")
    if statistic == "grad" and len(candidates) > 1:
        raise ValueError(f"candidates: statistic='grad' picks per GEMM between one candidate and high precision; "
                         f"give one candidate, got {len(candidates)} ({', '.join(c.name for c in candidates)})")
    loss_fn = loss_fn or (lambda m, b: default_loss(_call(m, b)))
    if statistic == "gemm":
        measured = [_measure(model, batches, c, loss_fn) for c in candidates]
        per_candidate = [_errors(modules, records) for records in measured]
        errors = {name: tuple(found[name] for found in per_candidate) for name, _ in modules}
    else:
        measured = [_measure(model, batches, candidates[0], loss_fn)]  # for the FLOPs
        if statistic == "loss":
            errors = loss_sensitivity(model, batches, candidates, loss_fn)
        else:
            errors = gradient_sensitivity(model, batches, candidates, loss_fn)
    flops = _gemm_flops(model, modules, measured[0])
    total = sum(flops.values()) or 1.0
    items = list(errors) if statistic == "grad" else [name for name, _ in modules]
    share = {item: flops[item[0]] / total / len(GEMMS) if statistic == "grad" else flops[item] / total
             for item in items}
    picks: dict[Any, Recipe | None] = {}
    reasons: dict[Any, str] = {}
    for item in items:
        under = [i for i, e in enumerate(errors[item]) if e < threshold]
        picks[item] = candidates[under[0]] if under else None
        reasons[item] = "under threshold" if under and under[0] == 0 else (
            f"{candidates[0].name} over threshold" if under else "every candidate over threshold")
    spent = 0.0  # the budget: the largest excesses keep their promotion while their FLOPs fit
    for item in sorted((i for i in items if picks[i] is not candidates[0]), key=lambda i: (-errors[i][0], str(i))):
        if spent + share[item] <= budget * (1 + 1e-9):
            spent += share[item]
        else:
            picks[item], reasons[item] = candidates[0], "over threshold, over the FLOP budget"

    rows = [Row(*(item if statistic == "grad" else (item, "all")), share[item], errors[item], picks[item],
                reasons[item]) for item in items]
    layer_picks = {name: _layer_pick([r for r in rows if r.layer == name], candidates[0]) for name, _ in modules}
    recipe_map = RecipeMap(rules=list(layer_picks.items()))
    schedule = None if switch_at is None else RecipeSchedule(recipe_map=recipe_map, switch_at=switch_at,
                                                              switch_to=switch_to)
    if show:
        print(format_table(rows, candidates, threshold, budget, spent, statistic))
        if schedule is not None:
            print(describe_switch({name: flops[name] / total for name, _ in modules}, layer_picks, schedule))
    return recipe_map if schedule is None else schedule


def _layer_pick(rows: list[Row], first: Recipe) -> Recipe | None:
    """A layer's recipe from its rows: the one row's pick, or from per-GEMM rows `first` with the GEMMs kept in
    high precision switched there by `Debug` (None: all three kept)."""
    if len(rows) == 1 and rows[0].gemm == "all":
        return rows[0].pick
    kept = tuple(r.gemm for r in rows if r.pick is None)
    if not kept:
        return first
    return None if len(kept) == len(GEMMS) else Debug(first, high_precision=kept)


def _check_switch(switch_at: Any, switch_to: Any) -> None:
    if switch_at is not None and (isinstance(switch_at, bool) or not isinstance(switch_at, (int, float))
                                  or not 0 < switch_at <= 1):
        raise ValueError(f"switch_at: expected None or a fraction in (0, 1] of the run's steps (e.g. 0.9: the last "
                         f"10% in higher precision), got {switch_at!r}")
    if switch_to is not None and not isinstance(switch_to, Recipe):
        raise TypeError(f"switch_to: expected an engine recipe or None (high precision), got {type(switch_to).__name__}")
    if switch_to is not None and switch_at is None:
        raise ValueError("switch_to: given without switch_at; pass switch_at=F (a fraction of the run's steps)")


def four_bit_share(flop_shares: dict[str, float], picks: dict[str, Recipe | None]) -> float:
    """The share of the layers' GEMM FLOPs (3 alike GEMMs a call) on 4-bit operands under `picks`."""
    return sum(share * sum(four_bit_gemms(picks[layer]).values()) / 3 for layer, share in flop_shares.items())


def describe_switch(flop_shares: dict[str, float], picks: dict[str, Recipe | None], schedule: RecipeSchedule) -> str:
    """One line: the switch, and the share of the run's GEMM FLOPs in 4-bit before, after and over the run."""
    before = four_bit_share(flop_shares, picks)
    late = schedule.late_map()
    after = four_bit_share(flop_shares, {layer: late.recipe_for(layer) for layer in flop_shares})
    to = "high precision" if schedule.switch_to is None else schedule.switch_to.name
    run = schedule.switch_at * before + (1 - schedule.switch_at) * after
    return (f"late switch: at {100 * schedule.switch_at:g}% of the steps to {to}; GEMM FLOPs in 4-bit: "
            f"{100 * before:.1f}% before, {100 * after:.1f}% after, {100 * run:.1f}% over the run")


def format_table(rows: list[Row], candidates: list[Recipe], threshold: float, budget: float, spent: float,
                 statistic: str = "gemm") -> str:
    """The decision as text: one line per layer."""
    per_gemm = any(r.gemm != "all" for r in rows)
    heads = ["layer", *(["GEMM"] if per_gemm else []), "GEMM FLOPs %", *[f"err {c.name}" for c in candidates],
             "pick", "why"]
    lines = [[r.layer, *([r.gemm] if per_gemm else []), f"{100 * r.flop_share:.1f}", *[f"{e:.4f}" for e in r.errors],
              "high precision" if r.pick is None else r.pick.name, r.reason] for r in rows]
    widths = [max(len(x) for x in column) for column in zip(heads, *lines)]
    text = ["  ".join(x.ljust(w) for x, w in zip(line, widths)) for line in [heads, *lines]]
    text.insert(1, "  ".join("-" * w for w in widths))
    measured = STATISTICS[statistic]
    return "\n".join([f"engine.recommend: {measured} per layer{' and GEMM' if per_gemm else ''}; threshold "
                      f"{threshold}; {100 * spent:.1f}% of GEMM FLOPs above {candidates[0].name} (budget "
                      f"{100 * budget:.1f}%)", *text])
