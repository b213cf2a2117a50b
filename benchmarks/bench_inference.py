"""Quantized inference Linears (engine.quantize_ configs) vs torch's fp32 and bf16 `F.linear`, measured in the same run.

    python -m engine bench inference [--shapes 4096x4096,4096x11008,11008x4096] [--ms 1,16,256]
                                     [--configs int8wo,int4wo-g128,...] [--blocks 3] [--wall] [--quick]

A shape is KxN (in_features x out_features: x [M, K], W [N, K]; 4096x11008 and 11008x4096 are the two
orientations of an MLP). Default timing: one thread, the calling thread's CPU time over the least
disturbed of `--blocks` interleaved blocks (`common.least_disturbed_cpu_seconds`), which is what a quiet
machine shows; `--wall`: wall-time medians with torch's default threads (both cores). Every config (bf16 x) is
timed against torch's fp32 (fp32 x and W) and bf16 `F.linear` in the same run, and its speed-up given against
each and against the faster of the two (on a CPU without native bf16, such as an AVX2 one, that is fp32). The
title names engine's kernel level (`engine.ops.native.isa()`) and torch's CPU capability. Weight bytes are the memory a quantized weight holds
(`QuantizedWeight.nbytes_quantized`: its storage, and oneDNN's prepacked copy next to it; bf16: N*K*2).
Each call reads its weight from memory, as a layer of a model does: every variant cycles through copies
of its weight, at least `--cold-mib` (default 128, four times this machine's 32 MiB L3) of them in all,
so no call finds its weight in the cache (`--cold-mib 0`: one weight, cache-warm after the first call,
which flatters M = 1 for weights that fit the L3).
`torch-int8pack` / `torch-int4pack-g128` time torch's own weight-only CPU kernels on the same weights
(`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`), for comparison. `--quick`: the int configs only,
M = 1 and 16 (a minute or two).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import least_disturbed_cpu_seconds, machine_line, median_seconds, print_table, torch_threads  # noqa: E402

import engine  # noqa: E402
from engine.ops import native  # noqa: E402
from engine.formats import INT4  # noqa: E402
from engine.inference import int_formats  # noqa: E402
from engine.inference.weight import QuantizedWeight  # noqa: E402
from engine.ops import int_elements  # noqa: E402

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
TORCH_KERNELS = ("torch-int8pack", "torch-int4pack-g128")
QUICK_CONFIGS = "int8wo,int4wo-g128,int4wo-g32,int8dq,torch-int8pack,torch-int4pack-g128"


def parse_shape(text: str) -> tuple[int, int]:
    k, n = (int(v) for v in text.lower().split("x"))
    return k, n


def torch_kernel(name: str, w: torch.Tensor) -> tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]:
    """(f(x, *weight) = x @ W^T by torch's own weight-only CPU op, weight tensors) for `name` of TORCH_KERNELS."""
    if name == "torch-int8pack":
        return torch.ops.aten._weight_int8pack_mm, int_formats.rowwise_int8(w, torch.bfloat16)
    st = QuantizedWeight.from_float(w, engine.Int4WeightOnly(group_size=128)).storage  # codes -8..7, (scale, zero)
    q = int_elements.load(st.rowwise_data, INT4, w.shape[1]) + 8  # torch's codes: 0..15
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
    sz = st.rowwise_scale_inv.transpose(0, 1).contiguous()
    return (lambda x, p, s: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, 128, s)), (packed, sz)


def cycling(x: torch.Tensor, f: Callable[..., torch.Tensor], weights: list[tuple]) -> Callable[[], torch.Tensor]:
    """A call of f(x, *weight) on the next of `weights` each time."""
    turn = itertools.cycle(weights)
    return lambda: f(x, *next(turn))


