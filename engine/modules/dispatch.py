"""linear(): which implementation runs a linear layer's GEMMs - the eager autograd function, the custom ops
torch.compile traces, or (for DTensors) the tensor-parallel path that engine.distributed registers."""

from __future__ import annotations

import sys

import torch

from engine import autocast
from engine.dtensor import any_dtensor
from engine.hooks import Hook
from engine.modules.linear_function import LinearArgs, LinearFunction, torch_autocast_on
from engine.modules.linear_plan import PlannedLinear, plan_for

#: the exact types no DTensor has
PLAIN = (torch.Tensor, torch.nn.Parameter)

#: y = x W^T + b when any of them is a DTensor (tensor parallel): engine.distributed.dtensor_linear, above this
#: layer, registers it
DTENSOR_LINEAR: Hook = Hook("engine linear layers on DTensors", "engine.distributed")


def linear(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, args: LinearArgs) -> torch.Tensor:
    """LinearFunction on `inp`; under torch.autocast, in the autocast dtype (as torch.nn.Linear computes).

    The input is cast once here and torch.autocast is off inside, so the FP8 GEMMs' own
    dtypes (fp32 partial sums, bf16 operands) are not recast op by op. Under torch.compile
    the same math runs as custom ops (`linear_op`), which Dynamo traces without breaks.
    """
    device_type = inp.device.type
    if torch_autocast_on(device_type):
        inp = inp.to(torch.get_autocast_dtype(device_type))
        with torch.autocast(device_type, enabled=False):
            return _linear(inp, weight, bias, args)
    return _linear(inp, weight, bias, args)


def _linear(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, args: LinearArgs) -> torch.Tensor:
    # no DTensor can exist before torch.distributed.tensor is imported (engine.dtensor), nor be a plain tensor or
    # parameter: skip the three checks then (a type test each)
    if "torch.distributed.tensor" in sys.modules and not (type(inp) in PLAIN and type(weight) in PLAIN
                                                          and (bias is None or type(bias) in PLAIN)) \
            and any_dtensor(inp, weight, bias):  # tensor parallel
        return DTENSOR_LINEAR(inp, weight, bias, args)
    if torch.compiler.is_compiling():
        from engine.modules.linear_op import compiled_linear

        return compiled_linear(inp, weight, bias, args)
    observer = autocast.inspector()
    if observer is not None:  # an engine.inspect step: the same function, watched (engine.numerics)
        return observer.linear(inp, weight, bias, args)
    plan = plan_for(inp, weight, bias, args)
    if plan is not None:  # the steady state: kernels resolved once (linear_plan.py), same bits
        return PlannedLinear.apply(inp, weight, bias, plan)
    return LinearFunction.apply(inp, weight, bias, args)
