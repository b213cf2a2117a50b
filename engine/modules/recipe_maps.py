"""Per-layer recipes on a model: each engine module's pick from a RecipeMap, stored in the module.

`set_recipe_map(model, recipe_map)` names every engine module after `model.named_modules()` and gives it
the map's pick for that name; under any fp8_autocast without a map of its own the module then runs
under its pick. Its `_extra_state` carries the pick, so a state dict (torch.save, safetensors) brings
the per-layer recipes back with the weights; a Hugging Face model's config carries the map too
(`config.engine_recipe_map`, written by `save_pretrained`), and `engine.convert` of a model loaded with
`from_pretrained` applies it. `recipe_map_of(model)` reads the picks back as a map of exact names.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from engine.checks import check_instance
from engine.modules.base import FP8Module
from engine.recipes import Recipe, RecipeMap
from engine.recipes.recipe_map import INHERIT, as_recipe_map

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
