"""Bandwidth of the MXFP4 / MXFP6 quantize kernels (both usages), against a plain copy and the reference path.

    python benchmarks/bench_mx_small.py [--size 4096 4096] [--dtype bf16] [--runs 15] [--isa auto]

As bench_quantize.py: for each element (E2M1, E2M3, E3M2, RCEIL scales) the median wall time of
the C++ kernel into preallocated outputs (both usages from one pass over x), the bandwidth counted
as bytes read + written (x once, each usage's data and E8M0 codes once), and that as a fraction of
`y.copy_(x)` timed alternately with it; the module path (`MXQuantizer(element)(x)`, fresh outputs per
call) and the reference. `main(argv)` is the entry point for `python -m engine bench mx`.
"""

from __future__ import annotations

import argparse

import torch

from bench_quantize import DTYPES, Row, Scheme, bench_input, format_table, measure
from engine.ops import native
from engine.ops import reference as ref
from engine.quantizers import MXQuantizer
from engine.schemes import mx_scheme


def schemes(x: torch.Tensor) -> list[Scheme]:
    m, k = x.shape
    n, es = x.numel(), x.element_size()
    out = []
    for element in ("e2m1", "e2m3", "e3m2"):
        scheme = mx_scheme(element)
        kp = scheme.data_shape((m, k), False)[-1]
        bufs = {"out_row_data": torch.empty(m, kp, dtype=torch.uint8),
                "out_row_codes": torch.empty(m, -(-k // 32), dtype=torch.uint8),
                "out_col_data": torch.empty(m, kp, dtype=torch.uint8),
                "out_col_codes": torch.empty(-(-m // 32), k, dtype=torch.uint8)}
        quantizer = MXQuantizer(element)
        written = sum(t.numel() for t in bufs.values())
        out.append(Scheme(
            f"MX{element.upper()} rceil rowwise + columnwise",
            lambda s=scheme, b=bufs: native.quantize_mx_coded(x, s.element, **b),
            lambda s=scheme: (ref.quantize_blocked(x, s), ref.quantize_blocked(x, s, columnwise=True)),
            lambda q=quantizer: q(x),
            n * es + written, "out= all; x read once"))
    return out


def run(m: int, k: int, dtype: torch.dtype, runs: int, warmup: int, reference_runs: int) -> tuple[list[Row], float]:
    x = bench_input(m, k, dtype)
    return measure(x, schemes(x), runs, warmup, reference_runs)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, nargs=2, default=(4096, 4096), metavar=("M", "K"))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reference-runs", type=int, default=2)
    parser.add_argument("--isa", choices=("auto", "baseline", "avx2", "avx512"), default="auto")
    args = parser.parse_args(argv)
    if not native.available():
        print(f"the C++ kernels are unavailable: {native.why_unavailable()}")
        return 1
    m, k = args.size
    with native.use_isa(args.isa):
        rows, back_to_back = run(m, k, DTYPES[args.dtype], args.runs, args.warmup, args.reference_runs)
        header = (f"MXFP4/MXFP6 quantize {m}x{k} {args.dtype}, kernels: {native.isa()}, "
                  f"threads: {torch.get_num_threads()}, median of {args.runs} runs")
    print(format_table(rows, back_to_back, header))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
