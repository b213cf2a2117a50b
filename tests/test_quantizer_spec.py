"""Quantizer specs as {scheme, rule, params} over the rule registry (issue 27, item 3).

Expected values are written out here: the schemes each rule fits, the quantizer each spec of the built-in
recipes built before the registry (the old if-chain, `first_form_quantizer` below, from Transformer Engine's
constructors), the first-form plain data checkpoints hold, and the recipe headers of the checkpoint fixtures
(read with struct + json).
"""

from __future__ import annotations

import json
import struct

import pytest
import torch

import checkpoint_specs as specs
import engine
from engine.quantizers import (
    RULE_ENTRIES, CurrentRule, Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8RowwiseQuantizer,
    MXFP8Quantizer, MXQuantizer, NVFP4Quantizer, NVFP4Rule, Quantizer, RuleParams, ScaleRule, quantizer_from_plain,
    register_rule,
)
from engine.quantizers.base import RULES
from engine.quantizers.registry import RULE_CLASSES
from engine.recipes import OperandRecipe, QuantizerSpec, Recipe, recipe_from_plain, recipe_to_plain
from engine.schemes import SCHEMES

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = ("e4m3", "e5m2")


def builtin_recipes() -> list[Recipe]:
    """Every recipe class engine.recipes exports whose specs are module-independent (all but CustomRecipe), as the
    checkpoint fixtures build it."""
    return [specs.make_recipe(cls.__name__) for cls in specs.exported_recipe_classes()
            if cls is not engine.recipes.CustomRecipe]


def first_form_quantizer(spec: QuantizerSpec) -> Quantizer:
    """What QuantizerSpec.make() built before the registry: Transformer Engine's constructor per layout."""
    if spec.layout == "nvfp4":
        return NVFP4Quantizer(with_rht=spec.rht, stochastic_rounding=spec.stochastic_rounding,
                              with_2d_quantization=spec.two_d)
    if spec.layout == "mx":
        return MXFP8Quantizer(spec.dtype, scale_mode=spec.scale_mode) if spec.element in FP8 else \
            MXQuantizer(spec.element, scale_mode=spec.scale_mode)
    dtype = {"e4m3": E4M3, "e5m2": E5M2}[spec.element]
    if spec.layout == "axiswise":
        return Float8RowwiseQuantizer(dtype, force_pow_2_scales=spec.pow2, amax_epsilon=spec.amax_epsilon)
    if spec.layout == "tensor":
        return Float8CurrentScalingQuantizer(dtype, force_pow_2_scales=spec.pow2, amax_epsilon=spec.amax_epsilon)
    return Float8BlockQuantizer(dtype, block_scaling_dim=2 if spec.layout == "block2d" else 1,
                                force_pow_2_scales=spec.pow2, amax_epsilon=spec.amax_epsilon)


# ---------------------------------------------------------------------------- the registry
def test_every_rule_is_registered_with_the_schemes_it_fits():
    fp8_layouts = [f"{layout}_{element}{pow2}" for element in FP8 for layout in ("tensor", "block1d", "block2d",
                                                                                  "axiswise") for pow2 in ("", "_pow2")]
    want = {"current": set(fp8_layouts), "delayed": {"tensor_e4m3", "tensor_e5m2"},
            "e8m0": {"mx_e4m3", "mx_e5m2", "mx_e2m1", "mx_e2m3", "mx_e3m2"}, "nvfp4": {"nvfp4_e2m1", "nvfp4_rht_e2m1", "nvfp4_e256_e2m1"}}
    assert {name: set(entry.schemes) for name, entry in RULE_ENTRIES.items()} == want
    assert [name for name, entry in RULE_ENTRIES.items() if entry.stateful] == ["delayed"]
    # RULES (a checkpoint's plain Quantizer names its rule class) holds NVFP4Rule too
    assert {"DelayedRule", "CurrentRule", "E8M0Rule", "NVFP4Rule"} <= set(RULES)


def test_a_plain_quantizer_with_an_nvfp4_rule_round_trips_through_plain_data():
    x = torch.randn(32, 48, generator=torch.Generator().manual_seed(0))
    q = Quantizer(SCHEMES["nvfp4_e2m1"], NVFP4Rule(two_d=True))
    again = quantizer_from_plain(q.to_plain())
    assert type(again) is Quantizer and again.config() == {"scheme": "nvfp4_e2m1", "rule": "NVFP4Rule",
                                                           "with_2d_quantization": True, "stochastic_rounding": False}
    want = NVFP4Quantizer(with_2d_quantization=True).quantize_storage(x)
    got = again.quantize_storage(x)
    for field, t in want.buffers().items():
        assert torch.equal(t.view(torch.uint8), got.buffers()[field].view(torch.uint8)), field


