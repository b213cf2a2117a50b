"""Arguments refused when they are made, with errors that name them: a recipe or config class where an instance
belongs, out-of-range seeds, formats a recipe ignores, non-int group sizes, negative random-stream offsets."""

from __future__ import annotations

import pytest
import torch

import engine
from engine.inference.weight import QuantizedWeight
from engine.quantizers import NVFP4Quantizer
from engine.quantizers.base import quantizer_from_plain
from engine.recipes import (
    DelayedScaling, Float8BlockScaling, MXFP4BlockScaling, MXFP6BlockScaling, NVFP4BlockScaling, OperandRecipe,
)


def _enter(manager) -> None:
    with manager:
        pass


RECIPE_TAKERS = {
    "fp8_autocast": lambda r: _enter(engine.fp8_autocast(recipe=r)),
    "autocast": lambda r: _enter(engine.autocast(recipe=r)),
    "fp8_model_init": lambda r: _enter(engine.fp8_model_init(recipe=r)),
    "quantized_model_init": lambda r: _enter(engine.quantized_model_init(recipe=r)),
    "convert": lambda r: engine.convert(torch.nn.Sequential(torch.nn.Linear(16, 16)), recipe=r, fp8_weights=True),
}


@pytest.mark.parametrize("taker", RECIPE_TAKERS)
@pytest.mark.parametrize("cls", [DelayedScaling, NVFP4BlockScaling])
def test_a_recipe_class_for_an_instance_says_what_was_meant(taker, cls):
    take = RECIPE_TAKERS[taker]
    # the autocasts also take a per-layer RecipeMap
    expected = "an engine.recipes.Recipe, a RecipeMap or None" if "autocast" in taker else "an engine.recipes.Recipe or None"
    with pytest.raises(TypeError) as err:
        take(cls)
    assert str(err.value) == f"recipe: expected {expected}, got the class {cls.__name__}; did you mean `{cls.__name__}()`?"
    with pytest.raises(TypeError) as err:
        take("delayed")
    assert str(err.value) == f"recipe: expected {expected}, got str"


@pytest.mark.parametrize("cls", [engine.Int8WeightOnly, engine.Int4WeightOnly, engine.NVFP4WeightOnly])
def test_a_config_class_for_an_instance_says_what_was_meant(cls):
    for take in (lambda c: engine.quantize_(torch.nn.Linear(16, 16), c),
                 lambda c: QuantizedWeight.from_float(torch.ones(16, 16), c)):
        with pytest.raises(TypeError, match=rf"config: expected one of .*, got the class {cls.__name__}; "
                                            rf"did you mean `{cls.__name__}\(\)`\?$"):
            take(cls)
    with pytest.raises(TypeError, match=r"config: expected one of .*, got the class DelayedScaling$"):
        engine.quantize_(torch.nn.Linear(16, 16), DelayedScaling)  # not a config class: no suggestion


@pytest.mark.parametrize("seed", [-1, 2**32, 2**70])
def test_nvfp4_seeds_outside_32_bits_are_refused(seed):
    with pytest.raises(ValueError, match=rf"seed: expected an int in \[0, 2\*\*32\) .*, got {seed}"):
        NVFP4BlockScaling(seed=seed)
    assert NVFP4BlockScaling(seed=2**32 - 1).seed == 2**32 - 1


def test_formats_a_recipe_fixes_are_refused():
    """NVFP4's elements and scales, the MX recipes' elements and OperandRecipe's specs fix the format; another
    fp8_format would be ignored. Recipes that read fp8_format keep taking it."""
    for make, fixed in ((NVFP4BlockScaling, "E4M3"), (MXFP4BlockScaling, "E4M3"), (MXFP6BlockScaling, "E4M3"),
                        (OperandRecipe, "HYBRID")):
        other = "E4M3" if fixed == "HYBRID" else "HYBRID"
        with pytest.raises(ValueError, match=rf"fp8_format: {make.__name__} .* so fp8_format must stay "
                                             rf"Format.{fixed}; got Format.{other}"):
            make(fp8_format=other)
        assert make(fp8_format=fixed).fp8_format.value == fixed
    assert Float8BlockScaling(fp8_format="HYBRID").fp8_format.value == "HYBRID"


@pytest.mark.parametrize("make, field, value", [
    (engine.Int4WeightOnly, "group_size", 128.0),
    (engine.Int4WeightOnly, "group_size", True),
    (engine.Int4WeightOnly, "group_size", "128"),
    (engine.MXWeightOnly, "element", b"e4m3"),
    (engine.MXWeightOnly, "scale_mode", 1),
    (engine.Float8DynamicActivationFloat8Weight, "granularity", None),
])
def test_config_fields_of_another_type_are_type_errors(make, field, value):
    with pytest.raises(TypeError, match=rf"{field}: expected one of \[.*\] \(type (int|str)\), got "
                                        rf"{value!r} \(type {type(value).__name__}\)"):
        make(**{field: value})


def test_a_negative_random_stream_offset_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"rng_counter: the offset .* must be >= 0, got -5"):
        NVFP4Quantizer(stochastic_rounding=True, rng_counter=torch.tensor([3, -5]))
    plain = NVFP4Quantizer(stochastic_rounding=True, rng_counter=torch.tensor([3, 5])).to_plain()
    with pytest.raises(ValueError, match=r"rng_counter: the offset .* must be >= 0, got -1"):
        quantizer_from_plain({**plain, "rng_counter": torch.tensor([3, -1])})
