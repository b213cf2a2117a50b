"""`permute` / `unpermute`: tokens copied into rows grouped by expert, and expert outputs merged back per token.

`permute(tokens, routing)` gathers one row per kept routing slot (`routing.row_id_map`); its backward sums each
row's gradient back into its token (`unpermute` without probs). `unpermute(rows, row_id_map, probs)` gives
token t the sum over its kept slots s of probs[t, s] * rows[slot_rows[t, s]], in slot order and in fp32,
cast to the rows' dtype; its backward is the gradient permuted (times probs) and, for probs, the dot product of
each row with its token's gradient. A quantized token tensor (rowwise FP8 / MX / NVFP4) is permuted as data and
scales (`quantized_rows`).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.moe.quantized_rows import gather_quantized_rows
from engine.moe.routing import RowIdMap, row_id_map
from engine.tensors import QuantizedTensor, QuantizedTensorBase

__all__ = ["merge_rows", "permute", "unpermute"]


def merge_rows(rows: torch.Tensor, slot_rows: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    """out[t] = sum over kept slots s (in order) of probs[t, s] * rows[slot_rows[t, s]], in fp32."""
    tokens, slots = slot_rows.shape
    out = torch.zeros(tokens, rows.shape[1], dtype=torch.float32, device=rows.device)
    if rows.shape[0] == 0:
        return out
    for s in range(slots):
        row = slot_rows[:, s]
        kept = (row >= 0).unsqueeze(1)
        part = rows.index_select(0, row.clamp(min=0)).float()
        if probs is not None:
            part = part * probs[:, s].float().unsqueeze(1)
        out = torch.where(kept, out + part, out)
    return out


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tokens: torch.Tensor, route: RowIdMap) -> torch.Tensor:
        ctx.route = route
        if isinstance(tokens, QuantizedTensor):
            return gather_quantized_rows(tokens, route.source_rows)
        return tokens.index_select(0, route.source_rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        route = ctx.route
        return merge_rows(grad, route.slot_rows, None).to(grad.dtype), None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, route: RowIdMap, probs: torch.Tensor | None) -> torch.Tensor:
        ctx.route = route
        ctx.save_for_backward(rows, probs)
        return merge_rows(rows, route.slot_rows, probs).to(rows.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None]:
        rows, probs = ctx.saved_tensors
        route = ctx.route
        token_grad = grad.index_select(0, route.source_rows).float()
        grad_rows = grad_probs = None
        if ctx.needs_input_grad[0]:
            weights = None if probs is None else probs.reshape(-1)[route.row_slots].float().unsqueeze(1)
            scaled = token_grad if weights is None else token_grad * weights
            grad_rows = scaled.to(rows.dtype)
        if probs is not None and ctx.needs_input_grad[2]:
            flat = torch.zeros(probs.numel(), dtype=torch.float32, device=probs.device)
            flat[route.row_slots] = (rows.float() * token_grad).sum(dim=1)
            grad_probs = flat.view(probs.shape).to(probs.dtype)
        return grad_rows, None, grad_probs


def _check_tokens(tokens: Any) -> None:
    if isinstance(tokens, QuantizedTensorBase):
        return
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"tokens: expected a [tokens, hidden] tensor, got {type(tokens).__name__}")
    if tokens.dim() != 2:
        raise ValueError(f"tokens: expected a 2D [tokens, hidden] tensor, got shape {tuple(tokens.shape)}; "
                         "pass x.reshape(-1, hidden)")


def permute(tokens: torch.Tensor, routing_map_or_indices: torch.Tensor, num_out_tokens: int | None = None, *,
            num_experts: int | None = None, capacity: int | list[int] | None = None
            ) -> tuple[torch.Tensor, RowIdMap, list[int]]:
    """(rows grouped by expert, the row id map `unpermute` takes, rows per expert).

    `routing_map_or_indices`: [T, K] int expert indices (-1: a dropped slot; then `num_experts` is needed) or a
    [T, E] bool routing map. `capacity`: rows an expert keeps at most (its earliest tokens; a list: one limit per
    expert). `num_out_tokens`: rows kept at most (the last in expert order dropped; None or -1, TE's default: all).
    `tokens` may be a
    row-quantized QuantizedTensor (or storage): its rowwise data and scales move, unchanged.
    """
    _check_tokens(tokens)
    if num_out_tokens == -1 and not isinstance(num_out_tokens, bool):  # TE's default: every kept row
        num_out_tokens = None
    tokens_count = tokens.shape[0]
    if routing_map_or_indices.dim() >= 1 and routing_map_or_indices.shape[0] != tokens_count:
        raise ValueError(f"routing_map_or_indices: expected one row per token ({tokens_count}), got shape "
                         f"{tuple(routing_map_or_indices.shape)}")
    route = row_id_map(routing_map_or_indices, num_experts=num_experts, capacity=capacity,
                       num_out_tokens=num_out_tokens)
    if isinstance(tokens, QuantizedTensorBase):
        return gather_quantized_rows(tokens, route.source_rows), route, list(route.m_splits)
    return _Permute.apply(tokens, route), route, list(route.m_splits)


def unpermute(permuted: torch.Tensor, row_id_map: RowIdMap, probs: torch.Tensor | None = None) -> torch.Tensor:
    """[T, H]: each token's rows summed back, weighted by `probs` ([T, K] in the index form, [T, E] in the mask
    form; None: weight 1); a token whose slots were all dropped gets zeros."""
    if not isinstance(row_id_map, RowIdMap):
        raise TypeError(f"row_id_map: expected the RowIdMap permute returned, got {type(row_id_map).__name__}")
    if not isinstance(permuted, torch.Tensor) or permuted.dim() != 2 or permuted.shape[0] != row_id_map.num_rows:
        got = tuple(permuted.shape) if isinstance(permuted, torch.Tensor) else type(permuted).__name__
        raise ValueError(f"permuted: expected [{row_id_map.num_rows}, hidden] (one row per kept slot, as permute "
                         f"made them), got {got}")
    if isinstance(permuted, QuantizedTensor):
        permuted = permuted.dequantize()
    if probs is not None:
        want = (row_id_map.num_tokens, row_id_map.num_slots)
        if not isinstance(probs, torch.Tensor) or tuple(probs.shape) != want or not probs.is_floating_point():
            got = f"{probs.dtype} {tuple(probs.shape)}" if isinstance(probs, torch.Tensor) else type(probs).__name__
            raise ValueError(f"probs: expected a floating tensor of shape {list(want)} (one weight per routing slot), "
                             f"got {got}")
    return _Unpermute.apply(permuted, row_id_map, probs)
