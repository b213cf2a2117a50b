"""Bandwidth of the NVFP4 quantize kernel against `torch.Tensor.copy_` of its input.

    python benchmarks/bench_nvfp4.py [--size 4096 4096] [--dtype bf16] [--threads 1,2] [--isa auto]

For each variant (both usages; plain or with the RHT'd columnwise usage; round-to-nearest or stochastic
rounding) the per-call thread CPU time of the C++ kernel as a quantizer calls it (no out_* buffers: the
packed data land in idle reused buffers, `engine.memory.output_buffer`, the scales in fresh memory),
the least over interleaved blocks (`common.least_disturbed_cpu_seconds`: the machine is shared), next to
`y.copy_(x)` measured the same way. Bytes counted: x read once, each usage's packed data and E4M3 scales
written once. "of copy_" is the kernel's bandwidth as a fraction of copy_'s (2 * x's bytes per call).
`main(argv)` is the entry point for `python -m engine bench nvfp4`.
"""

from __future__ import annotations

import argparse

import torch

from common import least_disturbed_cpu_seconds, print_table, torch_threads
from engine.ops import native

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def variants(x: torch.Tensor) -> dict[str, tuple[object, int]]:
    """name -> (call, bytes read + written)."""
    m, k = x.shape
    usage_bytes = -(-k // 2) * m + -(-k // 16) * m  # packed data and scales of one usage (same for the other)
    read = x.numel() * x.element_size()
    counter = torch.tensor([1234, 0])
    out = {}
    for rht in (False, True):
        for sr in (False, True):
            name = f"both usages{' rht' if rht else ''}{' sr' if sr else ''}"
            out[name] = (lambda r=rht, s=sr: native.quantize_nvfp4(x, rht=r, counter=counter if s else None),
                         read + 2 * usage_bytes)
    out["rowwise only"] = (lambda: native.quantize_nvfp4(x, columnwise=False), read + usage_bytes)
    out["columnwise only rht"] = (lambda: native.quantize_nvfp4(x, rowwise=False, rht=True), read + usage_bytes)
    return out


def run(m: int, k: int, dtype: torch.dtype, threads: int, blocks: int, calls: int) -> list[list[str]]:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-8, 9, (m, k), generator=g).float())).to(dtype)
    dst = torch.empty_like(x)
    copy_bytes = 2 * x.numel() * x.element_size()
    cases = variants(x)
    fns = {"copy_": lambda: dst.copy_(x), **{name: fn for name, (fn, _) in cases.items()}}
    with torch_threads(threads):
        seconds = least_disturbed_cpu_seconds(fns, blocks=blocks, calls=calls, warmup=2)
    copy_bw = copy_bytes / seconds["copy_"] / 1e9
    rows = [[str(threads), "copy_", f"{seconds['copy_'] * 1e3:.2f}", f"{copy_bw:.2f}", "1.00"]]
    for name, (_, moved) in cases.items():
        bw = moved / seconds[name] / 1e9
        rows.append([str(threads), name, f"{seconds[name] * 1e3:.2f}", f"{bw:.2f}", f"{bw / copy_bw:.2f}"])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, nargs=2, default=(4096, 4096), metavar=("M", "K"))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--blocks", type=int, default=7, help="interleaved blocks; the least disturbed one counts")
    parser.add_argument("--calls", type=int, default=3, help="calls per block")
    parser.add_argument("--isa", choices=("auto", "avx512", "portable"), default="auto")
    args = parser.parse_args(argv)
    if not native.available():
        print(f"the C++ kernels are unavailable: {native.why_unavailable()}")
        return 1
    m, k = args.size
    rows = []
    with native.use_isa(args.isa):
        for threads in (int(t) for t in args.threads.split(",")):
            rows += run(m, k, DTYPES[args.dtype], threads, args.blocks, args.calls)
        print(f"NVFP4 quantize {m}x{k} {args.dtype}, kernels: {native.isa()}, outputs as a quantizer gets them, "
              f"thread CPU time (least of {args.blocks} interleaved blocks of {args.calls} calls)")
    print_table(["threads", "variant", "ms", "GB/s", "of copy_"], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
