"""Checkpoints: scaling state in _extra_state, weights_only loads, loads across recipes (formats: test_saving.py).

The round trip and the load across every pair of recipes, for every recipe `engine.recipes` exports, are the
contract of tests/conformance/test_conformance_saving.py; here: the records' contents, delayed scaling's state
into a high-precision run, requantizing FP8 weights, plain torch checkpoints, malformed states.
"""


import pytest
import torch

import engine
from engine.autocast import fp8_autocast, fp8_model_init
from engine.modules.saving import encode_extra_state, read_extra_state
from engine.recipes import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling
from engine.tensors import Float8Tensor, MXFP8Tensor, QuantizedTensor
from tiny_models import TinyModel, next_output, roundtrip, train

def test_extra_state_holds_the_recipe_and_the_delayed_scaling_state():
    model = TinyModel()
    recipe = DelayedScaling(amax_history_len=8, margin=1)
    train(model, recipe, steps=2)
    saved = model.state_dict()["proj._extra_state"]
    assert saved.dtype == torch.uint8 and saved.dim() == 1  # the bytes are checked in test_saving.py
    extra = read_extra_state(saved)
    assert extra["recipe"] == {"name": "delayed", "fields": {
        "fp8_format": "HYBRID", "margin": 1, "amax_history_len": 8, "amax_compute_algo": "max",
        "scaling_factor_compute_algo": None, "reduce_amax": True}}
    assert torch.equal(extra["forward"]["scale"], model.proj._fwd_state.scale)
    assert torch.equal(extra["backward"]["amax_history"], model.proj._bwd_state.amax_history)
    assert extra["forward"]["amax_history"].shape == (8, 3)
    current = TinyModel()
    train(current, Float8CurrentScaling(use_power_2_scales=True), steps=1)
    extra = read_extra_state(current.state_dict()["proj._extra_state"])
    assert set(extra) == {"recipe"} and extra["recipe"]["fields"]["use_power_2_scales"] is True


def test_a_delayed_checkpoint_loads_into_a_high_precision_run():
    model = TinyModel()
    train(model, DelayedScaling(amax_history_len=8), steps=2)
    state = roundtrip(model.state_dict())
    fresh = TinyModel()
    fresh.load_state_dict(state)
    x = torch.randn(2, 32, 64)  # high precision: the FP8 state is simply not used
    assert torch.equal(fresh(x), model(x))


def test_fp8_primary_weights_are_requantized_for_another_recipe():
    with fp8_model_init(recipe=DelayedScaling()):
        model = TinyModel()
    assert isinstance(model.proj.weight, Float8Tensor)
    train(model, DelayedScaling(), steps=1)
    state = roundtrip(model.state_dict())
    with fp8_model_init(recipe=DelayedScaling()):
        fresh = TinyModel()
    fresh.load_state_dict(state)
    weight_object = fresh.proj.weight
    before = fresh.proj.weight.dequantize().clone()
    with pytest.warns(UserWarning, match="requantized"):
        next_output(fresh, MXFP8BlockScaling())
    assert fresh.proj.weight is weight_object  # the optimizer's Parameter object survives
    assert isinstance(fresh.proj.weight, MXFP8Tensor) and isinstance(fresh.proj.weight, torch.nn.Parameter)
    assert ((fresh.proj.weight.dequantize() - before).norm() / before.norm()).item() < 2.0**-4


def test_fp8_weights_load_into_a_high_precision_model_and_back():
    with fp8_model_init(recipe=Float8CurrentScaling()):
        fp8_model = TinyModel()
    plain = TinyModel()
    plain.load_state_dict(roundtrip(fp8_model.state_dict()))
    assert not isinstance(plain.proj.weight, QuantizedTensor)
    assert torch.equal(plain.proj.weight, fp8_model.proj.weight.dequantize())
    with fp8_model_init(recipe=Float8CurrentScaling()):
        again = TinyModel()
    again.load_state_dict(plain.state_dict())
    assert isinstance(again.proj.weight, QuantizedTensor)
    assert torch.equal(again.proj.weight.dequantize(), plain.proj.weight)  # FP8 values requantize exactly


def test_a_plain_torch_linear_checkpoint_loads():
    torch_linear = torch.nn.Linear(64, 96)
    linear = engine.Linear(64, 96)
    linear.load_state_dict(roundtrip(torch_linear.state_dict()))
    x = torch.randn(4, 64)
    assert torch.equal(linear(x), torch_linear(x))


@pytest.mark.parametrize("bad, match", [
    ({"version": 99, "recipe": None}, "version"),
    ("not a dict", "expected a uint8 tensor"),
    ({"version": 1, "recipe": {"name": "nope", "fields": {}}}, "recipe"),
    ({"version": 1, "recipe": {"name": "delayed", "fields": {"margin": -1}}}, "invalid"),
    ({"version": 1, "recipe": {"name": "delayed", "fields": {}}, "forward": {"scale": 1}}, "forward"),
])
def test_malformed_extra_state_is_a_clear_error(bad, match):
    linear = engine.Linear(64, 96)
    state = linear.state_dict()
    state["_extra_state"] = bad
    with pytest.raises(ValueError, match=match):
        linear.load_state_dict(state)
        with fp8_autocast(recipe=DelayedScaling()):
            linear(torch.randn(4, 64))


def test_delayed_state_with_the_wrong_number_of_slots_is_a_clear_error():
    train_model = TinyModel()
    train(train_model, DelayedScaling(amax_history_len=8), steps=1)
    state = train_model.proj.state_dict()
    extra = read_extra_state(state["_extra_state"])
    extra["forward"]["scale"] = torch.ones(6)
    for saved in (encode_extra_state(extra), {"version": 1, **extra}):  # today's format and the dict of before
        linear = engine.Linear(96, 64)
        with pytest.raises(ValueError, match=r"_extra_state\['forward'\]\['scale'\].*slots"):
            linear.load_state_dict({**state, "_extra_state": saved})  # at load, not at the first forward
