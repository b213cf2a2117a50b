"""Quantized inference weights in checkpoints: plain tensors only, torch.load(weights_only=True) and safetensors
round trips bit for bit, and bad checkpoints are ValueErrors naming the key."""

from __future__ import annotations

import io
import math

import pytest
import safetensors.torch
import torch

import engine
from engine.inference.weight import QuantizedWeight
from test_inference import ALL_CONFIGS, ids
from test_saving import parse_record, write_record

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
            assert isinstance(mine, QuantizedWeight) and set(mine.operands) == set(theirs.operands)
            assert mine.storage.scheme == theirs.storage.scheme
            for name, t in theirs.plain_parts().items():  # as saved (parts may hold a kernel's layout)
                assert torch.equal(mine.plain_parts()[name].view(torch.uint8), t.view(torch.uint8)), name
        assert torch.equal(target(x), expected)


def test_plain_checkpoint_loads_into_a_quantized_model() -> None:
    """A plain weight (no record) is quantized with the model's config as it is copied in."""
    plain = model(torch.nn.Linear, seed=0)
    target = quantized(torch.nn.Linear, engine.Int8WeightOnly(), seed=1)
    target.load_state_dict(plain.state_dict())
    reference = quantized(torch.nn.Linear, engine.Int8WeightOnly(), seed=0)
    for name, t in reference[0].weight.plain_parts().items():
        assert torch.equal(target[0].weight.plain_parts()[name], t)


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
    with pytest.raises(ValueError, match=r"^0\.weight_scale_inv: E8M0 code 255"):
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


# ---------------------------------------------------------------------------- every load error names its key
def nested(cls: type, config: object, seed: int) -> torch.nn.Module:
    """A quantized layer two modules deep: its keys are "0.0.weight", "0.0.weight_qformat", ..."""
    torch.manual_seed(seed)
    return engine.quantize_(torch.nn.Sequential(torch.nn.Sequential(cls(64, 32))).bfloat16(), config)


def _record_edit(change):
    def edit(state: dict, record: str) -> None:
        _, version, header, _ = parse_record(state[record])
        change(header)
        state[record] = write_record({**header, "tensors": []}, magic=b"ENGQWGHT", version=version)
    return edit


def _set(field, value):
    return _record_edit(lambda h: h.update({field: value}))


def _config_set(field, value):
    return _record_edit(lambda h: h["config"].update({field: value}))


RECORD_CORRUPTIONS = {  # each field of the record (the config's own fields are added per config below)
    "config not a dict": _set("config", [1]),
    "config name unknown": _config_set("name", "x"),
    "config name unhashable": _config_set("name", ["x"]),
    "config name missing": _record_edit(lambda h: h["config"].pop("name")),
    "config field unknown": _config_set("colour", "red"),
    "shape": _set("shape", [32, 65]),
    "shape not a list": _set("shape", "32x64"),
    "dtype": _set("dtype", "int8"),
    "dtype not a string": _set("dtype", 3),
    "parts": _set("parts", ["data"]),
    "parts not a list": _set("parts", 7),
    "unknown field": _set("colour", "red"),
    "missing field": _record_edit(lambda h: h.pop("dtype")),
    "truncated": lambda s, r: s.update({r: s[r][:20].clone()}),
    "not uint8": lambda s, r: s.update({r: s[r].float()}),
    "version 9": lambda s, r: s.update({r: write_record({**parse_record(s[r])[2], "tensors": []}, magic=b"ENGQWGHT",
                                                        version=9)}),
}
PART_CORRUPTIONS = {
    "missing": lambda t: None,
    "float64": lambda t: t.double(),
    "flattened twice over": lambda t: torch.cat([t.reshape(-1), t.reshape(-1)]),
    "not dense": lambda t: torch.stack([t, t], -1)[..., 0],
}


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=ids)
@pytest.mark.parametrize("cls", [torch.nn.Linear, engine.Linear])
def test_every_corrupted_field_is_a_value_error_naming_its_full_key(config: object, cls: type) -> None:
    """Each field of the record (the config's fields included) and each part, corrupted: a ValueError whose
    message starts with the key it came from, layer prefix included (and only once)."""
    source = nested(cls, config, seed=0).state_dict()
    record = "0.0.weight_qformat"
    cases = {name: (record, edit) for name, edit in RECORD_CORRUPTIONS.items()}
    for field in parse_record(source[record])[2]["config"]:
        if field != "name":
            for bad in (-1, None, "x", [1]):
                cases[f"config {field}={bad!r}"] = (record, _config_set(field, bad))
    for key in [k for k in source if k.startswith("0.0.weight") and k != record]:
        for name, change in PART_CORRUPTIONS.items():
            def edit(state: dict, _: str, key: str = key, change=change) -> None:
                value = change(state[key])
                if value is None:
                    del state[key]
                else:
                    state[key] = value
            cases[f"{key} {name}"] = (key, edit)
    target = nested(cls, config, seed=1)
    for name, (key, edit) in cases.items():
        state = {k: v.clone() for k, v in source.items()}
        edit(state, record)
        with pytest.raises(ValueError) as info:
            target.load_state_dict(state)
        message = str(info.value)
        assert message.startswith(key + ":") or message.startswith(key + "["), (name, message)
        assert "0.0.0.0." not in message, (name, message)


