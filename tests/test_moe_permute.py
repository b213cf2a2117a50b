"""engine.moe.permute / unpermute against a pure-torch loop reference: random routes, dropped slots (-1),
capacity, num_out_tokens, empty experts, T = 0, both routing forms; autograd against autograd through the
reference; row-quantized tokens of every recipe's input quantizer moved with their scales, bit for bit."""

from __future__ import annotations

import pytest
import torch

import checkpoint_specs as specs
from engine.moe import permute, unpermute
from engine.recipes import Gemm, Role
from engine.tensors import QuantizedTensor


# ------------------------------------------------------------------------------------------ the reference
def reference_rows(experts: torch.Tensor, num_experts: int, capacity: int | list[int] | None, num_out: int | None
                   ) -> list[tuple[int, int]]:
    """(token, slot) of each permuted row: expert by expert, tokens in order, at most `capacity` per expert (a
    list: capacity[e] for expert e)."""
    rows = []
    for e in range(num_experts):
        taken = 0
        limit = capacity[e] if isinstance(capacity, list) else capacity
        for t in range(experts.shape[0]):
            for s in range(experts.shape[1]):
                if int(experts[t, s]) == e and (limit is None or taken < limit):
                    rows.append((t, s))
                    taken += 1
    return rows if num_out is None else rows[:num_out]


def reference_permute(tokens: torch.Tensor, rows: list[tuple[int, int]]) -> torch.Tensor:
    if not rows:
        return tokens[:0]
    return torch.stack([tokens[t] for t, _ in rows])


def reference_unpermute(permuted: torch.Tensor, rows: list[tuple[int, int]], shape: tuple[int, int],
                        probs: torch.Tensor | None) -> torch.Tensor:
    tokens, slots = shape
    out = [torch.zeros(permuted.shape[1], dtype=torch.float32) for _ in range(tokens)]
    row_of = {ts: i for i, ts in enumerate(rows)}
    for t in range(tokens):
        for s in range(slots):  # in slot order, in fp32
            if (t, s) in row_of:
                weight = 1.0 if probs is None else probs[t, s].float()
                out[t] = out[t] + permuted[row_of[t, s]].float() * weight
    if not tokens:  # (kept in the graph, so autograd has something to differentiate)
        return permuted.new_zeros(0, permuted.shape[1]) + permuted.sum(0)
    return torch.stack(out).to(permuted.dtype)


def slot_experts(routing: torch.Tensor) -> torch.Tensor:
    if routing.dtype == torch.bool:
        return torch.where(routing, torch.arange(routing.shape[1]), -1)
    return routing


# ------------------------------------------------------------------------------------------ cases
def random_indices(tokens: int, top_k: int, experts: int, seed: int, drop: float = 0.2,
                   skip: tuple[int, ...] = ()) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(experts) if e not in skip])
    picks = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:top_k]] for _ in range(tokens)]) \
        if tokens else torch.zeros(0, top_k, dtype=torch.long)
    dropped = torch.rand(picks.shape, generator=g) < drop
    return torch.where(dropped, -1, picks)


CASES = {  # id: (tokens, top_k, experts, form, capacity, num_out_tokens, experts never picked)
    "index": (13, 2, 4, "index", None, None, ()),
    "index-top3-empty-expert": (11, 3, 6, "index", None, None, (2, 5)),
    "index-capacity": (17, 2, 4, "index", 3, None, ()),
    "index-capacity-per-expert": (17, 2, 4, "index", [5, 0, 2, 100], None, ()),  # expert parallel's global capacity
    "index-num-out": (9, 2, 3, "index", None, 7, ()),
    "mask": (12, 2, 5, "mask", None, None, (0,)),
    "mask-capacity": (15, 3, 4, "mask", 2, None, ()),
    "no-tokens": (0, 2, 4, "index", None, None, ()),
    "all-on-one-expert": (6, 1, 4, "index", None, None, (0, 1, 3)),
}


