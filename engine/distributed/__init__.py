"""engine on torch.distributed: amax agreement across ranks (more to come: FSDP2, tensor parallel)."""

from engine.distributed.amax import all_reduce_max, group_size

__all__ = ["all_reduce_max", "group_size"]
