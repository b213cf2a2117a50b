"""Saving the way the ecosystem saves: safetensors, torch.load(weights_only=True), plain-torch models, HF.

The record format is read and written here by independent code (struct + json + numpy, from
the layout in engine/tensors/records.py's docstring), never by engine's own codec.

Every test about recipes runs every recipe `engine.recipes` exports (`exported_recipes`); the round trip
through torch.save and the loads across recipes are tests/conformance/test_conformance_saving.py's.
"""

from __future__ import annotations

import io
import json
import math
import struct

import numpy as np
import pytest
import safetensors.torch
import torch

import checkpoint_specs
import engine
from engine.recipes import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling
from engine.tensors import QuantizedTensor

MODULES = {
    "Linear": lambda: engine.Linear(64, 96),
    "LayerNormLinear": lambda: engine.LayerNormLinear(64, 96),
    "LayerNormMLP": lambda: engine.LayerNormMLP(64, 128, activation="swiglu"),
}
FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def make(kind, recipe, fp8_weights, seed):
    torch.manual_seed(seed)
    with engine.fp8_model_init(enabled=fp8_weights, recipe=recipe):
        return MODULES[kind]()


def run(module, recipe, steps=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        with engine.fp8_autocast(recipe=recipe):
            module(torch.randn(8, 64, generator=gen)).pow(2).mean().backward()


def via_safetensors(state, tmp_path):
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file(state, path)
    return safetensors.torch.load_file(path)


def via_torch(state, tmp_path):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def scaling_state(module):
    """The module's saved scaling state (`RecipeState.to_plain`: delayed scales and histories, counters)."""
    out = []
    for state in (module._fwd_state, module._bwd_state):
        part = state.to_plain() or {}
        out += [part[k] for k in sorted(part)]
    return out


def exported_recipes():
    """Every recipe class `engine.recipes` exports, as tests/checkpoint_specs.py makes it (a CustomRecipe, which has
    no default factory, with the checkpoint fixtures' one): a new recipe is tested without a change here."""
    return [checkpoint_specs.make_recipe(cls.__name__) for cls in checkpoint_specs.exported_recipe_classes()]


def stateless(recipe) -> bool:
    """The recipe's Linear states keep nothing between steps (no delayed scales, no stochastic-rounding counters)."""
    return all(recipe.make_state(forward=f, module="Linear").to_plain() is None for f in (True, False))


def recipe_id(recipe) -> str:
    return type(recipe).__name__


def bits(t):
    return t.detach().contiguous().view(torch.uint8) if t.element_size() == 1 else t.detach()


# --------------------------------------------------------------------- an independent reader and writer
def parse_record(t):
    """(magic, version, header, {name: numpy array}) read with struct/json/numpy from the documented layout."""
    raw = t.numpy().tobytes()
    magic, version, length = struct.unpack_from("<8sII", raw)
    header = json.loads(raw[16 : 16 + length])
    arrays, offset = {}, 16 + length
    for name, dtype, shape in header.pop("tensors"):
        assert dtype == "float32"
        n = math.prod(shape) * 4
        arrays[name] = np.frombuffer(raw[offset : offset + n], dtype="<f4").reshape(shape)
        offset += n
    assert offset == len(raw)
    return magic, version, header, arrays


def write_record(header, payload=b"", *, magic=b"ENGXSTAT", version=2, header_len=None):
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    length = len(text) if header_len is None else header_len
    return torch.tensor(list(struct.pack("<8sII", magic, version, length) + text + payload), dtype=torch.uint8)


# ============================================================================ the _extra_state record
def test_extra_state_is_the_documented_record():
    lin = engine.Linear(64, 32)
    run(lin, DelayedScaling(amax_history_len=4, margin=2))
    saved = lin.state_dict()["_extra_state"]
    assert type(saved) is torch.Tensor and saved.dtype == torch.uint8 and saved.dim() == 1
    magic, version, header, arrays = parse_record(saved)
    assert (magic, version) == (b"ENGXSTAT", 2)
    assert header == {"recipe": {"name": "delayed", "fields": {
        "fp8_format": "HYBRID", "margin": 2, "amax_history_len": 4, "amax_compute_algo": "max",
        "scaling_factor_compute_algo": None, "reduce_amax": True}}}
    assert list(arrays) == ["forward.scale", "forward.amax_history", "backward.scale", "backward.amax_history"]
    for name, t in (("forward.scale", lin._fwd_state.scale), ("forward.amax_history", lin._fwd_state.amax_history),
                    ("backward.scale", lin._bwd_state.scale), ("backward.amax_history", lin._bwd_state.amax_history)):
        assert np.array_equal(arrays[name].view("<u4"), t.numpy().view("<u4")), name
    assert (lin._fwd_state.scale != 1).any()  # something was learned, so the check above means something


@pytest.mark.parametrize("recipe", [r for r in exported_recipes() if stateless(r)], ids=recipe_id)
def test_stateless_recipes_save_only_the_recipe(recipe, tmp_path):
    lin = engine.Linear(64, 32)
    run(lin, recipe, steps=1)
    _, _, header, arrays = parse_record(lin.state_dict()["_extra_state"])
    assert header["recipe"]["name"] == recipe.name and arrays == {}
    other = engine.Linear(64, 32)
    other.load_state_dict(via_safetensors(lin.state_dict(), tmp_path))
    target = MXFP8BlockScaling() if recipe.name != "mxfp8" else Float8CurrentScaling()
    with pytest.warns(UserWarning, match=f"saved under {type(recipe).__name__}"):
        run(other, target, steps=1)


def test_a_module_that_never_ran_saves_no_extra_state_and_loads_strictly_into_torch(tmp_path):
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))
    converted = torch.nn.Sequential(engine.Linear(64, 96), torch.nn.GELU(), engine.Linear(96, 32))
    converted.load_state_dict(plain.state_dict(), strict=True)
    assert list(converted.state_dict()) == list(plain.state_dict())
    again = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))
    again.load_state_dict(via_safetensors(converted.state_dict(), tmp_path), strict=True)
    x = torch.randn(4, 64)
    assert torch.equal(again(x), plain(x))


