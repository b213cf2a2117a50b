"""The late switch to higher precision (NVFP4 paper, appendix D): RecipeSchedule, engine.recommend(switch_at=...),
`train --switch-at`, its checkpoint, and the share of GEMM FLOPs in 4-bit."""

from __future__ import annotations

import json

import pytest
import torch

import checkpoint_specs as specs
import engine
from engine.cli import main
from engine.recipes import Debug, MXFP8BlockScaling, NVFP4BlockScaling, RecipeMap, RecipeSchedule
from engine.recipes.operands import Gemm
from engine.recipes.schedule import four_bit_gemms
from engine.train.model import GPT, GPTConfig

NVFP4, MXFP8 = NVFP4BlockScaling(), MXFP8BlockScaling()
#: per exported recipe class, the GEMMs whose two operands are 4-bit (E2M1): a new class gets a line here
FOUR_BIT_GEMMS = {
    "NVFP4BlockScaling": {"fprop", "dgrad", "wgrad"}, "MXFP4BlockScaling": {"fprop", "dgrad", "wgrad"},
    "MXFP4MixedBlockScaling": {"fprop"},  # its backward is E4M3
    "DelayedScaling": set(), "Float8CurrentScaling": set(), "Float8BlockScaling": set(), "MXFP8BlockScaling": set(),
    "Float8RowwiseScaling": set(), "MXFP6BlockScaling": set(), "OperandRecipe": set(),
    "CustomRecipe": ValueError,  # its factory answers per module
    "Debug": {"fprop", "dgrad"},  # tests/checkpoint_specs.py's Debug: NVFP4 with wgrad in high precision
}
TINY = GPTConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16)
RUN = ["--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "16", "--batch-size", "2", "--eval-every", "4",
       "--speed-rounds", "0", "--in-process", "--no-progress"]


@pytest.mark.parametrize("recipe_class", [cls.__name__ for cls in specs.exported_recipe_classes()])
def test_four_bit_gemms_of_every_recipe(recipe_class):
    recipe = specs.make_recipe(recipe_class)
    if FOUR_BIT_GEMMS[recipe_class] is ValueError:
        with pytest.raises(ValueError, match="recipe: a CustomRecipe's quantizers come from its factory"):
            four_bit_gemms(recipe)
        return
    got = four_bit_gemms(recipe)
    assert {g.value for g, four in got.items() if four} == FOUR_BIT_GEMMS[recipe_class]


def test_four_bit_gemms_of_high_precision_and_debug_switches():
    assert not any(four_bit_gemms(None).values())
    got = four_bit_gemms(Debug(NVFP4, fake_quantize=("fprop",), current_scaling=("dgrad",)))
    assert got == {Gemm.FPROP: False, Gemm.DGRAD: False, Gemm.WGRAD: True}


def test_the_switch_step_and_the_maps_before_and_after():
    early = RecipeMap(rules=[("blocks.1.mlp", None), ("blocks.0.*", MXFP8)])
    schedule = RecipeSchedule(recipe_map=early, switch_at=0.9, switch_to=MXFP8)
    assert [schedule.switch_step(n) for n in (1, 10, 15, 200, 201)] == [1, 9, 14, 180, 181]  # round half up
    late = schedule.late_map()
    assert late.recipe_for("blocks.1.mlp") is None  # kept in high precision
    assert late.recipe_for("blocks.0.attn.qkv") == MXFP8 and late.recipe_for("blocks.1.attn.qkv") == MXFP8
    assert schedule.map_at(179, 200) is early and schedule.map_at(180, 200) == late
    assert RecipeSchedule(switch_at=0.5).late_map().recipe_for("anything") is None
    assert RecipeSchedule.from_plain(json.loads(json.dumps(schedule.to_plain()))) == schedule


@pytest.mark.parametrize("switch_at", [0, 1.5, float("nan")])
def test_a_bad_switch_fraction_is_refused(switch_at):
    with pytest.raises(ValueError, match="switch_at"):
        RecipeSchedule(switch_at=switch_at)


def test_the_share_of_gemm_flops_in_4_bit_counts_the_picks_by_weight_size():
    # per block: qkv 3 d^2, proj d^2, mlp 8 d^2 weights (12 d^2); the same tokens pass every layer
    model = GPT(GPTConfig(d_model=32, n_layers=4, n_heads=2, seq_len=16))
    assert engine.four_bit_flop_share(model, NVFP4) == 1.0
    assert engine.four_bit_flop_share(model, MXFP8) == 0.0
    assert engine.four_bit_flop_share(model, NVFP4, unquantized=("blocks.3",)) == 0.75  # TE's hand rule
    engine.set_recipe_map(model, RecipeMap(rules=[("blocks.3.mlp", None), ("blocks.2.attn.proj", MXFP8)]))
    assert engine.four_bit_flop_share(model, NVFP4) == pytest.approx(1 - 8 / 48 - 1 / 48)
    engine.set_recipe_map(model, RecipeMap(rules=[("blocks.0.*", Debug(NVFP4, high_precision=("wgrad",)))]))
    assert engine.four_bit_flop_share(model, None) == pytest.approx(12 / 48 * 2 / 3)  # the picks run, not the autocast's


def test_recommend_schedules_the_switch_and_prints_the_flop_shares(capsys):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[engine.Linear(64, 64) for _ in range(4)])
    batch = [torch.randn(32, 64)]
    plain = engine.recommend(model, batch, candidates=[NVFP4], budget=0.25, threshold=0.01, show=False)
    schedule = engine.recommend(model, batch, candidates=[NVFP4], budget=0.25, threshold=0.01, switch_at=0.9)
    assert schedule == RecipeSchedule(recipe_map=plain, switch_at=0.9, switch_to=None)
    assert sum(schedule.recipe_map.recipe_for(str(i)) is None for i in range(4)) == 1
    assert "GEMM FLOPs in 4-bit: 75.0% before, 0.0% after, 67.5% over the run" in capsys.readouterr().out


