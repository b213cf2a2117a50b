"""Checkpoints saved by an earlier engine still load, and compute what they computed then (bit for bit).

tests/fixtures/checkpoints/ holds one checkpoint per recipe (high-precision weights with their scaling state,
FP8 primary weights, FP8 primary weights of odd shapes) and per inference config, each with an input and the
output the saving model gave for it (tests/fixtures/make_checkpoints.py wrote them; tests/checkpoint_specs.py
says what each is). A fixture that no longer loads strictly, warns, computes another output, or is written back
differently means the checkpoint format changed: fix the code, never the fixture. The outputs are bitwise on the
kind of CPU they were computed on (torch's CPU capability, stored with each); elsewhere only that check skips.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import checkpoint_specs as specs
import engine

FIXTURES = specs.fixtures()
RUN_SCRIPT = (f"run `python {specs.SCRIPT}` (it writes only the fixtures that do not exist yet) and commit "
              "the new files")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so NaNs and signed zeros compare too."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: {got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}")
    assert torch.equal(bits(got), bits(want)), (
        f"{what}: differs from the fixture (max |diff| {(got.double() - want.double()).abs().max().item():.3g})")


def load(name: str) -> dict:
    path = specs.path_of(name)
    if not path.exists():
        pytest.fail(f"{path.name}: no checkpoint fixture for {name}; {RUN_SCRIPT}")
    saved = torch.load(path, weights_only=True)
    assert set(saved) == {"state_dict", "input", "output", "cpu"}, sorted(saved)
    return saved


# ---------------------------------------------------------------------------- coverage
def test_every_exported_recipe_and_every_inference_config_has_its_fixtures() -> None:
    """Every recipe class engine.recipes exports and every inference config (each value of each field) has its
    files, and no file is left whose recipe or config is gone."""
    on_disk = {p.stem for p in specs.FIXTURE_DIR.glob("*.pt")}
    recipes = [cls.__name__ for cls in specs.exported_recipe_classes()]
    assert {"DelayedScaling", "MXFP8BlockScaling", "NVFP4BlockScaling", "OperandRecipe"} <= set(recipes)
    wanted = {f"train-{r}-{v}" for r in recipes for v in ("hp", "fp8")}
    wanted |= {specs.config_name(c) for c in specs.every_config()}
    configs = {type(f.config) for f in FIXTURES.values() if f.config is not None}
    assert configs == set(engine.inference.CONFIGS.values())
    missing = sorted(wanted - on_disk) + sorted(set(FIXTURES) - on_disk - wanted)
    assert not missing, f"no checkpoint fixture for {missing}; {RUN_SCRIPT}"
    orphans = sorted(on_disk - set(FIXTURES))
    assert not orphans, (f"fixtures {orphans} name no exported recipe or config: was a public recipe, config or "
                         "field value removed? Old checkpoints name it; keep it loading")


# ---------------------------------------------------------------------------- every fixture
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixture_loads_strictly_and_is_written_back_unchanged(name: str) -> None:
    """Into the identical model (built from another seed): a strict load without a warning, and the loaded (not
    yet run) model saves the same state dict again, key by key and bit for bit."""
    fixture, saved = FIXTURES[name], load(name)
    state = saved["state_dict"]
    assert all(type(v) is torch.Tensor for v in state.values())
    model = fixture.build(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same recipe, same config: nothing to warn about
        model.load_state_dict(state, strict=True)
        again = model.state_dict()
    assert list(again) == list(state), "the state dict is written with other keys"
    for key, value in state.items():
        assert_same_bits(again[key], value, f"{name}: {key} as written back")


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixture_computes_its_stored_output(name: str) -> None:
    """The loaded model's output for the stored input under the same recipe, bit for bit, with the numerics
    pinned as when it was written (checkpoint_specs.pinned_numerics); a model from another seed computes
    another output, so the loaded state is what decides it."""
    fixture, saved = FIXTURES[name], load(name)
    x, want, written_on = saved["input"], saved["output"], specs.decode_text(saved["cpu"])
    if written_on != specs.cpu_capability():
        pytest.skip(f"the stored output was computed on a {written_on} CPU, this one is {specs.cpu_capability()}: "
                    "oneDNN's GEMMs may sum in another order here (the load checks still run)")
    assert not torch.equal(specs.output(fixture.build(1), fixture, x), want)
    model = fixture.build(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.load_state_dict(saved["state_dict"], strict=True)
        assert_same_bits(specs.output(model, fixture, x), want, f"{name}: output")


# ---------------------------------------------------------------------------- another recipe than saved
SAVED, LOADED = "DelayedScaling", "MXFP8BlockScaling"


def test_hp_checkpoint_loads_under_another_recipe_with_the_documented_warning() -> None:
    """Saved under DelayedScaling, run under MXFP8BlockScaling: the warning names both (engine/modules/base.py),
    the saved delayed scales are not used, and the output is that of the same weights run under MXFP8 alone."""
    saved = load(f"train-{SAVED}-hp")
    target = specs.make_recipe(LOADED)
    model = FIXTURES[f"train-{SAVED}-hp"].build(1)
    model.load_state_dict(saved["state_dict"], strict=True)
    with pytest.warns(UserWarning, match=f"saved under {SAVED}.* loaded under {LOADED}"), torch.no_grad(), \
            engine.fp8_autocast(recipe=target):
        got = model(saved["input"])
    weights_only = {k: v for k, v in saved["state_dict"].items() if not k.endswith("_extra_state")}
    assert len(weights_only) < len(saved["state_dict"])
    plain = FIXTURES[f"train-{SAVED}-hp"].build(2)
    plain.load_state_dict(weights_only, strict=True)
    with warnings.catch_warnings(), torch.no_grad(), engine.fp8_autocast(recipe=target):
        warnings.simplefilter("error")
        want = plain(saved["input"])
    assert_same_bits(got, want, "cross-recipe output")
    assert not torch.equal(got, saved["output"])


def test_fp8_checkpoint_loads_under_another_recipe_requantized_with_the_documented_warning() -> None:
    """FP8 primary weights saved under DelayedScaling, run under MXFP8BlockScaling: requantized with a warning
    naming both recipes; the output is that of the dequantized weights in a high-precision model under MXFP8."""
    name = f"train-{SAVED}-fp8"
    saved = load(name)
    target = specs.make_recipe(LOADED)
    model = FIXTURES[name].build(1)
    model.load_state_dict(saved["state_dict"], strict=True)
    with pytest.warns(UserWarning) as record, torch.no_grad(), engine.fp8_autocast(recipe=target):
        got = model(saved["input"])
    messages = [str(w.message) for w in record]
    requantized = sorted(m.split(":")[0] for m in messages
                         if f"quantized under {SAVED}(" in m and f"requantized for {LOADED}(" in m)
    assert requantized == ["LayerNormMLP.fc1_weight", "LayerNormMLP.fc2_weight", "Linear.weight"], messages
    torch.manual_seed(2)
    plain = specs.TrainModel()
    plain.load_state_dict(engine.plain_state_dict(saved["state_dict"]), strict=True)
    with torch.no_grad(), engine.fp8_autocast(recipe=target):
        want = plain(saved["input"])
    assert_same_bits(got, want, "cross-recipe output")
