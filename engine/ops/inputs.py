"""What engine's kernels accept: plain, dense tensors with data (every backend checks its arguments here).

Apart from `backend.py` (which chooses the kernels) so that the kernels' modules (`native.py`) can check
their arguments without importing the module that imports them.
"""

from __future__ import annotations

import torch

PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def check_tensor(x: object, name: str) -> torch.Tensor:
    """`x` if the quantization kernels can read it: a plain dense torch.Tensor with data.

    The kernels read raw memory. A tensor subclass (DTensor, FakeTensor, any
    `__torch_dispatch__` wrapper) has no data of its own there, a meta tensor has none at
    all, sparse/nested/mkldnn tensors are laid out otherwise: each gets a TypeError naming
    `name`. `nn.Parameter` is a plain tensor. A few attribute reads (~0.3 us) when `x` is fine.
    """
    if type(x) in PLAIN_TENSOR_TYPES and not x.is_meta and x.layout is torch.strided and not x.is_nested:
        return x
    cls = type(x)
    if cls not in PLAIN_TENSOR_TYPES:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {cls.__name__}")
        hint = " (pass x.to_local() or x.full_tensor())" if cls.__name__ == "DTensor" else ""
        raise TypeError(f"{name}: expected a plain torch.Tensor, got a tensor subclass "
                        f"{cls.__module__}.{cls.__qualname__}{hint}; engine's quantization kernels read raw "
                        "memory and do not dispatch tensor subclasses")
    if x.is_meta:
        raise TypeError(f"{name}: expected a tensor with data, got a meta tensor of shape {tuple(x.shape)}")
    if x.layout != torch.strided or x.is_nested:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got "
                        f"{'a nested tensor' if x.is_nested else f'layout {x.layout}'}")
    return x


def check_not_subclass(x: object, name: str) -> None:
    """A tensor subclass (DTensor, ...) cannot go into engine's ops; FakeTensors can (the ops' fake
    implementations trace them), and meta tensors too (their shapes only)."""
    if isinstance(x, torch.Tensor) and type(x) not in PLAIN_TENSOR_TYPES and not _is_fake(x):
        check_tensor(x, name)


def _is_fake(x: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor)
