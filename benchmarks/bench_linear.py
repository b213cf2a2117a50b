"""One Linear forward+backward step per recipe vs torch.nn.Linear in fp32 and in bf16, measured in the same run.

    python benchmarks/bench_linear.py [--shapes 2048x2048x2048,16x256x256] [--torchao] [--cpu-time]

The baseline of each shape is the faster of torch.nn.Linear in fp32 and in bf16 (bf16 where torch's bf16 GEMM
runs on bf16 instructions, fp32 on a CPU without them, where torch converts bf16 to fp32 inside, several times
slower); engine.Linear then runs in that dtype (parameters, activations and gradients), as a user of that
machine would. The header names the instruction set of engine's kernels and whether torch's bf16 GEMM is native.

`--cpu-time`: one thread, thread CPU time of the least disturbed of many interleaved blocks
(see `common.least_disturbed_cpu_seconds`): steady numbers for small shapes on a shared machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import least_disturbed_cpu_seconds, machine_line, median_seconds, print_table, torch_threads  # noqa: E402

import engine  # noqa: E402
from engine.recipes import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling  # noqa: E402

RECIPES = {"delayed": DelayedScaling(), "current": Float8CurrentScaling(), "block": Float8BlockScaling(),
           "mxfp8": MXFP8BlockScaling()}


def parse_shape(text: str) -> tuple[int, int, int]:
    m, k, n = (int(v) for v in text.lower().split("x"))
    return m, k, n


def step_fn(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, recipe=None):
    """One fwd+bwd step as users write it (fp8_autocast around the forward, backward after it)."""
    def step():
        if recipe is None:
            out = module(x)
        else:
            with engine.fp8_autocast(recipe=recipe):
                out = module(x)
        out.backward(grad)
        x.grad = None
        for p in module.parameters():
            p.grad = None

    return step


def step_time(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, recipe=None, *, min_time: float) -> float:
    return median_seconds(step_fn(module, x, grad, recipe), repeat=5, min_time=min_time)


def torchao_time(m: int, k: int, n: int, x: torch.Tensor, grad: torch.Tensor, min_time: float,
                 dtype: torch.dtype = torch.bfloat16) -> float | None:
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        return None
    model = torch.nn.Sequential(torch.nn.Linear(k, n, dtype=dtype))
    convert_to_float8_training(model)
    return step_time(model, x, grad, min_time=min_time)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def baseline_time(m: int, k: int, n: int, dtype: torch.dtype, min_time: float) -> float:
    """torch.nn.Linear's step in `dtype`; a step over a second is timed 3 times, not 5 (bf16 without bf16
    instructions)."""
    torch.manual_seed(0)
    x = torch.randn(m, k, dtype=dtype, requires_grad=True)
    grad = torch.randn(m, n, dtype=dtype)
    step = step_fn(torch.nn.Linear(k, n, dtype=dtype), x, grad)
    began = time.perf_counter()
    step()
    slow = time.perf_counter() - began > 1.0
    return median_seconds(step, repeat=3 if slow else 5, warmup=0 if slow else 2, min_time=min_time)


def header() -> str:
    """The machine's facts the table depends on: engine's instruction set, torch's, its bf16 GEMM, threads."""
    from engine.ops import native
    from engine.ops.exact_gemm import native_bf16_gemm

    isa = native.isa() if native.available() else "none (the C++ kernels did not build)"
    return (f"engine kernels {isa}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}, "
            f"native bf16 GEMM {'yes' if native_bf16_gemm() else 'no'}, {torch.get_num_threads()} threads")