def test_loaded_but_not_yet_run_state_is_saved_again_unchanged():
    lin = engine.Linear(64, 32)
    run(lin, DelayedScaling(amax_history_len=4))
    fresh = engine.Linear(64, 32)
    fresh.load_state_dict(lin.state_dict())
    assert torch.equal(fresh.state_dict()["_extra_state"], lin.state_dict()["_extra_state"])


# ============================================================================ round trips
@pytest.mark.parametrize("fp8_weights", [False, True], ids=["hp_weights", "fp8_weights"])
@pytest.mark.parametrize("recipe", exported_recipes(), ids=recipe_id)
@pytest.mark.parametrize("kind", sorted(MODULES))
def test_safetensors_round_trip_keeps_scaling_state_and_weights_exactly(kind, recipe, fp8_weights, tmp_path):
    via = via_safetensors
    src = make(kind, recipe, fp8_weights, seed=0)
    run(src, recipe)
    state = via(src.state_dict(), tmp_path)
    assert all(type(v) is torch.Tensor for v in state.values())  # plain tensors only
    dst = make(kind, recipe, fp8_weights, seed=1)
    dst.load_state_dict(state, strict=True)
    for name, p in src.named_parameters():
        q = getattr(dst, name)
        assert type(q) is type(p)
        if isinstance(p, QuantizedTensor):  # every quantized buffer, bit for bit, both usages
            assert q.quantizer is not None and q.quantizer is not p.quantizer
            for field in FIELDS:
                assert torch.equal(bits(getattr(p.qstorage, field)), bits(getattr(q.qstorage, field))), (name, field)
        else:
            assert torch.equal(p, q), name
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))
    with engine.fp8_autocast(recipe=recipe):  # the loaded scales are used: the same output, the same next state
        assert torch.equal(dst(x), src(x))
    assert len(scaling_state(src)) == (0 if stateless(recipe) else len(scaling_state(dst))) and \
        (stateless(recipe) or scaling_state(src))
    for a, b in zip(scaling_state(src), scaling_state(dst), strict=True):
        assert torch.equal(bits(a), bits(b))


