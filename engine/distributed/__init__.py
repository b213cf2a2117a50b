"""engine on torch.distributed: amax agreement across ranks, FSDP2 / DCP over FP8 primary weights, and
tensor and sequence parallel plans.

FSDP2 needs no engine call: `torch.distributed.fsdp.fully_shard` shards engine quantized weights as
quantized tensors and all-gathers their FP8 bytes (`engine.distributed.fsdp`), and their state-dict
components are DTensors that `torch.distributed.checkpoint` reshards (`engine.distributed.state_dict`);
`load_model_state_dict` loads such a checkpoint with every module's `_extra_state` as saved, also into modules
that have not run (`engine.distributed.dcp_load`).
Weights it cannot cut into whole scale blocks are kept whole on every rank instead
(`engine.distributed.fsdp.replicated_weights` and `average_gradients`).
The parallel styles (`ColwiseParallel`, `RowwiseParallel`, `SequenceParallel`, `LayerNormMLPParallel`) import
torch.distributed.tensor (~0.6 s), so they load on first use: `engine.distributed.ColwiseParallel`.

The layers below call what this package provides through hooks they declare (`engine.hooks`), registered
here when it is imported (`import engine` imports it): QuantizedTensor's FSDP2 all-gather, the state-dict
components of FSDP2-sharded FP8 weights, and the linear layers' path for DTensors.
"""

from typing import Any

from engine.collectives import all_reduce_max, group_size
from engine.distributed import fsdp, state_dict
from engine.distributed.dcp_load import load_model_state_dict
from engine.distributed.dtensor_linear import dtensor_linear
from engine.distributed.state_dict import is_sharded_quantized
from engine.modules import base, dispatch
from engine.tensors import quantized

quantized.FSDP_PRE_ALL_GATHER.register(fsdp.pre_all_gather)
quantized.FSDP_POST_ALL_GATHER.register(fsdp.post_all_gather)
base.SHARDED_COMPONENTS.register(state_dict.sharded_components)
base.LOAD_SHARDED_COMPONENTS.register(state_dict.load_sharded_components)
dispatch.DTENSOR_LINEAR.register(dtensor_linear)

__all__ = ["ColwiseParallel", "LayerNormMLPParallel", "RowwiseParallel", "SequenceParallel", "all_reduce_max",
           "group_size", "is_sharded_quantized", "load_model_state_dict"]

_STYLES = ("ColwiseParallel", "LayerNormMLPParallel", "RowwiseParallel", "SequenceParallel")


def __getattr__(name: str) -> Any:
    if name in _STYLES:
        from engine.distributed import tensor_parallel

        return getattr(tensor_parallel, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
