"""Recipes as plain data (for checkpoints): a name and field values, never pickled objects."""

from __future__ import annotations

import warnings
from enum import Enum
from typing import Any

from pydantic import ValidationError

from engine.recipes.base import Recipe


def recipe_to_plain(recipe: Recipe) -> dict[str, Any]:
    """{"name": ..., "fields": {...}}; a callable field is kept as its qualified name (a string)."""
    fields: dict[str, Any] = {}
    for key in type(recipe).model_fields:
        value = getattr(recipe, key)
        if isinstance(value, Enum):
            value = value.value
        elif isinstance(value, dict):  # OperandRecipe: operand name -> spec as plain data
            value = {k: None if v is None else v.to_plain() for k, v in value.items()}
        elif callable(value):
            value = f"<callable {getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', repr(value))}>"
        fields[key] = value
    return {"name": recipe.name, "fields": fields}


def recipe_from_plain(plain: Any) -> Recipe:
    """Inverse of `recipe_to_plain`. A saved callable cannot be restored: its field takes the default, with a warning
    (or what the recipe class restores it as: `Recipe.restore_callable`)."""
    from engine.recipes import SAVED_RECIPES

    if not isinstance(plain, dict) or plain.get("name") not in SAVED_RECIPES or not isinstance(plain.get("fields"), dict):
        raise ValueError(f"recipe: expected {{'name': one of {sorted(SAVED_RECIPES)}, 'fields': dict}}, got {plain!r}")
    cls = SAVED_RECIPES[plain["name"]]
    fields = dict(plain["fields"])
    for key, value in list(fields.items()):
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
