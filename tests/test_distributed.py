"""Amax reduction over torch.distributed for real: 2 and 4 processes on the gloo backend."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine import autocast
from engine.autocast import fp8_autocast
from engine.distributed import all_reduce_max, group_size
from engine.quantizers import Float8CurrentScalingQuantizer
from engine.recipes import DelayedScaling

STEPS = 3


def rank_amax(rank: int, step: int, slot: int) -> float:
    """A different amax on every rank, step and slot; the largest is on a different rank per slot."""
    return float(2 ** ((rank * 3 + slot * 5 + step * 7) % 11 - 5))


def _worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        recipe = DelayedScaling(amax_history_len=4)
        fwd, bwd = recipe.make_state(forward=True), recipe.make_state(forward=False)
        for step in range(STEPS):
            with fp8_autocast(recipe=recipe):  # fp8_group None: the world
                autocast.register_forward_state(fwd)
                autocast.register_backward_state(bwd)
                for slot, q in enumerate(fwd.quantizers):
                    q(torch.tensor([rank_amax(rank, step, slot)]))
            for slot, q in enumerate(bwd.quantizers):
                q(torch.tensor([-rank_amax(rank, step, slot + 3)]))
        with fp8_autocast(recipe=recipe):  # the last backward is folded in (and reduced) at the next entry
            pass
        current = Float8CurrentScalingQuantizer(torch.float8_e4m3fn, amax_reduction_group=dist.group.WORLD)
        scale_inv = current(torch.full((4, 4), float(rank + 1))).qstorage.rowwise_scale_inv
        plain = [torch.tensor([float(rank), -float(rank)]), torch.tensor([float(10 - rank)])]
        all_reduce_max(plain)
        torch.save({"fwd_scale": fwd.scale, "fwd_history": fwd.amax_history, "bwd_scale": bwd.scale,
                    "bwd_history": bwd.amax_history, "current_scale_inv": scale_inv, "plain": plain,
                    "group_size": group_size(None)}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def expected_states(world_size: int) -> dict:
    """The same steps on one process, with each amax already the max over ranks."""
    recipe = DelayedScaling(amax_history_len=4)
    fwd, bwd = recipe.make_state(forward=True), recipe.make_state(forward=False)
    for step in range(STEPS):
        for slot, q in enumerate(fwd.quantizers):
            q(torch.tensor([max(rank_amax(r, step, slot) for r in range(world_size))]))
        for slot, q in enumerate(bwd.quantizers):
            q(torch.tensor([max(rank_amax(r, step, slot + 3) for r in range(world_size))]))
        fwd.update()
        bwd.update()
    return {"fwd_scale": fwd.scale, "fwd_history": fwd.amax_history, "bwd_scale": bwd.scale,
            "bwd_history": bwd.amax_history}


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rank_ends_with_the_same_scales_and_histories(world_size, tmp_path):
    mp.spawn(_worker, args=(world_size, str(tmp_path / "init"), str(tmp_path)), nprocs=world_size, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world_size)]
    want = expected_states(world_size)
    for got in results:
        assert got["group_size"] == world_size
        for key, value in want.items():
            assert torch.equal(got[key], value), key
        # current scaling all-reduces its amax: every rank uses the largest, world_size
        assert torch.equal(got["current_scale_inv"], torch.ones(1) / (torch.tensor([448.0]) / world_size))
        assert got["plain"][0].tolist() == [world_size - 1.0, 0.0] and got["plain"][1].tolist() == [10.0]
    # the ranks saw different data, so without the reduction their scales would differ
    local = [max(rank_amax(r, STEPS - 1, 0), 0) for r in range(world_size)]
    assert len(set(local)) > 1


def test_without_torch_distributed_nothing_is_reduced():
    amax = torch.tensor([3.0])
    all_reduce_max([amax])
    assert amax.tolist() == [3.0] and group_size(None) == 1
