"""engine.recommend: a per-layer map from measured what-if GEMM errors, within a FLOP budget."""

from __future__ import annotations

import pytest
import torch

import engine
from engine.recipes import Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling

WIDTH, TOKENS = 64, 32
NVFP4, MXFP8 = NVFP4BlockScaling(), MXFP8BlockScaling()


def model_with_a_bad_layer(bad: int | None = 0) -> torch.nn.Sequential:
    """Four layers; layer `bad` has weight columns 0, 16, 32, 48 scaled by 1e3 and meets inputs that are zero there
    (batches()): its NVFP4 blocks of 16 crush every other weight, which carry the whole output."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[engine.Linear(WIDTH, WIDTH) for _ in range(4)])
    if bad is not None:
        with torch.no_grad():
            model[bad].weight[:, 0::16] *= 1e3
    return model


def batches(n: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randn(TOKENS, WIDTH, generator=g)
        x[:, 0::16] = 0
        out.append(x)
    return out


def picks(recipe_map, n: int = 4) -> list:
    return [recipe_map.recipe_for(str(i)) for i in range(n)]


def test_the_badly_scaled_layer_gets_the_higher_precision_and_the_others_stay_in_4_bit(capsys):
    model = model_with_a_bad_layer()
    recipe_map = engine.recommend(model, batches(), candidates=[NVFP4, MXFP8], budget=0.25, threshold=0.3)
    assert picks(recipe_map) == [MXFP8, NVFP4, NVFP4, NVFP4]
    table = capsys.readouterr().out
    assert "nvfp4 over threshold" in table and "25.0% of GEMM FLOPs above nvfp4" in table
    engine.set_recipe_map(model, recipe_map)  # a map the model takes as it is
    assert engine.recipe_map_of(model).recipe_for("0") == MXFP8


def test_a_layer_no_candidate_suits_goes_to_high_precision():
    recipe_map = engine.recommend(model_with_a_bad_layer(), batches(), candidates=[NVFP4], budget=0.25, threshold=0.3,
                                  show=False)
    assert picks(recipe_map) == [None, NVFP4, NVFP4, NVFP4]


def test_a_healthy_model_stays_in_the_first_candidate():
    recipe_map = engine.recommend(model_with_a_bad_layer(None), batches(), candidates=[Float8CurrentScaling()],
                                  budget=0.5, threshold=0.1, show=False)
    assert picks(recipe_map) == [Float8CurrentScaling()] * 4


@pytest.mark.parametrize("budget, promoted", [(0.0, 0), (0.25, 1), (0.5, 2), (0.6, 2), (1.0, 4)])
def test_the_budget_caps_the_share_of_flops_above_the_first_candidate_and_keeps_the_worst_layer(budget, promoted):
    # every layer's NVFP4 error breaks this threshold, no MXFP8 error does; layers are alike in FLOPs (a quarter each)
    recipe_map = engine.recommend(model_with_a_bad_layer(), batches(1), candidates=[NVFP4, MXFP8], budget=budget,
                                  threshold=0.1, show=False)
    got = picks(recipe_map)
    assert sum(p is not NVFP4 for p in got) == promoted
    assert (got[0] == MXFP8) == (promoted > 0)  # the largest error is the first kept


def test_the_loss_statistic_picks_the_badly_scaled_layer_too(capsys):
    # layer 0 alone in NVFP4 moves the loss by far more than 10%, every other layer (and MXFP8 anywhere) by under 10%
    recipe_map = engine.recommend(model_with_a_bad_layer(), batches(), candidates=[NVFP4, MXFP8], budget=0.25,
                                  threshold=0.1, statistic="loss")
    assert picks(recipe_map) == [MXFP8, NVFP4, NVFP4, NVFP4]
    assert "relative loss change with the layer alone quantized" in capsys.readouterr().out
    # every layer over a tiny threshold: the budget keeps the layer whose loss change is the largest
    recipe_map = engine.recommend(model_with_a_bad_layer(2), batches(), candidates=[NVFP4], budget=0.25,
                                  threshold=1e-9, statistic="loss", show=False)
    assert picks(recipe_map) == [NVFP4, NVFP4, None, NVFP4]


def test_the_loss_statistic_is_the_relative_loss_change_of_one_layer_quantized_alone(capsys):
    from engine.recipes import RecipeMap
    model, data = model_with_a_bad_layer(), batches()
    engine.recommend(model, data, candidates=[NVFP4], budget=0.0, threshold=1.0, statistic="loss")
    printed = {line.split()[0]: float(line.split()[2]) for line in capsys.readouterr().out.splitlines()[3:]}
    with torch.no_grad():
        reference = [model(x).square().mean().item() for x in data]
        for i in range(4):  # an independent route: a map with layer i alone in NVFP4, on a fresh copy of the model
            alone = engine.set_recipe_map(model_with_a_bad_layer(), RecipeMap(rules=[(str(i), NVFP4)], default=None))
            with engine.fp8_autocast(recipe=NVFP4):
                changes = [abs(alone(x).square().mean().item() - r) / r for x, r in zip(data, reference)]
            assert printed[str(i)] == pytest.approx(sum(changes) / len(changes), rel=1e-3, abs=1e-4)


def test_flops_follow_the_layer_shapes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(engine.Linear(WIDTH, WIDTH), engine.Linear(WIDTH, 3 * WIDTH))  # 1/4 and 3/4 of FLOPs
    for budget, expected in ((0.3, [MXFP8, NVFP4]), (0.8, [MXFP8, NVFP4]), (1.0, [MXFP8, MXFP8]), (0.2, [NVFP4, NVFP4])):
        recipe_map = engine.recommend(model, batches(1), candidates=[NVFP4, MXFP8], budget=budget, threshold=0.1,
                                      show=False)
        got = [recipe_map.recipe_for(n) for n in ("0", "1")]
        if budget == 0.8:  # both fit alone; the one with the larger error goes first, then the other may not fit
            assert sum(p is MXFP8 for p in got) == 1
        else:
            assert got == expected


@pytest.mark.parametrize("statistic", ["gemm", "loss"])
def test_the_model_and_its_gradients_are_left_as_they_were(statistic):
    model = model_with_a_bad_layer()
    model[0].weight.grad = torch.ones_like(model[0].weight)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine.recommend(model, batches(), candidates=[NVFP4], budget=0.25, threshold=0.3, show=False, statistic=statistic)
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight)) and model[1].weight.grad is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items() if not k.endswith("_extra_state"))


@pytest.mark.parametrize("kwargs, error, message", [
    ({"budget": 1.5}, ValueError, "budget: expected a share of GEMM FLOPs in \\[0, 1\\], got 1.5"),
    ({"budget": True}, ValueError, "budget"),
    ({"threshold": 0}, ValueError, "threshold: expected a finite relative error > 0, got 0"),
    ({"threshold": float("inf")}, ValueError, "threshold"),
    ({"candidates": []}, ValueError, "candidates: expected a non-empty list"),
    ({"candidates": ["nvfp4"]}, TypeError, "candidates\\[0\\]: expected an engine recipe"),
    ({"candidates": [NVFP4, NVFP4]}, ValueError, "listed twice"),
    ({"batches": []}, ValueError, "batches: expected at least one batch"),
    ({"batches": torch.zeros(2, WIDTH)}, TypeError, "batches: expected an iterable of batches"),
    ({"statistic": "sqnr"}, ValueError, "statistic: expected one of 'gemm', 'loss', 'grad' .*got 'sqnr'"),
    ({"statistic": ["loss"]}, ValueError, "statistic: expected one of"),
])
def test_bad_arguments_are_refused_naming_them(kwargs, error, message):
    args = {"batches": batches(1), "candidates": [NVFP4], "budget": 0.2, "threshold": 0.2, **kwargs}
    with pytest.raises(error, match=message):
        engine.recommend(model_with_a_bad_layer(), **args)


def test_a_model_without_engine_layers_is_refused():
    with pytest.raises(ValueError, match="model: expected a model with engine layers"):
        engine.recommend(torch.nn.Linear(4, 4), [torch.zeros(2, 4)], candidates=[NVFP4])


def test_the_demo_applies_a_recipe_map_to_its_recipe_runs_only():
    from engine.recipes import RecipeMap
    from engine.train.model import GPTConfig
    from engine.train.run import RunConfig, build_model

    plain = RecipeMap(rules=[("blocks.0.mlp", None), ("blocks.1.*", MXFP8)]).to_plain()
    shape = GPTConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16)
    model = build_model(RunConfig(recipe="nvfp4", model=shape, recipe_map=plain), NVFP4)
    got = engine.recipe_map_of(model)
    assert got.recipe_for("blocks.0.mlp") is None and got.recipe_for("blocks.1.attn.qkv") == MXFP8
    assert len(got.rules) == 4  # blocks.0.attn.* inherit: no pick
    assert engine.recipe_map_of(build_model(RunConfig(recipe="bf16", model=shape, recipe_map=plain), None)) is None
