"""ExpertLinears: one engine.Linear per expert, each run on its rows - Transformer Engine GroupedLinear's
`forward(inp, m_splits)` as a Python loop over experts.

MoEMLP takes any experts module with that call (`experts(num_gemms, in_features, out_features, bias=...,
params_dtype=...)` builds it; `forward(rows grouped by expert [T, K], m_splits) -> [T, N]`), so a grouped GEMM
module (engine.GroupedLinear) replaces this loop; the loop stays as the per-expert baseline it is measured against.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.modules import Linear

__all__ = ["ExpertLinears", "ExpertsFactory"]


class ExpertsFactory(Protocol):
    """What MoEMLP builds its experts with (ExpertLinears, or TE's GroupedLinear signature)."""

    def __call__(self, num_gemms: int, in_features: int, out_features: int, *, bias: bool,
                 params_dtype: torch.dtype | None) -> torch.nn.Module: ...


def check_m_splits(m_splits: object, experts: int, rows: int) -> list[int]:
    """m_splits as a list of `experts` ints >= 0 adding up to `rows`; ValueError naming what differs otherwise."""
    if not isinstance(m_splits, (list, tuple)) or len(m_splits) != experts or \
            any(isinstance(m, bool) or not isinstance(m, int) or m < 0 for m in m_splits):
        raise ValueError(f"m_splits: expected a list of {experts} ints >= 0 (rows per expert, as permute returns "
                         f"them), got {m_splits!r}")
    if sum(m_splits) != rows:
        raise ValueError(f"m_splits: adds up to {sum(m_splits)}, but inp has {rows} rows; pass the m_splits of the "
                         "permutation that made inp")
    return list(m_splits)


class ExpertLinears(torch.nn.Module):
    """`num_gemms` experts y_i = x_i W_i^T + b_i, expert i on its `m_splits[i]` rows of `inp` (in order)."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int, bias: bool = True,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if isinstance(num_gemms, bool) or not isinstance(num_gemms, int) or num_gemms < 1:
            raise ValueError(f"num_gemms: expected an int >= 1 (one GEMM per expert), got {num_gemms!r}")
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.linears = torch.nn.ModuleList(Linear(in_features, out_features, bias=bias, params_dtype=params_dtype)
                                           for _ in range(num_gemms))

    def forward(self, inp: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        splits = check_m_splits(m_splits, self.num_gemms, inp.shape[0])
        return torch.cat([linear(part) for linear, part in zip(self.linears, inp.split(splits))])

    def keep(self, first: int, stop: int) -> None:
        """Hold only experts first..stop-1 (expert parallel: this rank's share)."""
        self.linears = torch.nn.ModuleList(list(self.linears)[first:stop])
        self.num_gemms = stop - first
