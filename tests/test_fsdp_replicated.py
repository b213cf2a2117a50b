"""FSDP2 over FP8 primary weights of every recipe, with row counts that do not split into whole scale blocks
(384 rows on 2 ranks cut a 128-row tile; 200 rows cut every block size): such weights are kept whole on every
rank (`engine.distributed.fsdp.replicated_weights`, FSDP2's `ignored_params`) and their gradients averaged
(`average_gradients`); the others are sharded as before. 2 and 3 gloo processes (one spawn per world size), each
case against one process running the ranks' micro-batches in turn."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import engine
from engine.autocast import fp8_autocast
from engine.recipes import RECIPES, NVFP4BlockScaling
from engine.tensors import QuantizedTensor

STEPS = 2
LR = 0.02
#: the FP8 layers' rows (each reads the same 64 features)
ROWS = (384, 512, 200)
D = 64
WEIGHTS = ("0.weight", "1.weight", "2.weight")
#: which FP8 weights must be kept whole, by world size, written out from the rule (rows a multiple of
#: world_size x block rows: 128 for 128x128 tiles, 32 for MX's columnwise blocks; NVFP4 and FP8 rowwise have no
#: row slices; one scale per tensor takes any rows)
WHOLE = {
    2: {"per_tensor": set(), "block": {"0.weight", "2.weight"}, "mx": {"2.weight"}, "none": set(WEIGHTS)},
    3: {"per_tensor": set(), "block": {"1.weight", "2.weight"}, "mx": {"1.weight", "2.weight"},
        "none": set(WEIGHTS)},
}
KIND = {"delayed": "per_tensor", "current": "per_tensor", "block": "block", "mxfp8": "mx", "mxfp4": "mx",
        "mxfp4_mixed": "mx", "mxfp6": "mx", "rowwise": "none", "nvfp4": "none"}


def recipe_of(name: str):
    # NVFP4 without stochastic rounding: its random bits follow the order in which the micro-batches are quantized
    return NVFP4BlockScaling(disable_stochastic_rounding=True) if name == "nvfp4" else RECIPES[name]()


class Fan(torch.nn.ModuleList):
    """Layers side by side over the same input, their outputs concatenated."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([layer(x) for layer in self], dim=-1)


def make_model(name: str) -> Fan:
    torch.manual_seed(0)
    with engine.fp8_model_init(recipe=recipe_of(name)):
        return Fan(engine.Linear(D, rows) for rows in ROWS)  # the biases stay fp32


def batch(step: int, world_size: int) -> torch.Tensor:
    """The global batch of a step: 2 sequences of 8 tokens per rank (NVFP4 quantizes 16 tokens at a time)."""
    return torch.randn(2 * world_size, 8, D, generator=torch.Generator().manual_seed(100 + step))


def objective(out: torch.Tensor) -> torch.Tensor:
    """Summed over the features: gradients large enough to move 4-bit weights by whole steps in two updates."""
    return out.float().pow(2).sum(-1).mean()


def loss_of(model, x, recipe) -> torch.Tensor:
    with fp8_autocast(recipe=recipe):
        return objective(model(x))


