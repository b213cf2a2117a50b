"""fp8_autocast and fp8_model_init: the one place in `engine` with ambient state, kept per thread.

Like `torch.autocast`, the settings belong to the thread that entered the context: a
thread that never entered `fp8_autocast` runs in high precision whatever other threads do.

`fp8_autocast` says which recipe the modules run under. Delayed-scaling state that a
module used inside it is updated:

* forward slots (input, weight, output) when the outermost `fp8_autocast` exits, as in
  Transformer Engine;
* backward slots (grad_output, grad_input) of this step and the previous one when the
  outermost `fp8_autocast` exits and when the next one is entered. An update leaves slots
  that recorded nothing since the last one as they are (`DelayedScalingState`), so this
  folds each backward in exactly once, before the next backward quantizes: with the
  backward inside the autocast (at its exit) or after it (at the next entry), and with
  recomputation or a compiled backward, where nothing runs in Python at the end of the
  backward. (Transformer Engine updates at the end of the first module's backward; the
  scales each GEMM uses are the same.)

Before each update the recorded amaxes of all those states are all-reduced (MAX) in one
collective over `fp8_group` (default: the world), when torch.distributed is initialised,
the group has more than one rank, and the recipe's `reduce_amax` is on.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from engine.checks import check_bool, check_instance
from engine.collectives import all_reduce_max, group_size
from engine.recipes import DelayedScaling, Recipe, RecipeMap, RecipeState
from engine.recipes.debug import Debug
from engine.recipes.recipe_map import as_recipe_map


@dataclass
class AutocastStep:
    """What one outermost fp8_autocast collected: the states to update after it."""

    group: dist.ProcessGroup | None
    forward_states: dict[int, RecipeState] = field(default_factory=dict)
    backward_states: dict[int, RecipeState] = field(default_factory=dict)


class _AutocastState(threading.local):
    """The settings of the innermost fp8_autocast / fp8_model_init of the current thread."""

    def __init__(self) -> None:
        self.enabled = False
        self.calibrating = False
        self.recipe: Recipe | RecipeMap | None = None
        self.recipe_key: str | None = None  # recipe.key, read by compiled code (guarded by value)
        self.group: dist.ProcessGroup | None = None
        self.depth = 0
        self.step: AutocastStep | None = None
        self.pending: AutocastStep | None = None  # the last step: its backward states may still record
        self.model_init_enabled = False
        self.model_init_recipe: Recipe | None = None
        self.preserve_high_precision_init_val = False
        self.inspector: Any = None  # engine.inspect's observer of this thread's linear calls (None: off)


_STATE = _AutocastState()  # one instance, a separate set of attributes per thread


def _check_recipe(recipe: Any) -> Recipe:
    if recipe is None:
        return DelayedScaling()
    return check_instance(recipe, Recipe, "recipe", "an engine.recipes.Recipe or None")


def _check_recipe_or_map(recipe: Any) -> Recipe | RecipeMap:
    if isinstance(recipe, (RecipeMap, dict)):  # an "inherit" default: the enclosing autocast's recipe
        around = _STATE.recipe if _STATE.depth > 0 and _STATE.recipe is not None else DelayedScaling()
        return as_recipe_map(recipe, "recipe").inheriting(around.default if isinstance(around, RecipeMap) else around)
    if recipe is None:
        return DelayedScaling()
    return check_instance(recipe, Recipe, "recipe", "an engine.recipes.Recipe, a RecipeMap or None")


def fp8_autocast(
    enabled: bool = True,
    calibrating: bool = False,
    recipe: Recipe | RecipeMap | dict | None = None,
    fp8_group: dist.ProcessGroup | None = None,
) -> contextlib.AbstractContextManager[None]:
    """Run engine modules inside in FP8 under `recipe` (default: DelayedScaling()).

    `recipe` may be per layer: a `RecipeMap` (or a dict of module-name fnmatch patterns to a recipe, or
    to None for high precision; unmatched names get the enclosing fp8_autocast's recipe, DelayedScaling()
    outside any). A module's name is the one
    `engine.convert` or `engine.set_recipe_map` gave it. Without a map, a module that holds a pick of
    its own (`engine.set_recipe_map`, or a checkpoint that carried one) runs under its pick.

    `calibrating=True` with `enabled=False` runs in high precision while recording
    amaxes, so the first FP8 step starts from calibrated delayed scales. Nesting is
    allowed; the outer settings come back on exit. The arguments are checked on entry.
    """
    return _Fp8Autocast(enabled, calibrating, recipe, fp8_group)


class _Fp8Autocast(contextlib.ContextDecorator):
    """fp8_autocast's context (also a decorator): a class rather than a generator, whose enter and exit
    cost a few microseconds more per step (each training step enters one)."""

    def __init__(self, enabled: Any, calibrating: Any, recipe: Any, fp8_group: Any) -> None:
        self.args = (enabled, calibrating, recipe, fp8_group)
        self.saved: list[tuple] = []  # the outer settings, one entry per entry of this object

    def _recreate_cm(self) -> _Fp8Autocast:  # a decorated function's every call: a fresh context
        return _Fp8Autocast(*self.args)

    def __enter__(self) -> None:
        enabled, calibrating, recipe, fp8_group = self.args
        check_bool(enabled, "enabled")
        check_bool(calibrating, "calibrating")
        recipe = _check_recipe_or_map(recipe)
        if fp8_group is not None and not isinstance(fp8_group, dist.ProcessGroup):
            raise TypeError(f"fp8_group: expected a torch.distributed.ProcessGroup or None, "
                            f"got {type(fp8_group).__name__}")
        state = _STATE
        self.saved.append((state.enabled, state.calibrating, state.recipe, state.recipe_key, state.group))
        state.enabled, state.calibrating, state.recipe, state.group = enabled, calibrating, recipe, fp8_group
        state.recipe_key = recipe.key
        if state.depth == 0:
            state.step = AutocastStep(group=fp8_group)
            if state.pending is not None:  # a backward after the last autocast: fold it in before this step
                update_states(list(state.pending.backward_states.values()), state.pending.group)
        state.depth += 1

    def __exit__(self, *exc: Any) -> None:
        state = _STATE
        state.enabled, state.calibrating, state.recipe, state.recipe_key, state.group = self.saved.pop()
        state.depth -= 1
        if state.depth == 0:
            step, last, state.step, state.pending = state.step, state.pending, None, None
            backward = dict(last.backward_states) if last is not None else {}
            backward.update(step.backward_states)
            update_states([*step.forward_states.values(), *backward.values()], step.group)
            state.pending = step if step.backward_states else None


def is_fp8_enabled() -> bool:
    return _STATE.enabled


def is_calibrating() -> bool:
    return _STATE.calibrating


def get_recipe() -> Recipe | RecipeMap:
    """The recipe (or per-layer RecipeMap) of the innermost fp8_autocast (DelayedScaling() outside any)."""
    return _STATE.recipe if _STATE.recipe is not None else DelayedScaling()


def get_recipe_key() -> str | None:
    """`get_recipe().key` inside fp8_autocast (None outside): a string compiled code can guard on."""
    return _STATE.recipe_key


def get_fp8_group() -> dist.ProcessGroup | None:
    return _STATE.group


def update_states(states: list[RecipeState], group: dist.ProcessGroup | None) -> None:
    """All-reduce the amaxes the states recorded (one collective), then update them (stateless: no-ops)."""
    if group_size(group) > 1:  # one process: no views of the histories to collect
        all_reduce_max([a for s in states for a in s.amaxes_to_reduce()], group)
    for s in states:
        s.update()


def register_forward_state(state: RecipeState) -> None:
    """A module used `state` in forward: update it when the outermost fp8_autocast exits."""
    if _STATE.step is None:
        raise RuntimeError("register_forward_state: called outside fp8_autocast")
    _STATE.step.forward_states[id(state)] = state


def register_backward_state(state: RecipeState) -> None:
    """A module will use `state` in backward: update it after this step's backward (see the module docstring)."""
    if _STATE.step is None:
        raise RuntimeError("register_backward_state: called outside fp8_autocast")
    _STATE.step.backward_states[id(state)] = state