BAD_VALUES = {  # (config, part, where in it, value, the error's start): values quantizing never makes
    **{f"int8 scale {v}": (engine.Int8WeightOnly(), "weight_scale", (0,), v, r"0\.weight_scale: expected finite scales > 0")
       for v in (-1.0, math.nan, math.inf)},
    **{f"int8 dynamic scale {v}": (engine.Int8DynamicActivationInt8Weight(), "weight_scale", (3,), v,
                                   r"0\.weight_scale: expected finite scales > 0") for v in (-1.0, math.nan, math.inf)},
    **{f"int4 scale {v}": (engine.Int4WeightOnly(group_size=32), "weight_scale_and_zero", (1, 2, 0), v,
                           r"0\.weight_scale_and_zero: expected finite scales") for v in (-1.0, math.nan, math.inf)},
    **{f"int4 zero {v}": (engine.Int4WeightOnly(group_size=32), "weight_scale_and_zero", (0, 5, 1), v,
                          r"0\.weight_scale_and_zero: expected finite zeros") for v in (math.nan, -math.inf)},
    **{f"nvfp4 amax {v}": (engine.NVFP4WeightOnly(), "weight_amax", (0,), v, r"0\.weight_amax: expected finite amax")
       for v in (math.nan, math.inf)},
    "nvfp4 E4M3 NaN scale": (engine.NVFP4WeightOnly(), "weight_scale_inv", (2, 1), math.nan,
                             r"0\.weight_scale_inv: expected E4M3 block scales >= 0"),
    "nvfp4 negative scale": (engine.NVFP4WeightOnly(), "weight_scale_inv", (2, 1), -2.0,
                             r"0\.weight_scale_inv: expected E4M3 block scales >= 0"),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_scale_values_are_checked_at_load(case: str) -> None:
    """A scale quantizing never makes (negative, NaN, inf; NVFP4's amax NaN or inf, an E4M3 NaN scale code) is a
    ValueError naming its key at load, not outputs 11-175x off or NaN later."""
    config, part, index, value, match = BAD_VALUES[case]
    state = quantized(torch.nn.Linear, config, seed=0).state_dict()
    target = quantized(torch.nn.Linear, config, seed=1)
    good = {k: v.clone() for k, v in state.items()}
    state[f"0.{part}"] = state[f"0.{part}"].clone()
    state[f"0.{part}"][index] = value
    with pytest.raises(ValueError, match="^" + match):
        target.load_state_dict(state)
    target.load_state_dict(good)  # the unchanged checkpoint loads