def test_fp8_weight_keys_hold_plain_tensors():
    lin = make("Linear", MXFP8BlockScaling(), True, seed=0)
    state = lin.state_dict()
    st = lin.weight.qstorage
    assert list(state) == ["weight", "bias", "_extra_state", "weight_scale_inv", "weight_columnwise_data",
                           "weight_columnwise_scale_inv", "weight_quantization"]
    assert state["weight"].dtype == torch.float8_e4m3fn and torch.equal(bits(state["weight"]), bits(st.rowwise_data))
    assert torch.equal(state["weight_columnwise_scale_inv"], st.columnwise_scale_inv)
    magic, version, header, arrays = parse_record(state["weight_quantization"])
    assert (magic, version, arrays) == (b"ENGQTENS", 1, {})
    quantizer = {"class": "MXFP8Quantizer", "config": {"fp8_dtype": "float8_e4m3fn", "scale_mode": "rceil"}}
    assert header == {"scheme": "mx_e4m3", "shape": [96, 64], "nominal_dtype": "float32", "rowwise": True,
                      "columnwise": True, "quantizer": quantizer}
    per_tensor = make("Linear", Float8CurrentScaling(), True, seed=0).state_dict()
    assert "weight_columnwise_data" not in per_tensor  # the transpose of the rowwise data: derived at load
    keep = lin.state_dict(keep_vars=True)
    assert keep["weight"] is lin.weight and "weight_scale_inv" not in keep


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = engine.LayerNormMLP(64, 64, activation="swiglu")
        self.out = engine.Linear(64, 32)

    def forward(self, x):
        return self.out(self.mlp(x))


@pytest.mark.parametrize("recipe", exported_recipes(), ids=recipe_id)
def test_fp8_model_init_models_reload_bit_exactly_under_every_exported_recipe(recipe):
    """fp8_model_init model -> state_dict -> an identical fresh model, fresh and after a training step, in memory
    and through torch.save / torch.load(weights_only=True): every buffer (NVFP4's amaxes too) and the outputs
    bit for bit; plain_state_dict of both loads strictly into the high-precision model."""
    def make(seed, fp8_weights=True):
        torch.manual_seed(seed)
        with engine.fp8_model_init(enabled=fp8_weights, recipe=recipe):
            return TwoLayers()

    src = make(0)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(5))
    optimizer = torch.optim.SGD(src.parameters(), lr=0.1)
    for trained in (False, True):
        if trained:
            with engine.fp8_autocast(recipe=recipe):
                src(x).pow(2).mean().backward()
            optimizer.step()
        state = src.state_dict()
        from_file = via_torch(state, None)
        with engine.fp8_autocast(recipe=recipe):
            want = src(x)
        for loaded in (state, from_file):
            dst = make(1)
            dst.load_state_dict(loaded, strict=True)
            for name, p in src.named_parameters():
                q = dst.get_parameter(name)
                assert type(q) is type(p), name
                if isinstance(p, QuantizedTensor):
                    assert q.quantizer is not None
                    mine, theirs = p.qstorage.buffers(), q.qstorage.buffers()  # NVFP4's amaxes among them
                    assert list(mine) == list(theirs)
                    for field, t in mine.items():
                        assert (t is None) == (theirs[field] is None), (name, field)
                        assert t is None or torch.equal(bits(t), bits(theirs[field])), (name, field)
                else:
                    assert torch.equal(p, q), name
            with engine.fp8_autocast(recipe=recipe):
                assert torch.equal(dst(x), want)
            hp = make(2, fp8_weights=False)
            hp.load_state_dict(engine.plain_state_dict(loaded), strict=True)
            for name, p in src.named_parameters():
                value = p.dequantize() if isinstance(p, QuantizedTensor) else p
                assert torch.equal(hp.get_parameter(name), value), name


