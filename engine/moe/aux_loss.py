"""The load-balancing loss of Switch Transformer / GShard: E * sum_e f_e * P_e, with f_e the share of routing slots
that picked expert e and P_e the mean router probability of e. It is 1 when routing is uniform, larger otherwise."""

from __future__ import annotations

import torch

__all__ = ["load_balancing_loss"]


def load_balancing_loss(probs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """probs [T, E] (softmax of the router), indices [T, K] (top-k picks) -> a scalar (0 for T = 0)."""
    tokens, experts = probs.shape
    if tokens == 0:
        return probs.sum() * 0.0
    share = torch.bincount(indices.reshape(-1), minlength=experts).to(probs.dtype) / indices.numel()
    return experts * (share * probs.mean(dim=0)).sum()
