"""The Triton grouped GEMM (engine.ops.triton.grouped_gemm) inside GroupedLinear, against per-expert engine.Linear.

As tests/test_triton.py: the kernel runs under TRITON_INTERPRET=1 in a worker subprocess (this file run as a
script), never in the pytest process. The worker routes GroupedLinear's grouped GEMMs to the kernel (as on CUDA
tensors) and runs, under every recipe class `engine.recipes` exports (conformance DEFAULTS), one training step of a
GroupedLinear and of E engine.Linear modules holding the same weights (the CPU emulation, per expert), for m_splits
with zero-token, one-token and all-on-one experts. The contract is engine.ops.exact_gemm's (exact decode and
products, fp32 sums in an unspecified order):

* integer data in [-8, 8]: every FP8 value and product is exact and every fp32 sum is exact in any order, so
  outputs and gradients must be bitwise equal;
* random data: within 2 gamma_K sum_k |a_k b_k| (with room for the quantization) plus the fp32 output rounding.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
E, K, N = 4, 64, 32
SPLITS = {"zero_and_one": [0, 1, 29, 3], "all_on_one": [0, 0, 33, 0]}
#: the recipes whose every FP8 fprop and dgrad pair the kernel covers (per-tensor FP8, power-of-2 tiles)
KERNEL_RECIPES = {"DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling"}


def _data(kind: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    if kind == "integer":
        return torch.randint(-8, 9, shape, generator=g).float()
    return torch.randn(shape, generator=g)


def _run_case(case, data: str, splits: list[int], dtype: torch.dtype = torch.float32) -> dict:
    import engine
    from test_grouped_linear import share_streams

    g = torch.Generator().manual_seed(0)
    module = engine.GroupedLinear(E, K, N, params_dtype=dtype)
    with torch.no_grad():
        for e in range(E):
            getattr(module, f"weight{e}").copy_(_data(data, (N, K), g))
            getattr(module, f"bias{e}").copy_(_data(data, (N,), g))
    refs = []
    for e in range(E):
        ref = engine.Linear(K, N, params_dtype=dtype)
        with torch.no_grad():
            ref.weight.copy_(getattr(module, f"weight{e}"))
            ref.bias.copy_(getattr(module, f"bias{e}"))
        refs.append(ref)
    recipe = case.recipe()
    share_streams(module, refs, recipe)  # stochastic rounding: reference e gets expert e's counters
    x, dy = _data(data, (sum(splits), K), g).to(dtype), _data(data, (sum(splits), N), g).to(dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with engine.fp8_autocast(recipe=recipe):
        y = module(xa, splits)
    y.backward(dy)
    with engine.fp8_autocast(recipe=recipe):
        y_ref = torch.cat([r(xe) for r, xe in zip(refs, torch.split(xb, splits))])
    y_ref.backward(dy)
    weights = torch.stack([getattr(module, f"weight{e}").detach() for e in range(E)])
    return {"x": x, "dy": dy, "w": weights, "y": y.detach(), "y_ref": y_ref.detach(), "dx": xa.grad,
            "dx_ref": xb.grad, "dw": torch.stack([getattr(module, f"weight{e}").grad for e in range(E)]),
            "dw_ref": torch.stack([r.weight.grad for r in refs])}


def worker(path: str) -> None:
    """Every case under the interpreter, the grouped GEMMs routed to the kernel; results to `path`."""
    sys.path.insert(0, str(REPO / "tests"))
    from conformance.recipes import DEFAULTS

    import engine.modules.grouped_function as grouped_function
    import engine.ops.triton.grouped_gemm as kernel_module

    launches = [0]
    kernel = kernel_module.grouped_gemm

    def counting(*args, **kwargs):
        launches[0] += 1
        return kernel(*args, **kwargs)

    kernel_module.grouped_gemm = counting
    grouped_function.uses_triton = lambda device: True  # as on CUDA tensors
    results = {}
    for case in DEFAULTS:
        for data in ("integer", "random"):
            for name, splits in SPLITS.items():
                launches[0] = 0
                out = _run_case(case, data, splits)
                out["launches"] = launches[0]
                results[(case.id, data, name)] = out
        if case.id in KERNEL_RECIPES:  # bf16 activations and outputs: the kernel's fp32 result rounded once
            launches[0] = 0
            out = _run_case(case, "integer", SPLITS["zero_and_one"], torch.bfloat16)
            out["launches"] = launches[0]
            results[(case.id, "integer-bf16", "zero_and_one")] = out
    torch.save(results, path)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("grouped_triton") / "results.pt"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("ENGINE_BACKEND", None)
    proc = subprocess.run([sys.executable, __file__, "--worker", str(path)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"worker failed:\n{proc.stderr[-5000:]}"
    return torch.load(path, weights_only=False)


def _cases():
    sys.path.insert(0, str(REPO / "tests"))
    from conformance.recipes import DEFAULTS

    return [c.id for c in DEFAULTS]


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("case_id", _cases())
def test_integer_data_bitwise(results, case_id, split):
    out = results[(case_id, "integer", split)]
    if case_id in KERNEL_RECIPES:
        assert out["launches"] == 2, "fprop and dgrad each one grouped launch"
    for got, want in (("y", "y_ref"), ("dx", "dx_ref"), ("dw", "dw_ref")):
        assert torch.equal(out[got].view(torch.int32), out[want].view(torch.int32)), got


@pytest.mark.parametrize("case_id", sorted(KERNEL_RECIPES))
def test_bf16_integer_data_bitwise(results, case_id):
    out = results[(case_id, "integer-bf16", "zero_and_one")]
    assert out["launches"] == 2 and out["y"].dtype == torch.bfloat16
    for got, want in (("y", "y_ref"), ("dx", "dx_ref"), ("dw", "dw_ref")):
        assert torch.equal(out[got].view(torch.int16), out[want].view(torch.int16)), got


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("case_id", _cases())
def test_random_data_within_the_exact_gemm_bound(results, case_id, split):
    out = results[(case_id, "random", split)]
    splits = SPLITS[split]
    eps = 2.0**-24
    # |values| grow by at most one FP8 rounding (2^-2 relative for E5M2, generous for every format) per operand
    room = 1.25**2
    for got, want, lhs, rhs, k in (("y", "y_ref", out["x"], out["w"].transpose(1, 2), K),
                                   ("dx", "dx_ref", out["dy"], out["w"], N)):
        gamma = k * eps / (1 - k * eps)
        sums = torch.cat([lhs_e.abs() @ rhs[e].abs() for e, lhs_e in enumerate(torch.split(lhs, splits))])
        bound = 2 * gamma * sums * room + 4 * eps * out[want].abs() + 1e-30
        diff = (out[got] - out[want]).abs()
        assert torch.all(diff <= bound), f"{got}: max excess {(diff - bound).max().item()}"
    assert torch.equal(out["dw"], out["dw_ref"])  # wgrad stays per expert: the same GEMMs
    if case_id in KERNEL_RECIPES:
        assert out["launches"] == 2


def compile_for_gpus(path: str) -> None:
    """The kernel compiled for sm_80 and sm_90 (no GPU needed) in each configuration the launcher uses; a report of
    each: cubin size, FP8 conversion instructions, fp32 ops (to `path`, JSON)."""
    import json
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.ops.triton import grouped_gemm as module

    fn = module._grouped_gemm_kernel
    pointers = ("a_ptr", "b_ptr", "tile_group_ptr", "tile_row_ptr", "group_end_ptr")
    report = []
    for tiled, e8m0, fmt_b in ((False, False, (2, 5, 15, True)), (True, True, (3, 4, 7, False)),
                               (True, False, (3, 4, 7, False))):
        consts = dict(zip(("A_MAN", "A_EXP", "A_BIAS", "A_IEEE"), (3, 4, 7, False)),
                      **dict(zip(("B_MAN", "B_EXP", "B_BIAS", "B_IEEE"), fmt_b)), TILED=tiled, E8M0=e8m0,
                      A_TILE_ROWS=1, B_TILE_ROWS=128 if tiled and not e8m0 else 1, TILE_COLS=32 if e8m0 else 128,
                      HAS_BIAS=True, BLOCK_M=module.BLOCK_M, BLOCK_N=module.BLOCK_N, BLOCK_K=module.BLOCK_K)
        types = {name: ("*u8" if name in pointers[:2] else "*i32") if name in pointers else
                 ("*u8" if name in ("a_scale_ptr", "b_scale_ptr") and e8m0 else "*fp32") if name.endswith("_ptr")
                 else "i32" for name in fn.arg_names}
        sig = {name: "constexpr" if name in consts else types[name] for name in fn.arg_names}
        for arch in (80, 90):
            entry = {"arch": arch, "tiled": tiled, "e8m0": e8m0}
            try:
                k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", arch, 32),
                                   options={"num_warps": module.NUM_WARPS, **module.LAUNCH_OPTIONS})
                ptx = k.asm["ptx"]
                entry.update(cubin_bytes=len(k.asm["cubin"]),
                             fp8_cvt=sorted(set(re.findall(r"\bcvt\.[a-z0-9.]*e[45]m[23][a-z0-9.]*", ptx))),
                             ftz=sorted(set(re.findall(r"\b[a-z]+\.[a-z.]*ftz[a-z.]*f32\b", ptx))))
            except Exception as exc:  # reported; the test fails on it
                entry["error"] = f"{type(exc).__name__}: {exc}"[:3000]
            report.append(entry)
    with open(path, "w") as f:
        json.dump(report, f)


def test_the_kernel_compiles_for_gpus(tmp_path):
    """sm_80 and sm_90 cubins for per-tensor, E8M0-tile and fp32-tile operands: no FP8 conversion instruction (codes
    are decoded by integer ops), no flush-to-zero."""
    import json

    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, __file__, "--compile", str(tmp_path / "report.json")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report) == 6
    for entry in report:
        assert "error" not in entry, entry
        assert entry["cubin_bytes"] > 0 and entry["fp8_cvt"] == [] and entry["ftz"] == [], entry


def test_grouped_gemms_go_to_triton_on_cuda(monkeypatch):
    from engine.gemm import grouped
    from engine.gemm.grouped import uses_triton

    monkeypatch.delenv("ENGINE_BACKEND", raising=False)
    assert uses_triton(torch.device("cuda")) and not uses_triton(torch.device("cpu"))
    monkeypatch.setenv("ENGINE_BACKEND", "triton")
    assert uses_triton(torch.device("cpu"))
    monkeypatch.setenv("ENGINE_BACKEND", "native")
    assert not uses_triton(torch.device("cuda"))
    monkeypatch.delenv("ENGINE_BACKEND")
    monkeypatch.setattr(grouped, "triton_installed", lambda: False)  # no Triton: the per-expert GEMMs
    assert not uses_triton(torch.device("cuda"))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    if len(sys.argv) == 3 and sys.argv[1] == "--compile":
        compile_for_gpus(sys.argv[2])
