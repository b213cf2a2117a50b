"""One layer at a time, for engine.convert / engine.unconvert: torch layers to engine layers and back.

A converted layer keeps the torch layer's Parameter objects (same values, dtype, device,
`requires_grad`, `main_grad`, and ties to other modules) except where the layout or the
storage must change: `transformers`' Conv1D holds its weight as [in, out] and engine.Linear
as [out, in], and an FP8 primary weight is a new, quantized Parameter. A layer converted from
Conv1D saves and loads its weight in Conv1D's [in, out] layout (state_dict hooks), so
checkpoints move between the converted model and the original one.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from engine.autocast import fp8_model_init
from engine.modules import LayerNormLinear, Linear
from engine.recipes import Recipe
from engine.tensors import QuantizedTensor
from engine.tensors.serialization import META_SUFFIX, pop_components

#: attribute set on an engine.Linear converted from Conv1D (its checkpoints use Conv1D's layout)
CONV1D_LAYOUT = "_conv1d_layout"
#: attribute set on a LayerNormLinear fused from a norm and a Linear: (norm class name, the norm's eps)
FUSED_NORM = "_fused_norm"
#: attribute set on the nn.Identity left where a fused norm was
FUSED_AWAY = "_fused_into_next"


def conv1d_class() -> type | None:
    """transformers' Conv1D if transformers is imported (a model holding one has imported it), else None."""
    return getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)


def layer_kind(module: nn.Module) -> str | None:
    """'linear' or 'conv1d' for the exact classes convert replaces; None for anything else, subclasses included."""
    if type(module) is nn.Linear:
        return "linear"
    conv1d = conv1d_class()
    return "conv1d" if conv1d is not None and type(module) is conv1d else None


def is_linear_like(module: nn.Module) -> bool:
    """An nn.Linear or a Conv1D, or a subclass of either (convert names subclasses it leaves alone)."""
    conv1d = conv1d_class()
    return isinstance(module, nn.Linear) or (conv1d is not None and isinstance(module, conv1d))


def weight_of(module: nn.Module, kind: str) -> torch.Tensor:
    """The weight as engine.Linear holds it, [out, in] (a view for Conv1D)."""
    return module.weight if kind == "linear" else module.weight.t()


# ------------------------------------------------------------------ parameters
def copy_attributes(src: torch.Tensor, dst: torch.Tensor, transposed: bool) -> None:
    """Public attributes set on a Parameter (main_grad, sharding marks, ...) carried to its replacement;
    private ones (a quantized tensor's own `_qstorage`, ...) belong to the old tensor.

    A 2D `main_grad` of a transposed weight is carried as a transposed view: the gradient
    accumulates into the caller's buffer."""
    for name, value in vars(src).items():
        if name.startswith("_"):
            continue
        if name == "main_grad" and transposed and isinstance(value, torch.Tensor) and value.dim() == 2:
            value = value.t()
        setattr(dst, name, value)


def new_parameter(value: torch.Tensor, like: torch.Tensor, transposed: bool) -> nn.Parameter:
    """A Parameter holding `value` with `like`'s requires_grad and attributes."""
    param = nn.Parameter(value, requires_grad=like.requires_grad)
    copy_attributes(like, param, transposed)
    return param


def plain_weight(weight: torch.Tensor, transposed: bool) -> nn.Parameter:
    """`weight` as a high-precision Parameter: itself when nothing changes (ties and identity kept),
    else dequantized and/or transposed into a new one."""
    if not transposed and not isinstance(weight, QuantizedTensor):
        return weight
    with torch.no_grad():
        value = weight.dequantize() if isinstance(weight, QuantizedTensor) else weight.detach()
        value = value.t().contiguous() if transposed else value
    return new_parameter(value, weight, transposed)


# ------------------------------------------------------------------ torch -> engine
def to_engine_linear(module: nn.Module, kind: str, fp8_recipe: Recipe | None) -> Linear:
    """An engine.Linear computing what `module` (nn.Linear or Conv1D) computes, in its training mode.

    `fp8_recipe` set: the weight becomes an FP8 primary weight quantized by that recipe's weight
    quantizer (the layer is built under fp8_model_init with the values copied in)."""
    new = _build(Linear, module, kind, fp8_recipe)
    if kind == "conv1d":
        mark_conv1d_layout(new)
    return new


def to_layernorm_linear(norm: nn.Module, module: nn.Linear, fp8_recipe: Recipe | None) -> LayerNormLinear:
    """A LayerNormLinear holding `norm`'s parameters (as layer_norm_weight / layer_norm_bias) and `module`'s."""
    normalization = type(norm).__name__
    eps = norm.eps if norm.eps is not None else torch.finfo(norm.weight.dtype).eps  # RMSNorm's None: its dtype's eps
    new = _build(LayerNormLinear, module, "linear", fp8_recipe, normalization=normalization, eps=eps)
    new.layer_norm_weight = norm.weight
    new.layer_norm_bias = getattr(norm, "bias", None)
    setattr(new, FUSED_NORM, (normalization, norm.eps))
    return new


