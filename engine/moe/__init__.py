"""Mixture of experts: token permute / unpermute grouped by expert, the MoE MLP block, expert parallelism."""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.moe.aux_loss import load_balancing_loss
from engine.moe.experts import ExpertLinears
from engine.moe.mlp import MoEMLP
from engine.moe.permute import permute, unpermute
from engine.moe.routing import RowIdMap

__all__ = ["ExpertLinears", "MoEMLP", "RowIdMap", "expert_parallel", "load_balancing_loss", "permute", "unpermute"]


def expert_parallel(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> set[torch.nn.Parameter]:
    """Split the experts of every MoEMLP in `model` over the ranks of `group` (MoEMLP.expert_parallel); the expert
    parameters this rank keeps, to leave out of FSDP2 (`fully_shard(..., ignored_params=...)`)."""
    kept: set[torch.nn.Parameter] = set()
    for module in model.modules():
        if isinstance(module, MoEMLP):
            module.expert_parallel(group)
            kept.update(module.fc1.parameters())
            kept.update(module.fc2.parameters())
    return kept
