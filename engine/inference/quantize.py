"""engine.quantize_(model, config, *, module_filter=None): swap Linear weights for QuantizedWeights in place."""

from __future__ import annotations

from typing import Callable

import torch

from engine.inference.configs import InferenceConfig, check_config
from engine.inference.saving import load_hook, save_hook
from engine.inference.weight import QuantizedWeight

ModuleFilter = Callable[[str, torch.nn.Module], bool]


def is_linear(module: torch.nn.Module) -> bool:
    """torch.nn.Linear (not the subclass nn.MultiheadAttention reads its weight from directly) or engine.Linear."""
    from engine.modules import Linear

    if isinstance(module, torch.nn.modules.linear.NonDynamicallyQuantizableLinear):
        return False
    return isinstance(module, (torch.nn.Linear, Linear))


def quantize_(model: torch.nn.Module, config: InferenceConfig, *,
              module_filter: ModuleFilter | None = None) -> torch.nn.Module:
    """Quantize, in place, the weight of every torch.nn.Linear and engine.Linear in `model` (the model itself
    included) for which `module_filter(fqn, module)` is true (default: all of them); returns `model`.

    Each module stays; its `weight` Parameter becomes a `QuantizedWeight` (requires_grad=False) whose
    F.linear runs the config's GEMM, and the module saves and loads it as plain tensors
    (`engine.inference.saving`). A weight that is already quantized, not 2D float32/bfloat16/float16
    on the CPU, or a shape the config cannot take, is an error naming the module (use module_filter to
    leave it out). engine.Linear's quantized weight is for inference outside fp8_autocast.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    check_config(config)
    if module_filter is not None and not callable(module_filter):
        raise TypeError(f"module_filter: expected a callable (fqn, module) -> bool, got {type(module_filter).__name__}")
    chosen = []
    for fqn, module in model.named_modules():
        if not is_linear(module) or (module_filter is not None and not module_filter(fqn, module)):
            continue
        name = f"{fqn or type(model).__name__}.weight"
        if isinstance(module.weight, QuantizedWeight):
            raise ValueError(f"{name}: already quantized with {module.weight.config!r}")
        chosen.append((name, module))
    fresh = [(module, QuantizedWeight.from_float(_plain(module.weight, name), config, name)) for name, module in chosen]
    for module, weight in fresh:  # only once every weight quantized: an error leaves the model as it was
        module.weight = torch.nn.Parameter(weight, requires_grad=False)
        if not getattr(module, "_engine_inference_hooks", False):
            module.register_state_dict_post_hook(save_hook)
            module.register_load_state_dict_pre_hook(load_hook)
            module._engine_inference_hooks = True
    return model


def _plain(weight: torch.Tensor, name: str) -> torch.Tensor:
    """The high-precision value of a weight (an engine FP8 primary weight dequantized)."""
    from engine.tensors import QuantizedTensor

    return weight.dequantize() if isinstance(weight, QuantizedTensor) else weight
