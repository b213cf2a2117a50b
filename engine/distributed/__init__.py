"""engine on torch.distributed: amax agreement across ranks, tensor and sequence parallel plans.

The parallel styles (`ColwiseParallel`, `RowwiseParallel`, `SequenceParallel`, `LayerNormMLPParallel`) import
torch.distributed.tensor (~0.6 s), so they load on first use: `engine.distributed.ColwiseParallel`.
"""

from typing import Any

from engine.distributed.amax import all_reduce_max, group_size

__all__ = ["ColwiseParallel", "LayerNormMLPParallel", "RowwiseParallel", "SequenceParallel", "all_reduce_max",
           "group_size"]

_STYLES = ("ColwiseParallel", "LayerNormMLPParallel", "RowwiseParallel", "SequenceParallel")


def __getattr__(name: str) -> Any:
    if name in _STYLES:
        from engine.distributed import tensor_parallel

        return getattr(tensor_parallel, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