def copies(weight: tuple[torch.Tensor, ...], cold_bytes: int) -> list[tuple]:
    """`weight` and clones of it, together at least cold_bytes."""
    size = sum(t.nbytes_quantized() if isinstance(t, QuantizedWeight) else t.numel() * t.element_size()
               for t in weight)
    return [weight] + [tuple(t.clone() for t in weight) for _ in range(-(-cold_bytes // size) - 1)]


def main(argv: list[str] | None = None, prog: str | None = None) -> list[list[str]]:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4096x4096,4096x11008,11008x4096", help="KxN list, comma separated")
    parser.add_argument("--ms", default=None, help="token counts M, comma separated (default 1,16,256)")
    parser.add_argument("--configs", default=None,
                        help=f"of {','.join((*CONFIGS, *TORCH_KERNELS))} (default: all)")
    parser.add_argument("--blocks", type=int, default=3, help="interleaved blocks (CPU-time mode)")
    parser.add_argument("--wall", action="store_true", help="wall-time medians with torch's threads")
    parser.add_argument("--quick", action="store_true", help=f"--configs {QUICK_CONFIGS} --ms 1,16 (unless given)")
    parser.add_argument("--cold-mib", type=int, default=128,
                        help="each variant cycles through copies of its weight, this many MiB in all (0: one copy)")
    args = parser.parse_args(argv)
    known = (*CONFIGS, *TORCH_KERNELS)
    configs = args.configs or (QUICK_CONFIGS if args.quick else ",".join(known))
    ms = args.ms or ("1,16" if args.quick else "1,16,256")
    names = [n for n in configs.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; expected names of {','.join(known)}")
    with torch_threads(None if args.wall else 1), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="engine: NVFP4 quantization")
        return _measure(args, names, ms)


def _measure(args: argparse.Namespace, names: list[str], ms: str) -> list[list[str]]:
    rows = []
    for shape in args.shapes.split(","):
        k, n = parse_shape(shape)
        torch.manual_seed(0)
        w = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
        cold = args.cold_mib * 2**20
        variants = {"fp32": (torch.nn.functional.linear, copies((w.float(),), cold)),
                    "bf16": (torch.nn.functional.linear, copies((w,), cold))}
        for name in names:
            f, weight = ((torch.nn.functional.linear, (QuantizedWeight.from_float(w, CONFIGS[name]),))
                         if name in CONFIGS else torch_kernel(name, w))
            variants[name] = (f, copies(weight, cold))
        sizes = {name: sum(t.nbytes_quantized() if isinstance(t, QuantizedWeight) else t.numel() * t.element_size()
                           for t in ws[0]) for name, (_, ws) in variants.items()}
        for m in (int(v) for v in ms.split(",")):
            x = torch.randn(m, k, dtype=torch.bfloat16)
            fns = {name: cycling(x.float() if name == "fp32" else x, f, ws) for name, (f, ws) in variants.items()}
            if args.wall:
                times = {name: median_seconds(fn, repeat=5, warmup=1, min_time=0.02) for name, fn in fns.items()}
            else:
                calls = 8 if m * k * n < 2**26 else 1
                times = least_disturbed_cpu_seconds(fns, blocks=args.blocks, calls=calls, warmup=1)
            best = min(times["fp32"], times["bf16"])
            labels = {"fp32": "torch fp32 F.linear", "bf16": "torch bf16 F.linear"}
            for name in ("fp32", "bf16", *names):
                t = times[name]
                rows.append([f"{m}x{k}x{n}", labels.get(name, name), f"{t * 1e3:.3f}", f"{times['fp32'] / t:.2f}",
                             f"{times['bf16'] / t:.2f}", f"{best / t:.2f}", f"{sizes[name] / 2**20:.1f}"])
    how = "wall-time medians" if args.wall else "thread CPU time, 1 thread, least disturbed of interleaved blocks"
    cache = f"weights cycled through {args.cold_mib} MiB of copies" if args.cold_mib else "one weight, cache-warm"
    level = native.isa() if native.available() else "none (C++ kernels unavailable)"
    print(f"Inference Linear forward, bf16 activations ({how}; {cache}); engine kernels: {level}, torch CPU "
          f"capability: {torch.backends.cpu.get_cpu_capability()}\n{machine_line()}")
    print_table(["MxKxN", "config", "ms", "speed-up vs fp32", "speed-up vs bf16", "vs the faster", "weight MiB"], rows)
    return rows


if __name__ == "__main__":
    main()