def _build(cls: type, module: nn.Module, kind: str, fp8_recipe: Recipe | None, **kwargs: Any) -> Any:
    weight = weight_of(module, kind)
    out_features, in_features = weight.shape
    has_bias = module.bias is not None
    if fp8_recipe is None:  # built on the meta device (nothing allocated), then given the layer's own Parameters
        with fp8_model_init(enabled=False):
            new = cls(in_features, out_features, bias=has_bias, params_dtype=weight.dtype, device="meta", **kwargs)
        new.weight = plain_weight(module.weight, transposed=kind == "conv1d")
    else:
        def copy_values(w: torch.Tensor) -> None:
            w.copy_(weight.detach())

        with fp8_model_init(recipe=fp8_recipe):
            new = cls(in_features, out_features, bias=has_bias, params_dtype=weight.dtype, device=weight.device,
                      init_method=copy_values, **kwargs)
        new.weight.requires_grad_(module.weight.requires_grad)
        copy_attributes(module.weight, new.weight, transposed=kind == "conv1d")
    if has_bias:
        new.bias = module.bias
    new.train(module.training)
    return new


# ------------------------------------------------------------------ Conv1D's checkpoint layout
def mark_conv1d_layout(module: Linear) -> None:
    """Save and load `module.weight` as Conv1D's [in, out] (a transposed copy; an FP8 weight dequantized)."""
    setattr(module, CONV1D_LAYOUT, True)
    module.register_state_dict_post_hook(_save_conv1d_layout)
    module.register_load_state_dict_pre_hook(_load_conv1d_layout)


def _save_conv1d_layout(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    key = prefix + "weight"
    weight = state_dict.get(key)
    if _inference_quantized(weight):  # engine.quantize_'s weight: saved as its own record, in its own layout
        return
    if key + META_SUFFIX in state_dict:  # an FP8 weight saved as its components: Conv1D holds the plain value
        weight = pop_components(state_dict, key)[0].dequantize()
    elif isinstance(weight, QuantizedTensor):
        weight = weight.dequantize()
    if isinstance(weight, torch.Tensor):
        state_dict[key] = weight.t().contiguous()  # contiguous: safetensors saves only contiguous tensors


def _load_conv1d_layout(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    key = prefix + "weight"
    weight = state_dict.get(key)
    if _inference_record(state_dict, key):  # engine.quantize_'s entries (data [out, in], scales) load as saved
        return
    if isinstance(weight, torch.Tensor) and not isinstance(weight, QuantizedTensor) and weight.dim() == 2:
        state_dict[key] = weight.t().contiguous()  # load_state_dict works on its own copy of the dict


def _inference_quantized(weight: object) -> bool:
    """A weight engine.quantize_ made (a QuantizedWeight; engine.inference is imported once one exists)."""
    inference = sys.modules.get("engine.inference.weight")
    return inference is not None and isinstance(weight, inference.QuantizedWeight)


def _inference_record(state_dict: dict, key: str) -> bool:
    """`key` is a weight engine.quantize_ saved (its record is in the state dict)."""
    from engine.inference.saving import RECORD_SUFFIX

    return key + RECORD_SUFFIX in state_dict


# ------------------------------------------------------------------ engine -> torch
def to_torch_layer(module: Linear | LayerNormLinear) -> nn.Module:
    """nn.Linear (or Conv1D, for a layer converted from one) with `module`'s weight (dequantized if FP8) and bias."""
    conv1d = getattr(module, CONV1D_LAYOUT, False)
    weight = plain_weight(module.weight, transposed=conv1d)
    has_bias = module.bias is not None
    with torch.device("meta"):
        if conv1d:
            from transformers.pytorch_utils import Conv1D  # the layer came from one: transformers is installed

            new = Conv1D(module.out_features, module.in_features)
        else:
            new = nn.Linear(module.in_features, module.out_features, bias=has_bias, dtype=weight.dtype)
    new.weight = weight
    new.bias = module.bias
    new.train(module.training)
    return new


def split_layernorm_linear(module: LayerNormLinear) -> tuple[nn.Module, nn.Module]:
    """(norm, nn.Linear) from a LayerNormLinear that convert fused, with its Parameters."""
    normalization, eps = getattr(module, FUSED_NORM)
    size = module.in_features
    with torch.device("meta"):
        if normalization == "LayerNorm":
            norm = nn.LayerNorm(size, eps=eps, bias=module.layer_norm_bias is not None)
        else:
            norm = nn.RMSNorm(size, eps=eps)
    norm.weight = module.layer_norm_weight
    if module.layer_norm_bias is not None:
        norm.bias = module.layer_norm_bias
    norm.train(module.training)
    return norm, to_torch_layer(module)
