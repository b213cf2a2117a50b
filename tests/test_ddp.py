"""DistributedDataParallel over engine modules on 2 and 4 gloo processes (one spawn per world size runs every case).

* Training under every recipe `engine.recipes` exports leaves the same weights and scaling state (delayed
  histories, stochastic-rounding counters) on every rank, and a recipe with amaxes to agree on (delayed scaling)
  all-reduces them once per autocast exit and entry, in one collective for all modules.
* Gradient accumulation (`no_sync()` for the first micro-batch, `is_first_microbatch` weight caching) gives the
  gradient one process computes on the concatenated batch.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint_specs
from engine.autocast import fp8_autocast
from engine.recipes import DelayedScaling
from tiny_models import TinyModel

STEPS = 2
#: every recipe class `engine.recipes` exports, by name (tests/checkpoint_specs.py builds them)
RECIPES = [cls.__name__ for cls in checkpoint_specs.exported_recipe_classes()]


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(1000 * step + rank))


class AccumulatingModel(TinyModel):
    """TinyModel whose forward passes is_first_microbatch on to every engine module."""

    def forward(self, x, is_first_microbatch=None):
        h = self.proj(self.qkv(x, is_first_microbatch=is_first_microbatch), is_first_microbatch=is_first_microbatch)
        return self.mlp(h + x, is_first_microbatch=is_first_microbatch)


def microbatches(world_size: int) -> torch.Tensor:
    """[world_size, 2 micro-batches, 2, 8, 64]: rank r gets [r]; one process gets all of them concatenated."""
    return torch.randn(world_size, 2, 2, 8, 64, generator=torch.Generator().manual_seed(7))


def _worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        result = {}
        for name in RECIPES:
            torch.manual_seed(0)
            model = DDP(TinyModel())
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            recipe, calls, orig = checkpoint_specs.make_recipe(name), [], dist.all_reduce

            def counting(tensor, *args, **kwargs):
                calls.append(tensor.numel())
                return orig(tensor, *args, **kwargs)

            dist.all_reduce = counting  # DDP's own gradient all-reduce runs in C++: only engine's amaxes come here
            try:
                for step in range(STEPS):
                    with fp8_autocast(recipe=recipe):
                        loss = model(batch(step, rank)).pow(2).mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                with fp8_autocast(recipe=recipe):  # folds in (and reduces) the last backward's amaxes
                    pass
            finally:
                dist.all_reduce = orig
            inner = model.module
            state = {n: p.detach().clone() for n, p in inner.named_parameters()}
            reduces = False
            for m in ("qkv", "proj", "mlp"):
                for direction in ("fwd", "bwd"):
                    st = getattr(getattr(inner, m), f"_{direction}_state")
                    reduces |= bool(st.amaxes_to_reduce())
                    for key, value in (st.to_plain() or {}).items():
                        state[f"{m}.{direction}.{key}"] = value.clone()
            result[name] = {"state": state, "calls": calls, "reduces": reduces}
        # gradient accumulation: micro-batch 1 under no_sync (weights quantized and cached), micro-batch 2 reuses them
        torch.manual_seed(0)
        model = DDP(AccumulatingModel())
        with fp8_autocast(recipe=DelayedScaling()):
            with model.no_sync():
                model(microbatches(world_size)[rank, 0], is_first_microbatch=True).float().pow(2).sum().backward()
            model(microbatches(world_size)[rank, 1], is_first_microbatch=False).float().pow(2).sum().backward()
        result["accumulated"] = {n: p.grad.clone() for n, p in model.module.named_parameters()}
        result["cached"] = all(c.value is not None for m in model.module.children() for c in m._weight_caches)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request, tmp_path_factory):
    world_size = request.param
    tmp = tmp_path_factory.mktemp(f"ddp{world_size}")
    mp.spawn(_worker, args=(world_size, str(tmp / "init"), str(tmp)), nprocs=world_size, join=True)
    return world_size, [torch.load(tmp / f"rank{r}.pt", weights_only=True) for r in range(world_size)]


@pytest.mark.parametrize("name", RECIPES)
def test_every_rank_ends_with_the_same_weights_and_scales(ranks, name):
    world_size, results = ranks
    first = results[0][name]["state"]
    if name == "DelayedScaling":
        assert {"qkv.fwd.scale", "mlp.bwd.amax_history"} <= set(first)
    if name == "NVFP4BlockScaling":
        assert {"qkv.bwd.rng_counter", "mlp.bwd.rng_counter"} <= set(first)
    for r in results[1:]:
        assert r[name]["state"].keys() == first.keys()
        for key, value in first.items():
            assert torch.equal(r[name]["state"][key], value), key
    # the ranks saw different batches: the weights moved away from the initial ones
    torch.manual_seed(0)
    assert not torch.equal(first["proj.weight"], TinyModel().proj.weight.detach())


@pytest.mark.parametrize("name", RECIPES)
def test_delayed_scaling_reduces_all_modules_amaxes_in_one_collective(ranks, name):
    """Each reduction serves every module at once (3 modules, 4 GEMMs): at the autocast's exit the forward amaxes
    (3 per GEMM) with the backward slots (2 per GEMM) = 20, and, since the backward runs after the exit, the
    backward's 8 at the next autocast's entry (engine/autocast.py): 2 small collectives per step, not one per module.
    A recipe with nothing to agree on makes none; another with amaxes (CustomRecipe's delayed fc1) the same two."""
    _, results = ranks
    calls = results[0][name]["calls"]
    if name == "DelayedScaling":
        assert calls == [20] + [8, 20] * (STEPS - 1) + [8, 8]  # (the flush: its entry, then its exit)
    elif results[0][name]["reduces"]:
        assert len(calls) == 2 * STEPS + 1, calls
    else:
        assert calls == []


def test_gradient_accumulation_with_no_sync_and_weight_caching(ranks):
    """The gradient of 2 micro-batches per rank, accumulated under no_sync and averaged by DDP, is one process's on
    all of them concatenated: under delayed scaling (scales 1 at the first step) every element is quantized alike
    (the same loss, a sum, so the same output gradients), and only the order of the fp32 sums over tokens differs (wgrad: one GEMM vs micro-batches and ranks), so the
    bound is 1e-5 of each gradient's largest element."""
    world_size, results = ranks
    assert all(r["cached"] for r in results)
    torch.manual_seed(0)
    model = AccumulatingModel()
    x = microbatches(world_size).reshape(-1, 8, 64)
    with fp8_autocast(recipe=DelayedScaling()):
        loss = model(x).float().pow(2).sum()
    loss.backward()
    for n, p in model.named_parameters():
        for r in results:
            assert torch.equal(r["accumulated"][n], results[0]["accumulated"][n]), n  # DDP: the same on every rank
            got = r["accumulated"][n] * world_size  # DDP averages the ranks' sums (x world_size: exact)
            bound = 1e-5 * float(p.grad.abs().max())
            assert float((got - p.grad).abs().max()) <= bound, (n, float((got - p.grad).abs().max()), bound)
