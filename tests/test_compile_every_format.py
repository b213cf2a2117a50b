"""torch.compile(fullgraph=True) by contract: every recipe `engine.recipes` exports (high-precision and FP8 primary
weights) and every `engine.quantize_` config compiles whole and computes eager's bits.

The recipes and configs are derived from the package (tests/checkpoint_specs.py), so a new recipe class or config
is compiled here without a line added. Each case is one small graph under "aot_eager" (Dynamo and AOTAutograd as
torch.compile runs them, without Inductor's code generation); the custom ops run eager's code, so the compiled
outputs, gradients and scaling state (delayed scaling's amax history and scales, NVFP4's stochastic-rounding
counters) must equal eager's bit for bit. About 1.5 minutes for all cases on 2 busy cores.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import checkpoint_specs as specs
import engine
from engine.modules import FP8Module

RECIPES = [cls.__name__ for cls in specs.exported_recipe_classes()]
CONFIGS = specs.every_config()
# 2 x 15 tokens: not a multiple of NVFP4's 16 (its RHT'd wgrad operands are padded) nor of MX's 32-token blocks
TOKENS = (2, 15)
STEPS = 2


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def build(recipe_class: str, weights: str) -> torch.nn.Module:
    """engine.LayerNormMLP -> engine.Linear (tests/checkpoint_specs.py's TrainModel), the same weights every call."""
    torch.manual_seed(0)
    with engine.fp8_model_init(enabled=weights == "fp8", recipe=specs.make_recipe(recipe_class)):
        return specs.TrainModel()


def train(model: torch.nn.Module, params: torch.nn.Module, recipe_class: str) -> list[torch.Tensor]:
    """STEPS SGD steps; every output, input gradient and parameter gradient, then every module's scaling state
    (after the last backward is folded in) and the parameters."""
    recipe = specs.make_recipe(recipe_class)
    optimizer = torch.optim.SGD(params.parameters(), lr=0.05)
    torch.manual_seed(1)  # the states (built at the first step) draw NVFP4's stochastic-rounding streams from it
    seen = []
    for step in range(STEPS):
        x = torch.randn(*TOKENS, specs.WIDTH, generator=torch.Generator().manual_seed(step)).requires_grad_()
        with engine.fp8_autocast(recipe=recipe):
            out = model(x)
        out.float().square().mean().backward()
        seen += [out.detach(), x.grad] + [p.grad.clone() for p in params.parameters()]
        optimizer.step()  # FP8 primary weights: quantized back in place, outside the graph
        optimizer.zero_grad()
    with engine.fp8_autocast(recipe=recipe):  # fold in the last backward
        pass
    for module in params.modules():
        if isinstance(module, FP8Module):
            for state in (module._fwd_state, module._bwd_state):
                seen += [t.clone() for t in state.op_tensors()] + [c.clone() for c in getattr(state, "rng_counters", [])]
    seen += [p.dequantize() if isinstance(p, engine.QuantizedTensor) else p.detach() for p in params.parameters()]
    return seen


def refusal_of(model: torch.nn.Module) -> str | None:
    """Why the model's recipe states cannot compile (`RecipeState.compile_refusal` where a recipe has one)."""
    for module in model.modules():
        if isinstance(module, FP8Module):
            for state in (module._fwd_state, module._bwd_state):
                if getattr(state, "compile_refusal", None):
                    return state.compile_refusal
    return None


@pytest.mark.parametrize("weights", ["hp", "fp8"])
@pytest.mark.parametrize("recipe_class", RECIPES)
def test_every_recipe_compiles_whole_with_eager_bits(recipe_class: str, weights: str) -> None:
    eager = build(recipe_class, weights)
    want = train(eager, eager, recipe_class)
    model = build(recipe_class, weights)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    refusal = refusal_of(eager)
    if refusal is not None:  # a recipe whose states say why they cannot compile: that is the error's first line
        with pytest.raises(Exception) as err:
            train(compiled, model, recipe_class)
        assert str(err.value).splitlines()[0] == refusal.splitlines()[0], str(err.value)
        return
    got = train(compiled, model, recipe_class)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])
    stateful = [t for m in model.modules() if isinstance(m, FP8Module) for s in (m._fwd_state, m._bwd_state)
                for t in s.op_tensors() + list(getattr(s, "rng_counters", []))]
    if recipe_class in ("DelayedScaling", "NVFP4BlockScaling"):
        assert stateful  # the state compared below exists (delayed histories, NVFP4's counters)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), f"item {i} differs"


@pytest.mark.parametrize("config", CONFIGS, ids=specs.config_name)
def test_every_quantize_config_compiles_whole_with_eager_bits(config) -> None:
    torch.manual_seed(0)
    model = engine.quantize_(specs.InferenceModel().bfloat16(), config)  # engine.LayerNormMLP, engine.Linear, nn.Linear
    x = torch.randn(*TOKENS, specs.WIDTH, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.no_grad():
        want = model(x)
        got = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert got.dtype == want.dtype and torch.equal(got, want)
