"""Contract: FSDP2 (`fully_shard`) computes what one process computes, under every recipe class, and its
distributed state dict (torch.distributed.checkpoint) reloads FP8 primary weights bit for bit.

2 gloo processes, one spawn for the file. The model is engine.LayerNormMLP(64, 128) -> engine.Linear(64, 64)
with high-precision weights and with FP8 primary weights (`fp8_model_init`); FP8 weights FSDP2 cannot cut into
whole scale blocks (128x128 tiles at these sizes, NVFP4, FP8 rowwise) stay whole on every rank
(`engine.distributed.fsdp.replicated_weights`, gradients averaged by `average_gradients`), the others are sharded
and all-gathered as FP8. Two SGD steps on 2 x 15 tokens per rank.

The reference is one process running the ranks' micro-batches in turn under one fp8_autocast, gradients summed
then divided by 2 (what FSDP2's reduce-scatter does); stochastic rounding's counter is set back before each
micro-batch's backward, as each rank starts its backward from the same counter. With 2 ranks the gradient sum
a + b has one order, so losses, weights and scaling state are the same bits (tests/test_fsdp.py's bound).

Then each rank saves the FSDP2 model's `get_model_state_dict` with torch.distributed.checkpoint, loads it into a
fresh FSDP2 model (another seed) and compares every local buffer of every parameter, NVFP4's amaxes included,
and the next step's loss, weights and scaling state bit for bit; the parent loads the checkpoint into one
process without FSDP2 (`no_dist=True`) and compares with the ranks' values.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import engine
from conformance.harness import WORLD, buffers, case_ids, case_of, fp8_modules, scaling_state, spawn, value
from engine.tensors import QuantizedTensor

D, FFN, OUT, TOKENS, STEPS, LR = 64, 128, 64, 15, 2, 0.1


def make_model(recipe, primary: bool, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    with engine.fp8_model_init(enabled=primary, recipe=recipe):
        return torch.nn.Sequential(engine.LayerNormMLP(D, FFN), engine.Linear(D, OUT))


def batch(step: int) -> torch.Tensor:
    """The global batch of a step: 2 sequences of TOKENS per rank."""
    return torch.randn(2 * WORLD, TOKENS, D, generator=torch.Generator().manual_seed(100 + step))


def objective(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


# ------------------------------------------------------------------------------------------ the ranks
def shard(model: torch.nn.Sequential) -> list[str]:
    """fully_shard every layer and the model; FP8 weights that cannot be sharded by whole blocks stay whole."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from engine.distributed.fsdp import average_gradients, replicated_weights

    whole = replicated_weights(model, WORLD)
    ignored = {p for p, _ in whole.values()}
    for layer in model:
        fully_shard(layer, ignored_params=ignored)
    fully_shard(model, ignored_params=ignored)
    average_gradients(list(ignored), dist.group.WORLD)
    return sorted(whole)


def train_sharded(model, recipe, rank: int, steps: range) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in steps:
        with engine.fp8_autocast(recipe=recipe):
            loss = objective(model(batch(step).chunk(WORLD)[rank]))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    # a forward without grad: its autocast folds the last backward in, and its exit reduces the weight amaxes each
    # shard recorded when the optimizer requantized it (delayed scaling), so the ranks agree on the state
    with torch.no_grad(), engine.fp8_autocast(recipe=recipe):
        model(batch(steps.stop).chunk(WORLD)[rank])
    return losses


