"""A mixture of experts' grouped linear (fwd+bwd): engine.GroupedLinear vs a Python loop of engine.Linear vs torch.

    python -m engine bench moe [--shapes 8x2048x2x512x1024] [--recipes delayed,current,block,mxfp8]

A shape is experts x tokens x top-k x in x out: tokens*top-k rows, routed to the experts by a seeded random draw
(uneven groups, as a router gives). Per shape, in the same run: torch in fp32 and in bf16, as a loop of
torch.nn.functional.linear over the experts and as one torch._grouped_mm call; then, in the faster torch dtype
(bf16 where torch's bf16 GEMM is native), each recipe as a Python loop of per-expert engine.Linear modules and as
one engine.GroupedLinear. Each time is the median of repeated steps; the last column divides by the faster torch
baseline. By default each step is timed as this thread's CPU time on one torch thread, the variants of a shape
interleaved round by round (a shared machine's load then moves no ratio); `--wall` times wall clock on torch's
threads instead.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_line, median_seconds, print_table, torch_threads  # noqa: E402

import engine  # noqa: E402
from engine.recipes import (  # noqa: E402
    DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Float8RowwiseScaling, MXFP8BlockScaling,
    NVFP4BlockScaling,
)

RECIPES = {"delayed": DelayedScaling(), "current": Float8CurrentScaling(), "block": Float8BlockScaling(),
           "mxfp8": MXFP8BlockScaling(), "nvfp4": NVFP4BlockScaling(),
           "block-f32": Float8BlockScaling(use_f32_scales=True),  # fp32 tile scales
           "rowwise": Float8RowwiseScaling(), "rowwise-f32": Float8RowwiseScaling(use_power_2_scales=False)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    parts = [int(v) for v in text.lower().split("x")]
    if len(parts) != 5 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"expected experts x tokens x top-k x in x out, e.g. 8x2048x2x512x1024; "
                                         f"got {text!r}")
    return parts[0], parts[1], parts[2], parts[3], parts[4]


def routed_splits(experts: int, rows: int, seed: int = 0) -> list[int]:
    """Rows per expert from a seeded random routing (softmax-like skew: some experts get more)."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(experts, generator=g) + 0.5
    choice = torch.multinomial(weights, rows, replacement=True, generator=g)
    return torch.bincount(choice, minlength=experts).tolist()


def step(forward, x: torch.Tensor, grad: torch.Tensor, params: list[torch.Tensor], recipe=None):
    def run():
        with engine.fp8_autocast(enabled=recipe is not None, recipe=recipe):
            out = forward(x)
        out.backward(grad)
        x.grad = None
        for p in params:
            p.grad = None

    return run


def torch_steps(splits: list[int], k: int, n: int, dtype: torch.dtype) -> dict[str, object]:
    torch.manual_seed(0)
    rows, experts = sum(splits), len(splits)
    x = torch.randn(rows, k, dtype=dtype, requires_grad=True)
    grad = torch.randn(rows, n, dtype=dtype)
    w = torch.nn.Parameter(torch.randn(experts, n, k, dtype=dtype) / k**0.5)
    offs = torch.tensor(splits).cumsum(0).to(torch.int32)

    def loop(t):
        return torch.cat([torch.nn.functional.linear(xe, we) for we, xe in zip(w.unbind(0), torch.split(t, splits))])

    def grouped(t):
        return torch._grouped_mm(t, w.transpose(1, 2), offs=offs)

    return {"loop": step(loop, x, grad, [w]), "grouped_mm": step(grouped, x, grad, [w])}


def engine_steps(splits: list[int], k: int, n: int, dtype: torch.dtype, recipe) -> dict[str, object]:
    torch.manual_seed(0)
    rows, experts = sum(splits), len(splits)
    x = torch.randn(rows, k, dtype=dtype, requires_grad=True)
    grad = torch.randn(rows, n, dtype=dtype)
    grouped = engine.GroupedLinear(experts, k, n, bias=False, params_dtype=dtype)
    linears = [engine.Linear(k, n, bias=False, params_dtype=dtype) for _ in range(experts)]

    def loop(t):
        return torch.cat([lin(xe) for lin, xe in zip(linears, torch.split(t, splits))])

    return {"loop of engine.Linear": step(loop, x, grad, [p for m in linears for p in m.parameters()], recipe),
            "engine.GroupedLinear": step(lambda t: grouped(t, splits), x, grad, list(grouped.parameters()), recipe)}


def cpu_medians(fns: dict[str, object], repeat: int) -> dict[str, float]:
    """Median thread CPU seconds per call of each fn, over `repeat` rounds that run every fn once (after a warmup)."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.thread_time()
            fn()
            samples[name].append(time.thread_time() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def main(argv: list[str] | None = None, prog: str | None = None) -> list[list[str]]:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8x2048x2x512x1024,32x512x2x256x256",
                        help="experts x tokens x top-k x in x out, comma separated")
    parser.add_argument("--recipes", default="delayed,current,block,mxfp8",
                        help=f"comma separated, of {','.join(RECIPES)}")
    parser.add_argument("--repeat", type=int, default=3, help="timed steps per variant (the median is shown)")
    parser.add_argument("--wall", action="store_true", help="wall-clock medians on torch's threads, not 1-thread CPU time")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat: expected a whole number >= 1, got {args.repeat}")
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        parser.error(f"--recipes: unknown {unknown[0]!r}; expected some of {','.join(RECIPES)}")
    with torch_threads(None if args.wall else 1):
        rows = _rows(shapes, recipes, args)
    how = f"wall-clock medians of {args.repeat} on {torch.get_num_threads()} threads" if args.wall else \
        f"1-thread CPU time, medians of {args.repeat} interleaved rounds"
    print(f"MoE grouped linear fwd+bwd ({how}); engine in the faster torch dtype\n{machine_line()}")
    print_table(["E x tokens x top-k x in x out", "variant", "ms/step", "time vs baseline"], rows)
    return rows


def _rows(shapes: list[tuple[int, ...]], recipes: list[str], args: argparse.Namespace) -> list[list[str]]:
    def measure(fns: dict[str, object]) -> dict[str, float]:
        if args.wall:
            return {name: median_seconds(fn, repeat=args.repeat, warmup=1) for name, fn in fns.items()}
        return cpu_medians(fns, args.repeat)

    rows = []
    for experts, tokens, top_k, k, n in shapes:
        splits = routed_splits(experts, tokens * top_k)
        shape = f"{experts}x{tokens}x{top_k}x{k}x{n}"
        base = measure({f"torch {vname} {dname}": fn for dname, dtype in DTYPES.items()
                        for vname, fn in torch_steps(splits, k, n, dtype).items()})
        fastest = min(base, key=base.get)
        dtype = DTYPES[fastest.rsplit(" ", 1)[1]]
        times = dict(base)
        times.update(measure({f"{vname} {rname}": fn for rname in recipes
                              for vname, fn in engine_steps(splits, k, n, dtype, RECIPES[rname]).items()}))
        for name, t in times.items():
            rows.append([shape, name + (" (baseline)" if name == fastest else ""), f"{t * 1e3:.2f}",
                         f"{t / base[fastest]:.2f}"])
    return rows


if __name__ == "__main__":
    main()
