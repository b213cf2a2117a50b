"""Parameters that modules create: quantized under fp8_model_init (FP8 primary weights)."""

from __future__ import annotations

import torch

from engine import autocast
from engine.quantizers import Quantizer


def make_parameter(value: torch.Tensor, quantizer: Quantizer | None) -> torch.nn.Parameter:
    """`value` as a Parameter: quantized with `quantizer` inside fp8_model_init, plain otherwise."""
    if not (autocast.is_fp8_model_init() and quantizer is not None):
        return torch.nn.Parameter(value)
    with torch.no_grad():
        param = torch.nn.Parameter(quantizer.quantize(value.detach()))
    if autocast.preserve_high_precision_init_val():
        param._high_precision_init_val = value.detach().to("cpu", copy=True)
    return param


def get_high_precision_init_val(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The initial high-precision value kept by fp8_model_init(preserve_high_precision_init_val=True)."""
    return getattr(param, "_high_precision_init_val", None)


def clear_high_precision_init_val(param: torch.nn.Parameter) -> None:
    """Free the kept initial value (e.g. once the optimizer's master weights are made from it)."""
    if hasattr(param, "_high_precision_init_val"):
        del param._high_precision_init_val