# ------------------------------------------------------------------------------------------ the ranks
def _train_sharded(name: str, rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import fully_shard

    from engine.distributed.fsdp import average_gradients, replicated_weights

    model = make_model(name)
    whole = replicated_weights(model, world_size)
    ignored = {p for p, _ in whole.values()}
    for layer in model:
        fully_shard(layer, ignored_params=ignored)
    fully_shard(model, ignored_params=ignored)
    average_gradients(list(ignored), dist.group.WORLD)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    recipe = recipe_of(name)
    losses = []
    for step in range(STEPS):
        loss = loss_of(model, batch(step, world_size).chunk(world_size)[rank], recipe)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    local, kinds = {}, {}
    for n, p in model.named_parameters():
        t = p._local_tensor if hasattr(p, "_local_tensor") else p
        kinds[n] = ("sharded" if hasattr(p, "_local_tensor") else "whole", type(t).__name__)
        local[n] = (t.dequantize() if isinstance(t, QuantizedTensor) else t).detach().float().clone()
    return {"losses": torch.stack(losses), "local": local, "kinds": kinds, "whole": sorted(whole),
            "reasons": [reason for _, reason in whole.values()]}


def _worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        result = {}
        for name in RECIPES:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result[name] = _train_sharded(name, rank, world_size)
            result[name]["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 3])
def ranks(request, tmp_path_factory):
    world_size = request.param
    tmp = tmp_path_factory.mktemp(f"replicated{world_size}")
    mp.spawn(_worker, args=(world_size, str(tmp / "init"), str(tmp)), nprocs=world_size, join=True)
    return world_size, [torch.load(tmp / f"rank{r}.pt", weights_only=True) for r in range(world_size)]


# ------------------------------------------------------------------------------------------ one process
def reference(name: str, world_size: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(losses, fp32 weights) of one process: each rank's micro-batch in turn under one autocast, gradients
    summed and divided by the world size, the same SGD step."""
    model = make_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    recipe = recipe_of(name)
    losses = []
    for step in range(STEPS):
        with fp8_autocast(recipe=recipe):
            parts = [objective(model(x)) for x in batch(step, world_size).chunk(world_size)]
        for loss in parts:
            loss.backward()
        for p in model.parameters():
            p.grad.div_(world_size)
        opt.step()
        opt.zero_grad()
        losses.append(torch.stack(parts).detach().sum() / world_size)
    weights = {n: (p.dequantize() if isinstance(p, QuantizedTensor) else p).detach().float()
               for n, p in model.named_parameters()}
    return torch.stack(losses), weights


@pytest.mark.parametrize("name", list(RECIPES))
def test_fp8_weights_shard_by_whole_blocks_or_stay_whole(ranks, name):
    world_size, results = ranks
    want_whole = WHOLE[world_size][KIND[name]]
    for r in results:
        got = r[name]
        assert set(got["whole"]) == want_whole
        for n, (placement, cls) in got["kinds"].items():
            assert placement == ("whole" if n in want_whole else "sharded"), n
            assert (cls != "Tensor") == (n in WEIGHTS), (n, cls)  # FP8 weights stay engine quantized tensors
        # FSDP2's unused flat view of a block-scaled shard is the one fallback (as in tests/test_fsdp.py)
        assert not [w for w in got["warnings"] if "QuantizedFallbackWarning" in w and "aten.view" not in w]
        assert not [w for w in got["warnings"] if "FSDP" in w and "QuantizedFallbackWarning" not in w]
    for n in want_whole:  # every rank holds the same whole weight
        for r in results[1:]:
            assert torch.equal(r[name]["local"][n], results[0][name]["local"][n]), n
    losses, want = reference(name, world_size)
    got_losses = torch.stack([r[name]["losses"] for r in results]).mean(0)
    got = {n: results[0][name]["local"][n] if results[0][name]["kinds"][n][0] == "whole"
           else torch.cat([r[name]["local"][n] for r in results]) for n in want}
    worst = max(float((got[n] - want[n]).abs().max()) for n in want)
    print(f"{name} ws={world_size}: whole {sorted(want_whole)}, loss diff "
          f"{float((got_losses - losses).abs().max()):.3g}, weight diff {worst:.3g}")
    if world_size == 2:  # a + b has one order: the same bits as one process
        assert torch.equal(got_losses, losses)
        for n in want:
            assert torch.equal(got[n], want[n]), n
    else:  # three gradients may be summed in another order
        assert torch.allclose(got_losses, losses, rtol=1e-6, atol=0)
        for n in want:
            assert torch.allclose(got[n], want[n], rtol=0, atol=1e-5), n


def test_the_refusal_names_the_rule_and_the_fix():
    from engine.distributed.fsdp import replicated_weights, shard_refusal

    model = make_model("block")
    assert shard_refusal(model[1].weight, 2) is None  # 512 rows: two shards of two whole 128-row tiles
    assert shard_refusal(model[0].bias, 2) is None  # a high-precision parameter: FSDP2 shards it as it is
    reason = shard_refusal(model[0].weight, 2)
    assert reason == ("its 384 rows do not split into 2 equal shards of whole 128-row scale blocks "
                      "(rows must be a multiple of world_size * 128 = 256)")
    assert shard_refusal(model[0].weight, 3) is None and shard_refusal(model[0].weight, 1) is None
    assert sorted(replicated_weights(model, 2)) == ["0.weight", "2.weight"]
    nvfp4 = make_model("nvfp4")
    assert "nvfp4_e2m1 weight has no row shards" in shard_refusal(nvfp4[1].weight, 4)
