"""Activation recompute: engine.checkpoint against the same steps run without recompute.

The reference is the same model and batches run without any checkpointing; gradients
(input, weights, biases, norm parameters) must be the same bits, and delayed-scaling
scales and amax histories the same after three steps, for backward inside and after the
fp8_autocast and both torch checkpoint implementations.

That every recipe `engine.recipes` exports (and each variant) recomputes bit for bit is the contract of
tests/conformance/test_conformance_recompute.py; here: what the recompute quantizes, the autocast settings it
replays, nested and repeated recomputes, refusals, and plain torch.utils.checkpoint, every exported recipe
where a test is about recipes.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import checkpoint_specs
import engine
from engine import autocast
from engine.quantizers import Quantizer
from engine.recipes import DelayedScaling, Float8CurrentScaling

D, FFN = 32, 64
#: every recipe `engine.recipes` exports, by class name (tests/checkpoint_specs.py: OperandRecipe keeps wgrad in
#: high precision)
RECIPES = {cls.__name__: checkpoint_specs.make_recipe(cls.__name__)
           for cls in checkpoint_specs.exported_recipe_classes()}
MODES = ("reentrant", "non_reentrant")


def steps_for(name: str) -> int:
    """Three steps where scaling state carries over (delayed histories, stochastic-rounding counters), one where
    each step starts afresh."""
    return 3 if name in ("DelayedScaling", "NVFP4BlockScaling", "CustomRecipe") else 1


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = engine.LayerNormLinear(D, 2 * D)
        self.proj = engine.Linear(2 * D, D)
        self.mlp = engine.LayerNormMLP(D, FFN, normalization="RMSNorm", activation="swiglu")

    def forward(self, x: torch.Tensor, residual_scale: float = 1.0) -> torch.Tensor:
        h = residual_scale * x + self.proj(self.qkv(x))
        return h + self.mlp(h)


def call(model: Stack, x: torch.Tensor, how: str) -> torch.Tensor:
    if how == "none":
        return model(x, residual_scale=0.5)
    if how.startswith("torch_"):
        return torch_checkpoint(model, x, 0.5, use_reentrant=how == "torch_reentrant")
    return engine.checkpoint(model, x, use_reentrant=how == "reentrant", residual_scale=0.5)


def train(recipe, how: str, inside: bool, steps: int = 3, calibrating: bool = False, forward=call):
    """Per step the gradients of the input and every parameter; then the delayed states (scale, history)."""
    torch.manual_seed(0)
    model = Stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    grads = []
    for step in range(steps):
        x = torch.randn(2, 16, D, generator=torch.Generator().manual_seed(step), requires_grad=True)
        with engine.fp8_autocast(enabled=not calibrating, calibrating=calibrating, recipe=recipe):
            loss = forward(model, x, how).pow(2).mean()
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        grads.append([x.grad, *(p.grad.clone() for p in model.parameters())])
        opt.step()
        opt.zero_grad()
    states = [t.clone() for m in (model.qkv, model.proj, model.mlp) for s in (m._fwd_state, m._bwd_state)
              for t in (getattr(s, "scale", None), getattr(s, "amax_history", None)) if t is not None]
    return grads, states


def assert_same_bits(got, want) -> None:
    (got_grads, got_states), (want_grads, want_states) = got, want
    for step, (g, w) in enumerate(zip(got_grads, want_grads)):
        for i, (a, b) in enumerate(zip(g, w)):
            assert torch.equal(a, b), f"step {step}, gradient {i}: max diff {(a - b).abs().max()}"
    assert len(got_states) == len(want_states)
    for i, (a, b) in enumerate(zip(got_states, want_states)):
        assert torch.equal(a, b), f"scaling state tensor {i} differs"


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_while_calibrating_records_once(mode: str) -> None:
    recipe = DelayedScaling(amax_history_len=4)
    assert_same_bits(train(recipe, mode, inside=False, calibrating=True),
                     train(recipe, "none", inside=False, calibrating=True))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", RECIPES)
def test_recompute_quantizes_what_forward_quantized(name: str, mode: str, monkeypatch) -> None:
    counts = {}
    quantize_storage = Quantizer.quantize_storage

    def counting(self, x):
        key = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        counts[key] = counts.get(key, 0) + 1
        return quantize_storage(self, x)

    monkeypatch.setattr(Quantizer, "quantize_storage", counting)
    train(RECIPES[name], "none", inside=False, steps=1)
    plain, counts = counts, {}
    train(RECIPES[name], mode, inside=False, steps=1)
    assert plain["forward"] > 0 and plain["backward"] > 0
    assert counts["backward"] == plain["backward"] + plain["forward"]  # the recompute ran in FP8, in backward


@pytest.mark.parametrize("mode", MODES)
def test_recompute_replays_the_autocast_settings(mode: str) -> None:
    group = dist.ProcessGroup(dist.HashStore(), 0, 1)  # a group object only: torch.distributed stays uninitialised
    recipe = DelayedScaling(amax_history_len=8, margin=1)
    seen = []
    layer = engine.Linear(D, D)

    def function(x):
        seen.append((autocast.is_fp8_enabled(), autocast.is_calibrating(), autocast.get_recipe(),
                     autocast.get_fp8_group()))
        return layer(x)

    x = torch.randn(4, D, requires_grad=True)
    with engine.fp8_autocast(recipe=recipe, fp8_group=group):
        y = engine.checkpoint(function, x, use_reentrant=mode == "reentrant")
    y.sum().backward()
    assert len(seen) == 2 and seen[1] == seen[0] == (True, False, recipe, group)
    assert autocast.autocast_settings() == (False, False, None, None) and autocast.recompute_phase() is None


def one_layer_step(mode: str, recipe: DelayedScaling):
    """A checkpointed Linear after one delayed step; y.sum() gives dy = 1, so its next backward scale is 57344."""
    layer = engine.Linear(D, D)
    with engine.fp8_autocast(recipe=recipe):
        y = engine.checkpoint(layer, torch.randn(4, D, requires_grad=True), use_reentrant=mode == "reentrant")
    return layer._bwd_state, y


@pytest.mark.parametrize("mode", MODES)
def test_recomputed_backward_state_joins_the_pending_step(mode: str) -> None:
    recipe = DelayedScaling(amax_history_len=4)
    bwd, y = one_layer_step(mode, recipe)
    with engine.fp8_autocast(recipe=recipe):
        pass  # another step first: the pending backward states are folded in (nothing recorded yet) and dropped
    y.sum().backward()  # recomputed outside any autocast: the backward state joins a new pending step
    assert bwd.amax_history[0, 0] == 1 and bwd.scale[0] == 1
    with engine.fp8_autocast(recipe=recipe):  # folded in at this entry
        assert bwd.amax_history[-1, 0] == 1 and bwd.scale[0] == 57344
    assert bwd.scale[0] == 57344  # and only once


@pytest.mark.parametrize("mode", MODES)
def test_backward_in_another_thread_is_folded_in(mode: str) -> None:
    """As on a GPU, where autograd runs backward in a device thread with autocast state of its own: the
    backward state was registered by the forward, in the thread that will enter the next autocast."""
    recipe = DelayedScaling(amax_history_len=4)
    bwd, y = one_layer_step(mode, recipe)
    thread = threading.Thread(target=y.sum().backward)
    thread.start()
    thread.join()
    assert bwd.amax_history[0, 0] == 1 and bwd.scale[0] == 1
    with engine.fp8_autocast(recipe=recipe):
        assert bwd.scale[0] == 57344


@pytest.mark.parametrize("mode", MODES)
def test_nested_checkpoints(mode: str) -> None:
    """An engine.checkpoint inside another: the inner forward runs inside the outer recompute."""
    recipe = RECIPES["DelayedScaling"]

    def nested(model, x, how):
        if how == "none":
            return model(x, residual_scale=0.5)
        inner = lambda h: h + model.mlp(h)  # noqa: E731
        outer = lambda x: engine.checkpoint(  # noqa: E731
            inner, 0.5 * x + model.proj(model.qkv(x)), use_reentrant=how != "reentrant")
        return engine.checkpoint(outer, x, use_reentrant=how == "reentrant")

    assert_same_bits(train(recipe, mode, inside=False, forward=nested), train(recipe, "none", inside=False))


@pytest.mark.parametrize("mode", MODES)
def test_second_backward_recomputes_again(mode: str) -> None:
    recipe = RECIPES["DelayedScaling"]
    results = []
    for how in ("none", mode):
        torch.manual_seed(0)
        model = Stack()
        x = torch.randn(2, 16, D, requires_grad=True)
        with engine.fp8_autocast(recipe=recipe):
            loss = call(model, x, how).pow(2).mean()
        loss.backward(retain_graph=True)
        first = x.grad.clone()
        loss.backward()
        results.append((first, x.grad, model.mlp.fc1_weight.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", MODES)
def test_recompute_running_other_modules_raises(mode: str) -> None:
    layer, other = engine.Linear(D, D), engine.Linear(D, D)
    calls = []

    def function(x):  # the recompute runs a module the forward did not
        calls.append(1)
        return layer(x) if len(calls) == 1 else other(x)

    x = torch.randn(4, D, requires_grad=True)
    with engine.fp8_autocast(recipe=Float8CurrentScaling()):
        y = engine.checkpoint(function, x, use_reentrant=mode == "reentrant")
    with pytest.raises(RuntimeError, match=r"ran an engine module 1 time\(s\), the forward 0"):
        y.sum().backward()


def test_checkpoint_checks_its_arguments() -> None:
    x = torch.randn(4, D, requires_grad=True)
    with pytest.raises(TypeError, match="use_reentrant: expected a bool"):
        engine.checkpoint(engine.Linear(D, D), x, use_reentrant="yes")
    with pytest.raises(TypeError, match="function: expected a callable"):
        engine.checkpoint(3, x)


# ---------------------------------------------------------------- plain torch.utils.checkpoint
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", RECIPES)
def test_torch_checkpoint_with_backward_inside_autocast_is_exact(name: str, mode: str) -> None:
    """Nothing changes between forward and backward inside the autocast: torch's recompute repeats the forward."""
    steps = steps_for(name)
    assert_same_bits(train(RECIPES[name], f"torch_{mode}", True, steps), train(RECIPES[name], "none", True, steps))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["DelayedScaling", "MXFP8BlockScaling"])
def test_torch_checkpoint_after_autocast_raises(name: str, mode: str) -> None:
    """Recomputed outside the autocast it would run in high precision: an error names engine.checkpoint."""
    with pytest.raises(RuntimeError, match=r"Use engine\.checkpoint"):
        train(RECIPES[name], f"torch_{mode}", inside=False, steps=1)


@pytest.mark.parametrize("mode", MODES)
def test_torch_checkpoint_in_high_precision_still_works(mode: str) -> None:
    """A model that ran in FP8 once and then trains in high precision may use torch's checkpoint freely."""
    torch.manual_seed(0)
    model = Stack()
    with engine.fp8_autocast(recipe=Float8CurrentScaling()):
        model(torch.randn(2, D)).sum().backward()
    model.zero_grad()
    x = torch.randn(2, 16, D, requires_grad=True)
    torch_checkpoint(model, x, use_reentrant=mode == "reentrant").pow(2).mean().backward()
    got = [x.grad, *(p.grad.clone() for p in model.parameters())]
    x.grad = None
    model.zero_grad()
    model(x).pow(2).mean().backward()
    for a, b in zip(got, [x.grad, *(p.grad for p in model.parameters())]):
        assert torch.equal(a, b)
