"""engine.recommend(statistic="grad"): per-GEMM gradient sensitivity, and per-GEMM picks as Debug rules."""

from __future__ import annotations

import math

import pytest
import torch

import engine
from engine.numerics.grad_sensitivity import gradient_sensitivity
from engine.recipes import Debug, MXFP8BlockScaling, NVFP4BlockScaling, RecipeMap
from tests import checkpoint_specs as specs
from tests.test_recommend import WIDTH, batches, model_with_a_bad_layer, picks

NVFP4 = NVFP4BlockScaling()


def hand_gradient_error(model: torch.nn.Module, recipe_map: RecipeMap, batch: torch.Tensor, around) -> float:
    """The spec's statistic by another route: the model's gradients under `recipe_map` against all-high-precision
    ones, each tensor's relative error squared, weighed by its elements, square-rooted."""
    def grads(m):
        engine.set_recipe_map(m, m_map)
        m.zero_grad()
        with engine.fp8_autocast(recipe=around):
            m(batch).square().mean().backward()
        return [p.grad.double().clone() for p in m.parameters()]
    m_map = RecipeMap(rules=[], default=None)
    reference = grads(model)
    m_map = recipe_map
    torch.manual_seed(0)  # the streams of stochastic rounding, as the statistic draws them
    got = grads(model)
    rel = [((g - r).norm() / r.norm()).item() ** 2 * r.numel() for g, r in zip(got, reference)]
    return math.sqrt(sum(rel) / sum(r.numel() for r in reference))


@pytest.mark.parametrize("recipe_class", [c.__name__ for c in specs.exported_recipe_classes()])
def test_the_gradient_error_is_the_spec_for_every_recipe(recipe_class):
    recipe = specs.make_recipe(recipe_class)
    torch.manual_seed(0)
    model = torch.nn.Sequential(engine.Linear(WIDTH, WIDTH), engine.Linear(WIDTH, WIDTH))
    data = batches(1)
    errors = gradient_sensitivity(model, data, [recipe], lambda m, b: m(b).square().mean())
    assert set(errors) == {(str(i), g) for i in range(2) for g in ("fprop", "dgrad", "wgrad")}
    # layer 0's dgrad reaches no parameter (its input is the data): no error; layer 1's reaches layer 0's grads
    assert errors[("0", "dgrad")] == (0.0,)
    for (layer, gemm), (error,) in errors.items():
        others = tuple(g for g in ("fprop", "dgrad", "wgrad") if g != gemm)
        if isinstance(recipe, Debug):
            others = tuple(g for g in ("fprop", "dgrad", "wgrad") if g in others + recipe.high_precision)
            wrapped, keep = recipe.recipe, {"fake_quantize": tuple(g for g in recipe.fake_quantize if g == gemm),
                                            "current_scaling": tuple(g for g in recipe.current_scaling if g == gemm)}
        else:
            wrapped, keep = recipe, {}
        alone = RecipeMap(rules=[(layer, Debug(wrapped, high_precision=others, **keep))], default=None)
        fresh = torch.nn.Sequential(engine.Linear(WIDTH, WIDTH), engine.Linear(WIDTH, WIDTH))
        fresh.load_state_dict(model.state_dict())
        want = hand_gradient_error(fresh, alone, data[0], recipe)
        assert error == pytest.approx(want, rel=1e-3, abs=1e-6), (layer, gemm)


def test_the_grad_statistic_keeps_the_badly_scaled_layers_fprop_in_high_precision(capsys):
    # layer 0's weight has huge columns 0, 16, 32, 48 (zero inputs there): its NVFP4 weight blocks crush every other
    # weight, so its fprop is far off; its dgrad reaches no parameter (its input is the data), its wgrad (dY^T x)
    # does not read W
    model, data = model_with_a_bad_layer(), batches()
    recipe_map = engine.recommend(model, data, candidates=[NVFP4], budget=0.25, threshold=0.3, statistic="grad")
    table = capsys.readouterr().out
    got = picks(recipe_map)
    assert got[0] == Debug(NVFP4, high_precision=("fprop",)) and got[1:] == [NVFP4] * 3
    assert "Adam-normalized gradient" in table and "per layer and GEMM" in table
    assert "8.3% of GEMM FLOPs above nvfp4" in table
    rows = {tuple(line.split()[:2]): float(line.split()[3]) for line in table.splitlines()[3:]}
    assert len(rows) == 12 and rows[("0", "fprop")] > 0.5 and rows[("0", "dgrad")] == 0.0
    assert max(e for item, e in rows.items() if item != ("0", "fprop")) < 0.3
    engine.set_recipe_map(model, recipe_map)  # the model takes it; the Debug rule is saved with the model
    assert RecipeMap.from_plain(recipe_map.to_plain()).recipe_for("0") == got[0]


@pytest.mark.parametrize("budget, kept", [(0.0, 0), (1 / 12, 1), (1 / 6, 2), (1.0, 11)])
def test_the_budget_counts_a_third_of_a_layers_flops_per_gemm(budget, kept):
    # every GEMM over the threshold but layer 0's dgrad (no error: it reaches no parameter); a GEMM is 1/12 of FLOPs
    recipe_map = engine.recommend(model_with_a_bad_layer(), batches(1), candidates=[NVFP4], budget=budget,
                                  threshold=1e-9, statistic="grad", show=False)
    got = picks(recipe_map)
    hp = sum(3 if p is None else len(p.high_precision) if isinstance(p, Debug) else 0 for p in got)
    assert hp == kept
    if kept:  # the largest error, the badly scaled layer's fprop, is the first kept
        assert got[0] == Debug(NVFP4, high_precision=("fprop",) if kept < 11 else ("fprop", "wgrad"))
    if kept == 11:
        assert got[1:] == [None] * 3  # every GEMM of a layer kept: the layer in high precision, no Debug


def test_the_grad_statistic_takes_one_candidate():
    with pytest.raises(ValueError, match="candidates: statistic='grad' picks per GEMM .*give one candidate, got 2"):
        engine.recommend(model_with_a_bad_layer(), batches(1), candidates=[NVFP4, MXFP8BlockScaling()],
                         statistic="grad")


def test_the_grad_statistic_leaves_the_model_as_it_was():
    model = model_with_a_bad_layer()
    model[0].weight.grad = torch.ones_like(model[0].weight)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine.recommend(model, batches(1), candidates=[NVFP4], statistic="grad", show=False)
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight)) and model[1].weight.grad is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items() if not k.endswith("_extra_state"))
    assert all(m._recipe_choice is None for m in model)


def test_a_late_switch_counts_the_gemms_a_debug_pick_keeps(capsys):
    schedule = engine.recommend(model_with_a_bad_layer(), batches(1), candidates=[NVFP4], budget=0.25, threshold=0.3,
                                statistic="grad", switch_at=0.9)
    assert schedule.recipe_map.recipe_for("0") == Debug(NVFP4, high_precision=("fprop",))
    # 11 of 12 equal GEMMs in 4-bit before the switch, none after: 0.9 x 11/12 over the run
    assert "GEMM FLOPs in 4-bit: 91.7% before, 0.0% after, 82.5% over the run" in capsys.readouterr().out
