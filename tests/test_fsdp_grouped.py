"""FSDP2 over the grouped modules (GroupedLinear, StackedGroupedLinear, GroupedExperts) under every recipe class.

The contract of tests/conformance/test_conformance_fsdp.py (its sharding, training loop and reference), on a
mixture-of-experts stack: GroupedLinear(2 experts, 64 -> 64) with FP8 primary weights (`fp8_model_init`) or
high-precision ones, then StackedGroupedLinear(2, 64, 64) and GroupedExperts(2, 64, 32) (high precision: stacked
[E, N, K] weights have no FP8 primary form), which FSDP2 shards along the experts (one per rank). 2 gloo processes,
one spawn; each rank's 30 tokens are split [7, 23] over the GroupedLinear experts, and all routed to expert 1 of
GroupedExperts (a zero-token expert). Compared with one process running the ranks' micro-batches in turn: with 2
ranks the gradient sum a + b has one order, so losses, weights and scaling state must be the same bits. Then each
rank saves the model's distributed state dict (torch.distributed.checkpoint), loads it into a fresh sharded model
and compares every local buffer bit for bit; the parent loads it into one process without FSDP2.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import engine
from conformance.harness import WORLD, buffers, case_ids, case_of, fp8_modules, scaling_state, spawn, value
from conformance.test_conformance_fsdp import (D, LR, STEPS, _mismatched, batch, objective, reference, shard,
                                               train_sharded)
from engine.tensors import QuantizedTensor

E, H, F = 2, 64, 32
#: FP8 primary weights of GroupedLinear under every recipe class; high-precision ones once (the stacked layouts are
#: high precision in every case)
CASES = [(case_id, "fp8") for case_id in case_ids()] + [("DelayedScaling", "hp")]
#: the recipes whose FP8 expert weights are sharded and all-gathered as FP8 at these sizes (the others' are kept
#: whole on every rank: 128x128 tiles need 256 rows on 2 ranks; NVFP4 and FP8 rowwise have no row shards)
SHARDED_FP8 = {"DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling"}


class MoEStack(torch.nn.Sequential):
    """GroupedLinear -> StackedGroupedLinear -> GroupedExperts over [batch, seq, D] tokens (fixed routing)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, D)
        splits = [len(tokens) // 4, len(tokens) - len(tokens) // 4]
        y = self[0](tokens, splits)
        y = self[1](y, splits)
        route = torch.ones(len(tokens), 1, dtype=torch.long)  # every token to expert 1: expert 0 gets none
        return self[2](y, route, torch.ones(len(tokens), 1, dtype=y.dtype))


def make_model(recipe, primary: bool, seed: int = 0) -> MoEStack:
    torch.manual_seed(seed)
    with engine.fp8_model_init(enabled=primary, recipe=recipe):
        first = engine.GroupedLinear(E, D, H)
    return MoEStack(first, engine.StackedGroupedLinear(E, H, H), engine.GroupedExperts(E, H, F))


def _dcp_round_trip(model, recipe, case_id: str, weights: str, rank: int, out_dir: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    path = os.path.join(out_dir, f"ckpt-{case_id}-{weights}")
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    fresh = make_model(recipe, weights == "fp8", seed=1)
    shard(fresh)
    state = get_model_state_dict(fresh)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(fresh, state)
    return {"mismatched": _mismatched(model, fresh),
            "state_equal": all(map(torch.equal, scaling_state(model), scaling_state(fresh)))}


def _worker(rank: int, out_dir: str) -> dict:
    result: dict = {"dir": out_dir}
    for case_id, weights in CASES:
        recipe = case_of(case_id).recipe()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = make_model(recipe, weights == "fp8")
            whole = shard(model)
            losses = train_sharded(model, recipe, rank, range(STEPS))
        result[case_id, weights] = {
            "losses": torch.stack(losses), "whole": whole, "state": scaling_state(model),
            "local": {n: value(p) for n, p in model.named_parameters()},
            "sharded": {n: hasattr(p, "_local_tensor") for n, p in model.named_parameters()},
            "types": {n: type(getattr(p, "_local_tensor", p)).__name__ for n, p in model.named_parameters()},
            "fallbacks": [str(w.message) for w in caught if "QuantizedFallbackWarning" in w.category.__name__
                          and "aten.view" not in str(w.message)],
            "dcp": _dcp_round_trip(model, recipe, case_id, weights, rank, out_dir)}
    return result


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return spawn(_worker, tmp_path_factory.mktemp("fsdp_grouped"))


def gathered(results: list[dict], key: tuple, name: str) -> torch.Tensor:
    if not results[0][key]["sharded"][name]:
        for r in results[1:]:
            assert torch.equal(r[key]["local"][name], results[0][key]["local"][name]), f"{name}: ranks differ"
        return results[0][key]["local"][name]
    return torch.cat([r[key]["local"][name] for r in results])


@pytest.mark.parametrize(("case_id", "weights"), CASES)
def test_sharded_grouped_modules_equal_one_process(ranks: list[dict], case_id: str, weights: str) -> None:
    key = (case_id, weights)
    for r in ranks:
        assert not r[key]["fallbacks"], r[key]["fallbacks"]
        for name, t in r[key]["types"].items():  # FP8 primary weights (GroupedLinear's) stay quantized tensors
            assert (t != "Tensor") == (weights == "fp8" and name.startswith("0.weight")), (name, t)
        # the stacked weights are sharded along the experts
        assert r[key]["sharded"]["1.weight"] and r[key]["sharded"]["2.gate_up_proj"]
    losses, want, state = reference(case_of(case_id).recipe(), weights == "fp8", make=make_model)
    got_losses = torch.stack([r[key]["losses"] for r in ranks]).mean(0)
    assert torch.equal(got_losses, losses), (got_losses, losses)
    diffs = {name: (gathered(ranks, key, name) - want[name]).abs().max().item() for name in want}
    assert not any(diffs.values()), f"weights differ (max |diff| per parameter): {diffs}"
    for r in ranks:
        assert len(r[key]["state"]) == len(state)
        for i, (g, w) in enumerate(zip(r[key]["state"], state)):
            assert torch.equal(g, w), f"scaling state tensor {i} differs"
    whole = ranks[0][key]["whole"]
    if weights == "fp8" and case_id in SHARDED_FP8:
        assert ranks[0][key]["sharded"]["0.weight0"] and whole == [], "FP8 expert weights are sharded"
    assert all(name.startswith("0.weight") for name in whole), whole  # only FP8 weights are ever kept whole


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # the no_dist load, on purpose
@pytest.mark.parametrize(("case_id", "weights"), CASES)
def test_the_distributed_state_dict_reloads(ranks: list[dict], case_id: str, weights: str) -> None:
    import torch.distributed.checkpoint as dcp

    key = (case_id, weights)
    for r in ranks:
        assert r[key]["dcp"]["mismatched"] == [] and r[key]["dcp"]["state_equal"], r[key]["dcp"]
    one = make_model(case_of(case_id).recipe(), weights == "fp8", seed=1)
    state = one.state_dict()
    dcp.load(state, checkpoint_id=os.path.join(ranks[0]["dir"], f"ckpt-{case_id}-{weights}"), no_dist=True)
    one.load_state_dict(state)
    for name, p in one.named_parameters():
        assert isinstance(p, QuantizedTensor) == (ranks[0][key]["types"][name] != "Tensor"), name
        assert torch.equal(value(p), gathered(ranks, key, name)), name