@contextlib.contextmanager
def fp8_model_init(
    enabled: bool = True, recipe: Recipe | None = None, preserve_high_precision_init_val: bool = False
) -> Iterator[None]:
    """Parameters that engine modules create inside are stored quantized (FP8 primary weights).

    With `preserve_high_precision_init_val`, each keeps a CPU copy of its initial
    high-precision value (see `engine.parameters.get_high_precision_init_val`).
    """
    check_bool(enabled, "enabled")
    check_bool(preserve_high_precision_init_val, "preserve_high_precision_init_val")
    recipe = _check_recipe(recipe)
    _check_model_init_recipe(recipe)
    saved = (_STATE.model_init_enabled, _STATE.model_init_recipe, _STATE.preserve_high_precision_init_val)
    _STATE.model_init_enabled, _STATE.model_init_recipe = enabled, recipe
    _STATE.preserve_high_precision_init_val = preserve_high_precision_init_val
    try:
        yield
    finally:
        (_STATE.model_init_enabled, _STATE.model_init_recipe, _STATE.preserve_high_precision_init_val) = saved


def _check_model_init_recipe(recipe: Recipe | None) -> None:
    """A Debug recipe that switches a GEMM reading the weight to current scaling cannot read FP8 primary weights:
    they are stored in the wrapped recipe's format, which the switched GEMM's other operand does not pair with."""
    switched = [g for g in getattr(recipe, "current_scaling", ()) if g in ("fprop", "dgrad")]
    if isinstance(recipe, Debug) and switched:
        raise ValueError(f"recipe: fp8_model_init stores the weights in {recipe.recipe.name}'s format, which the "
                         f"{'/'.join(switched)} GEMM Debug(current_scaling=...) switches to per-tensor FP8 cannot "
                         "read; build the weights under the wrapped recipe (fp8_model_init(recipe=recipe.recipe)) "
                         "or in high precision, or switch only wgrad")


