"""engine.optim under FSDP2 (DTensor parameters, gradients and states) and DCP, on 2 gloo ranks.

A Linear(64, 64) is `fully_shard`ed (32 rows a rank) and stepped with known whole gradients, distributed like
the parameters: AdamW with every state format, the fused path (torch's fused kernel, the native kernel), SGD
with momentum with a few, and bf16 parameters rounded stochastically. Each rank's weight shard is 2048 elements: whole blocks of every format (128 FP8,
32 MX, 256 int8), so its blocks are the whole tensor's and one process stepping the whole weight must give the
same bits (weights and encoded states, scales and random-bit counters included). The bias shard (32 elements) is
whole MX blocks but not whole 1x128 / 256 blocks: those blocked states are each rank's own, so their reference is
one process stepping that shard alone. Then DCP: save on 2 ranks, load into 2 fresh ranks (every state bit for
bit) and into one process (resharding: bit for bit, the shards' own blocks as their exact fp32 values); an
fp32-state checkpoint loads into int8 states under FSDP2. Last, FP8 primary weights (`fp8_model_init`) under
every recipe class: the master and the requantized weight are the whole weight's.
"""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch

import engine
from conformance.harness import WORLD, case_ids, case_of, spawn, value
from conformance.test_conformance_fsdp import batch, shard
from engine.optim import formats, sharded

FORMATS = sorted({f.name: n for n, f in engine.optim.STATE_FORMATS.items()}.values())  # one name per format
STEPS, D = 3, 64


def make_model(seed: int = 0, kind: str = "AdamW") -> torch.nn.Linear:
    torch.manual_seed(seed)
    model = torch.nn.Linear(D, D)
    return model.bfloat16() if kind == BF16_WEIGHTS else model


def grads(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return {"weight": torch.randn(D, D, generator=g) * 10.0 ** torch.randint(-4, 1, (D, 1), generator=g),
            "bias": torch.randn(D, generator=g)}


#: bf16 parameters rounded stochastically (weights="stochastic"): their random bits are drawn by position too
BF16_WEIGHTS = "AdamW-bf16-stochastic-weights"


def make_opt(params, state_dtype: str, kind: str = "AdamW"):  # noqa: ANN001, ANN201
    if kind == "SGD":
        return engine.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=0.1, state_dtype=state_dtype, seed=3)
    return engine.optim.AdamW(params, lr=1e-2, weight_decay=0.1, state_dtype=state_dtype, seed=3,
                              fused=kind == "AdamW-fused", weights="stochastic" if kind == BF16_WEIGHTS else "master")


#: (optimizer, state format): AdamW with each format; the fused paths and SGD with a few
CASES = ([("AdamW", f) for f in FORMATS] + [("AdamW-fused", f) for f in ("fp32", "bf16", "bf16_sr", "fp8", "int8")]
         + [("SGD", f) for f in ("fp32", "bf16_sr", "int8")] + [(BF16_WEIGHTS, "bf16_sr")])


#: (checkpoint's formats, DCP template's formats) that differ
MISMATCHES = [("int8", "fp32"), ("bf16", "fp32"), ("fp32", "bf16")]


def local_states(opt, params) -> list[dict]:  # noqa: ANN001
    return [{k: getattr(v, "_local_tensor", v).clone() for k, v in opt.state[p].items()} for p in params]


