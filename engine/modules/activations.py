"""Activations of LayerNormMLP. Gated ones (swiglu, geglu) split fc1's output in two halves:
act(first half) * second half, as Transformer Engine does."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _gated(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def gated(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return act(gate) * up

    return gated


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": _gelu, "relu": F.relu, "silu": F.silu, "swiglu": _gated(F.silu), "geglu": _gated(_gelu),
}
GATED = frozenset({"swiglu", "geglu"})


def check_activation(activation: str) -> str:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {sorted(ACTIVATIONS)}, got {activation!r}")
    return activation