def is_fp8_model_init() -> bool:
    return _STATE.model_init_enabled


def model_init_recipe() -> Recipe:
    return _STATE.model_init_recipe if _STATE.model_init_recipe is not None else DelayedScaling()


def preserve_high_precision_init_val() -> bool:
    return _STATE.preserve_high_precision_init_val


def inspector() -> Any:
    """The observer `engine.inspect` set for this thread's linear calls (None: not inspecting)."""
    return _STATE.inspector


def swap_inspector(observer: Any) -> Any:
    """Make `observer` this thread's (None: off); returns the previous one."""
    previous, _STATE.inspector = _STATE.inspector, observer
    return previous


# ---------------------------------------------------------------- activation recompute (engine.recompute)
#: (enabled, calibrating, recipe or None, fp8_group): what a recompute replays of the forward's fp8_autocast
Settings = tuple[bool, bool, Recipe | None, dist.ProcessGroup | None]


class _RecomputeState(threading.local):
    """The engine.checkpoint phase (its forward or a recompute) running in this thread, if any."""

    def __init__(self) -> None:
        self.phase: Any = None


_RECOMPUTE = _RecomputeState()


def autocast_settings() -> Settings:
    """This thread's fp8_autocast settings, as a recompute replays them."""
    return (_STATE.enabled, _STATE.calibrating, _STATE.recipe, _STATE.group)


def in_fp8_autocast() -> bool:
    """Whether this thread is inside any fp8_autocast (enabled or not)."""
    return _STATE.depth > 0


def recompute_phase() -> Any:
    """The engine.checkpoint phase running in this thread (None: none)."""
    return _RECOMPUTE.phase


def swap_recompute_phase(phase: Any, settings: Settings | None = None) -> tuple[Any, Settings]:
    """Make `phase` this thread's engine.checkpoint phase and, if given, `settings` its fp8_autocast settings
    (no autocast step is opened: states register with the steps that are there). Returns the previous
    (phase, settings), to pass back when the phase ends."""
    previous = (_RECOMPUTE.phase, autocast_settings())
    _RECOMPUTE.phase = phase
    if settings is not None:
        _STATE.enabled, _STATE.calibrating, _STATE.recipe, _STATE.group = settings
        _STATE.recipe_key = None if _STATE.recipe is None else _STATE.recipe.key
    return previous


def register_recomputed_backward_state(state: RecipeState, group: dist.ProcessGroup | None) -> None:
    """A forward recomputed inside backward will use `state` in this backward: register it with the open
    outermost fp8_autocast, or outside any with the pending step (created if none), so it is folded in at
    the next outermost exit or entry, as a backward after the autocast is."""
    if _STATE.step is not None:
        _STATE.step.backward_states[id(state)] = state
        return
    if _STATE.pending is None:
        _STATE.pending = AutocastStep(group=group)
    _STATE.pending.backward_states[id(state)] = state


# ------------------------------------------------------------------ Transformer Engine 2.x names
def autocast(
    enabled: bool = True,
    calibrating: bool = False,
    recipe: Recipe | RecipeMap | dict | None = None,
    amax_reduction_group: dist.ProcessGroup | None = None,
) -> contextlib.AbstractContextManager[None]:
    """Transformer Engine 2.x's name for fp8_autocast, with its argument names
    (`amax_reduction_group` is fp8_autocast's `fp8_group`). `engine.autocast(...)` calls this."""
    return fp8_autocast(enabled=enabled, calibrating=calibrating, recipe=recipe, fp8_group=amax_reduction_group)


#: Transformer Engine 2.x's name for fp8_model_init (same arguments)
quantized_model_init = fp8_model_init


class _CallableModule(types.ModuleType):
    """This module, callable: `engine.autocast(recipe=...)` is TE 2.x's context manager while
    `engine.autocast.fp8_autocast`, `engine.autocast.register_forward_state`, ... keep working."""

    def __call__(
        self, enabled: bool = True, calibrating: bool = False, recipe: Recipe | RecipeMap | dict | None = None,
        amax_reduction_group: dist.ProcessGroup | None = None,
    ) -> contextlib.AbstractContextManager[None]:
        return autocast(enabled, calibrating, recipe, amax_reduction_group)


sys.modules[__name__].__class__ = _CallableModule
