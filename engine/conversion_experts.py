"""Hugging Face mixture-of-experts experts modules to engine.GroupedExperts, and back, for convert / unconvert.

transformers 5.x holds the experts of Qwen2-MoE, Mixtral, Qwen3-MoE and OLMoE in one module each
(`Qwen2MoeExperts`, ...) with stacked `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I], no biases, and a gated
activation `act_fn(gate) * up`. Those classes are listed here by name (their forward is known: the loop over experts
`GroupedExperts.forward` reproduces), and each instance is checked for that layout (the `use_experts_implementation`
flags: concatenated [gate; up], not transposed, no bias, no post-expert norm). The router (`gate`) is a separate
module with its own 2-D weight that is not an nn.Linear in these models, so it stays in high precision; an
nn.Linear that routes (ROUTER_NAMES: Qwen2-MoE's `shared_expert_gate`) stays too.

The converted module keeps the Hugging Face module's Parameter objects and their state-dict keys; the original
module object is kept (not registered) so `unconvert` puts it back with the same Parameters.
"""

from __future__ import annotations

from torch import nn

from engine.modules.experts import GroupedExperts
from engine.ops.reference import HIGH_PRECISION_DTYPES

#: the transformers 5.x experts classes whose forward GroupedExperts.forward computes
HF_EXPERTS_CLASSES = ("Qwen2MoeExperts", "MixtralExperts", "Qwen3MoeExperts", "OlmoeExperts")
#: in a model with such experts, the nn.Linear layers registered under these names route tokens (Qwen2-MoE's
#: `shared_expert_gate`, older Mixtral's `gate`) and stay in high precision, as the routers do
ROUTER_NAMES = ("gate", "router", "shared_expert_gate")
#: where a converted module keeps the Hugging Face module it replaced (not a submodule: no state-dict keys)
ORIGINAL = "_hf_experts"


def is_hf_experts(module: nn.Module) -> bool:
    """One of HF_EXPERTS_CLASSES (the exact class, by name, from a transformers module)."""
    cls = type(module)
    return cls.__name__ in HF_EXPERTS_CLASSES and cls.__module__.startswith("transformers.")


def why_not_experts(module: nn.Module, fp8_weights: bool) -> str | None:
    """Why GroupedExperts cannot stand in for this experts module, or None if it can."""
    flags = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
             "has_post_expert_norm": False}
    for name, wanted in flags.items():
        if getattr(module, name, wanted) != wanted:
            return f"{name}={getattr(module, name)!r}; engine.GroupedExperts takes {name}={wanted}"
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if type(gate_up) is not nn.Parameter or type(down) is not nn.Parameter or gate_up.dim() != 3 or down.dim() != 3:
        return "its gate_up_proj / down_proj are not 3-D Parameters [E, 2I, H] / [E, H, I]"
    e, two_i, h = gate_up.shape
    if tuple(down.shape) != (e, h, two_i // 2) or two_i % 2 or gate_up.dtype != down.dtype:
        return f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not [E, 2I, H] / [E, H, I]"
    if gate_up.dtype not in HIGH_PRECISION_DTYPES:
        return f"{gate_up.dtype} weights; engine takes float32, bfloat16 or float16"
    if gate_up.numel() == 0:
        return "empty expert weights"
    if fp8_weights:
        return "fp8_weights: stacked expert weights stay high precision (FP8 primary weights are 2-D)"
    return None


def to_grouped_experts(module: nn.Module) -> GroupedExperts:
    """A GroupedExperts over the module's own Parameters and activation, in its training mode."""
    gate_up, down = module.gate_up_proj, module.down_proj
    e, two_i, h = gate_up.shape
    new = GroupedExperts(e, h, two_i // 2, act_fn=module.act_fn, params_dtype=gate_up.dtype, device="meta")
    new.gate_up_proj, new.down_proj = gate_up, down  # the same Parameters: optimizer, ties and attributes kept
    new.train(module.training)
    new.__dict__[ORIGINAL] = module
    return new


def to_hf_experts(module: GroupedExperts) -> nn.Module | None:
    """The Hugging Face module `to_grouped_experts` replaced, holding the current Parameters; None if there is none."""
    original = module.__dict__.get(ORIGINAL)
    if original is None:
        return None
    original.gate_up_proj, original.down_proj = module.gate_up_proj, module.down_proj
    original.train(module.training)
    return original