def _worker(rank: int, out_dir: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor

    def sharded_model(seed: int, kind: str) -> torch.nn.Linear:
        model = make_model(seed, kind)
        fully_shard(model)
        return model

    def load(fmt: str, path: str, kind: str = "AdamW"):  # noqa: ANN202
        model = sharded_model(1, kind)
        opt = make_opt(model.parameters(), fmt, kind)
        state = get_optimizer_state_dict(model, opt)
        dcp.load(state, checkpoint_id=path)
        set_optimizer_state_dict(model, opt, state)
        return model, opt

    out = {"dir": out_dir}
    for kind, fmt in CASES:
        model = sharded_model(0, kind)
        params = [model.weight, model.bias]
        opt = make_opt(params, fmt, kind)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(STEPS):
                for name, p in zip(("weight", "bias"), params):
                    p.grad = distribute_tensor(grads(step)[name].to(p.dtype), p.device_mesh, p.placements)
                opt.step()
        path = os.path.join(out_dir, f"ckpt-{kind}-{fmt}")
        dcp.save(get_optimizer_state_dict(model, opt), checkpoint_id=path)
        fresh, fresh_opt = load(fmt, path, kind)
        out[kind, fmt] = {"warnings": [str(w.message) for w in caught],"params": [p._local_tensor.clone() for p in params], "states": local_states(opt, params),
                    "dtensor": {k: isinstance(v, DTensor) for k, v in opt.state[model.weight].items()},
                    "bytes": opt.state_bytes(),
                    "loaded": local_states(fresh_opt, [fresh.weight, fresh.bias])}
    # an fp32-state checkpoint into int8 states under FSDP2: through an fp32-state optimizer and load_state_dict
    model, fp32_opt = load("fp32", os.path.join(out_dir, "ckpt-AdamW-fp32"))
    int8_opt = make_opt(model.parameters(), "int8")
    int8_opt.load_state_dict(fp32_opt.state_dict())
    out["fp32->int8"] = local_states(int8_opt, [model.weight, model.bias])
    # a DCP template of other formats than the checkpoint's (dcp.load casts into the template's tensors)
    for saved, template in MISMATCHES:
        try:
            load(template, os.path.join(out_dir, f"ckpt-AdamW-{saved}"))
            out["mismatch", saved, template] = "loaded"
        except ValueError as e:
            out["mismatch", saved, template] = str(e)
    for case_id in case_ids():
        model = fp8_model(case_id)
        whole = shard(model)  # FP8 weights FSDP2 can shard by whole blocks are DTensors, the others whole on each rank
        out[case_id] = {**fp8_steps(model, case_id, batch(0).chunk(WORLD)[rank]), "whole": "0.weight" in whole}
    return out


def fp8_model(case_id: str) -> torch.nn.Sequential:
    """An engine.Linear(64, 64) with an FP8 primary weight (`fp8_model_init`) under every recipe class."""
    torch.manual_seed(0)
    with engine.fp8_model_init(recipe=case_of(case_id).recipe()):
        return torch.nn.Sequential(engine.Linear(D, D))


def fp8_steps(model: torch.nn.Sequential, case_id: str, x: torch.Tensor) -> dict:
    """A forward (FSDP2's first all-gather), then STEPS int8-state AdamW steps with known gradients: the weight
    (dequantized) and its fp32 master, local rows."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad(), engine.fp8_autocast(recipe=case_of(case_id).recipe()):
        model(x)
    p = model[0].weight
    initial = value(p)
    opt = make_opt([p], "int8")
    for step in range(STEPS):
        g = grads(step)["weight"]
        p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g
        opt.step()
    return {"weight": value(p), "initial": initial, "master": sharded_local(opt.state[p]["master"]),
            "type": type(getattr(p, "_local_tensor", p)).__name__}


def sharded_local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t).clone()


def own_blocks(fmt: str) -> bool:
    """Whether a bias shard (32 elements) is not whole blocks of `fmt`: its blocks are then its own."""
    f = formats.parse(fmt)
    return f.blocked and (D // WORLD) % f.block != 0


def reference(fmt: str, bias_rows: slice, kind: str = "AdamW") -> tuple[list[torch.Tensor], list[dict]]:
    """One process: the whole weight, and the bias whole or (`own_blocks`) its `bias_rows` shard alone."""
    model = make_model(0, kind)
    blocked = own_blocks(fmt)
    bias = torch.nn.Parameter(model.bias.detach()[bias_rows].clone() if blocked else model.bias.detach().clone())
    params = [model.weight, bias]
    opt = make_opt(params, fmt, kind)
    for step in range(STEPS):
        g = {k: v.to(model.weight.dtype) for k, v in grads(step).items()}
        model.weight.grad, bias.grad = g["weight"], g["bias"][bias_rows] if blocked else g["bias"]
        opt.step()
    if not blocked:
        bias = bias.detach()[bias_rows]
    return [model.weight.detach(), bias.detach()], [dict(opt.state[model.weight]), dict(opt.state[params[1]])]


def rows(rank: int) -> slice:
    half = D // WORLD
    return slice(rank * half, (rank + 1) * half)


def shard_of(key: str, t: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of a whole-weight state: its rows, or its blocks' scales."""
    if t.dim() == 0 or key.endswith("counter"):
        return t
    n = t.shape[0] // WORLD
    return t[rank * n:(rank + 1) * n]


def bias_state(key: str, t: torch.Tensor, blocked: bool, rank: int) -> torch.Tensor:
    return t if blocked else shard_of(key, t, rank)


def shard_bytes(fmt: str, n: int) -> int:
    """Bytes of one state of an n-element shard: 4, 2 or 1 byte an element, and a scale per started block."""
    f = formats.parse(fmt)
    if not f.blocked:
        return n * (4 if f.kind == "fp32" else 2)
    return n + -(-n // f.block) * (1 if f.scheme.startswith("mx") and f.kind == "fp8" else 4)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("block", [32, 128, 256])
def test_whole_blocks_agrees_with_splitting_the_indices(world, block):
    """sharded.whole_blocks against brute force: torch.chunk the element indices by rows and the block indices
    evenly; each rank's elements must fall in exactly its blocks, and no block is shared."""
    for shape in [(64, 64), (3, 64), (1, 64), (5, 128), (3, 512), (64,), (33,), (7, 32), (2, 100)]:
        idx = torch.arange(math.prod(shape)).reshape(shape)
        blocks = torch.arange(-(-idx.numel() // block))
        rows, scales = list(idx.chunk(world)), list(blocks.chunk(world))
        rows += [idx[:0]] * (world - len(rows))
        scales += [blocks[:0]] * (world - len(scales))
        want = all(torch.equal(torch.unique(r.reshape(-1) // block), s) for r, s in zip(rows, scales))
        assert sharded.whole_blocks(shape, world, block) == want, (shape, world, block)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawn(_worker, tmp_path_factory.mktemp("optim_fsdp"))


@pytest.mark.parametrize("case_id", case_ids())
def test_fp8_primary_weights_take_the_sharded_step(results, case_id):
    """FSDP2 shards of FP8 primary weights: the fp32 master and the requantized weight are the whole weight's."""
    model = fp8_model(case_id)
    with torch.no_grad(), engine.fp8_autocast(recipe=case_of(case_id).recipe()):
        model(batch(0))
    p = model[0].weight
    opt = make_opt([p], "int8")
    for step in range(STEPS):
        p.grad = grads(step)["weight"]
        opt.step()
    got = [r[case_id] for r in results]
    assert got[0]["type"] == type(p).__name__
    whole = got[0]["whole"]
    assert [tuple(g["master"].shape) for g in got] == [(D, D) if whole else (D // WORLD, D)] * WORLD
    for name, want in (("master", opt.state[p]["master"]), ("weight", value(p))):
        parts = [g[name] for g in got]
        assert all(same(x, want) for x in parts) if whole else same(torch.cat(parts), want), (case_id, name)
    for g in got:  # each shard was requantized from its master: nearer to it than the weight it started from
        assert (g["weight"] - g["master"]).abs().mean() < 0.5 * (g["initial"] - g["master"]).abs().mean(), case_id


@pytest.mark.parametrize(("kind", "fmt"), CASES, ids=[f"{k}-{f}" for k, f in CASES])
def test_fsdp2_steps_and_dcp_round_trips(results, kind, fmt):
    import torch.distributed.checkpoint as dcp

    names = make_opt([torch.nn.Parameter(torch.zeros(1))], fmt, kind).STATES
    blocked = own_blocks(fmt)
    assert all(results[0][kind, fmt]["dtensor"][k] for k in names), fmt
    if formats.parse(fmt).blocked:  # the weight's scales are a DTensor too (whole blocks)
        assert all(results[0][kind, fmt]["dtensor"][k + "_scale"] for k in names), fmt
    for rank, result in enumerate(results):
        got = result[kind, fmt]
        assert not any("engine.optim" in w for w in got["warnings"]), got["warnings"]  # the native kernel ran
        assert got["bytes"] == len(names) * sum(shard_bytes(fmt, n) for n in (D * D // WORLD, D // WORLD))
        want_params, want_states = reference(fmt, rows(rank), kind)
        assert same(got["params"][0], want_params[0][rows(rank)]), (rank, "weight")
        assert same(got["params"][1], want_params[1]), (rank, "bias")
        assert got["states"][0].keys() == want_states[0].keys()
        for key, want in want_states[0].items():
            assert same(got["states"][0][key], shard_of(key, want, rank)), (rank, "weight", key)
        for key, want in want_states[1].items():
            assert same(got["states"][1][key], bias_state(key, want, blocked, rank)), (rank, "bias", key)
        for mine, loaded in zip(got["states"], got["loaded"]):  # DCP round trip on 2 ranks
            assert mine.keys() == loaded.keys()
            for key in mine:
                assert same(loaded[key], mine[key]), (rank, "dcp", key)

    # one process (no FSDP2) loads the 2-rank checkpoint: the weight's states are the whole reference's
    model = make_model(1, kind)
    opt = make_opt(model.parameters(), fmt, kind)
    model.weight.grad, model.bias.grad = torch.zeros_like(model.weight), torch.zeros_like(model.bias)
    opt.step()  # creates the states the checkpoint fills
    state = {"state": {"weight": dict(opt.state[model.weight]), "bias": dict(opt.state[model.bias])}}
    if blocked:  # the bias shards' blocks were their own: the checkpoint holds them decoded to fp32
        for name in names:
            state["state"]["bias"][name] = torch.zeros(D)
            del state["state"]["bias"][name + "_scale"]
    dcp.load(state, checkpoint_id=os.path.join(results[0]["dir"], f"ckpt-{kind}-{fmt}"), no_dist=True)
    _, want_states = reference(fmt, slice(None), kind)
    for key, want in want_states[0].items():
        assert same(state["state"]["weight"][key], want), ("one process", key)
    if blocked:  # the exact values the shards held
        shards = [reference(fmt, rows(r), kind)[1][1] for r in range(WORLD)]
        for name in names:
            parts = [opt.load(s, opt.param_groups[0], name) for s in shards]
            assert same(state["state"]["bias"][name], torch.cat(parts)), ("one process bias", name)
    else:
        for key, want in want_states[1].items():
            assert same(state["state"]["bias"][key], want), ("one process bias", key)


def test_an_fp32_checkpoint_loads_into_int8_states_under_fsdp2(results):
    # fp32 checkpoint -> int8 states under FSDP2: each rank's int8 states encode the fp32 reference's shard
    int8 = formats.parse("int8")
    _, fp32_states = reference("fp32", slice(None))
    for rank, result in enumerate(results):
        got = result["fp32->int8"][0]
        m = fp32_states[0]["exp_avg"][rows(rank)]
        v = fp32_states[0]["exp_avg_sq"][rows(rank)]
        for name, value, signed in (("exp_avg", m, True), ("exp_avg_sq", formats.sqrt_rn(v), False)):
            data, scale = formats.encode(int8, value, signed=signed)
            assert same(got[name], data) and same(got[name + "_scale"], scale), (rank, name)


@pytest.mark.parametrize(("saved", "template"), MISMATCHES)
def test_a_dcp_template_of_other_formats_is_refused_with_the_fix(results, saved, template):
    """dcp.load fills a template of other formats with the checkpoint's values cast to its dtypes (an int8
    checkpoint's codes as fp32 numbers): load_state_dict refuses it on every rank, naming the checkpoint's formats
    and the way to convert."""
    for rank, result in enumerate(results):
        message = result["mismatch", saved, template]
        assert f"saved format {saved!r}" in message, (rank, message)
        assert f"state_dtype={{'exp_avg': '{saved}'" in message and "load_state_dict" in message, (rank, message)
