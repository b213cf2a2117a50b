"""FSDP2 over current-scaling FP8 weights: a multi-tensor optimizer update agrees on every weight's amax in one
all-reduce, with the same bits as agreeing weight by weight (2 gloo processes)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import engine
from engine.recipes import Float8CurrentScaling

WEIGHTS = 4  # fp8 weights in the model: LayerNormLinear, Linear, LayerNormMLP's fc1 and fc2


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    with engine.fp8_model_init(recipe=Float8CurrentScaling()):
        return torch.nn.Sequential(engine.LayerNormLinear(40, 30), engine.Linear(30, 24), engine.LayerNormMLP(24, 20))


class AllReduces:
    """Counts dist.all_reduce calls (the amax agreement is the only all-reduce in an optimizer step)."""

    def __enter__(self):
        self.count, self._orig = 0, dist.all_reduce

        def counting(*args, **kwargs):
            self.count += 1
            return self._orig(*args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._orig


def _step(foreach: bool, rank: int) -> tuple[int, dict[str, torch.Tensor]]:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for module in model:
        fully_shard(module)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1, foreach=foreach)
    x = torch.randn(4, 3, 40, generator=torch.Generator().manual_seed(7)).chunk(2)[rank]
    with engine.fp8_autocast(recipe=Float8CurrentScaling()):
        model(x).float().pow(2).mean().backward()
    with AllReduces() as reduces:
        opt.step()
    shards = {}
    for name, p in model.named_parameters():
        st = p._local_tensor
        if isinstance(st, engine.tensors.QuantizedTensor):
            shards[name + ".data"] = st.qstorage.rowwise_data.view(torch.uint8).clone()
            shards[name + ".scale_inv"] = st.qstorage.rowwise_scale_inv.clone()
    return reduces.count, shards


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        result = {f"foreach={f}": _step(f, rank) for f in (True, False)}
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_multi_tensor_update_agrees_on_all_amaxes_in_one_collective(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for r in ranks:
        batched, batched_shards = r["foreach=True"]
        one_by_one, shards = r["foreach=False"]
        # AdamW writes the weights twice (weight decay, then the update): one collective each, for all weights
        assert batched == 2 and one_by_one == 2 * WEIGHTS
        assert len(shards) == 2 * WEIGHTS and shards.keys() == batched_shards.keys()
        for name, want in shards.items():
            assert torch.equal(batched_shards[name], want), name
    for name, scale in ranks[0]["foreach=True"][1].items():  # one scale for the whole weight: the same on both ranks
        if name.endswith("scale_inv"):
            assert torch.equal(scale, ranks[1]["foreach=True"][1][name]), name


def test_fsdp2_refuses_fp8_weights_it_cannot_shard(tmp_path):
    """NVFP4 and FP8-rowwise primary weights have no row slices: fully_shard fails naming the rule (it used to
    train on fp32 copies with only a QuantizedFallbackWarning)."""
    from torch.distributed.fsdp import fully_shard

    from engine.recipes import RECIPES

    for name in ("nvfp4", "rowwise"):
        with engine.fp8_model_init(recipe=RECIPES[name]()):
            layer = engine.Linear(64, 32)
        with pytest.raises(NotImplementedError, match=r"split along dim 0 of a .*FSDP2 shards parameters"):
            torch.chunk(layer.weight, 2, dim=0)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        with pytest.raises(NotImplementedError, match="FP8 primary weights"):
            fully_shard(layer)
    finally:
        dist.destroy_process_group()
    # a plain split along the other dim still runs on the dequantized value, with the usual warning
    with pytest.warns(engine.tensors.QuantizedFallbackWarning):
        assert torch.equal(torch.cat(torch.chunk(layer.weight, 2, dim=1), dim=1), layer.weight.dequantize())
