"""Contract: a state dict restores a model bit for bit, and loads under any other recipe as that recipe's model.

Round trip, every case of tests/conformance/recipes.py, high-precision and FP8 primary weights: a model
(engine.LayerNormMLP -> engine.Linear, tests/checkpoint_specs.py's TrainModel) trained 2 steps, saved through
torch.save / torch.load(weights_only=True) and loaded strictly into a model made from another seed, has the
same parameters (every buffer of a quantized one, NVFP4's amaxes included), the same scaling state (delayed
scales and histories, stochastic-rounding counters: each module's `to_plain`), and its next training step gives
the same output, gradients and scaling state, bit for bit.

Across recipes, every ordered pair (A, B) of the recipe classes (each as `make_recipe` builds it): a checkpoint
of a model trained under A, loaded into a model built for B (under `fp8_model_init(recipe=B)` for FP8 weights),
then run under B, is B's model of the same weights: the model built for B from the checkpoint's high-precision
values (`engine.plain_state_dict`), run under B, gives the same output and gradients bit for bit.
"""

from __future__ import annotations

import io

import pytest
import torch

import checkpoint_specs as specs
import engine
from conformance.recipes import CASES, DEFAULTS, Case
from engine.modules import FP8Module
from engine.tensors import QuantizedTensor

TOKENS = (2, 15)


def build(recipe, primary: bool, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # FP8 primary weights build their states here: NVFP4 draws its streams now
    with engine.fp8_model_init(enabled=primary, recipe=recipe):
        return specs.TrainModel()


def step(model: torch.nn.Module, recipe, seed: int, lr: float = 0.05) -> list[torch.Tensor]:
    """One SGD step on a fixed batch: the output, the input gradient and every parameter gradient."""
    torch.manual_seed(1000 + seed)  # states built at this forward draw NVFP4's streams from here
    x = torch.randn(*TOKENS, specs.WIDTH, generator=torch.Generator().manual_seed(seed)).requires_grad_(True)
    with engine.fp8_autocast(recipe=recipe):
        out = model(x)
    out.square().mean().backward()
    seen = [out.detach(), x.grad] + [p.grad.clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(lr * p.grad)  # FP8 primary weights are requantized in place
    model.zero_grad(set_to_none=True)
    return seen


def scaling_state(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every module's saved scaling state (`RecipeState.to_plain`: delayed scales and histories, counters)."""
    out = []
    for module in model.modules():
        if isinstance(module, FP8Module) and module._fwd_state is not None:
            for state in (module._fwd_state, module._bwd_state):
                part = state.to_plain() or {}
                out += [part[k] for k in sorted(part)]
    return out


def buffers(t: torch.Tensor) -> dict[str, torch.Tensor | None]:
    return t.qstorage.buffers() if isinstance(t, QuantizedTensor) else {"value": t.detach()}


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32) if t.element_size() == 4 else t


def assert_same_bits(got: list, want: list, what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} tensors, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), f"{what} {i}: one is None"
        if g is not None:
            assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(bits(g), bits(w)), f"{what} {i} differs"


def via_file(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("weights", ["hp", "fp8"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_round_trip_restores_the_bits(case: Case, weights: str) -> None:
    recipe = case.recipe()
    src = build(recipe, weights == "fp8", seed=0)
    for s in range(2):
        step(src, recipe, s)
    state = via_file(src.state_dict())
    assert all(type(v) is torch.Tensor for v in state.values())  # plain tensors only
    dst = build(case.recipe(), weights == "fp8", seed=1)
    dst.load_state_dict(state, strict=True)
    for (name, p), q in zip(src.named_parameters(), dst.parameters()):
        assert type(q) is type(p), name
        mine, theirs = buffers(p), buffers(q)
        assert list(mine) == list(theirs), name
        assert_same_bits(list(theirs.values()), list(mine.values()), name)
    # the states of a module that has not run yet are built at its first forward, with the loaded state in them:
    # compare after the next step, which reads them
    want, got = step(src, recipe, 2), step(dst, recipe, 2)
    assert_same_bits(got, want, "next step's output/gradient")
    for model in (src, dst):
        with engine.fp8_autocast(recipe=recipe):  # fold the last backward's records in
            pass
    assert_same_bits(scaling_state(dst), scaling_state(src), "scaling state")
    if case.id in ("DelayedScaling", "NVFP4BlockScaling", "CustomRecipe"):  # histories; counters; both
        assert scaling_state(src), "the recipe's state was not compared"


PAIRS = [(a, b) for a in DEFAULTS for b in DEFAULTS if a.class_name != b.class_name]


def without_extra_state(state: dict) -> dict:
    return {k: v for k, v in state.items() if not k.endswith("._extra_state")}


def same_quantizer(p: torch.Tensor, q: torch.Tensor) -> bool:
    return type(p.quantizer) is type(q.quantizer) and p.quantizer.config() == q.quantizer.config()


@pytest.mark.parametrize("weights", ["hp", "fp8"])
@pytest.mark.parametrize("source, target", PAIRS, ids=lambda c: str(c))
def test_a_checkpoint_loads_under_another_recipe_as_that_recipes_model(source: Case, target: Case,
                                                                       weights: str) -> None:
    """High-precision weights: B's model of the checkpoint's values (`engine.plain_state_dict`). FP8 weights: each
    weight B quantizes alike (the same quantizer class and config) keeps the checkpoint's buffers, any other is
    B's quantization of the checkpoint's value; and the model runs as B's model of those weights does without
    A's recipe and scaling state (the checkpoint without its `_extra_state` entries)."""
    primary = weights == "fp8"
    a, b = source.recipe(), target.recipe()
    src = build(a, primary, seed=0)
    for s in range(2):
        step(src, a, s)
    state = via_file(src.state_dict())
    loaded = build(b, primary, seed=1)
    # the warning comes at load (FP8 weights: the model has B's states already) or at the first forward
    with pytest.warns(UserWarning, match=rf"saved under {type(a).__name__}\(.*loaded under {type(b).__name__}\("):
        loaded.load_state_dict(state, strict=True)
        loaded_weights = [(type(p), {k: None if t is None else t.clone() for k, t in buffers(p).items()})
                          for p in loaded.parameters()]
        got = step(loaded, b, 2)
    if primary:
        requantized = build(b, primary, seed=1)
        requantized.load_state_dict(engine.plain_state_dict(state), strict=True)
        for (name, mine), (kind, theirs), requant in zip(src.named_parameters(), loaded_weights,
                                                         requantized.parameters()):
            assert kind is type(requant), name  # the kind of tensor B's model holds
            if isinstance(mine, QuantizedTensor) and isinstance(requant, QuantizedTensor):
                want_buffers = buffers(mine) if same_quantizer(mine, requant) else buffers(requant)
                assert_same_bits(list(theirs.values()), list(want_buffers.values()), name)
    fresh = build(b, primary, seed=1)
    fresh.load_state_dict(without_extra_state(state) if primary else engine.plain_state_dict(state), strict=True)
    want = step(fresh, b, 2)
    assert_same_bits(got, want, f"{source} -> {target}")
