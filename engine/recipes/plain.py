"""Recipes as plain data (for checkpoints): a name and field values, never pickled objects."""

from __future__ import annotations

import json
import warnings
from functools import lru_cache
from typing import Any

from pydantic import ValidationError

from engine.recipes.base import Recipe, recipe_to_plain
from engine.recipes.block import Float8BlockScaling
from engine.recipes.current import Float8CurrentScaling
from engine.recipes.custom import OperandRecipe
from engine.recipes.debug import Debug
from engine.recipes.delayed import DelayedScaling
from engine.recipes.factory import CustomRecipe
from engine.recipes.mx_small import MXFP4BlockScaling, MXFP4MixedBlockScaling, MXFP6BlockScaling
from engine.recipes.mxfp8 import MXFP8BlockScaling
from engine.recipes.nvfp4 import NVFP4BlockScaling
from engine.recipes.rowwise import Float8RowwiseScaling

__all__ = ["RECIPES", "SAVED_RECIPES", "recipe_for_key", "recipe_from_plain", "recipe_to_plain"]

#: the presets (Transformer Engine's recipes), by short name
RECIPES: dict[str, type[Recipe]] = {
    cls.name: cls for cls in (DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling,
                              Float8RowwiseScaling, MXFP4BlockScaling, MXFP4MixedBlockScaling, MXFP6BlockScaling,
                              NVFP4BlockScaling)
}
#: every recipe a checkpoint can name
SAVED_RECIPES: dict[str, type[Recipe]] = {**RECIPES, OperandRecipe.name: OperandRecipe, CustomRecipe.name: CustomRecipe,
                                          Debug.name: Debug}


def recipe_from_plain(plain: Any) -> Recipe:
    """Inverse of `recipe_to_plain`. A saved callable cannot be restored: its field takes the default, with a warning
    (or what the recipe class restores it as: `Recipe.restore_callable`)."""
    if not isinstance(plain, dict) or plain.get("name") not in SAVED_RECIPES or not isinstance(plain.get("fields"), dict):
        raise ValueError(f"recipe: expected {{'name': one of {sorted(SAVED_RECIPES)}, 'fields': dict}}, got {plain!r}")
    cls = SAVED_RECIPES[plain["name"]]
    fields = dict(plain["fields"])
    for key, value in list(fields.items()):
        if isinstance(value, dict) and set(value) == {"name", "fields"}:  # a wrapped recipe (Debug's)
            fields[key] = recipe_from_plain(value)
            continue
        if isinstance(value, str) and value.startswith("<callable "):
            restored = cls.restore_callable(key, value)
            if restored is not None:
                fields[key] = restored
                continue
            warnings.warn(f"recipe field {key} was the callable {value[10:-1]}, which a checkpoint cannot carry; "
                          "using the default", UserWarning, stacklevel=3)
            del fields[key]
    try:
        return cls(**fields)
    except ValidationError as err:
        raise ValueError(f"recipe: the saved fields of {cls.__name__} are invalid: {err}") from err


@lru_cache(maxsize=64)
def recipe_for_key(key: str) -> Recipe:
    """The recipe a `Recipe.key` names (callable fields, which a key cannot carry, take their defaults:
    custom ops quantize with the state's scales and never call them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return recipe_from_plain(json.loads(key))
