"""engine on torch.distributed: amax agreement across ranks, FSDP2 / DCP over FP8 primary weights, and
tensor and sequence parallel plans.

FSDP2 needs no engine call: `torch.distributed.fsdp.fully_shard` shards engine quantized weights as
quantized tensors and all-gathers their FP8 bytes (`engine.distributed.fsdp`), and their state-dict
components are DTensors that `torch.distributed.checkpoint` reshards (`engine.distributed.state_dict`).
Weights it cannot cut into whole scale blocks are kept whole on every rank instead
(`engine.distributed.fsdp.replicated_weights` and `average_gradients`).
The parallel styles (`ColwiseParallel`, `RowwiseParallel`, `SequenceParallel`, `LayerNormMLPParallel`) import
torch.distributed.tensor (~0.6 s), so they load on first use: `engine.distributed.ColwiseParallel`.
"""

from typing import Any

from engine.distributed.amax import all_reduce_max, group_size
from engine.distributed.state_dict import is_sharded_quantized

__all__ = ["ColwiseParallel", "LayerNormMLPParallel", "RowwiseParallel", "SequenceParallel", "all_reduce_max",
           "group_size", "is_sharded_quantized"]

_STYLES = ("ColwiseParallel", "LayerNormMLPParallel", "RowwiseParallel", "SequenceParallel")


def __getattr__(name: str) -> Any:
    if name in _STYLES:
        from engine.distributed import tensor_parallel

        return getattr(tensor_parallel, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