def test_an_nvfp4_weight_record_holds_its_amaxes():
    """The record's tensors are the layout's own buffers, read here by the independent reader."""
    recipe = engine.recipes.NVFP4BlockScaling()
    torch.manual_seed(0)
    amax = engine.Linear(64, 32).weight.abs().max()  # the weight's own amax, in high precision
    torch.manual_seed(0)
    with engine.fp8_model_init(recipe=recipe):
        lin = engine.Linear(64, 32)
    state = lin.state_dict()
    _, version, header, arrays = parse_record(state["weight_quantization"])
    st = lin.weight.qstorage
    assert version == 1 and header["scheme"] == "nvfp4_e2m1" and sorted(arrays) == ["amax_columnwise", "amax_rowwise"]
    for name, t in arrays.items():
        assert t.tolist() == getattr(st, name).tolist() == [amax.item()]
    old = dict(state, weight_quantization=write_record({**header, "tensors": []}, magic=b"ENGQTENS", version=1))
    with engine.fp8_model_init(recipe=recipe):
        target = engine.Linear(64, 32)
    with pytest.raises(ValueError, match=r"^weight_quantization: a nvfp4_e2m1 tensor keeps .* save the model again"):
        target.load_state_dict(old)  # what engine wrote before: the amaxes are lost


def test_nvfp4_weight_scales_are_checked_at_load():
    """E4M3 block scales are >= 0 and the NaN code only comes with a NaN amax (a block with a NaN, whose NaN is
    the tensor's amax too): what quantizing makes loads, anything else is a ValueError naming the key."""
    recipe = engine.recipes.NVFP4BlockScaling()
    with engine.fp8_model_init(recipe=recipe):
        lin, target = engine.Linear(64, 32), engine.Linear(64, 32)
    state = lin.state_dict()
    for key, value in (("weight_scale_inv", math.nan), ("weight_scale_inv", -2.0),
                       ("weight_columnwise_scale_inv", math.nan)):
        bad = dict(state, **{key: state[key].clone()})
        bad[key][3, 1] = value
        with pytest.raises(ValueError, match=f"^{key}: expected E4M3 block scales >= 0"):
            target.load_state_dict(bad)
    with torch.no_grad():
        weight = lin.weight.dequantize()
        weight[5, 7] = math.nan
        lin.weight.copy_(weight)  # requantized: NaN amaxes, the NaN code in the scales of that tile
    state = via_torch(lin.state_dict(), None)
    assert torch.isnan(state["weight_scale_inv"].float()).any()
    target.load_state_dict(state)
    assert torch.isnan(target.weight.qstorage.amax_rowwise).all()


@pytest.mark.parametrize("recipe", exported_recipes(), ids=recipe_id)
def test_fp8_weights_load_into_a_high_precision_module_dequantized(recipe, tmp_path):
    src = make("LayerNormMLP", recipe, True, seed=0)
    hp = make("LayerNormMLP", recipe, False, seed=1)
    hp.load_state_dict(via_safetensors(src.state_dict(), tmp_path))
    for name in ("fc1_weight", "fc2_weight"):
        assert type(getattr(hp, name)) is torch.nn.Parameter
        assert torch.equal(getattr(hp, name), getattr(src, name).dequantize())


def test_assign_load_gives_the_weight_the_modules_quantizer():
    recipe = DelayedScaling(amax_history_len=4)
    src = make("Linear", recipe, True, seed=0)
    dst = make("Linear", recipe, True, seed=1)
    dst.load_state_dict(src.state_dict(), assign=True)
    assert isinstance(dst.weight, QuantizedTensor) and isinstance(dst.weight, torch.nn.Parameter)
    assert dst.weight.quantizer is dst._fwd_state.quantizer(engine.recipes.Role.WEIGHT, 0)
    assert torch.equal(bits(dst.weight.qstorage.columnwise_data), bits(src.weight.qstorage.columnwise_data))


