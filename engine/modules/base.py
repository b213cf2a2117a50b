"""What every engine module shares: recipe states, FP8 weights, checkpoint extra state.

A module keeps one forward and one backward `RecipeState` for the recipe it last ran
under (rebuilt when the recipe changes), registers them with fp8_autocast so delayed
scales update at the right moments, and carries delayed-scaling state in `_extra_state`
as plain tensors and data. A checkpoint saved under one recipe loads under another: the
quantizers are rebuilt and FP8 primary weights requantized, with a warning naming both.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from engine import autocast
from engine.modules.linear_function import LinearArgs, WeightCache
from engine.parameters import make_parameter
from engine.recipes import (
    BACKWARD_ROLES, FORWARD_ROLES, DelayedScaling, Recipe, RecipeState, Role, recipe_from_plain, recipe_to_plain,
)
from engine.tensors import QuantizedTensor

EXTRA_STATE_VERSION = 1


class FP8Module(torch.nn.Module):
    """Base of Linear, LayerNormLinear and LayerNormMLP. Subclasses set `num_gemms` and `weight_names`."""

    num_gemms: int = 1
    weight_names: tuple[str, ...] = ("weight",)

    def __init__(self) -> None:
        super().__init__()
        self._recipe: Recipe | None = None
        self._fwd_state: RecipeState | None = None
        self._bwd_state: RecipeState | None = None
        self._pending_extra_state: dict | None = None
        self._weight_caches = [WeightCache() for _ in range(self.num_gemms)]

    # ------------------------------------------------------------------ parameters
    def _new_weight(self, value: torch.Tensor, gemm: int) -> torch.nn.Parameter:
        """A weight parameter: quantized with this module's own weight quantizer under fp8_model_init."""
        if not autocast.is_fp8_model_init():
            return make_parameter(value, None)
        if self._fwd_state is None:
            self._build_states(autocast.model_init_recipe(), value.device)
        return make_parameter(value, self._primary_weight_quantizer(gemm))

    def _primary_weight_quantizer(self, gemm: int):
        """This module's weight quantizer, set to make both usages (fprop and dgrad read an FP8 weight)."""
        quantizer = self._fwd_state.quantizer(Role.WEIGHT, gemm)
        quantizer.set_usage(rowwise=True, columnwise=True)
        return quantizer

    # ------------------------------------------------------------------ recipe states
    def _build_states(self, recipe: Recipe, device: torch.device) -> None:
        # states and requantized weights outlive this call: never make them inference tensors, or the
        # first training step after an eval under torch.inference_mode() could not update them
        with torch.inference_mode(False):
            self._build_states_now(recipe, device)

    def _build_states_now(self, recipe: Recipe, device: torch.device) -> None:
        old_recipe, old_fwd, old_bwd = self._recipe, self._fwd_state, self._bwd_state
        self._recipe = recipe
        self._fwd_state = recipe.make_state(forward=True, num_gemms=self.num_gemms, device=device)
        self._bwd_state = recipe.make_state(forward=False, num_gemms=self.num_gemms, device=device)
        self._weight_caches = [WeightCache() for _ in range(self.num_gemms)]
        if old_fwd is not None:
            _carry_delayed_state(old_fwd, self._fwd_state)
            _carry_delayed_state(old_bwd, self._bwd_state)
        if self._pending_extra_state is not None:
            self._apply_extra_state(self._pending_extra_state)
        self._requantize_fp8_weights(old_recipe)

    def _requantize_fp8_weights(self, old_recipe: Recipe | None) -> None:
        """Give FP8 primary weights this recipe's weight quantizers (requantizing across schemes)."""
        for gemm, name in enumerate(self.weight_names):
            param = getattr(self, name, None)  # None while __init__ is still creating the weights
            if not isinstance(param, QuantizedTensor):
                continue
            quantizer = self._primary_weight_quantizer(gemm)
            if param.qstorage.quantizer is not None and param.qstorage.quantizer.config() == quantizer.config():
                param.update_quantizer(quantizer)
                continue
            if old_recipe is not None:
                warnings.warn(f"{type(self).__name__}.{name}: FP8 weight quantized under {old_recipe!r} is "
                              f"requantized for {self._recipe!r}", UserWarning, stacklevel=4)
            with torch.no_grad():
                fresh = torch.nn.Parameter(quantizer.quantize(param.dequantize()), requires_grad=param.requires_grad)
            torch.utils.swap_tensors(param, fresh)  # keeps the Parameter object the optimizer holds

    def _prepare(self, device: torch.device, is_first_microbatch: bool | None) -> list[LinearArgs]:
        """Per-GEMM arguments for this forward: FP8 or not, the states, and the autocast bookkeeping."""
        fp8, calibrating = autocast.is_fp8_enabled(), autocast.is_calibrating()
        grad = torch.is_grad_enabled()
        recipe = autocast.get_recipe()
        # high precision, unless calibrating delayed scaling (which records amaxes while running in it)
        if not fp8 and not (calibrating and isinstance(recipe, DelayedScaling)):
            return [LinearArgs(fp8=False, fuse_wgrad_accumulation=self.fuse_wgrad_accumulation, grad_enabled=grad)
                    for _ in range(self.num_gemms)]
        if self._recipe is None or (recipe is not self._recipe and recipe != self._recipe):
            self._build_states(recipe, device)
        autocast.register_forward_state(self._fwd_state)
        step = None
        if fp8 and grad:
            step = autocast.register_backward_state(self._bwd_state)
        return [
            LinearArgs(fp8=fp8, fwd=self._fwd_state, bwd=self._bwd_state, gemm=g, cache=self._weight_caches[g],
                       is_first_microbatch=is_first_microbatch, fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
                       backward_step=step if g == 0 else None, grad_enabled=grad)
            for g in range(self.num_gemms)
        ]

    def _calibrate(self, args: LinearArgs, inp: torch.Tensor, weight: torch.Tensor) -> None:
        """Record the input and weight amaxes of one GEMM while running in high precision."""
        if args.fp8 or args.fwd is None or not args.fwd.needs_update:
            return
        w = weight.dequantize() if isinstance(weight, QuantizedTensor) else weight
        args.fwd.record_amax(args.fwd.slot(Role.INPUT, args.gemm), inp)
        args.fwd.record_amax(args.fwd.slot(Role.WEIGHT, args.gemm), w)

    # ------------------------------------------------------------------ checkpoints
    def get_extra_state(self) -> dict[str, Any]:
        """Plain data: the recipe (name and fields) and, for delayed scaling, scales and amax histories."""
        if self._recipe is None and self._pending_extra_state is not None:
            return self._pending_extra_state  # loaded but not run yet: pass it on unchanged
        state: dict[str, Any] = {"version": EXTRA_STATE_VERSION, "recipe": None}
        if self._recipe is not None:
            state["recipe"] = recipe_to_plain(self._recipe)
            if self._fwd_state.needs_update:
                for key, s in (("forward", self._fwd_state), ("backward", self._bwd_state)):
                    state[key] = {"scale": s.scale.detach().clone(), "amax_history": s.amax_history.detach().clone()}
        return state

    def set_extra_state(self, state: Any) -> None:
        """Validate a saved state now (whether or not this module has run); apply it when states exist."""
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            return
        recipe = check_extra_state(state, self.num_gemms)
        if recipe is None:
            return
        self._pending_extra_state = state
        if self._recipe is not None:
            self._apply_extra_state(state)

    def _apply_extra_state(self, state: dict) -> None:
        saved_recipe = recipe_from_plain(state["recipe"])
        self._pending_extra_state = None
        if saved_recipe != self._recipe:
            warnings.warn(f"{type(self).__name__}: checkpoint was saved under {saved_recipe!r} and is loaded "
                          f"under {self._recipe!r}; quantizers are rebuilt for the new recipe",
                          UserWarning, stacklevel=4)
        if "forward" not in state or not self._fwd_state.needs_update:
            return
        for key, s in (("forward", self._fwd_state), ("backward", self._bwd_state)):
            _copy_delayed(state[key]["scale"], state[key]["amax_history"], s)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        try:
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        except ValueError as err:  # name the key the bad extra state came from
            raise ValueError(f"{prefix}{err}") from None
        missing_keys = args[2] if len(args) > 2 else kwargs.get("missing_keys")
        key = prefix + "_extra_state"
        if key not in state_dict and missing_keys is not None and key in missing_keys:
            missing_keys.remove(key)  # a checkpoint of a plain torch module has no FP8 state: that is fine


