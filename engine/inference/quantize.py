"""engine.quantize_(model, config, *, module_filter=None): swap linear weights for QuantizedWeights in place."""

from __future__ import annotations

import warnings
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

    Tied weights stay tied: a Parameter shared by chosen modules only is quantized once and shared. One also
    held by a module quantize_ does not quantize (the input embedding a Hugging Face output head is tied to, a
    layer module_filter leaves out) is left in high precision, with one warning naming it, as Hugging Face's
    torchao integration does by default: quantizing it would untie the two and keep both copies. Untie it first
    to quantize it.
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
    shared, left_tied = _group_ties(model, chosen)
    fresh = [(users, QuantizedWeight.from_float(_plain(getattr(users[0][1], users[0][2])), config, users[0][0]))
             for users in shared]
    for users, weight in fresh:  # only once every weight quantized: an error leaves the model as it was
        param = torch.nn.Parameter(weight, requires_grad=False)  # one object for all its users: a tie stays a tie
        for _, module, attr in users:
            setattr(module, attr, param)
            if not getattr(module, "_engine_inference_hooks", False):
                module.register_state_dict_post_hook(save_hook)
                module.register_load_state_dict_pre_hook(load_hook)
                module._engine_inference_hooks = True
    if left_tied:
        _warn_tied(left_tied)
    return model


Use = tuple[str, torch.nn.Module, str]  # (name for messages, module, attribute) of a weight quantize_ chose


def _group_ties(model: torch.nn.Module, chosen: list[Use]) -> tuple[list[list[Use]], list[tuple[str, list[str]]]]:
    """The chosen weights grouped by Parameter (a weight tied across chosen modules is quantized once, for all of
    them), and the chosen weights left alone because a module quantize_ does not quantize (an embedding, a layer
    module_filter leaves out) holds the same Parameter: (name, the other holders' names)."""
    holders: dict[int, list[tuple[str, torch.nn.Module, str]]] = {}
    for fqn, module in model.named_modules():
        for attr, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((f"{fqn}.{attr}" if fqn else attr, module, attr))
    picked = {(id(module), attr) for _, module, attr in chosen}
    groups: dict[int, list[Use]] = {}
    for use in chosen:
        groups.setdefault(id(getattr(use[1], use[2])), []).append(use)
    shared, left = [], []
    for key, users in groups.items():
        others = [f"{name} ({type(module).__name__})" for name, module, attr in holders.get(key, [])
                  if (id(module), attr) not in picked]
        if others:
            left.extend((name, others) for name, _, _ in users)
        else:
            shared.append(users)
    return shared, left


def _warn_tied(left: list[tuple[str, list[str]]]) -> None:
    """One warning for the tied weights quantize_ left in high precision: why, and how to quantize them."""
    listed = "; ".join(f"{name} is tied to {', '.join(others)}" for name, others in left)
    first = left[0][0]
    warnings.warn(
        f"engine.quantize_: {len(left)} tied weight(s) left in high precision: {listed}. quantize_ quantizes "
        "linear weights only, and quantizing one side of a tie would untie it: both copies would stay in memory "
        "(the Hugging Face / torchao default: tied embeddings stay unquantized). To quantize it anyway, untie it "
        f"first (e.g. `module.weight = torch.nn.Parameter(module.weight.detach().clone())` for {first}, and for a "
        "Hugging Face model `model.config.tie_word_embeddings = False` so it is not tied again at load), or leave "
        "it out with module_filter to silence this warning.", UserWarning, stacklevel=3)


def _plain(weight: torch.Tensor) -> torch.Tensor:
    """The high-precision value of a weight (an engine FP8 primary weight dequantized)."""
    from engine.tensors import QuantizedTensor

    return weight.dequantize() if isinstance(weight, QuantizedTensor) else weight


def linear_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights quantize_ swaps (or would swap) in `model`, each Parameter once: a QuantizedWeight's
    parts, a plain weight counted at 2 bytes per element (bf16, what inference would keep it in)."""
    total, seen = 0, set()
    for module in model.modules():
        for name in quantized_weight_names(module):
            w = getattr(module, name)
            if id(w) not in seen:  # a tied weight counts once
                seen.add(id(w))
                total += w.nbytes_quantized() if isinstance(w, QuantizedWeight) else 2 * w.numel()
    return total
