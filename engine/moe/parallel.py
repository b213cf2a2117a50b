"""Expert parallel: the experts of an MoE layer split over the ranks of a group, tokens exchanged by all-to-all.

Rank r of W holds experts r*E/W .. (r+1)*E/W - 1. A step: route and permute the rank's tokens over all E experts,
exchange the row counts (one all_to_all_single of E ints, then one host sync for the split sizes), send each
rank the rows of its experts (all_to_all_single with splits; differentiable), regroup the received rows by local
expert (they arrive by source rank), run the local experts, and send the outputs back the same way.

Every rank's loss reaches the experts it routed to, so an expert's gradient is the sum over the ranks; it is
divided by W (the expert's gradient is scaled by 1/W on its way back, its input's gradient by W, both exact for a
power-of-2 W), so experts are averaged over ranks as FSDP2 averages the other parameters.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from engine.moe.permute import permute, unpermute

__all__ = ["exchange", "expert_range", "run_experts_parallel"]


def expert_range(num_experts: int, group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(first, stop) of the experts this rank of `group` holds; ValueError when the ranks cannot share them."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if num_experts % world:
        raise ValueError(f"num_experts: {num_experts} experts cannot be split evenly over {world} ranks; use a "
                         f"multiple of {world} experts or a smaller expert-parallel group")
    local = num_experts // world
    return rank * local, (rank + 1) * local


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `factor`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with split sizes; its backward is the exchange the other way."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send: list[int], receive: list[int], group: Any) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return exchange(rows, send, receive, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return exchange(grad.contiguous(), ctx.receive, ctx.send, ctx.group), None, None, None


def exchange(rows: torch.Tensor, send: list[int], receive: list[int], group: Any) -> torch.Tensor:
    """Rows send[i] go to rank i; receive[i] rows come from rank i (in rank order)."""
    out = rows.new_empty(sum(receive), *rows.shape[1:])
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=receive, input_split_sizes=send, group=group)
    return out


Experts = Callable[[torch.Tensor, list[int]], torch.Tensor]


def run_experts_parallel(rows: torch.Tensor, m_splits: list[int], experts: Experts,
                         group: dist.ProcessGroup | None) -> torch.Tensor:
    """`experts` (this rank's E/W) on the rows every rank routed to them; each row's output back where it came from.

    `rows` are this rank's tokens grouped by global expert (`m_splits`: E counts)."""
    world = dist.get_world_size(group)
    local = len(m_splits) // world
    counts = torch.tensor(m_splits, dtype=torch.long)
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)  # [source rank, local expert]
    received_counts = received_counts.view(world, local)
    send = counts.view(world, local).sum(dim=1).tolist()
    receive = received_counts.sum(dim=1).tolist()
    received = _AllToAll.apply(rows, send, receive, group)
    # by source rank then expert -> by expert then source rank (each source's rows keep their order)
    expert_of_row = torch.repeat_interleave(torch.arange(local).repeat(world), received_counts.reshape(-1))
    grouped, route, local_splits = permute(received, expert_of_row.unsqueeze(1), num_experts=local)
    out = _ScaleGrad.apply(experts(_ScaleGrad.apply(grouped, float(world)), local_splits), 1.0 / world)
    return _AllToAll.apply(unpermute(out, route), receive, send, group)
