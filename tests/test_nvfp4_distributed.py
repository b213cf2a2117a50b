"""NVFP4Quantizer's amax all-reduce over a group, for real: 2 processes on the gloo backend."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.ops import nvfp4
from engine.quantizers import NVFP4Quantizer


def rank_input(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(32, 48, generator=g) * (rank + 1)


def _worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        q = NVFP4Quantizer(with_rht=True, amax_reduction_group=dist.group.WORLD)
        st = q(rank_input(rank)).qstorage
        torch.save({name: t for name, t in st.buffers().items()}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_amaxes_are_reduced_before_the_scales_are_made(tmp_path):
    world_size = 2
    mp.spawn(_worker, args=(world_size, str(tmp_path / "init"), str(tmp_path)), nprocs=world_size, join=True)
    inputs = [rank_input(r) for r in range(world_size)]
    row_amax = max(x.abs().max() for x in inputs).reshape(1)
    col_amax = max(nvfp4.rht_transform(x.t().contiguous()).float().abs().max() for x in inputs).reshape(1)
    for r in range(world_size):
        got = torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
        assert torch.equal(got["amax_rowwise"], row_amax) and torch.equal(got["amax_columnwise"], col_amax)
        want = nvfp4.quantize(inputs[r], rht=True, amax=row_amax, amax_t=col_amax)
        for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
            assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), (r, name)
    # rank 0 alone would have used its own, smaller amax
    assert inputs[0].abs().max() < row_amax[0]