def check_extra_state(state: Any, num_gemms: int) -> Recipe | None:
    """The saved recipe, after checking every part of a saved `_extra_state`; ValueError naming the bad key."""
    if not isinstance(state, dict) or state.get("version") != EXTRA_STATE_VERSION or "recipe" not in state:
        raise ValueError(f"_extra_state: expected a dict with version {EXTRA_STATE_VERSION} and a recipe, "
                         f"got {state!r:.200}")
    unknown = set(state) - {"version", "recipe", "forward", "backward"}
    if unknown:
        raise ValueError(f"_extra_state: unknown keys {sorted(unknown)}")
    if state["recipe"] is None:
        return None
    try:
        recipe = recipe_from_plain(state["recipe"])
    except ValueError as err:
        raise ValueError(f"_extra_state['recipe']: {err}") from None
    delayed = isinstance(recipe, DelayedScaling)
    for key, slots in (("forward", len(FORWARD_ROLES) * num_gemms), ("backward", len(BACKWARD_ROLES) * num_gemms)):
        if delayed != (key in state):
            raise ValueError(f"_extra_state[{key!r}]: a {recipe.name} recipe's state "
                             f"{'needs' if delayed else 'has no'} {key} scaling state")
        if delayed:
            _check_delayed_part(state[key], f"_extra_state[{key!r}]", slots)
    return recipe


