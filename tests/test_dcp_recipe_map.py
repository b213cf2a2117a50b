"""torch.distributed.checkpoint carries a RecipeMap and the scaling state into FSDP2 modules that have not run
(`engine.distributed.load_model_state_dict`: their `_extra_state` sized as saved), on 2 gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import engine
from engine.recipes import DelayedScaling, NVFP4BlockScaling, RecipeMap

#: layer 0 in high precision, 1 under delayed scaling (its amax history is saved), 2 under the autocast's NVFP4
#: (its stochastic-rounding counters are saved)
MAP = RecipeMap(rules=[("0", None), ("1", DelayedScaling(amax_history_len=4))])


def make_model(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(engine.LayerNormLinear(32, 32), engine.Linear(32, 32), engine.LayerNormMLP(32, 64))


def step(model: torch.nn.Module, rank: int, seed: int) -> list[torch.Tensor]:
    """One forward and backward under NVFP4 on this rank's input: the output and the input's gradient."""
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(seed * 10 + rank)).requires_grad_()
    with engine.fp8_autocast(recipe=NVFP4BlockScaling()):
        out = model(x)
    out.float().square().mean().backward()
    return [out.detach(), x.grad]


def _worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        def sharded(model: torch.nn.Module) -> torch.nn.Module:
            for m in model:
                fully_shard(m)
            return fully_shard(model)

        saved = sharded(engine.set_recipe_map(make_model(0), MAP))
        step(saved, rank, 0)  # the states now hold a history and counters: longer records than a fresh module's
        with engine.fp8_autocast(recipe=NVFP4BlockScaling()):  # fold the backward's amaxes into the saved history
            pass
        dcp.save(get_model_state_dict(saved), checkpoint_id=os.path.join(out_dir, "ran"))
        fresh = sharded(make_model(1))  # never ran, no picks: no `_extra_state` keys at all
        engine.distributed.load_model_state_dict(fresh, os.path.join(out_dir, "ran"))
        picks = engine.recipe_map_of(fresh)
        # the next step of both models: the same weights, picks, delayed history and NVFP4 counters give the same bits
        want, got = step(saved, rank, 1), step(fresh, rank, 1)

        unrun = sharded(make_model(2))  # a checkpoint without `_extra_state` keys into a model with picks
        dcp.save(get_model_state_dict(unrun), checkpoint_id=os.path.join(out_dir, "unrun"))
        picked = sharded(engine.set_recipe_map(make_model(3), MAP))
        engine.distributed.load_model_state_dict(picked, os.path.join(out_dir, "unrun"))
        torch.save({"picks": picks.to_plain() if picks else None, "want": want, "got": got,
                    "kept": engine.recipe_map_of(picked).to_plain()}, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # no rank tears its connections down while another still reads from them
    finally:
        dist.destroy_process_group()


def test_dcp_brings_the_picks_and_scaling_state_into_modules_that_have_not_run(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    want_picks = engine.recipe_map_of(engine.set_recipe_map(make_model(0), MAP)).to_plain()
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert result["picks"] == want_picks
        for got, want in zip(result["got"], result["want"]):
            assert torch.equal(got, want)
        assert result["kept"] == want_picks  # no saved `_extra_state`: the modules keep their own


def test_load_model_state_dict_needs_a_checkpoint():
    with pytest.raises(ValueError, match="checkpoint_id: expected the checkpoint's path"):
        engine.distributed.load_model_state_dict(make_model(0))
