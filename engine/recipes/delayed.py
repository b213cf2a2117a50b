"""Delayed scaling: per-tensor scales computed from a history of past amaxes.

State per module and direction: `scale` [n] and `amax_history` [history_len, n], one
column per slot (see roles.py). Quantizing records max|x| into row 0 of the history
(max with what is there) and uses the current scale; `update()` then turns the history
into the next scale, as Transformer Engine does:

    history = history with every non-finite amax replaced by 0
    amax    = history.max(0)   ("max") | history[0] ("most_recent") | algo(history)
    history = roll(history, -1, dim=0); history[0] = NOT_RECORDED
    scale   = (fp8_max / amax) * 2**-margin, keeping the old scale where amax <= 0 or is
              not finite, and FLT_MAX where the new scale is inf.

Row 0 starts each step at NOT_RECORDED (-1, below every amax): a slot that recorded
nothing since the last update (a weight reused from the micro-batch cache, a backward that
has not run yet) keeps its history and scale at that update. So `update()` may run at any
moment after a step - autocast runs it when the outermost `fp8_autocast` is entered and
when it exits - and the history still advances exactly once per recorded step. Nothing
outside the recorded tensors says "this slot ran", which is what lets the quantizing run
inside opaque custom ops and compiled graphs. Checkpoints keep the marker, so a loaded state
continues exactly; a Transformer Engine checkpoint's row 0 of zeros reads as a recorded 0.

A NaN or inf amax (a batch with a NaN or an inf in it) is dropped from the history at the
next update, so it never reaches the max: the step after such a batch uses a scale from
the finite amaxes around it (Transformer Engine's update ignores NaN in the same way; we
drop inf too, since one overflowed batch would otherwise pin the scale for
`amax_history_len` steps). In that batch itself the cast saturates: inf becomes ±fp8_max
and NaN stays NaN.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, ClassVar, Sequence, Union

import torch
from pydantic import Field

from engine.formats import fp8_max
from engine.ops import quantize as qops
from engine.ops.reference import FLT_MAX, usable_scales
from engine.quantizers import DelayedParams, Float8Quantizer
from engine.quantizers.rules import MAX_HISTORY_LEN, MAX_MARGIN, NOT_RECORDED, AmaxAlgo
from engine.recipes.base import SLOT_OF, SLOTS_PER_GEMM, Recipe, RecipeState
from engine.recipes.format import Format
from engine.recipes.operands import (
    BACKWARD_ROLES, FORWARD_ROLES, OPERANDS, Operand, QuantizerSpec, check_num_gemms,
)
from engine.schemes import fp8_scheme

#: scaling_factor_compute_algo(amax [n], scale [n], fp8_max, recipe) -> new scale [n]
ScaleAlgo = Callable[[torch.Tensor, torch.Tensor, float, "DelayedScaling"], torch.Tensor]


class DelayedScaling(Recipe):
    """Per-tensor FP8 with scales from the amax history (Transformer Engine's default recipe)."""

    name: ClassVar[str] = "delayed"

    # 2**-margin must be a normal fp32 number, or the scale underflows
    margin: int = Field(0, ge=0, le=MAX_MARGIN)
    amax_history_len: int = Field(1024, ge=1, le=MAX_HISTORY_LEN)
    amax_compute_algo: AmaxAlgo = "max"
    scaling_factor_compute_algo: Union[ScaleAlgo, None] = None
    reduce_amax: bool = True

    def operands(self) -> dict[Operand, QuantizerSpec | None]:
        """Per-tensor delayed specs carrying this recipe's settings (a CustomRecipe given them rebuilds it)."""
        params = {name: getattr(self, name) for name in DelayedParams.model_fields}
        return {op: QuantizerSpec(scheme=fp8_scheme("tensor", self.dtype_for(op[1])).name, rule="delayed",
                                  params=params) for op in OPERANDS}

    @classmethod
    def from_params(cls, params: DelayedParams, fp8_format: Format) -> DelayedScaling:
        """The recipe whose operands() carry `params` with elements of `fp8_format`."""
        return cls(fp8_format=fp8_format, **{name: getattr(params, name) for name in DelayedParams.model_fields})

    def make_state(
        self, *, forward: bool, num_gemms: int = 1, device: torch.device | str | None = None,
        module: str = "", gemm_names: Sequence[str] = (),
    ) -> DelayedScalingState:
        return DelayedScalingState(self, forward, check_num_gemms(num_gemms), device)

    def op_state(self, *, forward: bool, num_gemms: int, tensors: list[torch.Tensor]
                 ) -> tuple[DelayedScalingState, list[torch.Tensor]]:
        """Quantizers reading the given scale and recording into a fresh row of NOT_RECORDED."""
        scale = tensors[0]
        row = torch.full((1, scale.shape[0]), NOT_RECORDED, dtype=torch.float32, device=scale.device)
        return DelayedScalingState(self, forward, num_gemms, scale=scale, amax_history=row), [row[0]]

    def merge_records(self, tensors: list[torch.Tensor], records: list[torch.Tensor]) -> None:
        merge_amax_row(tensors[1], records[0])

    def check_saved_state(self, part: Any, where: str, slots: int) -> None:
        check_delayed_state(part, where, slots)


def check_delayed_state(part: Any, where: str, slots: int) -> None:
    """A saved delayed-scaling state: scale: fp32 [slots], finite and > 0; amax_history: fp32 [rows >= 1, slots],
    finite and >= 0 (row 0 may hold NOT_RECORDED)."""
    if not isinstance(part, dict) or set(part) != {"scale", "amax_history"}:
        raise ValueError(f"{where}: expected {{'scale': tensor, 'amax_history': tensor}}, got {part!r:.200}")
    scale, history = part["scale"], part["amax_history"]
    for key, t, shape in (("scale", scale, f"[{slots}]"), ("amax_history", history, f"[rows, {slots}]")):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or type(t) is not torch.Tensor:
            got = f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{where}[{key!r}]: expected a float32 tensor {shape}, got {got}")
    if tuple(scale.shape) != (slots,):
        raise ValueError(f"{where}['scale']: expected shape ({slots},) for this module's {slots} slots, "
                         f"got {tuple(scale.shape)} (a state saved from another kind of module?)")
    if history.dim() != 2 or history.shape[0] < 1 or history.shape[1] != slots:
        raise ValueError(f"{where}['amax_history']: expected shape (rows >= 1, {slots}), "
                         f"got {tuple(history.shape)}")
    usable = usable_scales(scale)
    if not bool(usable.all()):
        raise ValueError(f"{where}['scale']: every scale must be finite and > 0 with a finite reciprocal "
                         f"(scale_inv), got {scale[~usable][:4].tolist()} ({int((~usable).sum())} of "
                         f"{scale.numel()})")
    valid = torch.isfinite(history) & (history >= 0)
    valid[0] |= history[0] == NOT_RECORDED
    if not bool(valid.all()):
        raise ValueError(f"{where}['amax_history']: every amax must be finite and >= 0 "
                         f"(row 0 may be {NOT_RECORDED}: nothing recorded yet)")


def merge_amax_row(history: torch.Tensor, recorded: torch.Tensor) -> None:
    """history[0] = max(history[0], recorded): what recording in place would have left (max is exact)."""
    with torch.no_grad():
        history[0].copy_(torch.maximum(history[0], recorded))


def default_scale(amax: torch.Tensor, scale: torch.Tensor, max_value: float, margin: int) -> torch.Tensor:
    """(fp8_max / amax) * 2**-margin; old scale where amax <= 0 or not finite; FLT_MAX where inf."""
    # a true fp32 division, as TE's CUDA kernel does (`scalar / tensor` in torch would multiply by a reciprocal)
    new = torch.full_like(amax, max_value).div_(amax)
    if margin:
        new.mul_(math.ldexp(1.0, -margin))  # exact, and no float overflow for any margin
    new = torch.where(torch.isfinite(amax) & (amax > 0), new, scale)
    return new.clamp_max_(FLT_MAX)  # inf -> FLT_MAX; NaN cannot occur here


class DelayedScalingState(RecipeState):
    """scale [n] and amax_history [len, n] in TE's column layout, shared in place by the slots' Float8Quantizers.

    `quantizers[slot]` is the quantizer of each column, TE's output / grad_input columns included
    (modules never quantize with those; they keep checkpoints in TE's layout).
    """

    def __init__(
        self, recipe: DelayedScaling, forward: bool, num_gemms: int, device: torch.device | str | None = None,
        *, scale: torch.Tensor | None = None, amax_history: torch.Tensor | None = None,
    ) -> None:
        n = SLOTS_PER_GEMM[forward] * num_gemms
        if scale is None:
            with torch.inference_mode(False):  # made during an eval, the state must still update in training
                scale = torch.ones(n, dtype=torch.float32, device=device)
                amax_history = torch.zeros(recipe.amax_history_len, n, dtype=torch.float32, device=device)
                amax_history[0].fill_(NOT_RECORDED)
        self.scale, self.amax_history = scale, amax_history
        dtype = recipe.fp8_format.forward_dtype if forward else recipe.fp8_format.backward_dtype
        self.fp8_max = fp8_max(dtype)
        self.quantizers = [Float8Quantizer(self.scale[i : i + 1], self.amax_history[0, i : i + 1], dtype, _check=False)
                           for i in range(n)]
        by_operand = {}
        for gemm in range(num_gemms):
            for role in FORWARD_ROLES if forward else BACKWARD_ROLES:
                quantizer = self.quantizers[gemm * SLOTS_PER_GEMM[forward] + SLOT_OF[role]]
                by_operand.update({(use, gemm): quantizer for use in role.uses})
        super().__init__(recipe, forward, num_gemms, by_operand)

    op_records = 1

    def op_tensors(self) -> list[torch.Tensor]:
        return [self.scale, self.amax_history]

    def merge_records(self, records: list[torch.Tensor]) -> None:
        merge_amax_row(self.amax_history, records[0])

    @property
    def current_amax(self) -> torch.Tensor:
        """Row 0 of the history: the amaxes recorded in this step (reduced across ranks before update)."""
        return self.amax_history[0]

    def amaxes_to_reduce(self) -> list[torch.Tensor]:
        return [self.current_amax] if self.recipe.reduce_amax else []

    def to_plain(self) -> dict[str, torch.Tensor]:
        return {"scale": self.scale.detach().clone(), "amax_history": self.amax_history.detach().clone()}

    def load_plain(self, part: dict[str, torch.Tensor]) -> None:
        """A checked saved state: its scale, and the history rows that fit."""
        self.scale.copy_(part["scale"])
        history = part["amax_history"]
        rows = min(history.shape[0], self.amax_history.shape[0])
        self.amax_history.zero_()
        self.amax_history[:rows].copy_(history[:rows])

    def carry_from(self, old: RecipeState) -> None:
        if isinstance(old, DelayedScalingState) and old.scale.shape == self.scale.shape:
            self.load_plain(old.to_plain())

    def update(self) -> None:
        """Turn the history into the next scales (in place, so the quantizers see them); slots that
        recorded nothing since the last update keep their history and scale."""
        recipe: DelayedScaling = self.recipe
        history = self.amax_history
        algo = recipe.amax_compute_algo
        if history.is_cpu and recipe.scaling_factor_compute_algo is None and algo in ("max", "most_recent"):
            # the steps below in one native call (`engine.ops.quantize.delayed_update`), same bits; it
            # writes memory directly, so autograd's version counters do not move (see below)
            qops.delayed_update_state(history, self.scale, self.fp8_max, recipe.margin, algo)
            return
        held = history[0] < 0  # NOT_RECORDED (NaN compares False: a NaN batch was recorded)
        # a NaN/inf batch never reaches the max; older rows were cleaned at earlier updates (or checked at load)
        torch.nan_to_num_(history.data[0], nan=0.0, posinf=0.0, neginf=0.0)
        if algo == "max":
            amax = history.max(dim=0).values
        elif algo == "most_recent":
            amax = history[0].clone()
        else:
            amax = _checked_result(algo(history.clamp_min(0.0)), self.scale, "amax_compute_algo", "amax")
        if recipe.scaling_factor_compute_algo is None:
            new_scale = default_scale(amax, self.scale, self.fp8_max, recipe.margin)
        else:
            new_scale = recipe.scaling_factor_compute_algo(amax, self.scale.clone(), self.fp8_max, recipe)
            new_scale = _checked_result(new_scale, self.scale, "scaling_factor_compute_algo", "scale")
            if not bool((torch.isfinite(new_scale) & (new_scale > 0)).all()):  # a sync, for user callables only
                raise ValueError(f"scaling_factor_compute_algo: returned scales that are not finite and > 0: "
                                 f"{new_scale.tolist()}")
        rolled = torch.roll(history, -1, dims=0)
        rolled[0].fill_(NOT_RECORDED)
        # written through .data: a compiled backward saved these tensors to read the scales current at
        # backward time (as eager does); an update in between must not trip autograd's version check
        history.data.copy_(torch.where(held, history, rolled))
        self.scale.data.copy_(torch.where(held, self.scale, new_scale.to(self.scale)))

    def record_amax(self, slot: int, x: torch.Tensor) -> None:
        """Record max|x| for one slot without quantizing (calibration)."""
        self.quantizers[slot].record_amax(x)

    def replay_copy(self) -> DelayedScalingState:
        """A twin for an activation recompute: quantizers over a copy of today's scales (the update at the
        autocast exit must not reach them) and a scratch amax row (the recompute records nothing here)."""
        twin = copy.copy(self)
        twin.scale = self.scale.detach().clone()
        twin.amax_history = torch.zeros_like(self.amax_history[:1])
        twin.quantizers = []
        for i, quantizer in enumerate(self.quantizers):
            rule = copy.copy(quantizer.rule)  # the state tensors were checked when `quantizer` was built
            rule.scale, rule.amax = twin.scale[i : i + 1], twin.amax_history[0, i : i + 1]
            twin.quantizers.append(quantizer.copy())
            twin.quantizers[-1].rule = rule
        twin_of = {id(q): t for q, t in zip(self.quantizers, twin.quantizers)}
        twin._quantizers = {key: twin_of[id(q)] for key, q in self._quantizers.items()}
        twin._uses = {}
        return twin


def _checked_result(value: object, like: torch.Tensor, algo: str, what: str) -> torch.Tensor:
    """A user callable's result must be a float tensor of the state's shape (one per slot)."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.shape != like.shape:
        got = f"{value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
        raise ValueError(f"{algo}: expected a float tensor of shape {tuple(like.shape)} (one {what} per slot), "
                         f"got {got:.200}")
    return value.to(like)
