"""Mixture of experts: token permute / unpermute grouped by expert, the MoE MLP block, expert parallelism."""

from engine.moe.permute import permute, unpermute
from engine.moe.routing import RowIdMap

__all__ = ["RowIdMap", "permute", "unpermute"]
