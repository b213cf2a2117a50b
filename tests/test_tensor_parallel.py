"""Tensor and sequence parallel on DTensor, 2 and 4 gloo processes vs one process.

The block is LayerNormLinear (column parallel) -> gelu -> Linear (row parallel), under every
recipe and in bf16, plain (input replicated, output all-reduced) and sequence parallel (input
sharded along the sequence and all-gathered, in FP8 where the recipe allows; output
reduce-scattered). Each process runs every case once; the parent compares with the same
steps run in one process.

Bounds, and why:
* exact (same bits): what a rank computes as a slice of the single-process result - the
  column-parallel output and weight/bias gradients (its rows of W), the row-parallel weight
  gradient (its columns of W) and bias gradient. Per-tensor scales are agreed across ranks
  (amax all-reduced), block/MX tiles do not straddle shards, so each quantized operand holds
  the same bytes as in one process and each output element is the same dot product.
* bounded: what sums partial results of ranks - the block output (row parallel: partial sums
  over K added by the reduction, not inside one GEMM), the input gradient (column parallel's
  dgrad partials), the norm's gradients (sums over sequence shards). These differ only by the
  order of additions: fp32 activations (every FP8 recipe) within 64 * eps_fp32 * max|reference|;
  bf16 within 4 bf16 ulps of max|reference| (each rank's partial is rounded to bf16 before the
  sum), 16 for the norm's gradients (sums over every token of products whose inputs already
  differ by an ulp; in sequence parallel each rank's partial sum is rounded to bf16 too). An
  FP8 difference (a scale or a tile not agreed) is about 2**-4 relative, hundreds of times the
  fp32 bound; a missing or doubled reduction is of the order of the values themselves.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import checkpoint_specs
import engine
from conformance.harness import without_stochastic_rounding
from engine.recipes import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

D, B = 64, 2  # FFN and sequence: 128 per rank (whole 128-blocks on every rank, as the exact checks need)
RECIPES = {"bf16": None, "delayed": DelayedScaling(amax_history_len=4), "current": Float8CurrentScaling(),
           "block": Float8BlockScaling(), "mxfp8": MXFP8BlockScaling()}
#: every other recipe class `engine.recipes` exports, plain tensor parallel on 4 ranks (2 ranks and sequence
#: parallel: tests/conformance/test_conformance_tp.py); without stochastic rounding: its random bits follow each
#: element's position in the tensor, which a shard does not share with the whole
MORE_RECIPES = {cls.__name__: without_stochastic_rounding(checkpoint_specs.make_recipe(cls.__name__))
                for cls in checkpoint_specs.exported_recipe_classes()
                if cls not in {type(r) for r in RECIPES.values() if r is not None}}
EXACT = ("fc1_out", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
BOUNDED = ("y", "dx", "fc1.layer_norm_weight", "fc1.layer_norm_bias")


def steps(name: str) -> int:
    """Delayed scaling's second step quantizes with the scales the first step's (reduced) amaxes made."""
    return 2 if name == "delayed" else 1


def dtype_of(name: str) -> torch.dtype:
    return torch.bfloat16 if name == "bf16" else torch.float32


class Block(torch.nn.Module):
    def __init__(self, ffn: int, dtype: torch.dtype):
        super().__init__()
        self.fc1 = engine.LayerNormLinear(D, ffn, params_dtype=dtype)
        self.fc2 = engine.Linear(ffn, D, params_dtype=dtype)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def make_case(name: str, world_size: int) -> tuple[Block, list[torch.Tensor], list[torch.Tensor]]:
    """The model and each step's input and output gradient, the same in every process."""
    dtype, seq = dtype_of(name), 128 * world_size
    torch.manual_seed(0)
    model = Block(128 * world_size, dtype)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(B, seq, D, generator=gen).to(dtype) for _ in range(steps(name))]
    dys = [torch.randn(B, seq, D, generator=gen).to(dtype) for _ in range(steps(name))]
    return model, xs, dys


