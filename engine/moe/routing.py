"""Where each token's copies go: the row map of a permutation grouped by expert, from top-k indices or a routing map.

A token t has S routing *slots*: its top-k picks `indices[t, k]` (the index form, [T, K], -1 = dropped) or one slot
per expert `routing_map[t, e]` (the mask form, [T, E] bool). Every kept slot becomes one row of the permuted
tensor; rows are grouped by expert (expert 0's first), in token order within an expert, as Transformer Engine's
`moe_permute` orders them. An expert keeps at most `capacity` rows (the earliest tokens; the rest are dropped;
a list gives each expert its own, as expert parallel's global capacity does), and at most `num_out_tokens` rows
are kept in all (the last ones in expert order dropped, TE's convention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RowIdMap", "row_id_map"]


@dataclass(frozen=True)
class RowIdMap:
    """A permutation of tokens into rows grouped by expert, and back.

    `source_rows[r]`: the token row r copies; `row_slots[r]`: its flat slot (t * S + s, where probs are read);
    `slot_rows[t, s]`: the row of token t's slot s, -1 when the slot is dropped; `m_splits[e]`: rows of expert e.
    """

    source_rows: torch.Tensor
    row_slots: torch.Tensor
    slot_rows: torch.Tensor
    m_splits: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return self.slot_rows.shape[0]

    @property
    def num_slots(self) -> int:
        return self.slot_rows.shape[1]

    @property
    def num_rows(self) -> int:
        return self.source_rows.shape[0]


def _check_int(value: object, name: str, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected None or an int >= {minimum}, got {value!r}")
    return value


def _check_capacity(value: object, num_experts: int) -> int | list[int] | None:
    """None, an int >= 0 (every expert), or a list of `num_experts` ints >= 0 (one per expert)."""
    if not isinstance(value, (list, tuple)):
        return _check_int(value, "capacity", 0)
    if len(value) != num_experts or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in value):
        raise ValueError(f"capacity: expected None, an int >= 0 or a list of {num_experts} ints >= 0 (one per "
                         f"expert), got {list(value)!r:.200}")
    return list(value)


def slot_experts(routing: torch.Tensor, num_experts: int | None) -> tuple[torch.Tensor, int]:
    """([T, S] expert of every slot, -1 for a dropped one; E) from indices [T, K] or a bool routing map [T, E]."""
    if not isinstance(routing, torch.Tensor) or routing.dim() != 2:
        raise TypeError("routing_map_or_indices: expected a 2D tensor, [tokens, top_k] int indices (-1 = dropped) "
                        f"or a [tokens, experts] bool routing map; got {_describe(routing)}")
    if routing.dtype == torch.bool:
        experts = routing.shape[1]
        if num_experts is not None and num_experts != experts:
            raise ValueError(f"num_experts: the routing map has {experts} columns (one per expert), got {num_experts}")
        slots = torch.arange(experts, device=routing.device).expand_as(routing)
        return torch.where(routing, slots, -1), experts
    if routing.dtype.is_floating_point or routing.dtype.is_complex:
        raise TypeError(f"routing_map_or_indices: expected int indices or a bool map, got dtype {routing.dtype}; "
                        "pass topk(...).indices, or probs > 0 as a bool map")
    if num_experts is None:
        raise ValueError("num_experts: the index form needs the number of experts (m_splits has one entry per "
                         "expert, empty ones included); pass num_experts=E")
    indices = routing.long()
    if indices.numel():
        low, high = torch.aminmax(indices)  # one host sync, as m_splits needs one anyway
        if int(low) < -1 or int(high) >= num_experts:
            raise ValueError(f"routing_map_or_indices: expected expert indices in [0, {num_experts}) or -1 "
                             f"(dropped), got values in [{int(low)}, {int(high)}]")
    return indices, num_experts


def _describe(x: object) -> str:
    return f"a {x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def row_id_map(routing: torch.Tensor, *, num_experts: int | None = None,
               capacity: int | list[int] | None = None, num_out_tokens: int | None = None) -> RowIdMap:
    """The permutation of the kept slots of `routing` (indices [T, K] or a bool map [T, E]), grouped by expert."""
    num_out_tokens = _check_int(num_out_tokens, "num_out_tokens", 0)
    experts, num_experts = slot_experts(routing, num_experts)
    capacity = _check_capacity(capacity, num_experts)
    tokens, slots = experts.shape
    flat = experts.reshape(-1)
    kept = flat >= 0
    # stable sort by expert: token order (then slot order) within an expert; dropped slots last
    order = torch.argsort(torch.where(kept, flat, num_experts), stable=True)
    counts = torch.bincount(flat[kept], minlength=num_experts)
    sorted_kept = kept[order]
    if capacity is not None:  # position within its expert's group: the first `capacity` stay
        starts = torch.cumsum(counts, 0) - counts
        sorted_expert = flat[order].clamp(min=0)
        position = torch.arange(flat.numel(), device=flat.device) - starts[sorted_expert]
        limit = torch.tensor(capacity, device=flat.device)[sorted_expert] if isinstance(capacity, list) else capacity
        sorted_kept = sorted_kept & (position < limit)
    rows = order[sorted_kept]
    if num_out_tokens is not None:
        rows = rows[:num_out_tokens]
    m_splits = tuple(torch.bincount(flat[rows], minlength=num_experts).tolist())
    slot_rows = torch.full((tokens * slots,), -1, dtype=torch.long, device=flat.device)
    slot_rows[rows] = torch.arange(rows.numel(), device=flat.device)
    return RowIdMap(source_rows=rows // max(slots, 1), row_slots=rows, slot_rows=slot_rows.view(tokens, slots),
                    m_splits=m_splits)