def make_case(case: str, seed: int = 0):
    tokens, top_k, experts, form, capacity, num_out, skip = CASES[case]
    indices = random_indices(tokens, top_k, experts, seed, skip=skip)
    if form == "mask":
        routing = torch.zeros(tokens, experts, dtype=torch.bool)
        for t, s in (indices >= 0).nonzero().tolist():
            routing[t, indices[t, s]] = True
        return routing, experts, capacity, num_out
    return indices, experts, capacity, num_out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_permute_and_unpermute_match_the_loop_reference(case: str, dtype: torch.dtype) -> None:
    routing, experts, capacity, num_out = make_case(case)
    x = torch.randn(routing.shape[0], 8, dtype=dtype)
    probs = torch.rand(routing.shape, dtype=torch.float32)
    rows = reference_rows(slot_experts(routing), experts, capacity, num_out)
    permuted, route, m_splits = permute(x, routing, num_out, num_experts=experts, capacity=capacity)
    assert m_splits == [sum(1 for t, s in rows if int(slot_experts(routing)[t, s]) == e) for e in range(experts)]
    assert torch.equal(permuted, reference_permute(x, rows))
    y = torch.randn_like(permuted)
    for p in (None, probs):
        got = unpermute(y, route, p)
        want = reference_unpermute(y, rows, tuple(routing.shape), p)
        assert got.dtype == dtype and torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("case", ["index", "index-capacity", "mask", "index-top3-empty-expert", "no-tokens"])
def test_gradients_match_autograd_through_the_reference(case: str) -> None:
    routing, experts, capacity, num_out = make_case(case, seed=3)
    x = torch.randn(routing.shape[0], 8, requires_grad=True)
    probs = torch.rand(routing.shape, requires_grad=True)
    weight = torch.randn(8, 8)
    permuted, route, _ = permute(x, routing, num_out, num_experts=experts, capacity=capacity)
    out = unpermute(permuted @ weight, route, probs)
    grad = torch.randn_like(out)
    gx, gp = torch.autograd.grad(out, (x, probs), grad)
    rows = reference_rows(slot_experts(routing), experts, capacity, num_out)
    x2, p2 = x.detach().requires_grad_(), probs.detach().requires_grad_()
    ref = reference_unpermute(reference_permute(x2, rows) @ weight, rows, tuple(routing.shape), p2)
    wx, wp = torch.autograd.grad(ref, (x2, p2), grad, allow_unused=True)
    torch.testing.assert_close(gx, wx)
    torch.testing.assert_close(gp, torch.zeros_like(gp) if wp is None else wp)


def test_num_out_tokens_minus_one_keeps_every_row_as_te_does() -> None:
    x, indices = torch.randn(4, 8), torch.tensor([[0, 1], [1, -1], [1, 0], [-1, -1]])
    rows, _, m_splits = permute(x, indices, -1, num_experts=2)
    assert m_splits == [2, 3] and torch.equal(rows, x[[0, 2, 0, 1, 2]])


def test_a_token_with_every_slot_dropped_gets_zeros_and_no_gradient() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    indices = torch.tensor([[1, -1], [-1, -1], [0, 1]])
    permuted, route, m_splits = permute(x, indices, num_experts=2)
    assert m_splits == [1, 2]
    out = unpermute(permuted, route)
    assert torch.equal(out[1], torch.zeros(4)) and torch.equal(out[0], x[0].detach())
    out.sum().backward()
    assert torch.equal(x.grad, torch.tensor([[1.0] * 4, [0.0] * 4, [2.0] * 4]))


# ------------------------------------------------------------------------------------------ quantized rows
def input_quantizer(class_name: str):
    recipe = specs.make_recipe(class_name)
    q = recipe.make_state(forward=True, module="Linear").operand((Gemm.FPROP, Role.INPUT))
    if q is not None:
        q.set_usage(rowwise=True, columnwise=False)
    return q


