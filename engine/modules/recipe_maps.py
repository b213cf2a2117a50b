"""Per-layer recipes on a model: each engine module's pick from a RecipeMap, stored in the module.

`set_recipe_map(model, recipe_map)` names every engine module after `model.named_modules()` and gives it
the map's pick for that name; under any fp8_autocast without a map of its own the module then runs
under its pick. Its `_extra_state` carries the pick, so a state dict (torch.save, safetensors) brings
the per-layer recipes back with the weights; a Hugging Face model's config carries the map too
(`config.engine_recipe_map`, written by `save_pretrained`), and `engine.convert` of a model loaded with
`from_pretrained` applies it. `recipe_map_of(model)` reads the picks back as a map of exact names; `four_bit_flop_share(model, recipe)`
counts the share of the GEMM FLOPs the picks leave in 4-bit.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from engine.checks import check_instance
from engine.modules.base import FP8Module
from engine.recipes import Recipe, RecipeMap
from engine.recipes.recipe_map import INHERIT, as_recipe_map
from engine.recipes.schedule import four_bit_gemms

#: the attribute of a Hugging Face config (saved in config.json) that holds the map, as plain data
CONFIG_ATTRIBUTE = "engine_recipe_map"


def set_recipe_map(model: nn.Module, recipe_map: RecipeMap | dict | None) -> nn.Module:
    """Name every engine module of `model` and store its pick from `recipe_map` (None: remove the picks, so
    the modules run under the fp8_autocast's recipe again; a module the map's "inherit" default reaches gets
    no pick). Returns the model.

    A pattern that matches no engine module is a ValueError (a typo would otherwise keep a layer in FP4),
    naming the pattern and some of the names there are."""
    check_instance(model, nn.Module, "model", "a torch.nn.Module")
    recipe_map = None if recipe_map is None else as_recipe_map(recipe_map, "recipe_map")
    modules = [(name, m) for name, m in model.named_modules() if isinstance(m, FP8Module)]
    if recipe_map is not None:
        names = [name for name, _ in modules]
        unused = [p for p, _ in recipe_map.rules if not any(fnmatchcase(n, p) for n in names)]
        if unused:
            raise ValueError(f"recipe_map: the pattern {unused[0]!r} matches no engine module of the model; its "
                             f"engine modules are named like {names[:4]} (patterns are fnmatch, matched against "
                             "the whole name)")
    for name, module in modules:
        pick = INHERIT if recipe_map is None else recipe_map.recipe_for(name)
        module.name = name
        module.set_recipe_choice(None if pick == INHERIT else (pick,))
    config = hf_config(model)
    if config is not None:
        setattr(config, CONFIG_ATTRIBUTE, None if recipe_map is None else recipe_map.to_plain())
    return model


def hf_config(model: nn.Module) -> object | None:
    """The model's Hugging Face config (what save_pretrained writes as config.json), if it has one."""
    config = getattr(model, "config", None)
    return config if callable(getattr(config, "to_json_string", None)) else None


def saved_recipe_map(model: nn.Module) -> RecipeMap | None:
    """The map a Hugging Face model's config carries (set by set_recipe_map before save_pretrained)."""
    config = hf_config(model)
    plain = None if config is None else getattr(config, CONFIG_ATTRIBUTE, None)
    if plain is None:
        return None
    try:
        return RecipeMap.from_plain(plain)
    except ValueError as err:
        raise ValueError(f"config.{CONFIG_ATTRIBUTE}: {err}") from None


def recipe_map_of(model: nn.Module) -> RecipeMap | None:
    """The picks the model's engine modules hold, as exact-name rules; the others inherit (None: no module
    holds a pick)."""
    check_instance(model, nn.Module, "model", "a torch.nn.Module")
    rules: list[tuple[str, Recipe | None]] = [
        (name, m._recipe_choice[0]) for name, m in model.named_modules()
        if isinstance(m, FP8Module) and m._recipe_choice is not None]
    return RecipeMap(rules=rules) if rules else None


def four_bit_flop_share(model: nn.Module, recipe: Recipe | None, unquantized: tuple[str, ...] = ()) -> float:
    """The share of the engine modules' GEMM FLOPs (fprop, dgrad, wgrad) that run on 4-bit operands when
    `model` runs under `fp8_autocast(recipe=recipe)` (None: disabled) with its modules' picks; modules whose name
    starts with a prefix of `unquantized` run under a disabled fp8_autocast (e.g. the demo GPT's last blocks).

    Every GEMM of a module counts 2 M N K FLOPs with the same M (tokens) for every module, as in a transformer's
    linear layers: a GEMM weighs its weight's numel."""
    check_instance(model, nn.Module, "model", "a torch.nn.Module")
    four_bit = total = 0
    for name, module in model.named_modules():
        if not isinstance(module, FP8Module):
            continue
        in_force = recipe if module._recipe_choice is None else module._recipe_choice[0]
        if any(name == p or name.startswith(p + ".") for p in unquantized):
            in_force = None
        gemms = four_bit_gemms(in_force)
        for weight_name in module.weight_names:
            numel = getattr(module, weight_name).numel()
            total += len(gemms) * numel
            four_bit += sum(gemms.values()) * numel
    if total == 0:
        raise ValueError("model: expected a model with engine layers (engine.Linear, ...; see engine.convert), "
                         "it has none")
    return four_bit / total
