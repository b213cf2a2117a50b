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


def check_params_dtype(dtype: Any, name: str = "params_dtype") -> torch.dtype:
    """The dtype parameters are created in: fp32, bf16 or fp16 (None: torch's default dtype)."""
    resolved = torch.get_default_dtype() if dtype is None else dtype
    if resolved not in HIGH_PRECISION_DTYPES:
        source = "" if dtype is not None else " (torch.get_default_dtype())"
        raise TypeError(f"{name}: expected torch.float32, torch.bfloat16 or torch.float16, got {resolved!r}{source}")
    return resolved
