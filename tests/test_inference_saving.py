"""Quantized inference weights in checkpoints: plain tensors only, torch.load(weights_only=True) and safetensors
round trips bit for bit, and bad checkpoints are ValueErrors naming the key."""

from __future__ import annotations

import io

import pytest
import safetensors.torch
import torch

import engine
from engine.inference.weight import QuantizedWeight
from test_inference import ALL_CONFIGS, ids

pytestmark = pytest.mark.filterwarnings("ignore:engine. NVFP4 quantization")


def model(cls: type, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(cls(64, 128), torch.nn.ReLU(), cls(128, 32, bias=False)).bfloat16()


def quantized(cls: type, config: object, seed: int) -> torch.nn.Module:
    return engine.quantize_(model(cls, seed), config)


def torch_round_trip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=ids)
@pytest.mark.parametrize("cls", [torch.nn.Linear, engine.Linear])
def test_round_trips_are_bit_exact(config: object, cls: type, tmp_path) -> None:
    source = quantized(cls, config, seed=0)
    state = source.state_dict()
    assert all(type(v) is torch.Tensor for v in state.values())  # nothing to pickle
    assert {"0.weight", "0.weight_qformat", "2.weight", "2.weight_qformat"} <= set(state)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    expected = source(x)
    safetensors.torch.save_file(state, tmp_path / "q.safetensors")
    for loaded in (torch_round_trip(state), safetensors.torch.load_file(tmp_path / "q.safetensors")):
        target = quantized(cls, config, seed=1)  # other weights, overwritten by the load
        target.load_state_dict(loaded)
        for i in (0, 2):
            mine, theirs = target[i].weight, source[i].weight
            assert isinstance(mine, QuantizedWeight) and set(mine.parts) == set(theirs.parts)
            for name, t in theirs.plain_parts().items():  # as saved (parts may hold a kernel's layout)
                assert torch.equal(mine.plain_parts()[name].view(torch.uint8), t.view(torch.uint8)), name
        assert torch.equal(target(x), expected)


def test_plain_checkpoint_loads_into_a_quantized_model() -> None:
    """A plain weight (no record) is quantized with the model's config as it is copied in."""
    plain = model(torch.nn.Linear, seed=0)
    target = quantized(torch.nn.Linear, engine.Int8WeightOnly(), seed=1)
    target.load_state_dict(plain.state_dict())
    reference = quantized(torch.nn.Linear, engine.Int8WeightOnly(), seed=0)
    for name, t in reference[0].weight.parts.items():
        assert torch.equal(target[0].weight.parts[name], t)


def test_bad_checkpoints_are_named() -> None:
    state = quantized(torch.nn.Linear, engine.Int4WeightOnly(group_size=32), seed=0).state_dict()
    other = quantized(torch.nn.Linear, engine.Int4WeightOnly(group_size=64), seed=0)
    with pytest.raises(ValueError, match=r"0\.weight_qformat: the weight was saved quantized with "
                                         r"Int4WeightOnly\(group_size=32\)"):
        other.load_state_dict(state)
    target = quantized(torch.nn.Linear, engine.Int4WeightOnly(group_size=32), seed=1)
    bad = dict(state, **{"0.weight_scale_and_zero": state["0.weight_scale_and_zero"][:1].clone()})
    with pytest.raises(ValueError, match=r"0\.weight_scale_and_zero: expected torch.bfloat16 of shape \(2, 128, 2\)"):
        target.load_state_dict(bad)
    bad = dict(state, **{"2.weight_qformat": state["2.weight_qformat"][:20].clone()})
    with pytest.raises(ValueError, match=r"2\.weight_qformat"):
        target.load_state_dict(bad)
    mx = quantized(torch.nn.Linear, engine.MXWeightOnly("e4m3"), seed=0).state_dict()
    nan_scale = mx["0.weight_scale_inv"].clone()
    nan_scale[0, 0] = 255  # E8M0 NaN for a block whose data holds no NaN
    with pytest.raises(ValueError, match=r"0\.weight: .*scale_inv"):
        quantized(torch.nn.Linear, engine.MXWeightOnly("e4m3"), seed=1).load_state_dict(
            dict(mx, **{"0.weight_scale_inv": nan_scale}))
    with pytest.raises(RuntimeError, match="Unexpected key"):  # a plain model refuses quantized entries
        model(torch.nn.Linear, seed=0).load_state_dict(state)


def test_assign_load_deepcopy_and_dtype_moves() -> None:
    import copy

    source = quantized(torch.nn.Linear, engine.Int4WeightOnly(group_size=32), seed=0)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    expected = source(x)
    target = quantized(torch.nn.Linear, engine.Int4WeightOnly(group_size=32), seed=1)
    target.load_state_dict(torch_round_trip(source.state_dict()), assign=True)
    assert isinstance(target[0].weight, QuantizedWeight) and torch.equal(target(x), expected)
    assert torch.equal(copy.deepcopy(source)(x), expected)
    source.float()  # the nominal dtype moves; the parts and the bf16 output of bf16 inputs stay
    assert source[0].weight.dtype == torch.float32 and torch.equal(source(x), expected)
