"""One Linear forward+backward step per recipe vs torch.nn.Linear in bf16, measured in the same run.

    python benchmarks/bench_linear.py [--shapes 4096x4096x4096,16x256x256] [--torchao] [--cpu-time]

`--cpu-time`: one thread, thread CPU time of the least disturbed of many interleaved blocks
(see `common.least_disturbed_cpu_seconds`): steady numbers for small shapes on a shared machine.
"""

from __future__ import annotations

import argparse
import sys
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


def torchao_time(m: int, k: int, n: int, x: torch.Tensor, grad: torch.Tensor, min_time: float) -> float | None:
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        return None
    model = torch.nn.Sequential(torch.nn.Linear(k, n, dtype=torch.bfloat16))
    convert_to_float8_training(model)
    return step_time(model, x, grad, min_time=min_time)


def main(argv: list[str] | None = None, prog: str | None = None) -> list[list[str]]:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4096x4096x4096,16x256x256", help="MxKxN list, comma separated")
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
        torch.manual_seed(0)
        x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(m, n, dtype=torch.bfloat16)
        base_module = torch.nn.Linear(k, n, dtype=torch.bfloat16)
        base = step_time(base_module, x, grad, min_time=min_time)
        rows.append([shape, "torch.nn.Linear bf16 (baseline)", f"{base * 1e3:.3f}", "1.00"])
        module = engine.Linear(k, n, params_dtype=torch.bfloat16)
        for name in args.recipes.split(","):
            t = step_time(module, x, grad, RECIPES[name], min_time=min_time)
            rows.append([shape, f"engine.Linear {name}", f"{t * 1e3:.3f}", f"{t / base:.2f}"])
        if args.torchao:
            t = torchao_time(m, k, n, x, grad, min_time)
            if t is not None:
                rows.append([shape, "torchao Float8Linear", f"{t * 1e3:.3f}", f"{t / base:.2f}"])
    print(f"Linear fwd+bwd step, bf16 activations and weights, medians ({torch.get_num_threads()} threads)\n"
          f"{machine_line()}")
    print_table(["MxKxN", "module", "ms/step", "time vs bf16"], rows)
    return rows


def cpu_time_rows(args: argparse.Namespace) -> list[list[str]]:
    """The --cpu-time table, on one thread (this process's thread setting given back after)."""
    with torch_threads(1):
        return _cpu_time_rows(args)


def _cpu_time_rows(args: argparse.Namespace) -> list[list[str]]:
    rows = []
    for shape in args.shapes.split(","):
        m, k, n = parse_shape(shape)
        torch.manual_seed(0)
        x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(m, n, dtype=torch.bfloat16)
        module = engine.Linear(k, n, params_dtype=torch.bfloat16)
        fns = {"base": step_fn(torch.nn.Linear(k, n, dtype=torch.bfloat16), x, grad)}
        fns.update({name: step_fn(module, x, grad, RECIPES[name]) for name in args.recipes.split(",")})
        small = m * k * n < 2**24
        best = least_disturbed_cpu_seconds(fns, blocks=40 if small else 5, calls=50 if small else 1,
                                           warmup=50 if small else 1)
        rows.append([shape, "torch.nn.Linear bf16 (baseline)", f"{best['base'] * 1e3:.3f}", "1.00"])
        rows += [[shape, f"engine.Linear {name}", f"{t * 1e3:.3f}", f"{t / best['base']:.2f}"]
                 for name, t in best.items() if name != "base"]
    print("Linear fwd+bwd step, bf16 activations and weights, thread CPU ms (1 thread, least disturbed block)\n"
          f"{machine_line()}")
    print_table(["MxKxN", "module", "ms/step", "time vs bf16"], rows)
    return rows


if __name__ == "__main__":
    main()
