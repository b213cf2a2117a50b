"""engine on torch.distributed: amax agreement across ranks, and FSDP2 over FP8 primary weights.

FSDP2 needs no engine call: `torch.distributed.fsdp.fully_shard` shards engine quantized weights
as quantized tensors and all-gathers their FP8 bytes (see `engine.distributed.fsdp`).
"""

from engine.distributed.amax import all_reduce_max, group_size

__all__ = ["all_reduce_max", "group_size"]
