"""Per-layer recipes (engine.recipes.RecipeMap): which layer runs under which recipe, and the picks saved with the
model. Each layer's output is checked against the same layer run alone under its recipe (or F.linear)."""

from __future__ import annotations

import contextlib

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
import transformers

import checkpoint_specs
import engine
from engine.recipes import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling, RecipeMap

WIDTH, TOKENS = 64, 32


def every_recipe():
    """Every recipe class engine.recipes exports (a new one is tested here by being exported)."""
    return [checkpoint_specs.make_recipe(cls.__name__) for cls in checkpoint_specs.exported_recipe_classes()]


def stack(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(3)))


def alone(layer: torch.nn.Module, x: torch.Tensor, recipe) -> torch.Tensor:
    """The layer's output run by a fresh engine.Linear with its weights, alone, under `recipe` (None: F.linear)."""
    if recipe is None:
        return F.linear(x, layer.weight, layer.bias)
    single = engine.Linear(WIDTH, WIDTH)
    with torch.no_grad():
        single.weight.copy_(layer.weight)
        single.bias.copy_(layer.bias)
    with engine.fp8_autocast(recipe=recipe):
        return single(x)


def layer_outputs(model, x, recipe):
    """Each layer's input and output in one forward of the model under fp8_autocast(recipe=recipe)."""
    seen = []
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append((i[0].detach(), o.detach()))) for m in model]
    with engine.fp8_autocast(recipe=recipe):
        model(x)
    for h in hooks:
        h.remove()
    return seen


# ------------------------------------------------------------------ the map
def test_the_first_matching_rule_wins_and_unmatched_names_get_the_default():
    fp8, fp4 = MXFP8BlockScaling(), NVFP4BlockScaling()
    m = RecipeMap(rules=[("blocks.3.*", None), ("*.mlp.*", fp4), ("blocks.*", fp8)], default=Float8CurrentScaling())
    assert m.recipe_for("blocks.3.mlp.fc1") is None
    assert m.recipe_for("blocks.1.mlp.fc1") is fp4
    assert m.recipe_for("blocks.1.attn.qkv") is fp8
    assert m.recipe_for("lm_head") == Float8CurrentScaling()
    assert RecipeMap(rules={"a": None}).recipe_for("b") == "inherit"


def test_an_inherit_default_in_fp8_autocast_is_the_enclosing_recipe():
    x = torch.randn(TOKENS, WIDTH)
    for outer, want in ((None, DelayedScaling()), (MXFP8BlockScaling(), MXFP8BlockScaling()),
                        (RecipeMap(rules={"0": None}, default=Float8CurrentScaling()), Float8CurrentScaling())):
        model = engine.convert(stack(), keep_output_head=False)
        around = contextlib.nullcontext() if outer is None else engine.fp8_autocast(recipe=outer)
        with around:
            seen = layer_outputs(model, x, {"1": None})
        for i, (inp, out) in enumerate(seen):
            assert torch.equal(out, alone(model[i], inp, None if i == 1 else want)), (outer, i)


@pytest.mark.parametrize("bad", [[("", None)], [("x", "fp8")], [("x",)], "x*", 3])
def test_bad_rules_are_refused_naming_the_rule(bad):
    with pytest.raises(ValueError, match="rules"):
        RecipeMap(rules=bad)


def test_the_map_as_plain_data_comes_back_equal_and_its_key_follows_the_contents():
    m = RecipeMap(rules=[("0", None), ("1", NVFP4BlockScaling(disable_rht=True))], default=MXFP8BlockScaling())
    assert RecipeMap.from_plain(m.to_plain()) == m
    other = RecipeMap(rules=[("0", None), ("1", NVFP4BlockScaling())], default=MXFP8BlockScaling())
    assert m.key != other.key and m.key == RecipeMap.from_plain(m.to_plain()).key
    with pytest.raises(ValueError, match="recipe map"):
        RecipeMap.from_plain({"rules": []})


def test_fp8_autocast_refuses_what_is_neither_a_recipe_nor_a_map():
    with pytest.raises(TypeError, match="recipe: expected an engine.recipes.Recipe, a RecipeMap"):
        with engine.fp8_autocast(recipe="fp8"):
            pass


# ------------------------------------------------------------------ routing
@pytest.mark.parametrize("recipe", every_recipe(), ids=lambda r: type(r).__name__)
def test_a_map_in_fp8_autocast_routes_each_layer_to_its_recipe(recipe):
    model = engine.convert(stack(), keep_output_head=False)
    x = torch.randn(TOKENS, WIDTH)
    picks = {"0": None, "1": recipe, "2": Float8CurrentScaling()}
    seen = layer_outputs(model, x, picks)
    for (name, pick), (inp, out) in zip(picks.items(), seen):
        assert torch.equal(out, alone(model[int(name)], inp, pick)), name


