"""engine.quantize_(model, config, *, module_filter=None): swap linear weights for QuantizedWeights in place."""

from __future__ import annotations

from typing import Callable

import torch

from engine.inference.configs import InferenceConfig, check_config
from engine.inference.saving import load_hook, save_hook
from engine.inference.weight import QuantizedWeight

ModuleFilter = Callable[[str, torch.nn.Module], bool]


def quantized_weight_names(module: torch.nn.Module) -> tuple[str, ...]:
    """The weights quantize_ swaps in `module`: `weight` of torch.nn.Linear, engine.Linear and
    engine.LayerNormLinear; `fc1_weight` and `fc2_weight` of engine.LayerNormMLP; none of other modules
    (nor of the torch.nn.Linear subclass nn.MultiheadAttention reads its weight from directly)."""
    from engine.modules.base import FP8Module

    if isinstance(module, FP8Module):
        return module.weight_names
    if isinstance(module, torch.nn.modules.linear.NonDynamicallyQuantizableLinear):
        return ()
    return ("weight",) if isinstance(module, torch.nn.Linear) else ()


def quantize_(model: torch.nn.Module, config: InferenceConfig, *,
              module_filter: ModuleFilter | None = None) -> torch.nn.Module:
    """Quantize, in place, the weights of every torch.nn.Linear, engine.Linear, engine.LayerNormLinear and
    engine.LayerNormMLP (fc1 and fc2) in `model` (the model itself included) for which
    `module_filter(fqn, module)` is true (default: all of them); returns `model`.

    Each module stays; each of its weight Parameters becomes a `QuantizedWeight` (requires_grad=False)
    whose F.linear runs the config's GEMM, and the module saves and loads it as plain tensors
    (`engine.inference.saving`). The engine modules run it on their high-precision path (norm, GEMM,
    activation, GEMM), so a quantized engine module is for inference outside fp8_autocast (inside, it
    is a TypeError). A weight that is already quantized, not 2D float32/bfloat16/float16 on the CPU,
    or a shape the config cannot take, is an error naming it (use module_filter to leave it out).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    check_config(config)
    if module_filter is not None and not callable(module_filter):
        raise TypeError(f"module_filter: expected a callable (fqn, module) -> bool, got {type(module_filter).__name__}")
    chosen = []
    for fqn, module in model.named_modules():
        names = quantized_weight_names(module)
        if not names or (module_filter is not None and not module_filter(fqn, module)):
            continue
        for attr in names:
            name = f"{fqn or type(model).__name__}.{attr}"
            weight = getattr(module, attr)
            if isinstance(weight, QuantizedWeight):
                raise ValueError(f"{name}: already quantized with {weight.config!r}")
            chosen.append((name, module, attr))
    fresh = [(module, attr, QuantizedWeight.from_float(_plain(getattr(module, attr)), config, name))
             for name, module, attr in chosen]
    for module, attr, weight in fresh:  # only once every weight quantized: an error leaves the model as it was
        setattr(module, attr, torch.nn.Parameter(weight, requires_grad=False))
        if not getattr(module, "_engine_inference_hooks", False):
            module.register_state_dict_post_hook(save_hook)
            module.register_load_state_dict_pre_hook(load_hook)
            module._engine_inference_hooks = True
    return model


def _plain(weight: torch.Tensor) -> torch.Tensor:
    """The high-precision value of a weight (an engine FP8 primary weight dequantized)."""
    from engine.tensors import QuantizedTensor

    return weight.dequantize() if isinstance(weight, QuantizedTensor) else weight


def linear_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights quantize_ swaps (or would swap) in `model`: a QuantizedWeight's parts, a plain
    weight counted at 2 bytes per element (bf16, what inference would keep it in)."""
    total = 0
    for module in model.modules():
        for name in quantized_weight_names(module):
            w = getattr(module, name)
            total += w.nbytes_quantized() if isinstance(w, QuantizedWeight) else 2 * w.numel()
    return total
