"""Run test code in a subprocess that behaves like a CPU with AVX2 and FMA only (an AMD Zen 3: no AVX-512,
no VNNI, no bf16 instructions), whatever CPU runs the tests.

Three knobs: `ONEDNN_MAX_CPU_ISA=AVX2` (oneDNN, and torch's choice of oneDNN for bf16 matmuls, then use no
VNNI / AVX-512 / bf16 instructions), `ATEN_CPU_CAPABILITY=avx2` (torch's own vectorized kernels) and
`ENGINE_ISA=avx2` (engine's C++ kernels, engine/ops/native.py). The emulation is exact for what these
tests look at: which GEMMs give exact integer sums, which bf16 GEMM runs, which kernel set engine picks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "ENGINE_ISA": "avx2"}


def emulated() -> bool:
    """Whether this process already runs under the emulation (all three knobs set)."""
    return all(os.environ.get(k, "").lower() == v.lower() for k, v in ENV.items())


def run(code: str, timeout: float = 300.0) -> object:
    """Run `code` (Python, with this repository and tests/ importable) under the emulation; it prints one
    line of JSON last, which is returned. A failure raises with the subprocess's stderr."""
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"the emulated run failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split())