def test_stored_picks_win_over_the_autocasts_recipe_and_a_map_in_the_autocast_wins_over_them():
    model = engine.set_recipe_map(engine.convert(stack(), keep_output_head=False),
                                  RecipeMap(rules={"1": None}, default=MXFP8BlockScaling()))
    x = torch.randn(TOKENS, WIDTH)
    seen = layer_outputs(model, x, Float8CurrentScaling())
    assert [torch.equal(out, alone(model[i], inp, pick))
            for i, ((inp, out), pick) in enumerate(zip(seen, [MXFP8BlockScaling(), None, MXFP8BlockScaling()]))] == [True] * 3
    seen = layer_outputs(model, x, RecipeMap(rules={"0": None}, default=Float8CurrentScaling()))  # the map wins
    for i, ((inp, out), pick) in enumerate(zip(seen, [None, Float8CurrentScaling(), Float8CurrentScaling()])):
        assert torch.equal(out, alone(model[i], inp, pick)), i
    engine.set_recipe_map(model, None)  # no picks: the autocast's recipe everywhere
    seen = layer_outputs(model, x, Float8CurrentScaling())
    assert all(torch.equal(out, alone(model[i], inp, Float8CurrentScaling())) for i, (inp, out) in enumerate(seen))


def test_a_high_precision_pick_trains_like_the_torch_layer():
    model = engine.convert(stack(), keep_output_head=False, recipe_map={"*": None})
    reference = stack()
    x = torch.randn(TOKENS, WIDTH)
    with engine.fp8_autocast(recipe=NVFP4BlockScaling()):
        model(x).sum().backward()
    reference(x).sum().backward()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_a_map_without_names_or_with_a_pattern_that_matches_nothing_says_how_to_fix_it():
    bare = torch.nn.Sequential(engine.Linear(WIDTH, WIDTH))
    with pytest.raises(ValueError, match=r"no name.*engine.set_recipe_map"):
        with engine.fp8_autocast(recipe={"0": None}):
            bare(torch.randn(2, WIDTH))
    with pytest.raises(ValueError, match=r"'blocks\.\*' matches no engine module.*\['0'\]"):
        engine.set_recipe_map(bare, {"blocks.*": None})


def test_compiled_models_follow_the_picks():
    model = engine.convert(stack(), keep_output_head=False, recipe_map={"1": None, "2": MXFP8BlockScaling()})
    x = torch.randn(TOKENS, WIDTH)
    with engine.fp8_autocast(recipe=Float8CurrentScaling()):  # stateless recipes: a second step computes the same
        eager = model(x)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    with engine.fp8_autocast(recipe=Float8CurrentScaling()):
        assert torch.equal(compiled(x), eager)
    engine.set_recipe_map(model, None)  # another pick: a retrace, not the stale graph
    with engine.fp8_autocast(recipe=Float8CurrentScaling()):
        assert torch.equal(compiled(x), model(x))
        assert not torch.equal(compiled(x), eager)


# ------------------------------------------------------------------ saved with the model
def test_picks_survive_a_state_dict_through_safetensors_even_before_the_first_step(tmp_path):
    picks = RecipeMap(rules={"0": None, "2": NVFP4BlockScaling()}, default=MXFP8BlockScaling())
    x = torch.randn(TOKENS, WIDTH)
    for ran in (False, True):
        model = engine.convert(stack(), keep_output_head=False, recipe_map=picks)
        if ran:
            with engine.fp8_autocast():
                model(x)
        safetensors.torch.save_file(model.state_dict(), tmp_path / "m.safetensors")
        loaded = engine.convert(stack(seed=1), keep_output_head=False)
        loaded.load_state_dict(safetensors.torch.load_file(tmp_path / "m.safetensors"))
        assert engine.recipe_map_of(loaded) == RecipeMap(
            rules=[("0", None), ("1", MXFP8BlockScaling()), ("2", NVFP4BlockScaling())])
        with engine.fp8_autocast():  # the autocast's DelayedScaling is overridden everywhere
            assert torch.equal(loaded(x), model(x))


def test_a_hugging_face_model_carries_its_map_through_save_pretrained(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config)
    picks = RecipeMap(rules={"model.layers.1.*": None, "*.mlp.*": NVFP4BlockScaling()}, default=MXFP8BlockScaling())
    engine.convert(model, recipe_map=picks)
    ids = torch.randint(0, 64, (2, 16))
    with engine.fp8_autocast():
        want = model(ids).logits
    engine.unconvert(model)
    model.save_pretrained(tmp_path)
    loaded = engine.convert(transformers.LlamaForCausalLM.from_pretrained(tmp_path))
    assert engine.recipe_map_of(loaded) == engine.recipe_map_of(engine.convert(model))
    assert loaded.model.layers[1].mlp.up_proj._recipe_choice == (None,)
    assert loaded.model.layers[0].mlp.up_proj._recipe_choice == (NVFP4BlockScaling(),)
    with engine.fp8_autocast():
        assert torch.equal(loaded(ids).logits, want)
