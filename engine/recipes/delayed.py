"""Delayed scaling: per-tensor scales computed from a history of past amaxes.

State per module and direction: `scale` [n] and `amax_history` [history_len, n], one
column per slot (see roles.py). Quantizing records max|x| into row 0 of the history
(max with what is there) and uses the current scale; `update()` then turns the history
into the next scale, as Transformer Engine does:

    amax    = history.max(0)   ("max") | history[0] ("most_recent") | algo(history)
    history = roll(history, -1, dim=0); history[0] = 0
    scale   = (fp8_max / amax) / 2**margin, keeping the old scale where amax <= 0 or is
              not finite, and FLT_MAX where the new scale is inf.
"""

from __future__ import annotations

from typing import Callable, ClassVar, Literal, Union

import torch
from pydantic import Field

from engine.formats import fp8_max
from engine.ops.reference import FLT_MAX
from engine.quantizers import Float8Quantizer
from engine.recipes.base import Recipe, RecipeState
from engine.recipes.roles import Role, roles_for

AmaxAlgo = Union[Literal["max", "most_recent"], Callable[[torch.Tensor], torch.Tensor]]
#: scaling_factor_compute_algo(amax [n], scale [n], fp8_max, recipe) -> new scale [n]
ScaleAlgo = Callable[[torch.Tensor, torch.Tensor, float, "DelayedScaling"], torch.Tensor]


class DelayedScaling(Recipe):
    """Per-tensor FP8 with scales from the amax history (Transformer Engine's default recipe)."""

    name: ClassVar[str] = "delayed"

    margin: int = Field(0, ge=0)
    amax_history_len: int = Field(1024, ge=1)
    amax_compute_algo: AmaxAlgo = "max"
    scaling_factor_compute_algo: Union[ScaleAlgo, None] = None
    reduce_amax: bool = True

    def make_state(
        self, *, forward: bool, num_gemms: int = 1, device: torch.device | str | None = None
    ) -> DelayedScalingState:
        return DelayedScalingState(self, forward, roles_for(forward, num_gemms), device)


def default_scale(amax: torch.Tensor, scale: torch.Tensor, max_value: float, margin: int) -> torch.Tensor:
    """(fp8_max / amax) / 2**margin; old scale where amax <= 0 or not finite; FLT_MAX where inf."""
    # a true fp32 division, as TE's CUDA kernel does (`scalar / tensor` in torch would multiply by a reciprocal)
    new = torch.full_like(amax, max_value).div_(amax)
    if margin:
        new.div_(2.0**margin)
    new = torch.where(torch.isfinite(amax) & (amax > 0), new, scale)
    return new.clamp_max_(FLT_MAX)  # inf -> FLT_MAX; NaN cannot occur here


class DelayedScalingState(RecipeState):
    """scale [n] and amax_history [len, n] shared by the slots' Float8Quantizers (views, updated in place)."""

    needs_update: ClassVar[bool] = True

    def __init__(
        self, recipe: DelayedScaling, forward: bool, roles: list[Role], device: torch.device | str | None = None
    ) -> None:
        n = len(roles)
        self.scale = torch.ones(n, dtype=torch.float32, device=device)
        self.amax_history = torch.zeros(recipe.amax_history_len, n, dtype=torch.float32, device=device)
        self.held: set[int] = set()
        dtype = recipe.fp8_format.forward_dtype if forward else recipe.fp8_format.backward_dtype
        self.fp8_max = fp8_max(dtype)
        quantizers = [
            Float8Quantizer(self.scale[i : i + 1], self.amax_history[0, i : i + 1], dtype) for i in range(n)
        ]
        super().__init__(recipe, forward, roles, quantizers)

    @property
    def current_amax(self) -> torch.Tensor:
        """Row 0 of the history: the amaxes recorded in this step (reduced across ranks before update)."""
        return self.amax_history[0]

    def hold(self, slot: int) -> None:
        """Leave this slot's history and scale as they are at the next update (a cached weight)."""
        self.held.add(slot)

    def update(self) -> None:
        """Turn the history into the next scales (in place, so the quantizers see them)."""
        recipe: DelayedScaling = self.recipe
        history = self.amax_history
        algo = recipe.amax_compute_algo
        if algo == "max":
            amax = history.max(dim=0).values
        elif algo == "most_recent":
            amax = history[0].clone()
        else:
            amax = algo(history.clone())
        if recipe.scaling_factor_compute_algo is None:
            new_scale = default_scale(amax, self.scale, self.fp8_max, recipe.margin)
        else:
            new_scale = recipe.scaling_factor_compute_algo(amax, self.scale.clone(), self.fp8_max, recipe)
        rolled = torch.roll(history, -1, dims=0)
        rolled[0].zero_()
        new_scale = new_scale.to(self.scale)
        if self.held:  # held slots keep their history and scale
            keep = torch.zeros(self.scale.shape, dtype=torch.bool, device=self.scale.device)
            keep[sorted(self.held)] = True
            rolled = torch.where(keep, history, rolled)
            new_scale = torch.where(keep, self.scale, new_scale)
            self.held.clear()
        history.copy_(rolled)
        self.scale.copy_(new_scale)

    def record_amax(self, slot: int, x: torch.Tensor) -> None:
        """Record max|x| for one slot without quantizing (calibration)."""
        self.quantizers[slot].record_amax(x)