def _check_delayed_part(part: Any, where: str, slots: int) -> None:
    """scale: fp32 [slots], finite and > 0; amax_history: fp32 [rows >= 1, slots], finite and >= 0."""
    if not isinstance(part, dict) or set(part) != {"scale", "amax_history"}:
        raise ValueError(f"{where}: expected {{'scale': tensor, 'amax_history': tensor}}, got {part!r:.200}")
    scale, history = part["scale"], part["amax_history"]
    for name, t, shape in (("scale", scale, f"[{slots}]"), ("amax_history", history, f"[rows, {slots}]")):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or type(t) is not torch.Tensor:
            raise ValueError(f"{where}[{name!r}]: expected a float32 tensor {shape}, got {_describe(t)}")
    if tuple(scale.shape) != (slots,):
        raise ValueError(f"{where}['scale']: expected shape ({slots},) for this module's {slots} slots, "
                         f"got {tuple(scale.shape)} (a state saved from another kind of module?)")
    if history.dim() != 2 or history.shape[0] < 1 or history.shape[1] != slots:
        raise ValueError(f"{where}['amax_history']: expected shape (rows >= 1, {slots}), got {tuple(history.shape)}")
    if not bool((torch.isfinite(scale) & (scale > 0)).all()):
        raise ValueError(f"{where}['scale']: every scale must be finite and > 0, got {scale.tolist()}")
    if not bool((torch.isfinite(history) & (history >= 0)).all()):
        raise ValueError(f"{where}['amax_history']: every amax must be finite and >= 0")


def _describe(t: Any) -> str:
    return f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _copy_delayed(scale: torch.Tensor, history: torch.Tensor, state: RecipeState) -> None:
    """Load a saved scale and amax history into a delayed-scaling state (history rows that fit)."""
    state.scale.copy_(scale)
    rows = min(history.shape[0], state.amax_history.shape[0])
    state.amax_history.zero_()
    state.amax_history[:rows].copy_(history[:rows])


def _carry_delayed_state(old: RecipeState, new: RecipeState) -> None:
    """Keep what delayed scaling learned when its settings change between steps."""
    if old.needs_update and new.needs_update:
        _copy_delayed(old.scale, old.amax_history, new)
