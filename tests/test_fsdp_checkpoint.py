"""torch.distributed.checkpoint of an FSDP2 model of engine modules with FP8 primary weights and delayed-scaling
`_extra_state`: saved on 2 gloo ranks, loaded into 4 ranks and into one process without FSDP2, values equal."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import engine
from engine.autocast import fp8_autocast
from engine.recipes import DelayedScaling
from engine.tensors import QuantizedTensor


def make_model(seed: int) -> torch.nn.Sequential:
    """FP8 weights of 30 rows (uneven on 4 ranks) and 24 rows."""
    torch.manual_seed(seed)
    with engine.fp8_model_init(recipe=DelayedScaling()):
        return torch.nn.Sequential(engine.LayerNormLinear(40, 30), engine.Linear(30, 24))


def values(model) -> dict[str, torch.Tensor]:
    """fp32 values of every parameter this process holds (its shard under FSDP2), and the delayed scales."""
    out = {}
    for n, p in model.named_parameters():
        t = p._local_tensor if hasattr(p, "_local_tensor") else p
        out[n] = (t.dequantize() if isinstance(t, QuantizedTensor) else t).detach().float().clone()
    for i, m in enumerate(model):
        out[f"{i}.scale"], out[f"{i}.history"] = m._fwd_state.scale.clone(), m._fwd_state.amax_history.clone()
    return out


def _worker(rank: int, world_size: int, init_file: str, out_dir: str, save: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        model = make_model(0 if save else 1)
        for m in model:
            fully_shard(m)
        fully_shard(model)
        if save:  # two steps: the weights and the delayed scaling state move
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(2):
                with fp8_autocast(recipe=DelayedScaling()):
                    loss = model(torch.randn(2, 4, 40, generator=torch.Generator().manual_seed(step * 10 + rank)))
                loss.float().pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            # an optimizer step records each shard's own weight amax: the next autocast's exit reduces them, so
            # that the delayed state (one `_extra_state` for all ranks) is the same on every rank when saved
            with torch.no_grad(), fp8_autocast(recipe=DelayedScaling()):
                model(torch.randn(2, 4, 40))
            state = get_model_state_dict(model)
            dcp.save(state, checkpoint_id=os.path.join(out_dir, "ckpt"))
        else:
            state = get_model_state_dict(model)
            dcp.load(state, checkpoint_id=os.path.join(out_dir, "ckpt"))
            set_model_state_dict(model, state)
        types = {n: type(p._local_tensor).__name__ for n, p in model.named_parameters()}
        torch.save({"values": values(model), "types": types, "keys": sorted(state)},
                   os.path.join(out_dir, f"{'save' if save else 'load'}{rank}.pt"))
        dist.barrier()  # no rank tears its connections down while another still reads from them
    finally:
        dist.destroy_process_group()


def _gathered(results: list[dict]) -> dict[str, torch.Tensor]:
    """Shards back together (dim 0); the scales are each rank's own, checked equal."""
    out = {}
    for key in results[0]["values"]:
        parts = [r["values"][key] for r in results]
        if key.endswith(("scale", "history")):
            assert all(torch.equal(p, parts[0]) for p in parts), key
            out[key] = parts[0]
        else:
            out[key] = torch.cat(parts)
    return out


def test_dcp_save_on_2_ranks_loads_into_4_ranks_and_into_one_process(tmp_path):
    import torch.distributed.checkpoint as dcp

    mp.spawn(_worker, args=(2, str(tmp_path / "init2"), str(tmp_path), True), nprocs=2, join=True)
    saved = [torch.load(tmp_path / f"save{r}.pt", weights_only=True) for r in range(2)]
    want = _gathered(saved)
    assert "0._extra_state" in saved[0]["keys"] and "0.weight_scale_inv" in saved[0]["keys"]
    fresh = values(make_model(1))
    assert not torch.equal(fresh["0.weight"], want["0.weight"]) and not torch.equal(fresh["0.scale"], want["0.scale"])

    mp.spawn(_worker, args=(4, str(tmp_path / "init4"), str(tmp_path), False), nprocs=4, join=True)
    loaded = [torch.load(tmp_path / f"load{r}.pt", weights_only=True) for r in range(4)]
    got = _gathered(loaded)
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    for r in loaded:  # still FP8 shards
        assert r["types"]["0.weight"] == "Float8Tensor" and r["types"]["1.weight"] == "Float8Tensor"

    model = make_model(1)  # one process, no FSDP2: the plain component keys
    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    model.load_state_dict(state)
    assert isinstance(model[0].weight, QuantizedTensor)
    one = values(model)
    for key in want:
        assert torch.equal(one[key], want[key]), key