# ============================================================================ old checkpoints
def test_version_1_dict_checkpoint_with_a_quantized_tensor_object_still_loads():
    """What engine wrote before: _extra_state a dict, an FP8 weight pickled as its QuantizedTensor."""
    recipe = DelayedScaling(amax_history_len=4)
    src = make("Linear", recipe, True, seed=0)
    run(src, recipe)
    fwd, bwd = src._fwd_state, src._bwd_state
    old = {"weight": src.weight.detach(), "bias": src.bias.detach(), "_extra_state": {
        "version": 1,
        "recipe": {"name": "delayed", "fields": {"fp8_format": "HYBRID", "margin": 0, "amax_history_len": 4,
                                                 "amax_compute_algo": "max", "scaling_factor_compute_algo": None,
                                                 "reduce_amax": True}},
        "forward": {"scale": fwd.scale.clone(), "amax_history": fwd.amax_history.clone()},
        "backward": {"scale": bwd.scale.clone(), "amax_history": bwd.amax_history.clone()}}}
    dst = make("Linear", recipe, True, seed=1)
    dst.load_state_dict(via_torch(old, None), strict=True)
    for a, b in zip(scaling_state(src), scaling_state(dst), strict=True):
        assert torch.equal(a, b)
    for field in FIELDS:
        assert torch.equal(bits(getattr(src.weight.qstorage, field)), bits(getattr(dst.weight.qstorage, field)))
    # and it is saved again in today's format
    assert parse_record(dst.state_dict()["_extra_state"])[:2] == (b"ENGXSTAT", 2)


def test_empty_extra_state_as_transformer_engine_saves_it_is_accepted():
    lin = engine.Linear(64, 32)
    lin.load_state_dict({**lin.state_dict(), "_extra_state": torch.empty(0, dtype=torch.uint8)}, strict=True)
    assert "_extra_state" not in lin.state_dict()


# ============================================================================ into the original torch model
class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 96)
        self.out = torch.nn.Linear(96, 32)

    def forward(self, x):
        return self.out(torch.relu(self.proj(x)))


class Converted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = engine.Linear(64, 96)
        self.out = engine.Linear(96, 32)

    forward = Plain.forward


@pytest.mark.parametrize("fp8_weights", [False, True], ids=["hp_weights", "fp8_weights"])
@pytest.mark.parametrize("recipe", exported_recipes(), ids=recipe_id)
def test_plain_state_dict_loads_strictly_into_the_torch_model(recipe, fp8_weights, tmp_path):
    with engine.fp8_model_init(enabled=fp8_weights, recipe=recipe):
        model = Converted()
    run(model, recipe, steps=1)
    torch_model = Plain()
    with pytest.raises(RuntimeError, match="_extra_state"):  # the converted state dict as it is: not strictly
        torch_model.load_state_dict(model.state_dict())
    from_file = via_safetensors(model.state_dict(), tmp_path)
    for source in (model, from_file):
        torch_model = Plain()
        torch_model.load_state_dict(engine.plain_state_dict(source), strict=True)
        for name in ("proj", "out"):
            w = getattr(model, name).weight
            want = w.dequantize() if fp8_weights else w
            got = getattr(torch_model, name).weight
            assert torch.equal(got, want) and got.dtype == torch.float32
    assert list(engine.plain_state_dict(model)) == list(Plain().state_dict())


def test_plain_state_dict_passes_on_what_is_not_engines():
    other_extra = {"version": 7, "colour": "red"}  # another library's extra state
    state = {"a_quantization": torch.ones(2), "m._extra_state": other_extra, "b": torch.zeros(1)}
    out = engine.plain_state_dict(state)
    assert list(out) == list(state)
    assert out["m._extra_state"] is other_extra and out["a_quantization"] is state["a_quantization"]


def test_plain_state_dict_rejects_other_input():
    with pytest.raises(TypeError, match="source"):
        engine.plain_state_dict([1, 2])


