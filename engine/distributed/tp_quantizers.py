"""Per-tensor scales agreed across a tensor-parallel group.

A rank quantizing its shard of a tensor with a per-tensor current scale (or NVFP4's per-tensor
S_enc) would use the amax of its shard, so ranks (and the single-process run) would quantize
alike values differently. The view below swaps each such quantizer of the chosen roles for a
copy that all-reduces (MAX) its amax over the group first (the rule's `amax_reduction_group`),
so every rank uses the scale of the whole tensor. Delayed scaling needs no view: its amaxes are recorded
into the module's state and reduced over `fp8_autocast`'s `fp8_group` (the world by default)
before each update, so all ranks hold the same scales.
"""

from __future__ import annotations

import copy

import torch.distributed as dist

from engine.collectives import group_size
from engine.quantizers.base import Quantizer
from engine.quantizers.rules import CurrentRule
from engine.recipes import RecipeState, Role


def reducing_state(state: RecipeState | None, group: dist.ProcessGroup, roles: frozenset[Role]) -> RecipeState | None:
    """`state`, or a view of it whose per-tensor current-scaling quantizers of `roles` reduce their amax over
    `group`. Quantizers shared by two uses stay shared. Views are kept on the state (one per group and roles)."""
    if state is None or not roles or group_size(group) <= 1:
        return state
    views = state.__dict__.setdefault("_tp_views", {})
    key = (id(group), roles)
    if key not in views:
        views[key] = (group, _make_view(state, group, roles))  # the group is held so its id stays unique
    return views[key][1]


def _per_tensor_current(quantizer: Quantizer) -> bool:
    """Scales made from the amax of the whole tensor by a rule that can all-reduce it: current scaling's
    per-tensor scale, a tensor-level scale's amax (NVFP4's S_enc)."""
    scheme = quantizer.scheme
    return (scheme.rowwise_block.is_tensor or scheme.tensor_scale) and hasattr(quantizer.rule, "amax_reduction_group")


def _make_view(state: RecipeState, group: dist.ProcessGroup, roles: frozenset[Role]) -> RecipeState:
    swapped, mapping = {}, {}
    for (operand, gemm), quantizer in state._quantizers.items():
        if quantizer is not None and operand[1] in roles and _per_tensor_current(quantizer) and \
                quantizer.rule.amax_reduction_group is None:
            if id(quantizer) not in swapped:
                twin = quantizer.copy()
                twin.rule = copy.copy(quantizer.rule)
                twin.rule.amax_reduction_group = group
                swapped[id(quantizer)] = twin
            quantizer = swapped[id(quantizer)]
        mapping[operand, gemm] = quantizer
    if not swapped:
        return state
    view = copy.copy(state)
    view.__dict__.pop("_tp_views", None)
    view._quantizers = mapping
    return view