@pytest.mark.parametrize("class_name", [c.__name__ for c in specs.exported_recipe_classes()])
def test_quantized_tokens_move_with_their_scales(class_name: str) -> None:
    """Every recipe's input quantizer: the permuted rows are the source rows' data and scales, bit for bit, and
    where scales are per row (or per 1 x block) they are what quantizing the permuted tokens gives."""
    q = input_quantizer(class_name)
    if q is None:
        pytest.skip(f"{class_name} keeps inputs in high precision")
    x = torch.randn(32, 64) * torch.logspace(-3, 3, 32).unsqueeze(1)
    x[5, 7] = float("nan")
    indices = random_indices(32, 2, 4, seed=1)
    qx = q(x)
    permuted, route, _ = permute(qx, indices, num_experts=4, capacity=12)
    assert isinstance(permuted, QuantizedTensor) and permuted.qstorage.columnwise_data is None
    src, got = qx.qstorage, permuted.qstorage
    rows = torch.tensor([t for t, _ in reference_rows(indices, 4, 12, None)])
    assert torch.equal(got.rowwise_data.view(torch.uint8), src.rowwise_data.view(torch.uint8)[rows])
    if src.scheme.rowwise_block.is_tensor:
        assert torch.equal(got.rowwise_scale_inv, src.rowwise_scale_inv)
    else:
        assert torch.equal(got.rowwise_scale_inv.view(torch.uint8), src.rowwise_scale_inv.view(torch.uint8)[rows])
    deq = permuted.dequantize(dtype=torch.float32)
    want = qx.dequantize(dtype=torch.float32)[rows]
    assert torch.equal(deq.isnan(), want.isnan()) and torch.equal(deq.nan_to_num(), want.nan_to_num())
    if src.scheme.rowwise_block.rows == 1 and not src.scheme.tensor_scale:  # per-row scales: requantizing agrees
        again = q(x[rows]).qstorage
        assert torch.equal(again.rowwise_data.view(torch.uint8), got.rowwise_data.view(torch.uint8))


def test_quantized_tokens_with_tiles_across_rows_are_refused() -> None:
    from engine.quantizers import Float8BlockQuantizer

    q = Float8BlockQuantizer(torch.float8_e4m3fn, block_scaling_dim=2, rowwise=True, columnwise=False)
    with pytest.raises(ValueError, match="span 128 rows"):
        permute(q(torch.randn(8, 128)), torch.zeros(8, 1, dtype=torch.long), num_experts=2)


@pytest.mark.parametrize("routing, kwargs, match", [
    (torch.tensor([[0, 4]]), {"num_experts": 4}, r"in \[0, 4\) or -1"),
    (torch.tensor([[0, 1]]), {}, "num_experts"),
    (torch.tensor([[0.5, 1.0]]), {"num_experts": 2}, "int indices or a bool map"),
    (torch.tensor([[0, 1], [1, 0]]), {"num_experts": 2}, "one row per token"),
    (torch.tensor([[0, 1]]), {"num_experts": 2, "capacity": -1}, "capacity"),
    (torch.tensor([[0, 1]]), {"num_experts": 2, "capacity": [1, 2, 3]}, "one per expert"),
])
def test_bad_routing_is_refused_with_the_fix(routing, kwargs, match) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        permute(torch.randn(1, 4), routing, **kwargs)


def test_unpermute_refuses_mismatched_rows_and_probs() -> None:
    permuted, route, _ = permute(torch.randn(3, 4), torch.tensor([[0, 1], [1, -1], [0, 0]]), num_experts=2)
    with pytest.raises(ValueError, match=r"expected \[5, hidden\]"):
        unpermute(permuted[:4], route)
    with pytest.raises(ValueError, match=r"probs: expected a floating tensor of shape \[3, 2\]"):
        unpermute(permuted, route, torch.rand(3, 1))
