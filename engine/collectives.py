"""Agreeing on amaxes across ranks: one all-reduce(MAX) for many amax tensors.

At the bottom of the layers (it needs only torch.distributed): the quantizers and autocast below
`engine.distributed` call it; `engine.distributed` re-exports it."""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in `group` (the world when None); 1 when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def all_reduce_max(amaxes: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
    """Replace every tensor in `amaxes` by its elementwise max over the ranks of `group`, in place.

    The tensors are concatenated so that one collective serves them all; nothing happens
    when torch.distributed is not initialised or the group has a single rank.
    """
    if not amaxes or group_size(group) <= 1:
        return
    flat = torch.cat([a.reshape(-1) for a in amaxes])
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    for a, reduced in zip(amaxes, torch.split(flat, [a.numel() for a in amaxes])):
        a.copy_(reduced.view_as(a))
