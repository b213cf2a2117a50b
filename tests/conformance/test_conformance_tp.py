"""Contract: tensor and sequence parallel (engine.distributed's styles on DTensor) compute what one process
computes, under every recipe class.

2 gloo processes, one spawn for the file (tests/test_tensor_parallel.py's harness and bounds). The block is
LayerNormLinear(64, 256) column parallel -> GELU -> Linear(256, 64) row parallel: each rank holds 128 of the 256
features, whole 128-blocks. Plain tensor parallel on 2 x 15 replicated tokens; sequence parallel on 1 x 256
tokens sharded along the sequence (gathered quantized where the recipe allows). Two steps without an update (the
second one quantizes with the scales delayed scaling learned in the first, amaxes reduced over the ranks).

Exact (same bits): what a rank computes as a slice of the one-process result (fc1's output and weight and bias
gradients, fc2's weight and bias gradients): scales are agreed over the group, blocks do not straddle shards.
Bounded by 64 fp32 ulps of max|reference|: what sums the ranks' partial results (the output, the input
gradient, the norm's gradients), which only the order of additions changes.

Stochastic rounding draws each element's random bits by its position in the tensor, which a shard does not share
with the whole: a recipe that rounds stochastically runs without it (`harness.without_stochastic_rounding`).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import engine
from conformance.harness import WORLD, case_ids, case_of, spawn, without_stochastic_rounding

D, FFN, STEPS = 64, 128 * WORLD, 2
SHAPES = {"tp": (2, 15), "sp": (1, 128 * WORLD)}
EXACT = ("fc1_out", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
BOUNDED = ("y", "dx", "fc1.layer_norm_weight", "fc1.layer_norm_bias")


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = engine.LayerNormLinear(D, FFN)
        self.fc2 = engine.Linear(FFN, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def recipe_of(case_id: str):
    return without_stochastic_rounding(case_of(case_id).recipe())


def make_case(variant: str) -> tuple[Block, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = Block()
    gen = torch.Generator().manual_seed(1)
    return model, torch.randn(*SHAPES[variant], D, generator=gen), torch.randn(*SHAPES[variant], D, generator=gen)


def run_steps(model: Block, x: torch.Tensor, dy: torch.Tensor, recipe) -> dict[str, torch.Tensor]:
    """STEPS forward/backward steps (gradients zeroed between): the last one's output, input gradient, fc1 output."""
    seen = {}
    model.fc1.register_forward_hook(lambda m, i, out: seen.__setitem__("fc1_out", out.detach().clone()))
    for _ in range(STEPS):
        model.zero_grad(set_to_none=True)
        xg = x.detach().clone().requires_grad_(True)
        with engine.fp8_autocast(recipe=recipe):
            y = model(xg)
        y.backward(dy)
    return {"y": y.detach().clone(), "dx": xg.grad.clone(), **seen}


def _worker(rank: int, out_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (WORLD,))
    result = {}
    for case_id in case_ids():
        for variant in SHAPES:
            model, x, dy = make_case(variant)
            sp = variant == "sp"
            plan = ({"fc1": engine.distributed.ColwiseParallel(input_layouts=Shard(1)),
                     "fc2": engine.distributed.RowwiseParallel(output_layouts=Shard(1))} if sp else
                    {"fc1": engine.distributed.ColwiseParallel(), "fc2": engine.distributed.RowwiseParallel()})
            parallelize_module(model, mesh, plan)
            if sp:  # this rank's sequence shard of the input and of the output gradient
                x, dy = (t.chunk(WORLD, dim=1)[rank].contiguous() for t in (x, dy))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = run_steps(model, x, dy, recipe_of(case_id))
            out.update({n: p.grad.full_tensor() for n, p in model.named_parameters()})
            out["warnings"] = [str(w.message) for w in caught]
            result[case_id, variant] = out
    return result


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return spawn(_worker, tmp_path_factory.mktemp("tp_conformance"))


@pytest.mark.parametrize("variant", list(SHAPES))
@pytest.mark.parametrize("case_id", case_ids())
def test_a_parallel_step_equals_one_process(ranks: list[dict], case_id: str, variant: str) -> None:
    model, x, dy = make_case(variant)
    want = run_steps(model, x, dy, recipe_of(case_id))
    want.update({n: p.grad for n, p in model.named_parameters()})
    got = [r[case_id, variant] for r in ranks]
    seq = 1 if variant == "sp" else None
    full = {"fc1_out": torch.cat([g["fc1_out"] for g in got], dim=-1),
            **{k: torch.cat([g[k] for g in got], dim=seq) if seq else got[0][k] for k in ("y", "dx")},
            **{k: got[0][k] for k in want if "." in k}}
    for other in got[1:]:  # every rank holds the same (full) gradients
        for key in EXACT[1:] + BOUNDED[2:]:
            assert torch.equal(other[key], got[0][key]), key
    for key in EXACT:
        assert torch.equal(full[key], want[key]), f"{key}: max diff {(full[key] - want[key]).abs().max()}"
    for key in BOUNDED:
        diff = (full[key] - want[key]).abs().max().item()
        assert diff <= 64 * torch.finfo(torch.float32).eps * want[key].abs().max().item(), (key, diff)
    assert not [w for w in got[0]["warnings"] if "QuantizedFallbackWarning" in w], got[0]["warnings"]