def _dcp_round_trip(model, recipe, case_id: str, rank: int, out_dir: str) -> dict:
    """Save the model's distributed state dict, load it into a fresh sharded model, compare, take one more step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    path = os.path.join(out_dir, f"ckpt-{case_id}")
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    fresh = make_model(recipe, True, seed=1)
    shard(fresh)
    state = get_model_state_dict(fresh)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(fresh, state)
    mismatched = _mismatched(model, fresh)
    next_losses = [train_sharded(m, recipe, rank, range(STEPS, STEPS + 1))[0] for m in (model, fresh)]
    states = [scaling_state(m) for m in (model, fresh)]
    return {"mismatched": mismatched, "next": torch.stack(next_losses), "mismatched_after": _mismatched(model, fresh),
            "state_after": len(states[0]) == len(states[1]) and all(map(torch.equal, *states))}


def _mismatched(model: torch.nn.Module, other: torch.nn.Module) -> list[str]:
    """The parameters whose local tensors differ in kind or in any buffer's bits."""
    return [name for (name, p), q in zip(model.named_parameters(), other.parameters())
            if type(getattr(p, "_local_tensor", p)) is not type(getattr(q, "_local_tensor", q))
            or _differ(buffers(p), buffers(q))]


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) != list(b) or any(not torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _worker(rank: int, out_dir: str) -> dict:
    result: dict = {"dir": out_dir}
    for case_id in case_ids():
        for weights in ("hp", "fp8"):
            recipe = case_of(case_id).recipe()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model = make_model(recipe, weights == "fp8")
                whole = shard(model)
                losses = train_sharded(model, recipe, rank, range(STEPS))
            got = {"losses": torch.stack(losses), "whole": whole, "state": scaling_state(model),
                   "local": {n: value(p) for n, p in model.named_parameters()},
                   "sharded": {n: hasattr(p, "_local_tensor") for n, p in model.named_parameters()},
                   "types": {n: type(getattr(p, "_local_tensor", p)).__name__ for n, p in model.named_parameters()},
                   "fallbacks": [str(w.message) for w in caught if "QuantizedFallbackWarning" in w.category.__name__
                                 and "aten.view" not in str(w.message)]}
            if weights == "fp8":
                got["dcp"] = _dcp_round_trip(model, recipe, case_id, rank, out_dir)
            result[case_id, weights] = got
    return result


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return spawn(_worker, tmp_path_factory.mktemp("fsdp_conformance"))


# ------------------------------------------------------------------------------------------ one process
def reference(recipe, primary: bool, make=None) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[torch.Tensor]]:
    """(losses, fp32 weights, scaling state) of one process running each rank's micro-batch in turn, on the model
    `make(recipe, primary)` builds (default this file's `make_model`)."""
    model = (make or make_model)(recipe, primary)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        with engine.fp8_autocast(recipe=recipe):
            parts = [objective(model(x)) for x in batch(step).chunk(WORLD)]
        counters = [(m._bwd_state, (m._bwd_state.to_plain() or {}).get("rng_counter")) for m in fp8_modules(model)]
        for loss in parts:
            for state, counter in counters:  # every rank starts its backward from the same counters
                if counter is not None:  # (and the rest of the state as it is: delayed amaxes recorded so far)
                    state.load_plain({**state.to_plain(), "rng_counter": counter})
            loss.backward()
        for p in model.parameters():
            p.grad.div_(WORLD)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(torch.stack(parts).detach().sum() / WORLD)
    with torch.no_grad(), engine.fp8_autocast(recipe=recipe):  # as `train_sharded` ends
        for x in batch(STEPS).chunk(WORLD):
            model(x)
    return torch.stack(losses), {n: value(p) for n, p in model.named_parameters()}, scaling_state(model)


def gathered(results: list[dict], key: tuple, name: str) -> torch.Tensor:
    """A parameter put back together from the ranks (or rank 0's, for one every rank holds whole)."""
    if not results[0][key]["sharded"][name]:
        for r in results[1:]:
            assert torch.equal(r[key]["local"][name], results[0][key]["local"][name]), f"{name}: ranks differ"
        return results[0][key]["local"][name]
    return torch.cat([r[key]["local"][name] for r in results])


@pytest.mark.parametrize("weights", ["hp", "fp8"])
@pytest.mark.parametrize("case_id", case_ids())
def test_a_sharded_step_equals_one_process(ranks: list[dict], case_id: str, weights: str) -> None:
    key = (case_id, weights)
    for r in ranks:
        assert not r[key]["fallbacks"], r[key]["fallbacks"]
        for name, t in r[key]["types"].items():  # FP8 primary weights stay engine quantized tensors
            assert (t != "Tensor") == (weights == "fp8" and name.endswith("weight") and "layer_norm" not in name), \
                (name, t)
    losses, want, state = reference(case_of(case_id).recipe(), weights == "fp8")
    got_losses = torch.stack([r[key]["losses"] for r in ranks]).mean(0)
    assert torch.equal(got_losses, losses), (got_losses, losses)
    diffs = {name: (gathered(ranks, key, name) - want[name]).abs().max().item() for name in want}
    assert not any(diffs.values()), f"weights differ (max |diff| per parameter): {diffs}"
    for r in ranks:
        assert len(r[key]["state"]) == len(state)
        for i, (g, w) in enumerate(zip(r[key]["state"], state)):
            assert torch.equal(g, w), f"scaling state tensor {i} differs"
    if weights == "fp8" and case_id in ("DelayedScaling", "MXFP8BlockScaling", "Float8CurrentScaling"):
        types, sharded = ranks[0][key]["types"], ranks[0][key]["sharded"]
        assert any(sharded[n] for n, t in types.items() if t != "Tensor"), "no FP8 weight was sharded"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # the no_dist load, on purpose
@pytest.mark.parametrize("case_id", case_ids())
def test_the_distributed_state_dict_reloads_fp8_weights(ranks: list[dict], case_id: str) -> None:
    """Sharded and whole FP8 weights (NVFP4's with their amaxes) reload bit for bit, on the ranks and into one
    process, and the reloaded model's next step is the saved one's."""
    import torch.distributed.checkpoint as dcp

    key = (case_id, "fp8")
    for r in ranks:
        dcp_result = r[key]["dcp"]
        assert dcp_result["mismatched"] == [], dcp_result["mismatched"]
        first, second = dcp_result["next"]  # the next step: the same loss, weights and scaling state
        assert torch.equal(first, second)
        assert dcp_result["mismatched_after"] == [] and dcp_result["state_after"], dcp_result
    recipe = case_of(case_id).recipe()
    one = make_model(recipe, True, seed=1)
    state = one.state_dict()
    dcp.load(state, checkpoint_id=os.path.join(ranks[0]["dir"], f"ckpt-{case_id}"), no_dist=True)
    one.load_state_dict(state)
    for name, p in one.named_parameters():
        assert isinstance(p, QuantizedTensor) == (ranks[0][key]["types"][name] != "Tensor"), name
        assert torch.equal(value(p), gathered(ranks, key, name)), name
