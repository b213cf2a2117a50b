"""Training step of the demo GPT, eager vs torch.compile(fullgraph=True), for bf16 and each recipe, in one run.

    python benchmarks/bench_compile.py [--widths 128,1024] [--recipes delayed,current,block,mxfp8] [--repeat 5]
                                       [--cpu-time]

A step is forward in fp8_autocast (none for bf16), backward and an SGD update, as the demo
runs it. Compiled times are taken after three warm-up steps (which compile). The columns
"vs bf16" divide by the bf16 run of the same mode and width: the goal is a compiled ratio no
worse than the eager one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch
import torch._dynamo

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import least_disturbed_cpu_seconds, machine_line, median_seconds, print_table, torch_threads  # noqa: E402

import engine  # noqa: E402
from engine.recipes import RECIPES  # noqa: E402
from engine.train.run import DEFAULT_RECIPES  # noqa: E402
from engine.train.model import GPT, GPTConfig  # noqa: E402

# width -> (layers, batch, seq): the demo's size, and a wider model where the GEMMs dominate
SIZES = {128: (4, 16, 128), 1024: (2, 4, 128)}


def make_step(width: int, recipe_name: str, compiled: bool) -> Callable[[], None]:
    """One training step of a fresh demo GPT (seed 0) at `width`, eager or compiled."""
    layers, batch, seq = SIZES.get(width, (2, 4, 128))
    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=width, n_layers=layers, n_heads=max(4, width // 64), seq_len=seq))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = torch.compile(model.loss, fullgraph=True) if compiled else model.loss
    recipe = None if recipe_name == "bf16" else RECIPES[recipe_name]()
    tokens = torch.randint(0, 256, (batch, seq + 1))

    def step() -> None:
        with engine.fp8_autocast(enabled=recipe is not None, recipe=recipe):
            loss = loss_fn(tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def step_time(width: int, recipe_name: str, compiled: bool, repeat: int) -> float:
    seconds = median_seconds(make_step(width, recipe_name, compiled), repeat=repeat, warmup=3)
    torch._dynamo.reset()
    return seconds


def cpu_times(width: int, names: list[str], blocks: int) -> dict[str, dict[str, float]]:
    """--cpu-time: every (run, mode) built and warmed up (compiled) first, then timed interleaved, one step per
    block, the least disturbed of `blocks` blocks of thread CPU time on one thread."""
    limit = torch._dynamo.config.cache_size_limit
    torch._dynamo.config.cache_size_limit = 8 * len(names)  # one GPT.loss graph per model and recipe
    try:
        with torch_threads(1):
            steps = {(name, mode): make_step(width, name, mode == "compiled") for name in names
                     for mode in ("eager", "compiled")}
            best = least_disturbed_cpu_seconds(steps, blocks=blocks, calls=1, warmup=3)
    finally:
        torch._dynamo.config.cache_size_limit = limit
        torch._dynamo.reset()
    return {name: {mode: best[name, mode] for mode in ("eager", "compiled")} for name in names}


def main(argv: list[str] | None = None, prog: str | None = None) -> list[list[str]]:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="128,1024")
    parser.add_argument("--recipes", default=",".join(DEFAULT_RECIPES),
                        help=f"comma separated, of {','.join(RECIPES)} (NVFP4 does not compile yet)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--cpu-time", action="store_true",
                        help="1 thread, thread CPU time of the least disturbed of --repeat interleaved blocks")
    args = parser.parse_args(argv)
    rows = []
    names = ["bf16", *args.recipes.split(",")]
    for width in (int(w) for w in args.widths.split(",")):
        times = cpu_times(width, names, args.repeat) if args.cpu_time else {}
        for name in names:
            if not args.cpu_time:
                times[name] = {mode: step_time(width, name, mode == "compiled", args.repeat)
                               for mode in ("eager", "compiled")}
            t = times[name]
            rows.append([str(width), name, f"{t['eager'] * 1e3:.1f}", f"{t['compiled'] * 1e3:.1f}",
                         f"{t['compiled'] / t['eager']:.2f}",
                         f"{t['eager'] / times['bf16']['eager']:.2f}", f"{t['compiled'] / times['bf16']['compiled']:.2f}"])
            print("  ".join(rows[-1]), flush=True)
    how = ("thread CPU time, 1 thread, least disturbed interleaved block" if args.cpu_time
           else f"medians ({torch.get_num_threads()} threads)")
    print(f"\nDemo GPT training step, eager vs torch.compile(fullgraph=True), {how}\n{machine_line()}")
    print_table(["width", "run", "eager ms", "compiled ms", "compiled/eager", "eager vs bf16", "compiled vs bf16"],
                rows)
    return rows


if __name__ == "__main__":
    main()
