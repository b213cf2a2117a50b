"""Quantized inference Linears (engine.quantize_ configs) vs bf16 `x @ w.t()`, measured in the same run.

    python -m engine bench inference [--shapes 4096x4096,4096x11008] [--ms 1,16,256] [--configs int8wo,int4wo]
                                     [--blocks 3] [--wall]

A shape is KxN (in_features x out_features: x [M, K], W [N, K]). Default timing: one thread, the
calling thread's CPU time over the least disturbed of `--blocks` interleaved blocks
(`common.least_disturbed_cpu_seconds`), which is what a quiet machine shows; `--wall`: wall-time
medians with torch's default threads. Weight bytes are the quantized parts' (bf16: N*K*2).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import least_disturbed_cpu_seconds, median_seconds, print_table  # noqa: E402

import engine  # noqa: E402
from engine.inference.weight import QuantizedWeight  # noqa: E402

CONFIGS = {
    "int8wo": engine.Int8WeightOnly(),
    "int4wo-g128": engine.Int4WeightOnly(group_size=128),
    "int4wo-g32": engine.Int4WeightOnly(group_size=32),
    "int8dq": engine.Int8DynamicActivationInt8Weight(),
    "fp8wo": engine.Float8WeightOnly(),
    "fp8dq-tensor": engine.Float8DynamicActivationFloat8Weight("tensor"),
    "fp8dq-row": engine.Float8DynamicActivationFloat8Weight("row"),
    "mx-e4m3": engine.MXWeightOnly("e4m3"),
    "mx-e3m2": engine.MXWeightOnly("e3m2"),
    "mx-e2m3": engine.MXWeightOnly("e2m3"),
    "mx-e2m1": engine.MXWeightOnly("e2m1"),
    "nvfp4": engine.NVFP4WeightOnly(),
}


def parse_shape(text: str) -> tuple[int, int]:
    k, n = (int(v) for v in text.lower().split("x"))
    return k, n


def main(argv: list[str] | None = None) -> list[list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4096x4096,4096x11008", help="KxN list, comma separated")
    parser.add_argument("--ms", default="1,16,256", help="token counts M, comma separated")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"of {','.join(CONFIGS)}")
    parser.add_argument("--blocks", type=int, default=3, help="interleaved blocks (CPU-time mode)")
    parser.add_argument("--wall", action="store_true", help="wall-time medians with torch's threads")
    args = parser.parse_args(argv)
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; expected names of {','.join(CONFIGS)}")
    if not args.wall:
        torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="engine: NVFP4 quantization")
    rows = []
    for shape in args.shapes.split(","):
        k, n = parse_shape(shape)
        torch.manual_seed(0)
        w = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
        weights = {name: QuantizedWeight.from_float(w, CONFIGS[name]) for name in names}
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, dtype=torch.bfloat16)
            fns = {"bf16": lambda x=x: x @ w.t()}
            fns.update({name: (lambda q=q, x=x: torch.nn.functional.linear(x, q)) for name, q in weights.items()})
            if args.wall:
                times = {name: median_seconds(fn, repeat=5, warmup=1, min_time=0.02) for name, fn in fns.items()}
            else:
                calls = 8 if m * k * n < 2**26 else 1
                times = least_disturbed_cpu_seconds(fns, blocks=args.blocks, calls=calls, warmup=1)
            base = times["bf16"]
            rows.append([f"{m}x{k}x{n}", "bf16 x @ w.t()", f"{base * 1e3:.3f}", "1.00", f"{n * k * 2 / 2**20:.1f}"])
            for name, q in weights.items():
                rows.append([f"{m}x{k}x{n}", name, f"{times[name] * 1e3:.3f}", f"{base / times[name]:.2f}",
                             f"{q.nbytes_quantized() / 2**20:.1f}"])
    how = "wall-time medians" if args.wall else "thread CPU time, 1 thread, least disturbed of interleaved blocks"
    print(f"Inference Linear forward, bf16 activations ({how})")
    print_table(["MxKxN", "config", "ms", "speed-up vs bf16", "weight MiB"], rows)
    return rows


if __name__ == "__main__":
    main()
