"""Contract: engine.Linear, LayerNormLinear and LayerNormMLP under every recipe compute what a float64 model of
their formulas computes on the same weights, within the bound the recipe's element formats allow.

For every case of tests/conformance/recipes.py (every recipe `engine.recipes` exports, and its variants), with
high-precision weights and with FP8 primary weights (`fp8_model_init`): one step's output, input gradient and
every parameter gradient against tests/torch_reference.py, each within the bound of tests/conformance/bounds.py
(its docstring derives it). The same comparison against the model with one weight rolled by a row must fail:
the bound is one a wrong module cannot meet, at every case. 2 x 15 tokens (not a multiple of NVFP4's 16 or MX's
32); widths 64 -> 48 (Linear, LayerNormLinear) and 64 -> 96 -> 64 (LayerNormMLP).

`python -m conformance.test_conformance_modules` (from tests/) prints each tensor's worst error over 5 seeds
next to its bound.
"""

from __future__ import annotations

import pytest
import torch

import engine
import torch_reference as ref
from conftest import perturb_norms
from conformance import bounds
from conformance.recipes import CASES, Case
from engine.tensors import QuantizedTensor

TOKENS = (2, 15)
SPECS = {"linear": {"kind": "linear"}, "lnlinear": {"kind": "lnlinear"}, "mlp": {"kind": "mlp"}}
SIZES = {"linear": (64, 48), "lnlinear": (64, 48), "mlp": (64, 96)}
CLASSES = {"linear": engine.Linear, "lnlinear": engine.LayerNormLinear, "mlp": engine.LayerNormMLP}


def build(kind: str, recipe, primary: bool, seed: int = 0) -> torch.nn.Module:
    """The module, its norm parameters moved off 1 and 0 (a norm ignoring them shows)."""
    torch.manual_seed(seed)
    with engine.fp8_model_init(enabled=primary, recipe=recipe):
        module = CLASSES[kind](*SIZES[kind])
    return perturb_norms(module)


def params_of(module) -> dict[str, torch.Tensor]:
    """The parameters by name, FP8 primary weights as their (rowwise) dequantized values."""
    return {n: (p.dequantize() if isinstance(p, QuantizedTensor) else p).detach()
            for n, p in module.named_parameters()}


def inputs(kind: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + seed)
    width, hidden = SIZES[kind]
    out = width if kind == "mlp" else hidden
    return torch.randn(*TOKENS, width, generator=gen), torch.randn(*TOKENS, out, generator=gen)


def run(module, recipe, x: torch.Tensor, dy: torch.Tensor):
    """Two identical steps (no update): the second one's output and gradients. Delayed scaling quantizes it
    with the scales the first step recorded (of these same tensors)."""
    for _ in range(2):
        xg = x.clone().requires_grad_(True)
        module.zero_grad()
        with engine.fp8_autocast(recipe=recipe):
            out = module(xg)
        out.backward(dy)
    return out.detach(), {"x": xg.grad, **{n: p.grad for n, p in module.named_parameters()}}


def errors(out, grads, want_out, want) -> dict[str, float]:
    assert set(grads) == set(want), (sorted(grads), sorted(want))
    return {"out": ref.rel_error(out, want_out), **{n: ref.rel_error(grads[n], want[n]) for n in want}}


def measure(case: Case, kind: str, primary: bool, seed: int = 0):
    """(errors, bounds, module, x, dy, output, gradients) of one step."""
    recipe = case.recipe()
    module = build(kind, recipe, primary, seed)
    x, dy = inputs(kind, seed)
    out, grads = run(module, recipe, x, dy)
    params = params_of(module)
    got = errors(out, grads, *ref.forward_backward(SPECS[kind], params, x, dy))
    return got, bounds.bounds(module, SPECS[kind], params, x, dy, primary), module, x, dy, out, grads


@pytest.mark.parametrize("weights", ["hp", "fp8"])
@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("case", CASES, ids=str)
def test_module_matches_the_float64_model_within_the_format_bound(case: Case, kind: str, weights: str) -> None:
    got, bound, module, x, dy, out, grads = measure(case, kind, weights == "fp8")
    if weights == "fp8":
        assert any(isinstance(p, QuantizedTensor) for p in module.parameters()), "no FP8 primary weight was made"
    for name, err in got.items():
        assert err < bound[name], f"{name}: error {err:.3g} >= bound {bound[name]:.3g}"
    # the bound can fail: the module against the model with a weight rolled by one row is outside it
    params = params_of(module)
    weight = "fc2_weight" if kind == "mlp" else "weight"
    wrong = {**params, weight: params[weight].roll(1, dims=0)}
    bad = errors(out, grads, *ref.forward_backward(SPECS[kind], wrong, x, dy))
    assert bad["out"] > bound["out"], f"a wrong weight's output is within the bound ({bad['out']:.3g})"
    assert bad["x"] > bound["x"], f"a wrong weight's input gradient is within the bound ({bad['x']:.3g})"


def print_table(seeds: int = 5) -> None:
    """Per case, module and weights: each tensor's worst error over `seeds` seeds / its bound."""
    for case in CASES:
        for kind in SPECS:
            for primary in (False, True):
                worst: dict[str, float] = {}
                for seed in range(seeds):
                    got, bound = measure(case, kind, primary, seed)[:2]
                    for name, err in got.items():
                        worst[name] = max(worst.get(name, 0.0), err / bound[name])
                cells = " ".join(f"{n}={r:.2f}" for n, r in worst.items())
                print(f"{case.id} {kind} {'fp8' if primary else 'hp'}: max {max(worst.values()):.2f} | {cells}")


if __name__ == "__main__":
    print_table()