def test_fp8_components_into_a_torch_module_fail_naming_the_key():
    lin = make("Linear", Float8CurrentScaling(), True, seed=0)
    with pytest.raises(RuntimeError, match="weight_scale_inv"):
        torch.nn.Linear(64, 96).load_state_dict(lin.state_dict())


# ============================================================================ malformed records
GOOD_HEADER = {"recipe": {"name": "current", "fields": {}}, "tensors": []}
ONE_SCALE = {"recipe": {"name": "delayed", "fields": {"amax_history_len": 4}},
             "tensors": [["forward.scale", "float32", [3]]]}

BAD_RECORDS = {
    "not uint8": (torch.zeros(20, dtype=torch.int8), "1-D torch.uint8"),
    "2-D": (torch.zeros(4, 20, dtype=torch.uint8), "1-D torch.uint8"),
    "a string": ("delayed", "expected a uint8 tensor"),
    "too short": (torch.zeros(10, dtype=torch.uint8), "too few"),
    "bad magic": (write_record(GOOD_HEADER, magic=b"PICKLE!!"), "starting with"),
    "version 3": (write_record(GOOD_HEADER, version=3), "format version 3"),
    "version 1 as a record": (write_record(GOOD_HEADER, version=1), "format version 1"),
    "header longer than the bytes": (write_record(GOOD_HEADER, header_len=10_000), "header claims 10000"),
    "huge header": (write_record(GOOD_HEADER, header_len=2**31), "header claims"),
    "not JSON": (write_record(b"{recipe: 1"), "not valid JSON"),
    "not UTF-8": (write_record(b'{"a": "\xff"}'), "not valid JSON"),
    "NaN in JSON": (write_record(b'{"recipe": NaN, "tensors": []}'), "not valid JSON"),
    "deep JSON": (write_record(b"[" * 100_000 + b"]" * 100_000), "not valid JSON"),
    "duplicate keys": (write_record(b'{"recipe": null, "recipe": null, "tensors": []}'), "duplicate"),
    "no tensors list": (write_record({"recipe": None}), "'tensors' list"),
    "unknown header key": (write_record({**GOOD_HEADER, "surprise": 1}), "surprise"),
    "no recipe": (write_record({"tensors": []}), "header with a .recipe."),
    "truncated": (write_record(ONE_SCALE, struct.pack("<2f", 1, 1)), "truncated"),
    "trailing bytes": (write_record(ONE_SCALE, struct.pack("<4f", 1, 1, 1, 1)), "4 bytes follow the last tensor"),
    "huge claimed tensor": (write_record({**ONE_SCALE, "tensors": [["forward.scale", "float32", [10**9, 10**9]]]},
                                         struct.pack("<3f", 1, 1, 1)), "truncated"),
    "unknown dtype": (write_record({**ONE_SCALE, "tensors": [["forward.scale", "object", [3]]]}), "dtype"),
    "negative size": (write_record({**ONE_SCALE, "tensors": [["forward.scale", "float32", [-3]]]}), "shape"),
    "bool size": (write_record({**ONE_SCALE, "tensors": [["forward.scale", "float32", [True]]]}), "shape"),
    "too many dims": (write_record({**ONE_SCALE, "tensors": [["forward.scale", "float32", [1] * 9]]}), "shape"),
    "bad entry": (write_record({**ONE_SCALE, "tensors": [["forward.scale", "float32"]]}), "entry"),
    "unknown tensor": (write_record({**ONE_SCALE, "tensors": [["forward.bogus", "float32", [3]]]},
                                    struct.pack("<3f", 1, 1, 1)), "unknown tensor 'forward.bogus'"),
    "listed twice": (write_record({**ONE_SCALE, "tensors": [["forward.scale", "float32", [1]]] * 2},
                                  struct.pack("<2f", 1, 1)), "listed twice"),
    "state without recipe": (write_record({"recipe": None, "tensors": [["forward.scale", "float32", [1]]]},
                                          struct.pack("<f", 1)), "without a recipe"),
    "scale of the wrong shape": (write_record({**ONE_SCALE, "tensors": [
        ["forward.scale", "float32", [2]], ["forward.amax_history", "float32", [4, 3]],
        ["backward.scale", "float32", [2]], ["backward.amax_history", "float32", [4, 2]]]},
        struct.pack("<24f", *[1.0] * 24)), r"\['forward'\]\['scale'\]"),
    "scale inf": (write_record({**ONE_SCALE, "tensors": [
        ["forward.scale", "float32", [3]], ["forward.amax_history", "float32", [1, 3]],
        ["backward.scale", "float32", [2]], ["backward.amax_history", "float32", [1, 2]]]},
        struct.pack("<10f", 1, math.inf, 1, 0, 0, 0, 1, 1, 0, 0)), r"\['forward'\]\['scale'\]"),
    "scale subnormal": (write_record({**ONE_SCALE, "tensors": [  # its reciprocal (scale_inv) is inf: NaN outputs
        ["forward.scale", "float32", [3]], ["forward.amax_history", "float32", [1, 3]],
        ["backward.scale", "float32", [2]], ["backward.amax_history", "float32", [1, 2]]]},
        struct.pack("<10f", 1, 1e-45, 1, 0, 0, 0, 1, 1, 0, 0)), r"\['forward'\]\['scale'\].*finite reciprocal"),
    "stride 0": (torch.zeros(1, dtype=torch.uint8).expand(10**12), "dense"),
}


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_a_malformed_record_is_refused_naming_the_key(case):
    bad, match = BAD_RECORDS[case]
    model = torch.nn.Sequential(engine.Linear(64, 32))
    state = {**model.state_dict(), "0._extra_state": bad}
    with pytest.raises(ValueError, match=match) as info:
        model.load_state_dict(state)
    assert str(info.value).startswith("0._extra_state")


