"""Activation recompute that reruns engine modules exactly as their forward ran: `engine.checkpoint`.

`torch.utils.checkpoint` reruns a function inside backward. After the README's loop
(`loss.backward()` once `fp8_autocast` has exited) that rerun would see no autocast and run
in high precision, and under delayed scaling the scales were updated at the exit in between.
`engine.checkpoint(function, *args, use_reentrant=True, **kwargs)` (Transformer Engine's
`te.distributed.checkpoint` without its tensor-parallel and RNG-tracker options) wraps torch's checkpoint
so that the recompute

* runs under the fp8_autocast settings of the call (enabled, calibrating, recipe, fp8_group);
* quantizes with the forward state each module used in forward (`RecipeState.replay_copy`,
  stashed at that forward): delayed scaling's scales as they were then, amaxes recorded into
  scratch tensors, so each history advances once per step;
* registers the modules' backward states as a forward does (with the open autocast, or
  outside any with the pending step), so the backward amaxes are folded in as without
  recompute.

The gradients are the same bits as without recompute. Plain `torch.utils.checkpoint` is
exact when backward runs inside the fp8_autocast of the forward (nothing has changed
since); an engine module that ran in FP8 and is rerun in backward outside any fp8_autocast
without `engine.checkpoint` raises instead of computing in high precision
(`check_forward`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

from engine import autocast
from engine.checks import check_bool
from engine.recipes import RecipeState


class _Region:
    """One call of engine.checkpoint: the autocast settings of its forward and the forward states its modules used."""

    def __init__(self, settings: autocast.Settings, will_recompute: bool) -> None:
        self.settings = settings
        self.will_recompute = will_recompute  # grad was on at the call: backward will recompute
        # id(module's forward state) -> (that state, the copy each of its uses in forward quantized with)
        self.stash: dict[int, tuple[RecipeState, list[RecipeState]]] = {}


class _Phase:
    """One run of a region's function: its forward (stashing) or a recompute (replaying)."""

    def __init__(self, region: _Region, recomputing: bool, parent: _Phase | None) -> None:
        self.region, self.recomputing, self.parent = region, recomputing, parent
        self.replayed: dict[int, int] = {}  # id(forward state) -> uses replayed so far in this recompute


class _PhaseContext:
    """Runs a region's function as its forward or as a recompute. Enterable again (torch reuses the recompute
    context for every recompute, e.g. a second backward with retain_graph=True)."""

    def __init__(self, region: _Region, recomputing: bool) -> None:
        self.region, self.recomputing = region, recomputing
        self._previous: list[tuple[Any, autocast.Settings]] = []

    def __enter__(self) -> None:
        phase = _Phase(self.region, self.recomputing, autocast.recompute_phase())
        settings = self.region.settings if self.recomputing else None
        self._previous.append(autocast.swap_recompute_phase(phase, settings))

    def __exit__(self, *exc: Any) -> None:
        phase, settings = self._previous.pop()
        autocast.swap_recompute_phase(phase, settings if self.recomputing else None)


def checkpoint(function: Callable[..., Any], *args: Any, use_reentrant: bool = True, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)`, its activations recomputed in backward (torch.utils.checkpoint) exactly as
    this forward computed them under fp8_autocast (see the module docstring).

    `use_reentrant` picks torch's implementation (True, Transformer Engine's default: pass the tensors that
    need gradients in `args`; False: `kwargs` may hold them too). `kwargs` go to `function`. The RNG state is
    restored for the recompute, as torch does by default.
    """
    if not callable(function):
        raise TypeError(f"function: expected a callable, got {type(function).__name__}")
    check_bool(use_reentrant, "use_reentrant")
    if not use_reentrant:
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=checkpoint_context,
                                                 **kwargs)
    forward, recompute = checkpoint_context()
    calls = 0

    def run(*inputs: Any) -> Any:  # torch's reentrant checkpoint calls it for the forward, then per recompute
        nonlocal calls
        calls += 1
        with forward if calls == 1 else recompute:
            return function(*inputs, **kwargs)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=True)


def checkpoint_context() -> tuple[_PhaseContext, _PhaseContext]:
    """torch.utils.checkpoint's `context_fn` (use_reentrant=False) that makes its recompute engine.checkpoint's:
    for code that calls torch's checkpoint itself, e.g. Hugging Face models,
    `model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
    "context_fn": engine.checkpoint_context})`. torch calls it once per checkpointed call, in its forward, which
    captures the fp8_autocast settings there; the two contexts run that forward and its recompute."""
    region = _Region(autocast.autocast_settings(), torch.is_grad_enabled())
    return _PhaseContext(region, False), _PhaseContext(region, True)


# ---------------------------------------------------------------- what modules call (FP8Module._prepare)
def register_states(fwd: RecipeState, bwd: RecipeState, *, fp8: bool, grad: bool) -> RecipeState:
    """Register a module's states with fp8_autocast; return the forward state its GEMMs quantize with.

    Outside engine.checkpoint: `fwd` itself. In a checkpointed forward also a stashed
    `fwd.replay_copy()` (the backward state is registered even under the reentrant forward's
    no_grad: backward will recompute); in a recompute that copy, and only the backward
    state is registered.
    """
    return _register(autocast.recompute_phase(), fwd, bwd, fp8=fp8, grad=grad)


def _register(phase: _Phase | None, fwd: RecipeState, bwd: RecipeState, *, fp8: bool, grad: bool) -> RecipeState:
    if phase is None:
        autocast.register_forward_state(fwd)
        if fp8 and grad:
            autocast.register_backward_state(bwd)
        return fwd
    region = phase.region
    if phase.recomputing:
        _, copies = region.stash.get(id(fwd), (None, []))
        use = phase.replayed.get(id(fwd), 0)
        if use >= len(copies):
            raise RuntimeError(f"engine.checkpoint: the recompute ran an engine module {use + 1} time(s), the forward "
                               f"{len(copies)}; the checkpointed function must run the same modules in the same order")
        phase.replayed[id(fwd)] = use + 1
        if fp8 and grad:
            autocast.register_recomputed_backward_state(bwd, region.settings[3])
        return copies[use]
    # a checkpointed forward, perhaps itself inside an outer region's recompute: quantize with what the
    # enclosing phase gives, and stash a copy of that for this region's recompute
    used = _register(phase.parent, fwd, bwd, fp8=fp8, grad=grad or region.will_recompute)
    region.stash.setdefault(id(fwd), (fwd, []))[1].append(used.replay_copy())
    return used


def check_forward(module: torch.nn.Module, fp8: bool) -> None:
    """Raise if torch.utils.checkpoint is rerunning `module` in backward, outside any fp8_autocast and
    engine.checkpoint, after its forward ran in FP8: the rerun would compute in high precision."""
    if torch.compiler.is_compiling():
        return
    if (not fp8 and getattr(module, "_last_forward_fp8", False) and autocast.recompute_phase() is None
            and not autocast.in_fp8_autocast() and torch._C._current_graph_task_id() != -1):
        raise RuntimeError(
            f"{type(module).__name__}: its forward runs again during backward, outside fp8_autocast, after running "
            "in FP8 (torch.utils.checkpoint recomputing it?); it would recompute in high precision and the "
            "gradients would not be those of the FP8 forward. Use engine.checkpoint(function, *args, "
            "use_reentrant=...) instead, or call backward inside the forward's fp8_autocast.")
    if getattr(module, "_last_forward_fp8", False) != fp8:
        module._last_forward_fp8 = fp8