def run_steps(model, xs, dys, recipe) -> dict[str, torch.Tensor]:
    """Forward/backward steps; the last one's output, input gradient and fc1 output (gradients zeroed between)."""
    seen = {}
    if hasattr(model, "fc1"):
        model.fc1.register_forward_hook(lambda m, i, out: seen.__setitem__("fc1_out", out.detach().clone()))
    for x, dy in zip(xs, dys):
        model.zero_grad(set_to_none=True)
        x = x.detach().clone().requires_grad_(True)
        with engine.fp8_autocast(enabled=recipe is not None, recipe=recipe):
            y = model(x)
        y.backward(dy)
    return {"y": y.detach().clone(), "dx": x.grad.clone(), **seen}


def reference(name: str, world_size: int) -> dict[str, torch.Tensor]:
    model, xs, dys = make_case(name, world_size)
    out = run_steps(model, xs, dys, RECIPES[name])
    out.update({n: p.grad.clone() for n, p in model.named_parameters()})
    return out


def _count_gathers(log: list) -> None:
    """Record the bytes each rank sends to every all_gather_single (what sequence parallel gathers)."""
    original = dist.all_gather_single

    def counting(output, inp, *args, **kwargs):
        log.append(inp.numel() * inp.element_size())
        return original(output, inp, *args, **kwargs)

    dist.all_gather_single = counting


WORLD = 4


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    """4-way: the world's 1-D mesh. 2-way: the "tp" dim of a (dp=2, tp=2) mesh, two groups running the same case
    at once (data-parallel replicas; delayed scaling reduces its amaxes over the world, which holds both)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard

        meshes = {4: init_device_mesh("cpu", (WORLD,)),
                  2: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]}
        gathered: list[int] = []
        _count_gathers(gathered)
        results = {}
        for tp, mesh in meshes.items():
            for sp in (False, True):
                for name, recipe in RECIPES.items():
                    model, xs, dys = make_case(name, tp)
                    plan = ({"fc1": engine.distributed.ColwiseParallel(input_layouts=Shard(1)),
                             "fc2": engine.distributed.RowwiseParallel(output_layouts=Shard(1))} if sp else
                            {"fc1": engine.distributed.ColwiseParallel(), "fc2": engine.distributed.RowwiseParallel()})
                    results[tp, "sp" if sp else "tp", name] = _run_parallel(model, mesh, plan, xs, dys, recipe, sp,
                                                                          gathered)
        results.update(_extra_cases(meshes[4], gathered))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run_parallel(model, mesh, plan, xs, dys, recipe, sp: bool, gathered: list[int], dim: int = 1) -> dict:
    """Parallelize `model`, run the steps (sequence parallel: on this rank's shards along `dim`), collect the
    results."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh, plan)
    if sp:  # this rank's sequence shard of the input and of the output gradient
        xs, dys = ([t.chunk(mesh.size(), dim=dim)[mesh.get_local_rank()].contiguous() for t in ts]
                   for ts in (xs, dys))
    start = len(gathered)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run_steps(model, xs, dys, recipe)
    out.update({n: p.grad.full_tensor() for n, p in model.named_parameters()})
    out["gathered"] = torch.tensor(gathered[start:])
    out["hp_warnings"] = torch.tensor(sum("high precision" in str(w.message) for w in caught))
    return out


class HandModel(torch.nn.Module):
    """Every engine module with plain weights, for DTensor inputs passed by hand."""

    def __init__(self):
        super().__init__()
        self.qkv = engine.LayerNormLinear(D, D)
        self.mlp = engine.LayerNormMLP(D, 128)
        self.out = engine.Linear(D, 32)

    def forward(self, x):
        return self.out(self.mlp(self.qkv(x)))


class NormBlock(torch.nn.Module):
    """torchtitan's layout: a torch LayerNorm (torch's SequenceParallel), then engine Linears."""

    def __init__(self, ffn: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(D)
        self.fc1 = engine.Linear(D, ffn)
        self.fc2 = engine.Linear(ffn, D)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.norm(x))))


