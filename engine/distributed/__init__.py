"""engine on torch.distributed: amax agreement across ranks, and FSDP2 / DCP over FP8 primary weights.

FSDP2 needs no engine call: `torch.distributed.fsdp.fully_shard` shards engine quantized weights as
quantized tensors and all-gathers their FP8 bytes (`engine.distributed.fsdp`), and their state-dict
components are DTensors that `torch.distributed.checkpoint` reshards (`engine.distributed.state_dict`).
"""

from engine.distributed.amax import all_reduce_max, group_size
from engine.distributed.state_dict import is_sharded_quantized

__all__ = ["all_reduce_max", "group_size", "is_sharded_quantized"]
