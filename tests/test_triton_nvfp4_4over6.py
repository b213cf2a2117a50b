"""The Triton NVFP4 kernel with 4over6 (`engine.ops.triton.quantize_nvfp4(four_over_six=True, ...)`) against the
reference, bit for bit (codes, E4M3 scales, amaxes; NaN bits included), without a GPU.

The kernel runs under `TRITON_INTERPRET=1` in one worker subprocess (the interpreter is chosen at import, see
tests/test_triton.py); this process rebuilds the same inputs, runs `engine.ops.nvfp4.quantize` and compares. Inputs:
TE's fixture (its near ties, which pin the order of the fp32 operations, and one case of each other input) and
the edge cases of tests/nvfp4_4over6_cases.py (fp32 and bf16), each under an option, the options in turn; and
the refusals. tests/test_triton.py compiles the kernel for sm_80 / sm_90 (no FMA, IEEE divisions only).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.ops import nvfp4  # noqa: E402
from tests.nvfp4_4over6_cases import OPTIONS, edge_inputs, fixture_cases, mismatches, quantize_kwargs  # noqa: E402

EDGE_DTYPES = (torch.float32, torch.bfloat16)


def runs() -> dict[str, tuple[torch.Tensor, dict]]:
    """id -> (input, quantize kwargs): the fixture's order cases and one case of each of its other inputs (the
    interpreter is slow; the C++ test takes them all), and each edge input under an option (in turn)."""
    out, seen = {}, set()
    for name, x, kw in fixture_cases():
        if name.startswith("order-") or id(x) not in seen:
            out[f"te {name}"] = (x, kw)
        seen.add(id(x))
    for dtype in EDGE_DTYPES:
        for i, (name, x) in enumerate(edge_inputs(dtype).items()):
            option = OPTIONS[(i + 3 * (dtype == torch.bfloat16)) % len(OPTIONS)]
            out[f"{dtype} {name} {option}"] = (x, quantize_kwargs(option))
    return out


REFUSALS = [  # (id, kwargs, exception, message)
    ("rht", dict(rht=True), ValueError, "four_over_six and rht"),
    ("counter", dict(counter=torch.tensor([1, 0])), ValueError, "four_over_six and stochastic rounding"),
    ("err-mode", dict(four_over_six_err_mode="MAX"), ValueError, "four_over_six_err_mode"),
    ("e4m3-max", dict(four_over_six_e4m3_max=100), ValueError, "four_over_six_e4m3_max"),
]


def _worker(path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore", category=RuntimeWarning)
    from engine.ops import triton as triton_ops

    results = {}
    for run_id, (x, kw) in runs().items():
        try:
            results[run_id] = triton_ops.quantize_nvfp4(x, **kw)
        except Exception as exc:
            results[run_id] = f"{type(exc).__name__}: {exc}"
    for run_id, kw, _, _ in REFUSALS:
        try:
            triton_ops.quantize_nvfp4(torch.randn(16, 32), four_over_six=True, **kw)
            results[run_id] = None
        except Exception as exc:
            results[run_id] = (type(exc).__name__, str(exc))
    torch.save(results, path)


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory):
    path = tmp_path_factory.mktemp("triton_nvfp4_4over6") / "out.pt"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, __file__, "--worker", str(path)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return torch.load(path, weights_only=False)


def test_triton_4over6_is_bitwise_the_reference(triton_results):
    bad = []
    for run_id, (x, kw) in runs().items():
        got = triton_results[run_id]
        if isinstance(got, str):
            bad.append(f"{run_id}: {got}")
            continue
        bad += [f"{run_id}: {b}" for b in mismatches(got, nvfp4.quantize(x, **kw))]
    assert not bad, bad[:10]


@pytest.mark.parametrize("run_id, kw, exc, message", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_triton_4over6_refuses_what_the_reference_refuses(run_id, kw, exc, message, triton_results):
    got = triton_results[run_id]
    assert got is not None and got[0] == exc.__name__ and message in got[1], got
    with pytest.raises(exc, match=message):
        nvfp4.quantize(torch.randn(16, 32), four_over_six=True,
                       **{("rbits" if k == "counter" else k): (torch.zeros(16, 32, dtype=torch.uint8)
                                                                if k == "counter" else v) for k, v in kw.items()})


if __name__ == "__main__" and len(sys.argv) >= 3 and sys.argv[1] == "--worker":
    _worker(sys.argv[2])
