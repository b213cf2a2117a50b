"""engine.inspect under FSDP2 (2 gloo processes): each rank's sums are added over the ranks, so the numbers of
a batch split over the ranks are the numbers of the whole batch in one process, and rank 0 alone writes."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import engine
from engine.recipes import MXFP8BlockScaling

#: MXFP8's blocks: 1x32 rowwise, 32x1 columnwise; each rank's 32 tokens are whole columnwise blocks, so a split
#: batch quantizes exactly as the whole one
TOKENS = 64
COMPARED = ("amax", "underflow_pct", "saturation_pct", "sqnr_db", "mse", "scale_min", "scale_max",
            "zero_scale_pct", "subnormal_scale_pct", "saturated_scale_pct", "rel_error")


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(engine.Linear(64, 64), torch.nn.GELU(), engine.LayerNormMLP(64, 128))


def _batch() -> torch.Tensor:
    return torch.randn(TOKENS, 64, generator=torch.Generator().manual_seed(7))


def _records(model: torch.nn.Module, x: torch.Tensor, out: str | None = None) -> list[dict]:
    with engine.inspect(model, out=out) as inspector:
        with engine.fp8_autocast(recipe=MXFP8BlockScaling()):
            y = model(x.requires_grad_())
        y.float().pow(2).sum().backward()  # a sum: each token's gradient does not depend on the split
    return inspector.records


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model = _model()
        for module in (model[0], model[2]):
            fully_shard(module)
        fully_shard(model)
        records = _records(model, _batch().chunk(2)[rank].clone(), os.path.join(out_dir, "files"))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(records, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _key(r: dict) -> tuple:
    return (r["layer"], r["kind"], r.get("operand"), r.get("usage"), r.get("gemm"))


def test_fsdp2_records_are_the_whole_batch_numbers(tmp_path) -> None:
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]  # reduced: the same on every rank
    whole = {_key(r): r for r in _records(_model(), _batch())}
    split = {_key(r): r for r in ranks[0]}
    assert split.keys() == whole.keys()
    for key, want in whole.items():
        if key[4] == "wgrad":  # each rank's wgrad is its partial sum over its own tokens: its own error
            continue
        for field in COMPARED:
            if field in want:
                assert split[key][field] == pytest.approx(want[field], rel=1e-9, abs=1e-12), (key, field)
        if key[2] in ("fprop_input", "wgrad_input", "dgrad_grad_output", "wgrad_grad_output"):
            assert split[key]["numel"] == want["numel"]  # the tokens of both ranks
    lines = (tmp_path / "files" / "records.jsonl").read_text().splitlines()
    assert len(lines) == len(ranks[0])  # rank 0 only
