"""The Triton NVFP4 quantize (`engine.ops.triton.nvfp4`) against `engine.ops.nvfp4`, bit for bit, without a GPU.

The kernels run under `TRITON_INTERPRET=1` in one worker subprocess (the interpreter is chosen at import,
see tests/test_triton.py), through the registry's NVFP4 entry point (`registry.quantize_nvfp4`, which also
advances the stochastic-rounding counter); this process rebuilds the same seeded inputs, runs the
reference entry (`registry.quantize_nvfp4_reference`) and compares every buffer, both amaxes and the
counter by their bits. Cases: rowwise / columnwise / both, 1x16 blocks, 16x16 tiles, the 16-point RHT,
stochastic rounding (offsets whose words (index >> 2) cross 2^32, a negative seed), given amaxes (0, tiny,
inf, NaN), fp32 / bf16 / fp16, partial blocks, N-D and empty inputs, and the edge values (zeros, +-0,
subnormal and zero E4M3 block scales, one outlier per block, +-max, inf, NaN). A few seconds of interpreter time in all.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.ops import registry
from engine.schemes import SCHEMES

REPO = Path(__file__).resolve().parents[1]
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def edges(shape, dtype, *, nan=True) -> torch.Tensor:
    """Random blocks with the edge cases placed in whole 16-blocks and single elements."""
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[-1])
    x = torch.randn(*shape, generator=g) * torch.logspace(-3, 3, shape[-1])
    x[0, :16] = 0.0  # an all-zero block (zero scale)
    x[1, :16] = torch.randn(16, generator=g) * 1e-30  # a block far below the tensor's amax: zero / subnormal s_b
    x[2, :16] = torch.randn(16, generator=g) * 2.0**-12
    x[3, :16] = 1e-3
    x[3, 5] = 900.0  # one outlier per block
    x[4, :8] = torch.tensor([0.5, 1.5, 2.5, 3.5, 5.0, -0.25, -0.75, 6.5]) * 100.0  # E2M1 midpoints after scaling
    x[5, :4] = torch.tensor([-0.0, 0.0, 1e-40, -1e-41])
    big = torch.finfo(dtype).max
    x[6, 16:20] = torch.tensor([big, -big, float("inf"), float("-inf")])
    if nan:
        x[7, 33] = float("nan")
    return x.to(dtype)


def near_subnormal(shape) -> torch.Tensor:
    """fp32 values in [2^-128, 2^-122) with random mantissas (x / 4 rounds: the RHT's products are inexact there)."""
    g = torch.Generator().manual_seed(5)
    mant = torch.randint(0, 1 << 23, shape, generator=g, dtype=torch.int32)
    exp = torch.randint(-1, 5, shape, generator=g, dtype=torch.int32)  # biased exponents 0 (subnormal) .. 4
    sign = torch.randint(0, 2, shape, generator=g, dtype=torch.int32) << 31
    return ((exp.clamp(min=0) << 23) | mant | sign).view(torch.float32)


def rht_order(shape, dtype) -> torch.Tensor:
    """Tokens 2 and 3 of every 16 huge: they cancel in the RHT's first butterfly stage (for even outputs) and
    would swallow token 0 in a plain sum over the tokens, so the bits show the summation order."""
    x = rand(shape, F32)
    x.view(-1, 16, shape[-1])[:, 2:4] = 2.0**40
    return x.to(dtype)


def rand(shape, dtype, scale=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(math.prod(shape) + 7)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def counter(seed: int, offset: int) -> torch.Tensor:
    return torch.tensor([seed, offset], dtype=torch.int64)


# (id, input maker, layout, options); `rng_counter` is made fresh for each side
CASES = [
    ("1d-f32-both", lambda: rand((48, 80), F32), "nvfp4", {}),
    ("1d-bf16-partial", lambda: rand((37, 70), BF16, 1e3), "nvfp4", {}),
    ("1d-f16-3d-rowwise", lambda: rand((2, 24, 40), F16), "nvfp4", dict(columnwise=False)),
    ("1d-f32-edges", lambda: edges((32, 64), F32, nan=False), "nvfp4", {}),
    ("1d-bf16-edges-nan", lambda: edges((32, 70), BF16), "nvfp4", {}),
    ("1d-f16-edges", lambda: edges((20, 48), F16, nan=False), "nvfp4", dict(rowwise=False)),
    ("1d-zeros", lambda: torch.zeros(16, 32), "nvfp4", {}),
    ("1d-tiny", lambda: rand((16, 48), F32, 1e-40), "nvfp4", {}),
    ("1d-huge", lambda: rand((16, 48), F32, 1e37), "nvfp4", {}),
    ("1d-one-row", lambda: rand((1, 70), BF16), "nvfp4", {}),
    ("1d-empty", lambda: torch.zeros(0, 64), "nvfp4", {}),
    ("2d-f32", lambda: rand((48, 80), F32), "nvfp4", dict(two_d=True)),
    ("2d-bf16-partial-edges", lambda: edges((37, 70), BF16, nan=False), "nvfp4", dict(two_d=True)),
    ("2d-columnwise", lambda: rand((33, 40), F16), "nvfp4", dict(two_d=True, rowwise=False)),
    ("rht-f32", lambda: rand((48, 80), F32), "nvfp4_rht", {}),
    ("rht-bf16-columnwise", lambda: rand((32, 70), BF16, 1e-3), "nvfp4_rht", dict(rowwise=False)),
    ("rht-edges", lambda: edges((32, 64), F32, nan=False), "nvfp4_rht", {}),
    ("rht-nan", lambda: edges((16, 40), BF16), "nvfp4_rht", dict(rowwise=False)),
    ("rht-rowwise-odd-m", lambda: rand((20, 48), F32), "nvfp4_rht", dict(columnwise=False)),
    ("rht-near-subnormal", lambda: near_subnormal((32, 48)), "nvfp4_rht", dict(rowwise=False)),
    ("sr-edges-nan", lambda: edges((32, 40), F32), "nvfp4", dict(rng_counter=(3, 5))),
    ("rht-order-bf16", lambda: rht_order((32, 48), BF16), "nvfp4_rht", {}),
    ("sr-f32-both", lambda: rand((48, 80), F32), "nvfp4", dict(rng_counter=(2**40 + 7, 2**34 - 101))),
    ("sr-rht-bf16", lambda: edges((32, 48), BF16, nan=False), "nvfp4_rht", dict(rng_counter=(-5, 123))),
    ("sr-2d-rowwise", lambda: rand((40, 40), F16), "nvfp4", dict(two_d=True, columnwise=False,
                                                                 rng_counter=(9, 2**33))),
    ("sr-columnwise", lambda: rand((24, 72), F32, 10.0), "nvfp4", dict(rowwise=False, rng_counter=(1, 0))),
    ("given-amaxes", lambda: rand((32, 48), F32), "nvfp4", dict(amax=3.5, amax_t=1e-30)),
    ("given-zero-inf", lambda: rand((32, 48), BF16), "nvfp4_rht", dict(amax=0.0, amax_t=float("inf"))),
    ("given-nan", lambda: rand((16, 32), F32), "nvfp4", dict(amax=float("nan"), amax_t=1e30, two_d=True)),
]
BY_ID = {c[0]: c for c in CASES}
ERRORS = [  # (id, input maker, kwargs of engine.ops.triton.quantize_nvfp4, exception, message)
    ("rht-m-not-16", lambda: rand((20, 48), F32), dict(rht=True), ValueError, "multiple of 16"),
    ("rht-and-2d", lambda: rand((16, 48), F32), dict(rht=True, two_d=True), ValueError, "two_d and rht"),
    ("counter-dtype", lambda: rand((16, 48), F32), dict(counter=torch.zeros(2, dtype=torch.int32)), TypeError,
     "counter: expected an int64"),
    ("amax-shape", lambda: rand((16, 48), F32), dict(amax=torch.ones(2)), TypeError, "amax: expected a 1-element"),
    ("int-input", lambda: torch.ones(16, 32, dtype=torch.int32), {}, TypeError, None),
]


def options(opts: dict) -> dict:
    out = dict(rowwise=True, columnwise=True, two_d=False, rng_counter=None, amax_rowwise=None, amax_columnwise=None)
    for key, value in opts.items():
        if key == "rng_counter":
            value = counter(*value)
        elif key in ("amax", "amax_t"):  # the registry's names of the given amaxes
            key, value = {"amax": "amax_rowwise", "amax_t": "amax_columnwise"}[key], torch.tensor([value])
        out[key] = value
    return out


def run(fn, case_id: str):
    """(buffers, counter after) of the registry-style NVFP4 function `fn` on the case."""
    _, make, layout, opts = BY_ID[case_id]
    kw = options(opts)
    out, _ = fn(make(), SCHEMES[f"{layout}_e2m1"], **kw)
    return out, kw["rng_counter"]


# ------------------------------------------------------------------------------------------ worker
def _worker(path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    import functools
    import warnings

    warnings.filterwarnings("ignore", category=RuntimeWarning)
    from engine.ops import triton as triton_ops

    fn = functools.partial(registry.quantize_nvfp4, triton_ops)
    results = {}
    for case_id in BY_ID:
        try:
            results[case_id] = run(fn, case_id)
        except Exception as exc:
            results[case_id] = f"{type(exc).__name__}: {exc}"
    for case_id, make, kw, _, _ in ERRORS:
        try:
            triton_ops.quantize_nvfp4(make(), **kw)
            results[case_id] = None
        except Exception as exc:
            results[case_id] = (type(exc).__name__, str(exc))
    torch.save(results, path)


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory):
    path = tmp_path_factory.mktemp("triton_nvfp4") / "out.pt"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, __file__, "--worker", str(path)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return torch.load(path, weights_only=False)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


FIELDS = (*registry.BUFFER_FIELDS, "amax_rowwise", "amax_columnwise")


@pytest.mark.parametrize("case_id", list(BY_ID))
def test_triton_nvfp4_is_bitwise_the_reference(case_id, triton_results):
    got = triton_results[case_id]
    assert not isinstance(got, str), got
    (got_out, got_counter), (want_out, want_counter) = got, run(registry.quantize_nvfp4_reference, case_id)
    for field in FIELDS:
        a, b = got_out[field], want_out[field]
        assert (a is None) == (b is None), field
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, (field, a.dtype, b.dtype, a.shape, b.shape)
            assert torch.equal(bits(a), bits(b)), f"{field}: {(bits(a) != bits(b)).sum().item()} differ"
    if want_counter is not None:
        assert torch.equal(got_counter, want_counter)


@pytest.mark.parametrize("case_id, make, kw, exc, message", ERRORS, ids=[e[0] for e in ERRORS])
def test_triton_nvfp4_rejects_what_the_reference_rejects(case_id, make, kw, exc, message, triton_results):
    got = triton_results[case_id]
    assert got is not None and got[0] == exc.__name__, got
    if message:
        assert message in got[1]


def test_the_cases_reach_every_option():
    used = [BY_ID[c][3] for c in BY_ID]
    layouts = {BY_ID[c][2] for c in BY_ID}
    assert layouts == {"nvfp4", "nvfp4_rht"}
    for key in ("two_d", "rng_counter", "amax", "amax_t", "rowwise", "columnwise"):
        assert any(key in u for u in used), key
    assert {BY_ID[c][1]().dtype for c in BY_ID} == {F32, BF16, F16}


def test_the_cuda_registry_entries_are_the_triton_kernel():
    for layout in ("nvfp4", "nvfp4_rht"):
        entry = registry.KERNELS[("quantize", layout, "cuda")]
        assert entry.backend == "triton" and entry.fn is registry.quantize_nvfp4


if __name__ == "__main__" and len(sys.argv) >= 3 and sys.argv[1] == "--worker":
    _worker(sys.argv[2])
