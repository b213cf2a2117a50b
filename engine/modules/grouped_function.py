"""grouped_linear(): every expert's linear over its group of tokens, as one output [T, N].

The per-expert path runs `linear()` (the function engine.Linear runs: eager, compiled, recompute, inspect)
once per expert on its rows, so each expert's bits are an engine.Linear's by construction.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from engine.modules.linear_function import LinearArgs

PerExpert = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", LinearArgs], torch.Tensor]


def grouped_linear(inp2d: torch.Tensor, m_splits: Sequence[int], weights: Sequence[torch.Tensor],
                   biases: Sequence[torch.Tensor | None], args: Sequence[LinearArgs], *,
                   per_expert: PerExpert) -> torch.Tensor:
    """out [T, N]: rows of expert e = per_expert(inp rows of e, weights[e], biases[e], args[e])."""
    outs = [per_expert(x, w, b, a) for x, w, b, a in zip(torch.split(inp2d, list(m_splits)), weights, biases, args)]
    return torch.cat(outs) if len(outs) > 1 else outs[0]