def test_the_reader_accepts_what_the_independent_writer_writes():
    """The documented layout, written by hand, loads and is read as written."""
    scale = [2.0, 0.5, 4.0]
    rec = write_record({"recipe": {"name": "delayed", "fields": {"amax_history_len": 2}}, "tensors": [
        ["forward.scale", "float32", [3]], ["forward.amax_history", "float32", [2, 3]],
        ["backward.scale", "float32", [2]], ["backward.amax_history", "float32", [2, 2]]]},
        struct.pack("<3f", *scale) + struct.pack("<6f", 1, 2, 3, 4, 5, 6) + struct.pack("<6f", 1, 1, 1, 1, 0, 0))
    lin = engine.Linear(64, 32)
    lin.load_state_dict({**lin.state_dict(), "_extra_state": rec})
    _, _, header, arrays = parse_record(lin.state_dict()["_extra_state"])  # held until the module runs, saved as read
    assert header["recipe"]["fields"]["amax_history_len"] == 2
    assert arrays["forward.scale"].tolist() == scale
    assert arrays["forward.amax_history"].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert arrays["backward.amax_history"].tolist() == [[1, 1], [0, 0]]


# ============================================================================ malformed FP8 weight keys
def _fp8_state():
    return make("Linear", MXFP8BlockScaling(), True, seed=0).state_dict()


def _meta(change):
    def edit(state):
        _, _, header, _ = parse_record(state["weight_quantization"])
        change(header)
        state["weight_quantization"] = write_record({**header, "tensors": []}, magic=b"ENGQTENS", version=1)
    return edit


