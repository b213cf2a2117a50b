"""FSDP2-sharded FP8 weights in state dicts: the same component keys as an unsharded FP8 weight, as DTensors.

An FP8 primary weight saves as plain component tensors (`engine.tensors.serialization.to_components`:
FP8 data, scale_inv, a `_quantization` record, the columnwise copy where it cannot be derived).
Sharded by FSDP2 it is a DTensor over an engine quantized shard; its components are then
DTensors too, sharded like the weight (each rank's rows of the data and of row-blocked scales;
one scale per tensor is the same on every rank and saves as a plain tensor), and the record
describes the whole weight. So `torch.distributed.checkpoint` saves and reshards them like any
DTensor, and a checkpoint saved sharded loads into any number of ranks, or into one process
without FSDP2 (where the keys are the plain components), and the other way round.

The DTensors' local tensors are the shard's own buffers, so `dcp.load` into
`get_model_state_dict(model)` writes the FP8 bytes in place; `set_model_state_dict` (the module's
`_load_from_state_dict`) copies whatever it is given into the shard.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.tensors.quantized import QuantizedTensor
from engine.tensors.serialization import COMPONENT_SUFFIXES, META_SUFFIX, pop_components, to_components
from engine.tensors.storage import QuantizedTensorBase, buffer_specs

__all__ = ["is_sharded_quantized", "load_sharded_components", "sharded_components"]


def is_sharded_quantized(param: Any) -> bool:
    """A DTensor (FSDP2's sharded parameter) over an engine quantized tensor."""
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor) and isinstance(param._local_tensor, QuantizedTensor)


def _full_storage(param: Any) -> QuantizedTensorBase:
    """A meta storage of the whole weight with both usages: what the unsharded weight's record says."""
    local = param._local_tensor.qstorage
    return QuantizedTensorBase.empty(param.shape, scheme=local.scheme, nominal_dtype=local.nominal_dtype,
                                     device="meta", rowwise=True, columnwise=True, quantizer=local.quantizer)


def _check(param: Any, key: str) -> None:
    local = param._local_tensor.qstorage
    placements = [type(p).__name__ for p in param.placements]
    if placements != ["Shard"] or param.placements[0].dim != 0 or local.scheme.columnwise_transposed and \
            local.has_columnwise and not local.scheme.derivable:
        raise NotImplementedError(f"{key}: a {local.scheme.name} weight sharded as {param.placements} cannot be "
                                  "saved as components; FSDP2's Shard(0) of tensor, block2d or mx weights can")


def sharded_components(key: str, param: Any) -> dict[str, torch.Tensor]:
    """The component keys of a sharded FP8 weight: DTensors over the shard's buffers, plain shared scales."""
    from torch.distributed.tensor import DTensor

    _check(param, key)
    local = param._local_tensor.qstorage
    full = _full_storage(param)
    specs = buffer_specs(full.scheme, full.shape, rowwise=True, columnwise=True)
    out = {}
    for name, meta in to_components(key, full).items():
        if name == key + META_SUFFIX:
            out[name] = meta
            continue
        field = next(f for f, suffix in COMPONENT_SUFFIXES.items() if key + suffix == name)
        buffer = getattr(local, field)
        if field.endswith("scale_inv") and full.scheme.rowwise_block.is_tensor:
            out[name] = buffer.detach()
            continue
        size = torch.Size(specs[field][0])
        out[name] = DTensor.from_local(buffer.detach(), param.device_mesh, param.placements, run_check=False,
                                       shape=size, stride=torch.empty(size, device="meta").stride())
    return out


def load_sharded_components(state_dict: dict, key: str, param: Any) -> None:
    """Copy the component keys of `key` (DTensors or whole plain tensors) into the sharded FP8 weight `param`,
    taking them out of `state_dict`; ValueError naming the key if their scheme or shape is not the weight's."""
    from torch.distributed.tensor import DTensor

    _check(param, key)
    local = param._local_tensor.qstorage
    names = [key + suffix for suffix in COMPONENT_SUFFIXES.values()] + [key + META_SUFFIX]
    given = {n: state_dict[n] for n in names if n in state_dict}
    locals_ = {n: (t.to_local() if isinstance(t, DTensor) else t) for n, t in given.items()}
    sharded = any(isinstance(t, DTensor) for t in given.values())
    if sharded:  # ours (from sharded_components, after dcp.load): the shard's rows already
        header_only = {key + META_SUFFIX: given[key + META_SUFFIX]}
        full = _full_storage(param)
        want = to_components(key, full)[key + META_SUFFIX]
        got = header_only[key + META_SUFFIX]
        if got.shape != want.shape or not torch.equal(got, want):
            raise ValueError(f"{key + META_SUFFIX}: the checkpoint's weight is not a {full.scheme.name} "
                             f"{tuple(full.shape)} weight quantized like this one")
        for field, suffix in COMPONENT_SUFFIXES.items():
            mine, theirs = getattr(local, field), locals_.get(key + suffix)
            if mine is not None and theirs is not None and mine is not theirs:
                mine.copy_(theirs)
    else:  # a whole weight (e.g. from a model without FSDP2): this rank's rows of it
        storage, _ = pop_components(dict(given), key)
        if storage.scheme != local.scheme or tuple(storage.shape) != tuple(param.shape):
            raise ValueError(f"{key}: the checkpoint holds a {storage.scheme.name} {tuple(storage.shape)} weight, "
                             f"this one is {local.scheme.name} {tuple(param.shape)}")
        start = -(-param.shape[0] // param.device_mesh.size()) * param.device_mesh.get_local_rank()  # torch.chunk's
        rows = QuantizedTensor.wrap(storage)[start:start + local.shape[0]]
        param._local_tensor.copy_(rows)
    for n in given:
        del state_dict[n]
