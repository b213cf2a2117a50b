"""Format: which FP8 dtype forward tensors and gradients use."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import torch
from pydantic import AfterValidator


class Format(str, Enum):
    """E4M3 everywhere, or HYBRID: E4M3 forward (input, weight, output) and E5M2 gradients.

    E5M2 is listed so that asking for it fails with a clear message: its 2 mantissa bits
    are too coarse for weights and activations, so no recipe accepts it.
    """

    E4M3 = "E4M3"
    HYBRID = "HYBRID"
    E5M2 = "E5M2"

    @property
    def forward_dtype(self) -> torch.dtype:
        return torch.float8_e5m2 if self is Format.E5M2 else torch.float8_e4m3fn

    @property
    def backward_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self is Format.E4M3 else torch.float8_e5m2

    def __repr__(self) -> str:
        return f"Format.{self.name}"

    __str__ = __repr__


def fixed_format(value: Format, fixed: Format, recipe: str, why: str) -> Format:
    """`value` if it is the one format `recipe` computes with (`why` says what fixes it), else a ValueError."""
    if value is not fixed:
        raise ValueError(f"fp8_format: {recipe} {why}, so fp8_format must stay {fixed!r}; got {value!r}")
    return value


def check_stream_seed(value: int) -> int:
    """A recipe's stochastic-rounding seed: the low 32 bits of every stream it seeds."""
    if not 0 <= value < 2**32:
        raise ValueError(f"seed: expected an int in [0, 2**32) (the low 32 bits of each stochastic-rounding "
                         f"stream), got {value}")
    return value


#: the type of a recipe's `seed` field
StreamSeed = Annotated[int, AfterValidator(check_stream_seed)]
