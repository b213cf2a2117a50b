"""Argument checks shared by the public API: each names the argument, what was expected and what came."""

from __future__ import annotations

from typing import Any

import torch

from engine.ops.reference import HIGH_PRECISION_DTYPES


def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {value!r}")
    return value


def check_optional_bool(value: Any, name: str) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name}: expected True, False or None, got {value!r}")
    return value


def check_instance(value: Any, cls: type, name: str, expected: str, *, none_ok: bool = False) -> Any:
    """`value` if it is a `cls` (or None, if `none_ok`); else a TypeError naming `name`, `expected` and what came.

    A subclass of `cls` given where its instance belongs (`recipe=DelayedScaling`) gets the call that makes
    one: "did you mean `DelayedScaling()`?" (a pydantic or dataclass class would otherwise show as its
    metaclass, `ModelMetaclass` or `type`).
    """
    if isinstance(value, cls) or (none_ok and value is None):
        return value
    if isinstance(value, type):
        hint = f"; did you mean `{value.__name__}()`?" if issubclass(value, cls) and value is not cls else ""
        raise TypeError(f"{name}: expected {expected}, got the class {value.__name__}{hint}")
    raise TypeError(f"{name}: expected {expected}, got {type(value).__name__}")


def check_params_dtype(dtype: Any, name: str = "params_dtype") -> torch.dtype:
    """The dtype parameters are created in: fp32, bf16 or fp16 (None: torch's default dtype)."""
    resolved = torch.get_default_dtype() if dtype is None else dtype
    if resolved not in HIGH_PRECISION_DTYPES:
        source = "" if dtype is not None else " (torch.get_default_dtype())"
        raise TypeError(f"{name}: expected torch.float32, torch.bfloat16 or torch.float16, got {resolved!r}{source}")
    return resolved