@pytest.mark.parametrize("kwargs, error, message", [
    ({"switch_at": 0}, ValueError, r"switch_at: expected None or a fraction in \(0, 1\]"),
    ({"switch_at": True}, ValueError, "switch_at"),
    ({"switch_at": 0.9, "switch_to": "bf16"}, TypeError, "switch_to: expected an engine recipe or None"),
    ({"switch_to": MXFP8}, ValueError, "switch_to: given without switch_at"),
])
def test_recommend_refuses_a_bad_switch(kwargs, error, message):
    with pytest.raises(error, match=message):
        engine.recommend(torch.nn.Sequential(engine.Linear(16, 16)), [torch.randn(4, 16)], candidates=[NVFP4],
                         show=False, **kwargs)


def test_train_switches_late_and_its_checkpoint_carries_the_switch(tmp_path):
    """Steps 0-2 under NVFP4 as a run without the switch (the same losses, bit for bit), steps 3-5 in bf16; a resumed
    run continues after the switch; the checkpoint's modules hold the late picks."""
    assert main(["train", "--recipes", "nvfp4", "--steps", "6", "--out", str(tmp_path / "plain"), *RUN]) == 0
    assert main(["train", "--recipes", "nvfp4", "--steps", "6", "--switch-at", "0.5", "--out", str(tmp_path / "sw"),
                 *RUN]) == 0
    (plain,) = json.loads((tmp_path / "plain" / "results.json").read_text())
    (switched,) = json.loads((tmp_path / "sw" / "results.json").read_text())
    assert switched["train_losses"][:3] == plain["train_losses"][:3]
    assert switched["train_losses"][3] != plain["train_losses"][3]
    assert (switched["switch_step"], switched["four_bit_flop_share"], plain["four_bit_flop_share"]) == (3, 0.5, 1.0)
    checkpoint = torch.load(tmp_path / "sw" / "nvfp4.pt", weights_only=True)
    assert checkpoint["switch_step"] == 3
    assert RecipeSchedule.from_plain(checkpoint["recipe_schedule"]) == RecipeSchedule(switch_at=0.5)
    model = GPT(TINY)
    model.load_state_dict(checkpoint["model"])
    picks = engine.recipe_map_of(model)
    assert len(picks.rules) == 6 and all(recipe is None for _, recipe in picks.rules)
    # a resume without a map continues the saved schedule: all in bf16, its share of 4-bit FLOPs 0
    assert main(["train", "--resume", str(tmp_path / "sw" / "nvfp4.pt"), "--recipe", "nvfp4", "--steps", "2",
                 "--out", str(tmp_path / "resumed"), *RUN[8:]]) == 0
    (resumed,) = json.loads((tmp_path / "resumed" / "results.json").read_text())
    assert (resumed["switch_step"], resumed["four_bit_flop_share"]) == (3, 0.0)


def test_train_switches_a_recommended_map_and_keeps_its_high_precision_layers(tmp_path):
    plain = RecipeMap(rules=[("blocks.1.mlp", None)]).to_plain()
    (tmp_path / "map.json").write_text(json.dumps(plain))
    assert main(["train", "--recipes", "nvfp4", "--steps", "4", "--recipe-map", str(tmp_path / "map.json"),
                 "--switch-at", "0.75", "--switch-to", "mxfp8", "--out", str(tmp_path / "run"), *RUN]) == 0
    (result,) = json.loads((tmp_path / "run" / "results.json").read_text())
    assert result["four_bit_flop_share"] == pytest.approx(0.75 * (1 - 8 / 24))
    model = GPT(TINY)
    model.load_state_dict(torch.load(tmp_path / "run" / "nvfp4.pt", weights_only=True)["model"])
    picks = engine.recipe_map_of(model)
    assert picks.recipe_for("blocks.1.mlp") is None and picks.recipe_for("blocks.0.mlp") == MXFP8


@pytest.mark.parametrize("argv, message", [
    (["--switch-at", "0"], "--switch-at: expected a fraction of the run's steps in (0, 1]"),
    (["--switch-at", "x"], "--switch-at: expected a fraction"),
    (["--switch-to", "fp4"], "--switch-to: invalid choice"),
])
def test_bad_switch_options_get_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(["train", "--recipes", "nvfp4", "--steps", "1", *argv, *RUN])
    assert message in capsys.readouterr().err


def test_train_takes_a_schedule_file_and_refuses_a_second_switch(tmp_path):
    """`--recipe-map` takes what `engine.recommend(..., switch_at=)` returns, as plain data (recommend_demo's file)."""
    path = tmp_path / "schedule.json"
    path.write_text(json.dumps(RecipeSchedule(recipe_map=RecipeMap(rules=[("blocks.0.mlp", None)]),
                                              switch_at=0.5).to_plain()))
    with pytest.raises(SystemExit, match=r"--switch-at: .* already holds a schedule \(switch_at 0.5\)"):
        main(["train", "--recipes", "nvfp4", "--steps", "2", "--recipe-map", str(path), "--switch-at", "0.9", *RUN])
    assert main(["train", "--recipes", "nvfp4", "--steps", "2", "--recipe-map", str(path), "--out",
                 str(tmp_path / "run"), *RUN]) == 0
    (result,) = json.loads((tmp_path / "run" / "results.json").read_text())
    assert (result["switch_step"], result["four_bit_flop_share"]) == (1, pytest.approx(0.5 * (1 - 8 / 24)))