@pytest.mark.parametrize("recipe", builtin_recipes(), ids=lambda r: type(r).__name__)
def test_each_builtin_spec_builds_the_quantizer_it_built_before(recipe):
    """Through the registry, every (stateless) spec of every built-in recipe makes the Transformer Engine class and
    settings the old if-chain made: the same scheme and rule, so the same bits."""
    stateless = {spec for spec in recipe.operands().values() if spec is not None and not spec.stateful}
    if type(recipe).__name__ == "DelayedScaling":
        assert not stateless
        with pytest.raises(ValueError, match="rule: a 'delayed' spec"):
            recipe.operands()[engine.recipes.OPERANDS[0]].make()
        return
    assert stateless
    for spec in stateless:
        got, want = spec.make(), first_form_quantizer(spec)
        assert type(got) is type(want), spec
        assert got.config() == want.config() and got.scheme is want.scheme, spec
        assert type(got.rule) is type(want.rule) and got.rule.config() == want.rule.config(), spec
        assert got.state().keys() == want.state().keys()
        assert all(torch.equal(t, want.state()[k]) for k, t in got.state().items()), spec


def test_new_and_first_form_specs_are_the_same_spec():
    cases = [
        ({"layout": "tensor", "element": "e5m2", "pow2": True, "amax_epsilon": 0.5},
         {"scheme": "tensor_e5m2_pow2", "rule": "current", "params": {"amax_epsilon": 0.5}}),
        ({"layout": "block2d"}, {"scheme": "block2d_e4m3", "rule": "current"}),
        ({"layout": "mx", "element": "e3m2", "scaling": "e8m0", "scale_mode": "floor"},
         {"scheme": "mx_e3m2", "rule": "e8m0", "params": {"scale_mode": "floor"}}),
        ({"layout": "nvfp4", "element": "e2m1", "scaling": "nvfp4", "rht": True, "stochastic_rounding": True},
         {"scheme": "nvfp4_rht_e2m1", "rule": "nvfp4", "params": {"stochastic_rounding": True}}),
        ({"layout": "tensor", "scaling": "delayed"}, {"scheme": "tensor_e4m3", "rule": "delayed"}),
    ]
    for first, new in cases:
        a, b = QuantizerSpec(**first), QuantizerSpec(**new)
        assert a == b and hash(a) == hash(b)
        assert all(getattr(b, k) == v for k, v in first.items())  # the first form's fields, read back


def test_checkpoints_keep_the_first_form_of_a_spec_it_can_say():
    """OperandRecipe's plain data (what `_extra_state` holds) is the first form, field for field and in order, as
    checkpoints have always had it; a spec the first form cannot say is {scheme, rule, params}; both load back."""
    spec = QuantizerSpec(scheme="axiswise_e5m2_pow2", rule="current", params={"amax_epsilon": 1e-12})
    assert list(spec.to_plain().items()) == [
        ("layout", "axiswise"), ("element", "e5m2"), ("scaling", "current"), ("pow2", True), ("amax_epsilon", 1e-12),
        ("scale_mode", "rceil"), ("rht", False), ("stochastic_rounding", False), ("two_d", False)]
    nvfp4 = QuantizerSpec(scheme="nvfp4_e2m1", rule="nvfp4", params={"with_2d_quantization": True})
    assert nvfp4.to_plain()["two_d"] is True and nvfp4.to_plain()["layout"] == "nvfp4"
    delayed = QuantizerSpec(scheme="tensor_e4m3", rule="delayed", params={"margin": 2})
    assert delayed.to_plain() == {"scheme": "tensor_e4m3", "rule": "delayed", "params": {
        "margin": 2, "amax_history_len": 1024, "amax_compute_algo": "max", "scaling_factor_compute_algo": None,
        "reduce_amax": True}}
    for s in (spec, nvfp4, delayed):
        assert QuantizerSpec(**s.to_plain()) == s
    recipe = OperandRecipe(operands={"fprop_input": spec, "dgrad_weight": None})
    assert recipe_to_plain(recipe)["fields"]["operands_by_name"]["fprop_input"] == spec.to_plain()
    assert recipe_from_plain(recipe_to_plain(recipe)) == recipe


def record_header(record: torch.Tensor) -> bytes:
    """The JSON header of an `_extra_state` record: magic (8), version, length H (uint32 LE), H bytes."""
    raw = record.numpy().tobytes()
    assert raw[:8] == b"ENGXSTAT"
    _, length = struct.unpack("<II", raw[8:16])
    return raw[16:16 + length]


@pytest.mark.parametrize("name", [n for n in specs.fixtures() if n.startswith("train-") and n.endswith("-hp")])
def test_a_model_of_today_writes_the_recipe_header_its_fixture_holds(name):
    """After a step under the fixture's recipe, each module's `_extra_state` header (the recipe as plain data and
    its state's tensor list) is byte for byte the fixture's: recipes are written as they always were."""
    fixture = specs.fixtures()[name]
    saved = torch.load(specs.path_of(name), weights_only=True)["state_dict"]
    model = fixture.build(3)
    specs.train(model, fixture, steps=1)
    mine = model.state_dict()
    keys = [k for k in saved if k.endswith("_extra_state")]
    assert keys and [k for k in mine if k.endswith("_extra_state")] == keys
    for key in keys:
        assert record_header(mine[key]) == record_header(saved[key]), key
        json.loads(record_header(mine[key]))


