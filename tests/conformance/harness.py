"""What the distributed conformance files share: launching gloo processes, the recipes they run, fixed batches.

Each file spawns WORLD processes once (a module-scoped fixture); every rank runs every case and saves what it
saw to `rank<r>.pt`, which the tests compare with one process running the same steps.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import engine
from conformance.recipes import DEFAULTS, Case
from engine.modules import FP8Module
from engine.recipes import QuantizerSpec, Recipe
from engine.tensors import QuantizedTensor

WORLD = 2


def spawn(worker: Callable[..., None], tmp: Any, *args: Any) -> list[dict]:
    """Run `worker(rank, WORLD, init_file, out_dir, *args)` on WORLD gloo processes; each rank's saved results."""
    mp.spawn(_run, args=(worker, str(tmp / "init"), str(tmp), args), nprocs=WORLD, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def _run(rank: int, worker: Callable[..., dict], init_file: str, out_dir: str, args: tuple) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        result = worker(rank, out_dir, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # no rank tears its connections down while another still reads from them
    finally:
        dist.destroy_process_group()


def case_ids() -> list[str]:
    return [case.id for case in DEFAULTS]


def case_of(case_id: str) -> Case:
    return next(case for case in DEFAULTS if case.id == case_id)


def rounds_stochastically(recipe: Recipe) -> bool:
    """Whether any quantizer of the recipe (in the states of a LayerNormMLP's two GEMMs, or of a Linear's or
    LayerNormLinear's one) rounds stochastically."""
    from engine.recipes import OPERANDS

    for module, names in (("LayerNormMLP", ("fc1", "fc2")), ("Linear", ("",)), ("LayerNormLinear", ("",))):
        for forward in (True, False):
            state = recipe.make_state(forward=forward, num_gemms=len(names), module=module, gemm_names=names)
            quantizers = [state.operand(op, g) for op in OPERANDS if op[1].is_forward == forward
                          for g in range(len(names))]
            if any(getattr(q.rule, "stochastic_rounding", False) for q in quantizers if q is not None):
                return True
    return False


def without_stochastic_rounding(recipe: Recipe) -> Recipe:
    """The recipe with stochastic rounding off: NVFP4BlockScaling(disable_stochastic_rounding=True), and a
    CustomRecipe whose factory's specs drop `stochastic_rounding`, a Debug of such a recipe. Another recipe that rounds stochastically is a
    ValueError, so that a new one is taught here rather than compared with another recipe's numbers."""
    if "disable_stochastic_rounding" in type(recipe).model_fields:
        fields = {name: getattr(recipe, name) for name in type(recipe).model_fields}
        out = type(recipe)(**{**fields, "disable_stochastic_rounding": True})
    elif isinstance(recipe, engine.recipes.CustomRecipe):
        out = engine.recipes.CustomRecipe(qfactory=_deterministic(recipe.qfactory))
    elif isinstance(recipe, engine.recipes.Debug):  # the wrapped recipe's rounding
        fields = {name: getattr(recipe, name) for name in type(recipe).model_fields}
        out = type(recipe)(**{**fields, "recipe": without_stochastic_rounding(recipe.recipe)})
    else:
        out = recipe
    if rounds_stochastically(out):
        raise ValueError(f"{recipe!r} rounds stochastically: teach without_stochastic_rounding to turn it off")
    return out


class _deterministic:
    """A CustomRecipe factory answering as `factory` does, with `stochastic_rounding` off in its specs (a
    module-level class, so the recipe's key names it the same in every process)."""

    def __init__(self, factory: Callable) -> None:
        self.factory = factory
        self.__qualname__ = f"deterministic({getattr(factory, '__qualname__', factory)})"

    def __call__(self, role: Any) -> Any:
        answer = self.factory(role)
        if isinstance(answer, QuantizerSpec) and getattr(answer.params, "stochastic_rounding", False):
            params = {**answer.params.model_dump(), "stochastic_rounding": False}
            return QuantizerSpec(scheme=answer.scheme, rule=answer.rule, params=params)
        return answer


def fp8_modules(model: torch.nn.Module) -> list[FP8Module]:
    return [m for m in model.modules() if isinstance(m, FP8Module)]


def scaling_state(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every module's saved scaling state (`RecipeState.to_plain`), in module order."""
    out = []
    for module in fp8_modules(model):
        if module._fwd_state is not None:
            for state in (module._fwd_state, module._bwd_state):
                part = state.to_plain() or {}
                out += [part[k].clone() for k in sorted(part)]
    return out


def value(t: torch.Tensor) -> torch.Tensor:
    """A parameter (or its local shard) in fp32: quantized ones dequantized."""
    t = getattr(t, "_local_tensor", t)
    return (t.dequantize() if isinstance(t, QuantizedTensor) else t).detach().float().clone()


def buffers(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """A parameter's (local) bytes: every buffer of a quantized one, else its value."""
    t = getattr(t, "_local_tensor", t)
    if isinstance(t, QuantizedTensor):
        return {k: v.clone() for k, v in t.qstorage.buffers().items() if v is not None}
    return {"value": t.detach().clone()}