def hand_case() -> tuple[HandModel, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = HandModel()
    gen = torch.Generator().manual_seed(2)
    return model, torch.randn(8, 16, D, generator=gen), torch.randn(8, 16, 32, generator=gen)


def mlp_case() -> tuple[engine.LayerNormMLP, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = engine.LayerNormMLP(D, 128 * WORLD)
    gen = torch.Generator().manual_seed(3)
    return model, torch.randn(2, 32, D, generator=gen), torch.randn(2, 32, D, generator=gen)


def norm_case() -> tuple[NormBlock, list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = NormBlock(128 * WORLD)
    gen = torch.Generator().manual_seed(4)
    return model, [torch.randn(B, 128 * WORLD, D, generator=gen)], [torch.randn(B, 128 * WORLD, D, generator=gen)]


def mlp_sequence_case() -> tuple[engine.LayerNormMLP, list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = engine.LayerNormMLP(D, 128 * WORLD)
    gen = torch.Generator().manual_seed(6)
    return model, [torch.randn(B, 128 * WORLD, D, generator=gen)], [torch.randn(B, 128 * WORLD, D, generator=gen)]


def seq_first_case() -> tuple[Block, list[torch.Tensor], list[torch.Tensor]]:
    """Megatron's [sequence, batch, hidden] layout: each rank's rows are one run of 64 x 2 = 128 rows."""
    torch.manual_seed(0)
    model = Block(128 * WORLD, torch.float32)
    gen = torch.Generator().manual_seed(7)
    return model, [torch.randn(64 * WORLD, B, D, generator=gen)], [torch.randn(64 * WORLD, B, D, generator=gen)]


def fallback_case() -> tuple[Block, list[torch.Tensor], list[torch.Tensor]]:
    """Block scaling with 32 sequence rows per rank: 128x1 columnwise blocks would straddle ranks."""
    torch.manual_seed(0)
    model = Block(128 * WORLD, torch.float32)
    gen = torch.Generator().manual_seed(5)
    return model, [torch.randn(B, 32 * WORLD, D, generator=gen)], [torch.randn(B, 32 * WORLD, D, generator=gen)]


def return_bias_case() -> tuple[engine.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(5)
    return engine.Linear(D, D, return_bias=True), torch.randn(B, D), torch.randn(B, D)


def _raised(fn) -> str:
    try:
        fn()
    except Exception as err:  # the test checks the type and message
        return f"{type(err).__name__}: {err}"
    return "nothing raised"


def _extra_cases(mesh, gathered: list[int]) -> dict:
    """DTensors passed by hand, torch's norm with SequenceParallel, the high-precision gather, refusals."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
    from torch.distributed.tensor.parallel import parallelize_module

    recipe, out = Float8CurrentScaling(), {}
    # plain modules, a batch-sharded DTensor input
    model, x, dy = hand_case()
    xd = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_(True)
    with engine.fp8_autocast(recipe=recipe):
        y = model(xd)
    y.backward(distribute_tensor(dy, mesh, [Shard(0)]))
    out["hand"] = {"y": y.full_tensor(), "dx": xd.grad.full_tensor(), "placement": torch.tensor(y.placements[0].dim),
                   **{n: p.grad for n, p in model.named_parameters()}}
    # LayerNormMLP split by hand: fc1 by columns, fc2 by rows (the Megatron MLP)
    model, x, dy = mlp_case()
    for name, placement in (("fc1_weight", Shard(0)), ("fc1_bias", Shard(0)), ("fc2_weight", Shard(1))):
        model.register_parameter(name, torch.nn.Parameter(distribute_tensor(getattr(model, name), mesh, [placement])))
    for name in ("fc2_bias", "layer_norm_weight", "layer_norm_bias"):
        model.register_parameter(name, torch.nn.Parameter(distribute_tensor(getattr(model, name), mesh, [Replicate()])))
    xd = distribute_tensor(x, mesh, [Replicate()]).requires_grad_(True)
    with engine.fp8_autocast(recipe=recipe):
        y = model(xd)
    partial = y.placements[0].is_partial()
    y = y.redistribute(placements=[Replicate()])
    y.to_local().backward(dy)
    out["mlp"] = {"y": y.to_local().clone(), "dx": xd.grad.full_tensor(), "partial": torch.tensor(partial),
                  **{n: p.grad.full_tensor() for n, p in model.named_parameters()}}
    # torch's LayerNorm under torch's SequenceParallel, engine Linears column / row parallel
    model, xs, dys = norm_case()
    plan = {"norm": engine.distributed.SequenceParallel(),
            "fc1": engine.distributed.ColwiseParallel(input_layouts=Shard(1)),
            "fc2": engine.distributed.RowwiseParallel(output_layouts=Shard(1))}
    out["norm"] = _run_parallel(model, mesh, plan, xs, dys, recipe, True, gathered)
    # LayerNormMLP under its style, sequence parallel
    model, xs, dys = mlp_sequence_case()
    style = engine.distributed.LayerNormMLPParallel(input_layouts=Shard(1), output_layouts=Shard(1))
    out["mlp_style"] = _run_parallel(model, mesh, style, xs, dys, recipe, True, gathered)
    # sequence first ([S, B, D], sharded along dim 0), block and MX scales gathered
    for name in ("block", "mxfp8"):
        model, xs, dys = seq_first_case()
        plan = {"fc1": engine.distributed.ColwiseParallel(input_layouts=Shard(0)),
                "fc2": engine.distributed.RowwiseParallel(output_layouts=Shard(0))}
        out[f"seq_first_{name}"] = _run_parallel(model, mesh, plan, xs, dys, RECIPES[name], True, gathered, dim=0)
    # block scaling whose columnwise blocks straddle ranks: gathered in high precision, with a warning
    model, xs, dys = fallback_case()
    plan = {"fc1": engine.distributed.ColwiseParallel(input_layouts=Shard(1)),
            "fc2": engine.distributed.RowwiseParallel(output_layouts=Shard(1))}
    out["fallback"] = _run_parallel(model, mesh, plan, xs, dys, Float8BlockScaling(), True, gathered)
    for name, more in MORE_RECIPES.items():
        model, xs, dys = make_case(name, WORLD)
        plan = {"fc1": engine.distributed.ColwiseParallel(), "fc2": engine.distributed.RowwiseParallel()}
        out[f"more_{name}"] = _run_parallel(model, mesh, plan, xs, dys, more, False, gathered)
    # row parallel with return_bias=True: the output reduced, the bias handed back (Megatron's skip_bias_add)
    model, x, dy = return_bias_case()
    parallelize_module(model, mesh, engine.distributed.RowwiseParallel())
    xd = x.chunk(WORLD, dim=-1)[dist.get_rank()].clone().requires_grad_(True)
    with engine.fp8_autocast(recipe=recipe):
        y, bias = model(xd)
    (y + bias).backward(dy)
    out["return_bias"] = {"y": y.detach().clone(), "bias": bias.detach().clone(), "dx": xd.grad,
                          "weight": model.weight.grad.to_local(), "bias_grad": model.bias.grad.to_local()}
    # what is refused, and how
    mesh2d = init_device_mesh("cpu", (2, 2))
    two_d = engine.Linear(D, D)
    two_d.register_parameter("weight", torch.nn.Parameter(distribute_tensor(two_d.weight, mesh2d,
                                                                            [Shard(0), Replicate()])))
    out["errors"] = {
        "torch_colwise": _raised(lambda: parallelize_module(engine.Linear(D, D), mesh, TorchColwise())),
        "rowwise_lnlinear": _raised(lambda: parallelize_module(engine.LayerNormLinear(D, D), mesh,
                                                               engine.distributed.RowwiseParallel())),
        "colwise_mlp": _raised(lambda: parallelize_module(engine.LayerNormMLP(D, D), mesh,
                                                          engine.distributed.ColwiseParallel())),
        "mesh_2d": _raised(lambda: two_d(torch.randn(4, D))),
    }
    first_two = dist.new_group([0, 1])  # every rank takes part in making it
    column = engine.Linear(D, D)
    parallelize_module(column, mesh, engine.distributed.ColwiseParallel())
    if dist.get_rank() < 2:  # ranks 2 and 3 are in the mesh but not in this fp8_group

        def delayed_over_two():
            with engine.fp8_autocast(recipe=DelayedScaling(), fp8_group=first_two):
                column(torch.randn(4, D))

        out["errors"]["fp8_group"] = _raised(delayed_over_two)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """One launch of 4 processes serves every case."""
    tmp = tmp_path_factory.mktemp("tp")
    mp.spawn(_worker, args=(str(tmp / "init"), str(tmp)), nprocs=WORLD, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def bound(name: str, key: str, ref: torch.Tensor) -> float:
    """See the module docstring: a few units in the last place of max|reference|."""
    scale = ref.float().abs().max().item()
    if name != "bf16":
        return 64 * torch.finfo(torch.float32).eps * scale
    return (16 if key.startswith("fc1.layer_norm") else 4) * 2.0 ** -8 * scale


def gathered_bytes(name: str, rows: int) -> tuple[int, int]:
    """(forward, backward) bytes a rank sends for its `rows` x D input shard, from the layouts by hand."""
    if name == "bf16":
        return 2 * rows * D, 2 * rows * D  # forward for fprop, backward again for wgrad
    if name in ("delayed", "current"):
        return rows * D, rows * D  # FP8 bytes only: the scale is agreed, not sent
    if name == "block":  # fp32 scales: 1x128 rowwise (one partial block per row: D = 64), 128x1 columnwise
        return rows * D + rows * 4, rows * D + D * (rows // 128) * 4
    return rows * D + rows * (D // 32), rows * D + (rows // 32) * D  # mxfp8: E8M0 bytes per 32


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_and_sequence_parallel_match_one_process(world_size, ranks):
    group = ranks[:world_size]  # 2-way: ranks 0 and 1 form the first tp group
    table = []
    for name in RECIPES:
        ref = reference(name, world_size)
        for variant in ("tp", "sp"):
            got = [r[world_size, variant, name] for r in group]
            cat = (lambda key: torch.cat([g[key] for g in got], dim=1)) if variant == "sp" else (lambda key: got[0][key])
            full = {"y": cat("y"), "dx": cat("dx"), "fc1_out": torch.cat([g["fc1_out"] for g in got], dim=-1)}
            full.update({k: got[0][k] for k in ref if k not in full})
            for rank_out in got[1:]:  # every rank holds the same gradients
                for key in EXACT[1:] + BOUNDED[2:]:
                    assert torch.equal(rank_out[key], got[0][key]), (variant, name, key)
            for key in EXACT:
                assert torch.equal(full[key], ref[key]), (variant, name, key, (full[key] - ref[key]).abs().max())
            diffs = {key: (full[key].float() - ref[key].float()).abs().max().item() for key in BOUNDED}
            table.append((variant, name, diffs, {key: bound(name, key, ref[key]) for key in BOUNDED}))
            if variant == "sp":
                fwd, bwd = gathered_bytes(name, B * 128)
                assert got[0]["gathered"].tolist() == [fwd, bwd] * steps(name), (name, got[0]["gathered"].tolist())
                assert got[0]["hp_warnings"].item() == 0
    print(f"\nworld size {world_size}: max |TP - one process| (bound)")
    for variant, name, diffs, bounds in table:
        print(f"  {variant} {name:8s} " + " ".join(f"{k}={v:.2e} ({bounds[k]:.1e})" for k, v in diffs.items()))
    for variant, name, diffs, bounds in table:
        for key, diff in diffs.items():
            assert diff <= bounds[key], (variant, name, key, diff, bounds[key])


@pytest.mark.parametrize("name", list(MORE_RECIPES))
def test_newer_recipes_under_tensor_parallel(ranks, name):
    """FP8 rowwise, MX FP4/FP6, NVFP4 (its per-tensor S_enc agreed over the group like current scaling's scale),
    operand maps and factories: every recipe class but the four above."""
    model, xs, dys = make_case(name, WORLD)
    ref = run_steps(model, xs, dys, MORE_RECIPES[name])
    ref.update({n: p.grad for n, p in model.named_parameters()})
    got = dict(ranks[0][f"more_{name}"], fc1_out=torch.cat([r[f"more_{name}"]["fc1_out"] for r in ranks], dim=-1))
    for key in EXACT:
        assert torch.equal(got[key], ref[key]), (name, key)
    for key in BOUNDED:
        fp32_close(got[key], ref[key], f"{name} {key}")


def fp32_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Within the fp32 bound of the module docstring (a different order of additions)."""
    diff = (got - want).abs().max().item()
    assert diff <= 64 * torch.finfo(torch.float32).eps * want.abs().max().item(), (what, diff)


def run_reference(model, x, dy, recipe) -> torch.Tensor:
    x = x.clone().requires_grad_(True)
    with engine.fp8_autocast(recipe=recipe):
        y = model(x)
    y.backward(dy)
    return y.detach(), x.grad


def test_dtensor_inputs_passed_by_hand_to_plain_modules(ranks):
    """A batch-sharded DTensor through LayerNormLinear, LayerNormMLP and Linear with plain weights: each rank
    quantizes its rows with the scales of the whole batch, so outputs and input gradients are the single
    process's rows; weight gradients are summed over ranks (replicated weights)."""
    model, x, dy = hand_case()
    y, dx = run_reference(model, x, dy, Float8CurrentScaling())
    got = ranks[0]["hand"]
    assert got["placement"].item() == 0  # the output keeps the input's Shard(0)
    assert torch.equal(got["y"], y) and torch.equal(got["dx"], dx)
    for name, p in model.named_parameters():
        fp32_close(got[name], p.grad, name)
        for other in ranks[1:]:
            assert torch.equal(other["hand"][name], got[name]), name


def test_layernorm_mlp_split_by_hand(ranks):
    """fc1 Shard(0), fc2 Shard(1) DTensors in a LayerNormMLP: the Megatron MLP through the same code."""
    model, x, dy = mlp_case()
    y, dx = run_reference(model, x, dy, Float8CurrentScaling())
    got = ranks[0]["mlp"]
    assert got["partial"].item()  # fc2's output is a partial sum until reduced
    for name in ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"):
        assert torch.equal(got[name], getattr(model, name).grad), name
    for name, want in (("y", y), ("dx", dx), ("layer_norm_weight", model.layer_norm_weight.grad),
                       ("layer_norm_bias", model.layer_norm_bias.grad)):
        fp32_close(got[name], want, name)


def test_torch_sequence_parallel_norm_with_engine_linears(ranks):
    """torch's LayerNorm under SequenceParallel feeding engine column/row parallel Linears (torchtitan's plan)."""
    model, xs, dys = norm_case()
    ref = run_steps(model, xs, dys, Float8CurrentScaling())
    got = [r["norm"] for r in ranks]
    assert torch.equal(torch.cat([g["fc1_out"] for g in got], dim=-1), ref["fc1_out"])
    fp32_close(torch.cat([g["y"] for g in got], dim=1), ref["y"], "y")
    fp32_close(torch.cat([g["dx"] for g in got], dim=1), ref["dx"], "dx")
    for name, p in model.named_parameters():
        if name.startswith("norm"):
            fp32_close(got[0][name], p.grad, name)
        else:
            assert torch.equal(got[0][name], p.grad), name
    assert got[0]["gathered"].tolist() == [B * 128 * D] * 2 and got[0]["hp_warnings"].item() == 0


def test_layernorm_mlp_parallel_sequence_parallel(ranks):
    """LayerNormMLPParallel with sequence-sharded input and output: fc1's and fc2's weight gradients are slices of
    the single process's; the output, input and norm gradients are sums of partials."""
    model, xs, dys = mlp_sequence_case()
    ref = run_steps(model, xs, dys, Float8CurrentScaling())
    got = [r["mlp_style"] for r in ranks]
    fp32_close(torch.cat([g["y"] for g in got], dim=1), ref["y"], "y")
    fp32_close(torch.cat([g["dx"] for g in got], dim=1), ref["dx"], "dx")
    for name, p in model.named_parameters():
        if name.startswith("layer_norm"):
            fp32_close(got[0][name], p.grad, name)
        else:
            assert torch.equal(got[0][name], p.grad), name
    assert got[0]["gathered"].tolist() == [B * 128 * D] * 2 and got[0]["hp_warnings"].item() == 0


@pytest.mark.parametrize("name", ["block", "mxfp8"])
def test_sequence_first_layout(ranks, name):
    """[S, B, D] sharded along S: a rank's rows are one run of S_l x B rows (not B runs of S_l); block and MX
    scales (128x1 stored transposed, 32x1 not) still gather exactly."""
    model, xs, dys = seq_first_case()
    ref = run_steps(model, xs, dys, RECIPES[name])
    got = [r[f"seq_first_{name}"] for r in ranks]
    assert torch.equal(torch.cat([g["fc1_out"] for g in got], dim=-1), ref["fc1_out"])
    fp32_close(torch.cat([g["y"] for g in got], dim=0), ref["y"], "y")
    fp32_close(torch.cat([g["dx"] for g in got], dim=0), ref["dx"], "dx")
    for param in ("fc1.weight", "fc1.bias", "fc2.weight"):
        assert torch.equal(got[0][param], dict(model.named_parameters())[param].grad), param
    assert got[0]["hp_warnings"].item() == 0 and got[0]["gathered"].tolist() == list(gathered_bytes(name, 128))


def test_blocks_straddling_ranks_gather_in_high_precision(ranks):
    """32 sequence rows per rank cannot hold a 128x1 block: x is gathered in fp32 (with a warning) and quantized
    whole, as one process does - the column-parallel output is still exact."""
    model, xs, dys = fallback_case()
    ref = run_steps(model, xs, dys, Float8BlockScaling())
    got = [r["fallback"] for r in ranks]
    assert got[0]["hp_warnings"].item() >= 1
    assert got[0]["gathered"].tolist() == [4 * B * 32 * D]  # fp32, forward only: the full x waits for wgrad
    assert torch.equal(torch.cat([g["fc1_out"] for g in got], dim=-1), ref["fc1_out"])
    fp32_close(torch.cat([g["y"] for g in got], dim=1), ref["y"], "y")
    fp32_close(torch.cat([g["dx"] for g in got], dim=1), ref["dx"], "dx")


def test_row_parallel_with_return_bias(ranks):
    """return_bias=True: each rank gets the reduced output without the bias and the whole bias, to add once."""
    model, x, dy = return_bias_case()
    xr = x.clone().requires_grad_(True)
    with engine.fp8_autocast(recipe=Float8CurrentScaling()):
        y, bias = model(xr)
    (y + bias).backward(dy)
    for rank, r in enumerate(ranks):
        got = r["return_bias"]
        fp32_close(got["y"], y.detach(), "y")
        assert torch.equal(got["bias"], bias.detach()) and torch.equal(got["bias_grad"], model.bias.grad)
        assert torch.equal(got["dx"], xr.grad.chunk(WORLD, dim=-1)[rank])
        assert torch.equal(got["weight"], model.weight.grad.chunk(WORLD, dim=-1)[rank])


def test_what_is_refused(ranks):
    errors = ranks[0]["errors"]
    # what users reported: torch's own style refuses engine.Linear (hence engine.distributed's styles)
    assert errors["torch_colwise"].startswith("NotImplementedError") and "nn.Linear" in errors["torch_colwise"]
    assert errors["rowwise_lnlinear"].startswith("NotImplementedError: RowwiseParallel") \
        and "got LayerNormLinear" in errors["rowwise_lnlinear"]
    assert errors["colwise_mlp"].startswith("NotImplementedError: ColwiseParallel") \
        and "got LayerNormMLP" in errors["colwise_mlp"]
    assert errors["mesh_2d"].startswith("NotImplementedError") and "1-D device mesh" in errors["mesh_2d"]
    # delayed scaling agrees on scales over fp8_group: one missing ranks of the mesh would let them differ
    assert errors["fp8_group"].startswith("ValueError: fp8_group") and "ranks [2, 3]" in errors["fp8_group"]
