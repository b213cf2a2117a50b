"""Per-layer recipes: module-name patterns mapped to a recipe, or to None (the layer stays in high precision).

NVIDIA's NVFP4 recipe keeps the last blocks of a model in bf16; a practitioner keeps a diverging layer
in FP8 while the rest runs in FP4. A `RecipeMap` says so as data:

    RecipeMap(rules=[("blocks.3.*", None), ("*.mlp.*", NVFP4BlockScaling())], default=MXFP8BlockScaling())

The first rule whose pattern matches a module's name (`fnmatch`, case-sensitive, against the name
`model.named_modules()` gives it) picks the recipe; no match, the default. The default "inherit" (what
a dict of rules gets) means the recipe around: in `fp8_autocast(recipe=map)` the enclosing
fp8_autocast's recipe (DelayedScaling() outside any, as fp8_autocast's own default), and for the picks
`engine.set_recipe_map` / `engine.convert(recipe_map=...)` store in the modules (where their
checkpoints carry them), no pick: the module runs under whatever recipe the fp8_autocast brings.
"""

from __future__ import annotations

import hashlib
import json
from fnmatch import fnmatchcase
from functools import cached_property
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, field_validator

from engine.recipes.base import Recipe
from engine.recipes.plain import recipe_from_plain, recipe_to_plain

#: how a module's pick of "high precision" is written in a checkpoint
HIGH_PRECISION_PLAIN: dict[str, Any] = {"high_precision": True}
#: the default that defers to the recipe around (module docstring)
INHERIT = "inherit"


class RecipeMap(BaseModel):
    """Rules (pattern, recipe or None), tried in order, and the recipe of the names no rule matches."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    rules: tuple[tuple[str, Recipe | None], ...] = ()
    default: Recipe | None | Literal["inherit"] = INHERIT

    @field_validator("rules", mode="before")
    @classmethod
    def _rules_as_pairs(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            value = tuple(value.items())
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"rules: expected a mapping or a sequence of (pattern, recipe or None) pairs, got "
                             f"{type(value).__name__}")
        for i, pair in enumerate(value):
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], str) and pair[0]
                    and (pair[1] is None or isinstance(pair[1], Recipe))):
                raise ValueError(f"rules[{i}]: expected (a non-empty fnmatch pattern, an engine recipe or None), "
                                 f"got {pair!r:.200}")
        return tuple(tuple(pair) for pair in value)

    def recipe_for(self, name: str) -> Recipe | None | Literal["inherit"]:
        """The recipe of the module called `name` (None: high precision; "inherit": the recipe around)."""
        for pattern, recipe in self.rules:
            if fnmatchcase(name, pattern):
                return recipe
        return self.default

    @cached_property
    def key(self) -> str:
        """A string naming the map's contents (compiled code guards on it, as on a recipe's key)."""
        text = json.dumps(self.to_plain(), sort_keys=True)
        return "recipe_map:" + hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_plain(self) -> dict[str, Any]:
        default = INHERIT if self.default == INHERIT else choice_to_plain(self.default)
        return {"rules": [[p, choice_to_plain(r)] for p, r in self.rules], "default": default}

    @classmethod
    def from_plain(cls, plain: Any) -> RecipeMap:
        if not (isinstance(plain, dict) and set(plain) == {"rules", "default"} and isinstance(plain["rules"], list)):
            raise ValueError(f"recipe map: expected {{'rules': [[pattern, recipe], ...], 'default': recipe}}, got "
                             f"{plain!r:.200}")
        default = INHERIT if plain["default"] == INHERIT else choice_from_plain(plain["default"])
        return cls(rules=[(p, choice_from_plain(r)) for p, r in plain["rules"]], default=default)

    def inheriting(self, around: Recipe) -> RecipeMap:
        """This map with an "inherit" default made `around` (the map itself if its default is set)."""
        return self if self.default != INHERIT else RecipeMap(rules=self.rules, default=around)

    def __repr__(self) -> str:
        return f"RecipeMap(rules={list(self.rules)!r}, default={self.default!r})"

    __str__ = __repr__


def as_recipe_map(value: Any, argument: str) -> RecipeMap:
    """A RecipeMap, or a mapping of patterns to recipes (default: "inherit")."""
    if isinstance(value, RecipeMap):
        return value
    if isinstance(value, Mapping):
        return RecipeMap(rules=value)
    raise TypeError(f"{argument}: expected an engine.recipes.RecipeMap or a dict of fnmatch patterns to recipes "
                    f"(None: high precision), got {type(value).__name__}")


def choice_to_plain(choice: Recipe | None) -> dict[str, Any]:
    """A module's pick as checkpoint data: the recipe's plain form, or HIGH_PRECISION_PLAIN."""
    return dict(HIGH_PRECISION_PLAIN) if choice is None else recipe_to_plain(choice)


def choice_from_plain(plain: Any) -> Recipe | None:
    return None if plain == HIGH_PRECISION_PLAIN else recipe_from_plain(plain)
