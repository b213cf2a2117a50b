"""Recognising DTensors without importing torch.distributed.tensor (0.6 s) when no one has made one.

At the bottom of the layers (it needs only torch): the modules below `engine.distributed` ask it."""

from __future__ import annotations

import sys
from typing import Any

import torch


def is_dtensor(x: Any) -> bool:
    """Whether `x` is a DTensor. No DTensor can exist before torch.distributed.tensor is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


def any_dtensor(*xs: Any) -> bool:
    return any(is_dtensor(x) for x in xs)


def local_of(x: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (no autograd link); any other tensor as it is."""
    return x.to_local().detach() if is_dtensor(x) else x


def like_input(param: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """`param` as a DTensor replicated over `x`'s mesh when `x` is a DTensor and `param` is a plain tensor
    (gradients then come back summed over the mesh, as for any replicated parameter); else as it is."""
    if param is None or not is_dtensor(x) or is_dtensor(param):
        return param
    from torch.distributed.tensor import DTensor, Replicate

    mesh = x.device_mesh
    return DTensor.from_local(param, mesh, [Replicate()] * mesh.ndim, run_check=False)


def settled(t: torch.Tensor) -> torch.Tensor:
    """`t`, or for a tensor an asynchronous collective still writes (torch's AsyncCollectiveTensor, what
    DTensor redistributions return) the plain tensor once it is written: engine's kernels read raw memory."""
    module = sys.modules.get("torch.distributed._functional_collectives")
    if module is not None and isinstance(t, module.AsyncCollectiveTensor):
        return t.trigger_wait()
    return t
