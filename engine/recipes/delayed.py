"""Delayed scaling: per-tensor scales computed from a history of past amaxes.

State per module and direction: `scale` [n] and `amax_history` [history_len, n], one
column per slot (see roles.py). Quantizing records max|x| into row 0 of the history
(max with what is there) and uses the current scale; `update()` then turns the history
into the next scale, as Transformer Engine does:

    history = history with every non-finite amax replaced by 0
    amax    = history.max(0)   ("max") | history[0] ("most_recent") | algo(history)
    history = roll(history, -1, dim=0); history[0] = 0
    scale   = (fp8_max / amax) * 2**-margin, keeping the old scale where amax <= 0 or is
              not finite, and FLT_MAX where the new scale is inf.

A NaN or inf amax (a batch with a NaN or an inf in it) is dropped from the history at the
next update, so it never reaches the max: the step after such a batch uses a scale from
the finite amaxes around it (Transformer Engine's update ignores NaN in the same way; we
drop inf too, since one overflowed batch would otherwise pin the scale for
`amax_history_len` steps). In that batch itself the cast saturates: inf becomes ±fp8_max
and NaN stays NaN.
"""

from __future__ import annotations

import math
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


MAX_MARGIN = 126
MAX_HISTORY_LEN = 1 << 16


class DelayedScaling(Recipe):
    """Per-tensor FP8 with scales from the amax history (Transformer Engine's default recipe)."""

    name: ClassVar[str] = "delayed"

    # 2**-margin must be a normal fp32 number, or the scale underflows
    margin: int = Field(0, ge=0, le=MAX_MARGIN)
    amax_history_len: int = Field(1024, ge=1, le=MAX_HISTORY_LEN)
    amax_compute_algo: AmaxAlgo = "max"
    scaling_factor_compute_algo: Union[ScaleAlgo, None] = None
    reduce_amax: bool = True

    def make_state(
        self, *, forward: bool, num_gemms: int = 1, device: torch.device | str | None = None
    ) -> DelayedScalingState:
        return DelayedScalingState(self, forward, roles_for(forward, num_gemms), device)


def default_scale(amax: torch.Tensor, scale: torch.Tensor, max_value: float, margin: int) -> torch.Tensor:
    """(fp8_max / amax) * 2**-margin; old scale where amax <= 0 or not finite; FLT_MAX where inf."""
    # a true fp32 division, as TE's CUDA kernel does (`scalar / tensor` in torch would multiply by a reciprocal)
    new = torch.full_like(amax, max_value).div_(amax)
    if margin:
        new.mul_(math.ldexp(1.0, -margin))  # exact, and no float overflow for any margin
    new = torch.where(torch.isfinite(amax) & (amax > 0), new, scale)
    return new.clamp_max_(FLT_MAX)  # inf -> FLT_MAX; NaN cannot occur here


class DelayedScalingState(RecipeState):
    """scale [n] and amax_history [len, n] shared by the slots' Float8Quantizers (views, updated in place)."""

    needs_update: ClassVar[bool] = True

    def __init__(
        self, recipe: DelayedScaling, forward: bool, roles: list[Role], device: torch.device | str | None = None
    ) -> None:
        n = len(roles)
        with torch.inference_mode(False):  # made during an eval, the state must still update in training
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
        history.masked_fill_(~torch.isfinite(history), 0.0)  # a NaN/inf batch never reaches the max
        algo = recipe.amax_compute_algo
        if algo == "max":
            amax = history.max(dim=0).values
        elif algo == "most_recent":
            amax = history[0].clone()
        else:
            amax = _checked_result(algo(history.clone()), self.scale, "amax_compute_algo", "amax")
        if recipe.scaling_factor_compute_algo is None:
            new_scale = default_scale(amax, self.scale, self.fp8_max, recipe.margin)
        else:
            new_scale = recipe.scaling_factor_compute_algo(amax, self.scale.clone(), self.fp8_max, recipe)
            new_scale = _checked_result(new_scale, self.scale, "scaling_factor_compute_algo", "scale")
            if not bool((torch.isfinite(new_scale) & (new_scale > 0)).all()):  # a sync, for user callables only
                raise ValueError(f"scaling_factor_compute_algo: returned scales that are not finite and > 0: "
                                 f"{new_scale.tolist()}")
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


def _checked_result(value: object, like: torch.Tensor, algo: str, what: str) -> torch.Tensor:
    """A user callable's result must be a float tensor of the state's shape (one per slot)."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.shape != like.shape:
        got = f"{value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
        raise ValueError(f"{algo}: expected a float tensor of shape {tuple(like.shape)} (one {what} per slot), "
                         f"got {got:.200}")
    return value.to(like)
