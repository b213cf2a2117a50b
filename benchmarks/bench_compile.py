"""Training step of the demo GPT, eager vs torch.compile(fullgraph=True), for bf16 and each recipe, in one run.

    python benchmarks/bench_compile.py [--widths 128,1024] [--recipes delayed,current,block,mxfp8] [--repeat 5]

A step is forward in fp8_autocast (none for bf16), backward and an SGD update, as the demo
runs it. Compiled times are taken after three warm-up steps (which compile). The columns
"vs bf16" divide by the bf16 run of the same mode and width: the goal is a compiled ratio no
worse than the eager one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch._dynamo

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median_seconds, print_table  # noqa: E402

import engine  # noqa: E402
from engine.recipes import RECIPES  # noqa: E402
from engine.train.run import DEFAULT_RUNS  # noqa: E402
from engine.train.model import GPT, GPTConfig  # noqa: E402

# width -> (layers, batch, seq): the demo's size, and a wider model where the GEMMs dominate
SIZES = {128: (4, 16, 128), 1024: (2, 4, 128)}


def step_time(width: int, recipe_name: str, compiled: bool, repeat: int) -> float:
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

    seconds = median_seconds(step, repeat=repeat, warmup=3)
    torch._dynamo.reset()
    return seconds


def main(argv: list[str] | None = None) -> list[list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="128,1024")
    parser.add_argument("--recipes", default=",".join(r for r in DEFAULT_RUNS if r != "bf16"),
                        help=f"comma separated, of {','.join(RECIPES)} (NVFP4 does not compile yet)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    rows = []
    for width in (int(w) for w in args.widths.split(",")):
        times = {}
        for name in ["bf16", *args.recipes.split(",")]:
            times[name] = {mode: step_time(width, name, mode == "compiled", args.repeat) for mode in ("eager", "compiled")}
            t = times[name]
            rows.append([str(width), name, f"{t['eager'] * 1e3:.1f}", f"{t['compiled'] * 1e3:.1f}",
                         f"{t['compiled'] / t['eager']:.2f}",
                         f"{t['eager'] / times['bf16']['eager']:.2f}", f"{t['compiled'] / times['bf16']['compiled']:.2f}"])
            print("  ".join(rows[-1]), flush=True)
    print(f"\nDemo GPT training step, eager vs torch.compile(fullgraph=True), medians ({torch.get_num_threads()} threads)")
    print_table(["width", "run", "eager ms", "compiled ms", "compiled/eager", "eager vs bf16", "compiled vs bf16"],
                rows)
    return rows


if __name__ == "__main__":
    main()