# ---------------------------------------------------------------------------- errors, at construction
@pytest.mark.parametrize("fields, match", [
    ({"scheme": "tensor_e3m4", "rule": "current"}, r"scheme: expected one of \["),
    ({"scheme": "tensor_e4m3", "rule": "dynamic"}, r"rule: expected one of \['current', 'delayed', 'e8m0'"),
    ({"scheme": "tensor_e4m3", "rule": "e8m0"}, r"rule: 'e8m0' fits the schemes \['mx_e4m3'"),
    ({"scheme": "tensor_e4m3_pow2", "rule": "delayed"}, r"rule: 'delayed' fits the schemes \['tensor_e4m3', "),
    ({"scheme": "tensor_e4m3", "rule": "current", "params": {"amax_epsilon": -1.0}},
     r"params\.amax_epsilon: .*greater than or equal to 0"),
    ({"scheme": "mx_e4m3", "rule": "e8m0", "params": {"scale_mod": "floor"}}, r"params\.scale_mod: Extra inputs"),
    ({"scheme": "mx_e4m3", "rule": "e8m0", "params": {"scale_mode": "nearest"}}, r"params\.scale_mode: "),
    ({"scheme": "nvfp4_e2m1", "rule": "nvfp4", "params": {"stochastic_rounding": 1}}, r"params\.stochastic_rounding"),
    ({"scheme": "tensor_e4m3", "rule": "delayed", "params": {"amax_history_len": 0}}, r"params\.amax_history_len"),
    ({"scheme": "tensor_e4m3", "rule": "current", "params": [0.0]}, r"params: expected a dict"),
    ({"rule": "current"}, r"scheme: missing"),
    ({"scheme": "tensor_e4m3", "layout": "tensor"}, r"layout: give a spec either as"),
    ({"layout": "mx", "element": "e4m3", "scaling": "e8m0", "pow2": True}, r"pow2: not an option of scaling 'e8m0'"),
    ({"layout": "tensor", "scaling": "delayed", "amax_epsilon": 1.0}, r"amax_epsilon: not an option"),
    ({"layout": "block1d", "element": "e2m1"}, r"there is no 'block1d' scheme of 'e2m1' elements"),
    ({"layout": "block1d", "scaling": "delayed"}, r"scaling: 'delayed' scales do not fit layout 'block1d'"),
])
def test_a_bad_spec_is_a_value_error_naming_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        QuantizerSpec(**fields)


def test_model_copy_checks_what_it_changes():
    fp8 = QuantizerSpec(scheme="tensor_e4m3", rule="current")
    assert fp8.model_copy(update={"element": "e5m2"}) == QuantizerSpec(scheme="tensor_e5m2", rule="current")
    assert fp8.model_copy(update={"scheme": "block1d_e4m3"}).make().block_scaling_dim == 1
    with pytest.raises(ValueError, match="rule: 'current' fits"):
        fp8.model_copy(update={"scheme": "mx_e4m3"})


# ---------------------------------------------------------------------------- a rule of one's own
class HalfEpsilonParams(RuleParams):
    epsilon: float = 1.0


class HalfEpsilonRule(CurrentRule):
    """Current scaling with amax_epsilon = epsilon / 2 (a rule the registry does not ship)."""

    def __init__(self, epsilon: float = 1.0) -> None:
        super().__init__(epsilon / 2)
        self.epsilon = epsilon

    def config(self) -> dict:
        return {"epsilon": self.epsilon}


@pytest.fixture
def half_epsilon_rule():
    register_rule("half_epsilon", HalfEpsilonParams)(HalfEpsilonRule)
    try:
        yield "half_epsilon"
    finally:
        del RULE_ENTRIES["half_epsilon"], RULE_CLASSES[HalfEpsilonRule.__name__]


def test_a_registered_rule_of_ones_own_is_a_spec_a_recipe_and_a_checkpoint(half_epsilon_rule):
    spec = QuantizerSpec(scheme="tensor_e4m3", rule=half_epsilon_rule, params={"epsilon": 4.0})
    q = spec.make()
    assert type(q) is Quantizer and isinstance(q.rule, HalfEpsilonRule) and isinstance(q.rule, ScaleRule)
    x = torch.full((4, 8), 0.5)  # amax 0.5 < epsilon / 2 = 2: scale = 448 / 2
    assert torch.equal(q.quantize_storage(x).dequantize(), Float8CurrentScalingQuantizer(E4M3, amax_epsilon=2.0)
                       .quantize_storage(x).dequantize())
    assert spec.to_plain() == {"scheme": "tensor_e4m3", "rule": "half_epsilon", "params": {"epsilon": 4.0}}
    recipe = OperandRecipe(operands={"fprop_weight": spec, "dgrad_weight": spec})
    assert recipe_from_plain(recipe_to_plain(recipe)) == recipe
    with pytest.raises(ValueError, match=r"params\.epsilon"):
        QuantizerSpec(scheme="tensor_e4m3", rule=half_epsilon_rule, params={"epsilon": "big"})
    with pytest.raises(ValueError, match="is registered already"):
        register_rule("half_epsilon", HalfEpsilonParams)(CurrentRule)