def main(argv: list[str] | None = None, prog: str | None = None) -> list[list[str]]:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="2048x2048x2048,16x256x256", help="MxKxN list, comma separated")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--torchao", action="store_true", help="add torchao's Float8Linear when it is installed")
    parser.add_argument("--cpu-time", action="store_true", help="1 thread, least disturbed interleaved thread CPU time")
    args = parser.parse_args(argv)
    if args.cpu_time:
        return cpu_time_rows(args)
    rows = []
    for shape in args.shapes.split(","):
        m, k, n = parse_shape(shape)
        small = m * k * n < 2**24
        min_time = 0.05 if small else 0.0
        base = {name: baseline_time(m, k, n, dtype, min_time) for name, dtype in DTYPES.items()}
        fast = min(base, key=base.get)
        for name, t in base.items():
            role = "baseline: the faster" if name == fast else "the slower"
            rows.append([shape, f"torch.nn.Linear {name} ({role})", f"{t * 1e3:.3f}", f"{t / base[fast]:.2f}"])
        dtype = DTYPES[fast]
        torch.manual_seed(0)
        x = torch.randn(m, k, dtype=dtype, requires_grad=True)
        grad = torch.randn(m, n, dtype=dtype)
        module = engine.Linear(k, n, params_dtype=dtype)
        for name in args.recipes.split(","):
            t = step_time(module, x, grad, RECIPES[name], min_time=min_time)
            rows.append([shape, f"engine.Linear {name} ({fast})", f"{t * 1e3:.3f}", f"{t / base[fast]:.2f}"])
        if args.torchao:
            t = torchao_time(m, k, n, x, grad, min_time, dtype)
            if t is not None:
                rows.append([shape, f"torchao Float8Linear ({fast})", f"{t * 1e3:.3f}", f"{t / base[fast]:.2f}"])
    print(f"Linear fwd+bwd step, medians; engine.Linear in the faster baseline's dtype ({header()})\n{machine_line()}")
    print_table(["MxKxN", "module", "ms/step", "time vs the faster baseline"], rows)
    return rows


def cpu_time_rows(args: argparse.Namespace) -> list[list[str]]:
    """The --cpu-time table, on one thread (this process's thread setting given back after)."""
    with torch_threads(1):
        return _cpu_time_rows(args)


def _cpu_time_rows(args: argparse.Namespace) -> list[list[str]]:
    from engine.ops.exact_gemm import native_bf16_gemm

    fast = "bf16" if native_bf16_gemm() else "fp32"  # the dtype engine.Linear runs in (main() measures which)
    rows = []
    for shape in args.shapes.split(","):
        m, k, n = parse_shape(shape)
        torch.manual_seed(0)
        fns = {}
        for name, dtype in DTYPES.items():
            x = torch.randn(m, k, dtype=dtype, requires_grad=True)
            grad = torch.randn(m, n, dtype=dtype)
            fns[f"base {name}"] = step_fn(torch.nn.Linear(k, n, dtype=dtype), x, grad)
            if name == fast:
                module = engine.Linear(k, n, params_dtype=dtype)
                fns.update({r: step_fn(module, x, grad, RECIPES[r]) for r in args.recipes.split(",")})
        small = m * k * n < 2**24
        best = least_disturbed_cpu_seconds(fns, blocks=40 if small else 5, calls=50 if small else 1,
                                           warmup=50 if small else 1)
        base = min(best["base fp32"], best["base bf16"])
        for name in DTYPES:
            role = "baseline: the faster" if best[f"base {name}"] == base else "the slower"
            rows.append([shape, f"torch.nn.Linear {name} ({role})", f"{best[f'base {name}'] * 1e3:.3f}",
                         f"{best[f'base {name}'] / base:.2f}"])
        rows += [[shape, f"engine.Linear {name} ({fast})", f"{t * 1e3:.3f}", f"{t / base:.2f}"]
                 for name, t in best.items() if not name.startswith("base")]
    print(f"Linear fwd+bwd step, thread CPU ms (1 thread, least disturbed block; {header()})\n{machine_line()}")
    print_table(["MxKxN", "module", "ms/step", "time vs the faster baseline"], rows)
    return rows


if __name__ == "__main__":
    main()
