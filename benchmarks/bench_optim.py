"""The optimizer step: engine.optim.AdamW with fp32, bf16, FP8 and 8-bit states against torch.optim.AdamW(fused=True).

    python benchmarks/bench_optim.py [--numel 1048576] [--tensors 4] [--threads 1] [--blocks 5] [--calls 3] [--floor]

Each row is a fresh optimizer over its own copy of the same parameters (`--tensors` tensors of `--numel`
elements), stepped on fixed gradients; the time is the thread CPU time per step of the least disturbed of
`--blocks` blocks of `--calls` steps, all rows interleaved block by block (benchmarks/common.py:
shared machines swing wall time 2-3x), with `--threads` torch / OpenMP threads (1: single-thread CPU time, what
a loaded machine can measure). "vs torch fused" is the ratio to torch.optim.AdamW(fused=True) fp32 in the same
run; "state B/param" counts every optimizer state byte (moments, their block scales) per parameter. `--floor` adds
a row that is a lower bound for any fused step with two 8-bit states on this machine (benchmarks/optim_floor.py).
`main(argv)` is the entry point for `python -m engine bench optim`.
"""

from __future__ import annotations

import argparse

import torch

from common import least_disturbed_cpu_seconds, machine_line, print_table, torch_threads
from engine import optim
from engine.ops import native
from optim_floor import floor_row

ROWS = {  # name: (factory, state bytes of torch's fp32 AdamW or None)
    "torch AdamW fused fp32": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "torch AdamW foreach fp32": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "engine AdamW fp32 (fused)": lambda ps: optim.AdamW(ps, lr=1e-3, fused=True),
    "engine AdamW bf16 (native)": lambda ps: optim.AdamW(ps, lr=1e-3, fused=True, state_dtype="bf16"),
    "engine AdamW bf16_sr (native)": lambda ps: optim.AdamW(ps, lr=1e-3, fused=True, state_dtype="bf16_sr"),
    "engine AdamW fp8 1x128 (native)": lambda ps: optim.AdamW(ps, lr=1e-3, fused=True, state_dtype="fp8"),
    "engine AdamW int8 (native)": lambda ps: optim.AdamW(ps, lr=1e-3, fused=True, state_dtype="int8"),
    "engine AdamW int8 (reference)": lambda ps: optim.AdamW(ps, lr=1e-3, state_dtype="int8"),
}


FLOOR = "floor: two linear int8 block states"


def state_bytes(opt: torch.optim.Optimizer) -> int:
    if hasattr(opt, "state_bytes"):  # engine.optim.AdamW, the floor row
        return opt.state_bytes()
    return sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step")


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=1 << 20, help="elements per parameter tensor (default 2^20)")
    p.add_argument("--tensors", type=int, default=4, help="parameter tensors (default 4)")
    p.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads (default 1)")
    p.add_argument("--blocks", type=int, default=5, help="interleaved blocks; the least disturbed counts (default 5)")
    p.add_argument("--calls", type=int, default=3, help="steps per block (default 3)")
    p.add_argument("--rows", default="", help="comma separated row names to run (default: all)")
    p.add_argument("--floor", action="store_true",
                   help="add the floor row: a fused step with two linear int8 states, compiled with cc (a bound)")
    args = p.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(args.numel, generator=gen) for _ in range(args.tensors)]
    grads = [torch.randn(args.numel, generator=gen) * 1e-3 for _ in range(args.tensors)]
    rows = {k: v for k, v in ROWS.items() if not args.rows or k in args.rows.split(",")}
    opts, params = {}, {}
    for name, make in rows.items():
        ps = [b.clone().requires_grad_() for b in base]
        for q, g in zip(ps, grads):
            q.grad = g.clone()
        opts[name], params[name] = make(ps), ps
        opts[name].step()  # states exist: the timed steps are steady-state steps of a fresh optimizer
    if args.floor:
        rows = {**rows, FLOOR: None}
        opts[FLOOR] = floor_row(base, grads, native.isa() if native.available() else "baseline")
        opts[FLOOR].step()
    with torch_threads(args.threads):
        print(f"# optimizer step, {args.tensors} x {args.numel} parameters; {machine_line()}; "
              f"{args.threads} thread(s); thread CPU time, least disturbed of {args.blocks} blocks")
        times = least_disturbed_cpu_seconds({n: o.step for n, o in opts.items()}, blocks=args.blocks,
                                            calls=args.calls, warmup=1)
    total = args.numel * args.tensors
    base_time = times.get("torch AdamW fused fp32")
    table = []
    for name in rows:
        ratio = f"{times[name] / base_time:.2f}" if base_time else "-"
        table.append([name, f"{times[name] * 1e3:.2f}", ratio, f"{state_bytes(opts[name]) / total:.3f}"])
    print_table(["optimizer / states", "step ms", "vs torch fused", "state B/param"], table)


if __name__ == "__main__":
    main()
