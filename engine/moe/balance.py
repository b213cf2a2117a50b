"""Routing statistics over an expert-parallel group: the load-balancing loss and the capacity of one process.

Under expert parallel each rank routes its own tokens, but the load-balancing loss and the expert capacity are
properties of the whole batch: one all_gather of every rank's per-expert picks, token count and probability sums
(E + 1 + E numbers; the routing already syncs once for m_splits) gives each rank the values one process computes
over the ranks' tokens concatenated in rank order:

- the aux loss E * sum_e f_e * P_e with f_e and P_e over all tokens (the same value on every rank). Its gradient
  reaches this rank's router probabilities times the group's size, so that averaging gradients over the group
  (FSDP2, DDP) gives one process's gradient of (mean of the ranks' losses + aux);
- the capacity ceil(capacity_factor * T_all * k / E) per expert, of which rank r keeps what ranks 0..r-1 left
  (an expert keeps its earliest rows over the concatenated batch, as one process's permute does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["GroupRouting", "group_routing"]


@dataclass(frozen=True)
class GroupRouting:
    """This rank's view of the group's routing: the aux loss (before its coefficient) and its capacity list."""

    aux_loss: torch.Tensor
    capacity: list[int] | None


def group_routing(probs: torch.Tensor, indices: torch.Tensor, capacity_factor: float | None,
                  group: dist.ProcessGroup) -> GroupRouting:
    """probs [T, E] (the router's softmax), indices [T, K] (top-k picks) of this rank -> the group's statistics."""
    tokens, experts = probs.shape
    top_k = indices.shape[1]
    picks = torch.bincount(indices.reshape(-1), minlength=experts)
    prob_sums = probs.float().sum(dim=0)
    mine = torch.cat([picks.double(), torch.tensor([float(tokens)], dtype=torch.float64), prob_sums.detach().double()])
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    table = torch.stack(gathered)  # [world, E + 1 + E]
    all_picks, all_tokens = table[:, :experts], int(table[:, experts].sum())
    if all_tokens == 0:
        aux = probs.sum() * 0.0
    else:
        share = (all_picks.sum(dim=0) / (all_tokens * top_k)).to(probs.dtype)
        total = table[:, experts + 1:].sum(dim=0).float()
        scaled = world * prob_sums  # the value of the group's sum, the gradient of `world` copies of this rank's
        mean_probs = (scaled - (scaled - total).detach()) / all_tokens
        aux = experts * (share * mean_probs.to(probs.dtype)).sum()
    capacity = None
    if capacity_factor is not None:
        limit = math.ceil(capacity_factor * all_tokens * top_k / experts)
        before = all_picks[:rank].sum(dim=0).long().tolist()
        capacity = [max(0, limit - int(b)) for b in before]
    return GroupRouting(aux_loss=aux, capacity=capacity)