BAD_WEIGHTS = {
    "missing scale_inv": (lambda s: s.pop("weight_scale_inv"), "weight_scale_inv: missing"),
    "missing columnwise": (lambda s: s.pop("weight_columnwise_data"), "weight_columnwise_data: missing"),
    "scale_inv of the wrong dtype": (lambda s: s.update(weight_scale_inv=s["weight_scale_inv"].float()),
                                     "^weight_scale_inv: expected torch.uint8"),
    "data of the wrong shape": (lambda s: s.update(weight=s["weight"][:64]), "^weight: expected"),
    "E8M0 NaN code without NaN data": (lambda s: s["weight_scale_inv"].fill_(255), "^weight_scale_inv: E8M0 code 255"),
    "no metadata": (lambda s: s.pop("weight_quantization"), "weight_quantization that says how"),
    "unknown scheme": (_meta(lambda h: h.update(scheme="fp9")), "^weight_quantization: scheme"),
    "shape disagrees": (_meta(lambda h: h.update(shape=[96, 32])), "^weight: expected"),
    "int nominal dtype": (_meta(lambda h: h.update(nominal_dtype="int32")), "^weight_quantization: nominal_dtype"),
    "no usage": (_meta(lambda h: h.update(rowwise=False, columnwise=False)), "^weight_quantization: 'rowwise'"),
    "unknown field": (_meta(lambda h: h.update(colour="red")), "^weight_quantization: expected the fields"),
    "bad quantizer": (_meta(lambda h: h.update(quantizer="MXFP8")), "^weight_quantization: 'quantizer'"),
    # an unknown quantizer class would requantize the weight with the module's quantizer, silently
    "unknown quantizer class": (_meta(lambda h: h["quantizer"].update({"class": "x"})),
                                r"^weight_quantization: 'quantizer' class: expected one of \[.*'MXFP8Quantizer'.*\], "
                                r"got 'x'"),
    "bit-flipped quantizer class": (_meta(lambda h: h["quantizer"].update({"class": "Float8Quantizes"})),
                                    r"^weight_quantization: 'quantizer' class: expected one of \[.*'Float8Quantizer'"
                                    r".*\], got 'Float8Quantizes'"),
    "not a record": (lambda s: s.update(weight_quantization=torch.ones(3)), "^weight_quantization: expected a 1-D"),
    "a tensor in the record": (lambda s: s.update(weight_quantization=write_record(
        {**parse_record(s["weight_quantization"])[2], "tensors": [["amax_rowwise", "float32", [1]]]},
        struct.pack("<f", 1.0), magic=b"ENGQTENS", version=1)), r"^weight_quantization: unknown tensors \['amax_rowwise'\]"),
}


@pytest.mark.parametrize("case", sorted(BAD_WEIGHTS))
def test_malformed_fp8_weight_keys_are_refused_naming_the_key(case):
    change, match = BAD_WEIGHTS[case]
    state = _fp8_state()
    change(state)
    for target in (make("Linear", MXFP8BlockScaling(), True, seed=1), engine.Linear(64, 96)):
        with pytest.raises(ValueError, match=match):
            target.load_state_dict(state)


# ============================================================================ Hugging Face
def _tiny_llama(seed):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    for name, module in list(model.named_modules()):  # every Linear but the output head, by hand
        for child_name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and child_name != "lm_head":
                new = engine.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                new.load_state_dict(child.state_dict())
                setattr(module, child_name, new)
    return model


def test_hugging_face_save_pretrained_keeps_the_scaling_state(tmp_path):
    recipe = DelayedScaling(amax_history_len=4)
    model = _tiny_llama(seed=0)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with engine.fp8_autocast(recipe=recipe):
        model(ids, labels=ids).loss.backward()
    model.save_pretrained(tmp_path)
    saved = safetensors.torch.load_file(tmp_path / "model.safetensors")
    key = "model.layers.0.self_attn.q_proj._extra_state"
    assert saved[key].dtype == torch.uint8 and parse_record(saved[key])[2]["recipe"]["name"] == "delayed"
    fresh = _tiny_llama(seed=1)
    fresh.load_state_dict(saved, strict=True)
    with engine.fp8_autocast(recipe=recipe):  # the loaded scales are used: the same logits, the same next state
        assert torch.equal(fresh(ids).logits, model(ids).logits)
    q, q2 = model.model.layers[0].self_attn.q_proj, fresh.model.layers[0].self_attn.q_proj
    assert (q._fwd_state.scale != 1).any()
    for a, b in zip(scaling_state(q), scaling_state(q2), strict=True):
        assert torch.equal(a, b)
