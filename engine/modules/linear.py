"""Linear: y = x W^T + b, with its three GEMMs in FP8 inside fp8_autocast."""

from __future__ import annotations

import math
from typing import Callable

import torch

from engine.checks import check_bool, check_optional_bool, check_params_dtype
from engine.modules.base import FP8Module
from engine.modules.dispatch import linear

InitMethod = Callable[[torch.Tensor], object]


def check_features(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return value


def check_input(inp: torch.Tensor, features: int, owner: str, is_first_microbatch: bool | None = None,
                weight: torch.Tensor | None = None) -> None:
    if not isinstance(inp, torch.Tensor):
        raise TypeError(f"{owner}: inp must be a torch.Tensor, got {type(inp).__name__}")
    if weight is not None and inp.is_meta and not weight.is_meta:
        raise TypeError(f"{owner}: inp is a meta tensor (no data) but the weights hold data on {weight.device}; "
                        "run the module on tensors with data, or build it on the meta device too")
    if inp.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{owner}: inp must be float32, bfloat16 or float16, got {inp.dtype}")
    if inp.dim() < 1 or inp.shape[-1] != features:
        raise ValueError(f"{owner}: inp's last dim must be {features}, got shape {tuple(inp.shape)}")
    check_optional_bool(is_first_microbatch, "is_first_microbatch")


def check_layer_flags(**flags: bool) -> None:
    """Constructor switches (bias, return_bias, fuse_wgrad_accumulation, ...) must be bools."""
    for name, value in flags.items():
        check_bool(value, name)


def init_linear(weight: torch.Tensor, bias: torch.Tensor | None, init_method: InitMethod | None) -> None:
    """torch.nn.Linear's initialisation, unless `init_method(weight)` is given."""
    with torch.no_grad():
        if init_method is None:
            torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        else:
            init_method(weight)
        if bias is not None:
            bound = 1 / math.sqrt(weight.shape[1])
            torch.nn.init.uniform_(bias, -bound, bound)


def linear_parameters(
    module: FP8Module, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype,
    device: torch.device | str | None, init_method: InitMethod | None, gemm: int,
) -> tuple[torch.nn.Parameter, torch.nn.Parameter | None]:
    """(weight [out, in], bias [out]) initialised; the weight is FP8 under fp8_model_init."""
    weight = torch.empty(out_features, in_features, dtype=dtype, device=device)
    b = torch.empty(out_features, dtype=dtype, device=device) if bias else None
    init_linear(weight, b, init_method)
    return module._new_weight(weight, gemm), None if b is None else torch.nn.Parameter(b)


class Linear(FP8Module):
    """Drop-in for torch.nn.Linear. Inside fp8_autocast its fprop, dgrad and wgrad GEMMs run in FP8.

    `forward(inp, is_first_microbatch=None)`: True quantizes the weight and caches it,
    False reuses the cache (gradient accumulation), None quantizes every call.
    `fuse_wgrad_accumulation` adds the weight gradient into `weight.main_grad` (fp32).
    `return_bias` returns (out, bias) with the bias not added, for a later fused add.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        return_bias: bool = False,
        fuse_wgrad_accumulation: bool = False,
        init_method: InitMethod | None = None,
    ) -> None:
        super().__init__()
        self.in_features = check_features(in_features, "in_features")
        self.out_features = check_features(out_features, "out_features")
        check_layer_flags(bias=bias, return_bias=return_bias, fuse_wgrad_accumulation=fuse_wgrad_accumulation)
        self.return_bias = return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        dtype = check_params_dtype(params_dtype)
        self.weight, b = linear_parameters(self, in_features, out_features, bias=bias, dtype=dtype,
                                           device=device, init_method=init_method, gemm=0)
        self.register_parameter("bias", b)

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None):
        weight, bias = self.weight, self.bias  # each read is a Module.__getattr__ call: once per step
        check_input(inp, self.in_features, type(self).__name__, is_first_microbatch, weight=weight)
        (args,) = self._prepare(inp.device, is_first_microbatch)
        if not args.fp8:
            self._calibrate(args, inp, weight)
        out = linear(inp, weight, None if self.return_bias else bias, args)
        return (out, bias) if self.return_bias else out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
