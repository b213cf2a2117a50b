"""The cases of the conformance suite: every recipe `engine.recipes` exports, and its variants.

A case is a recipe class exported by `engine.recipes` (tests/checkpoint_specs.py's `exported_recipe_classes`,
built by its `make_recipe`: the fixtures' fields where a class needs some), plus one variant per other value of
each of its option fields: a bool flipped, each other value of a `Literal` (or `Optional[Literal]`), each other
`Format`. A value the class refuses at construction (a fixed `fp8_format`) is no variant, nor is one that
quantizes as an earlier case does (the same quantizer configs: a field only the distributed amax reduction reads,
or a default spelled out). So a new recipe class, or a new option of an existing one (NVFP4's `disable_rht`,
MXFP6's `element`, ...), is a case without a line edited here. Fields of other types (numbers, callables, dicts)
keep the case's value.

`CASES` holds every case; `DEFAULTS` one per class (each class as `make_recipe` builds it), for the contracts
whose cost is per case (the distributed ones). A case's id is its class name, then `field=value` for a variant.
"""

from __future__ import annotations

import enum
import types
import typing
from dataclasses import dataclass
from typing import Any

import checkpoint_specs as specs
from engine.recipes import Recipe


@dataclass(frozen=True)
class Case:
    """One recipe to run every contract under: `recipe()` builds a fresh instance (with its own state)."""

    class_name: str
    changes: tuple[tuple[str, Any], ...] = ()

    @property
    def id(self) -> str:
        return "-".join([self.class_name, *(f"{name}={_text(value)}" for name, value in self.changes)])

    def recipe(self) -> Recipe:
        base = specs.make_recipe(self.class_name)
        return type(base)(**{**_fields_of(base), **dict(self.changes)}) if self.changes else base

    def __str__(self) -> str:
        return self.id


def _text(value: Any) -> str:
    return value.name if isinstance(value, enum.Enum) else str(value)


def _fields_of(recipe: Recipe) -> dict[str, Any]:
    """The fields `recipe` was built with (its class's defaults where it was given none)."""
    return {name: getattr(recipe, name) for name in type(recipe).model_fields}


def option_values(annotation: Any) -> list[Any] | None:
    """Every value a field of this type takes, for bools, Literals, Optional[Literal]s and enums; else None."""
    if annotation is bool:
        return [False, True]
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return list(annotation)
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return list(typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        parts = [option_values(a) for a in args if a is not type(None)]
        if any(p is None for p in parts):
            return None  # a Union with a callable or a number: not an option list
        return [v for p in parts for v in p] + ([None] if type(None) in args else [])
    return None


def quantizer_configs(recipe: Recipe) -> tuple:
    """What a recipe quantizes with: the config of every operand's quantizer (None: high precision) in the
    states of a two-GEMM module (LayerNormMLP's fc1, fc2), forward and backward."""
    from engine.recipes import BACKWARD_ROLES, FORWARD_ROLES, OPERANDS

    out = []
    for forward in (True, False):
        state = recipe.make_state(forward=forward, num_gemms=2, module="LayerNormMLP", gemm_names=("fc1", "fc2"))
        roles = FORWARD_ROLES if forward else BACKWARD_ROLES
        out += [(str(op), gemm, None if state.operand(op, gemm) is None else repr(state.operand(op, gemm).config()))
                for op in OPERANDS if op[1] in roles for gemm in range(2)]
    return tuple(out)


def variants(class_name: str, seen: set[tuple]) -> list[Case]:
    """The class as `make_recipe` builds it, then each other value of each option field, one at a time; a
    variant that quantizes as a case in `seen` does (same quantizer configs: a field only the distributed
    amax reduction reads, or the default spelled out) is left out. Adds what it returns to `seen`."""
    base = specs.make_recipe(class_name)
    out = [Case(class_name)]
    seen.add(quantizer_configs(base))
    for name, field in type(base).model_fields.items():
        values = option_values(field.annotation)
        for value in values or ():
            if value == getattr(base, name):
                continue
            try:
                recipe = type(base)(**{**_fields_of(base), name: value})
            except ValueError:  # refused at construction (a fixed fp8_format): not a recipe this class makes
                continue
            configs = quantizer_configs(recipe)
            if configs not in seen:
                seen.add(configs)
                out.append(Case(class_name, ((name, value),)))
    return out


def _every_case() -> list[Case]:
    seen: set[tuple] = set()
    return [case for cls in specs.exported_recipe_classes() for case in variants(cls.__name__, seen)]


DEFAULTS: list[Case] = [Case(cls.__name__) for cls in specs.exported_recipe_classes()]
CASES: list[Case] = _every_case()
