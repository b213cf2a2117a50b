"""Bandwidth of the NVFP4 quantize kernel, against a plain copy and the reference path.

    python benchmarks/bench_nvfp4.py [--size 4096 4096] [--dtype bf16] [--runs 15] [--threads 1,2] [--isa auto]
                                     [--stages]

As bench_quantize.py (the same table): for each variant (both usages, plain or with the RHT'd columnwise
usage, round-to-nearest or stochastic rounding; the weights' 16x16 tiles; one usage alone; 4over6, MAE and
MSE, 1x16 blocks and 16x16 tiles, with TE's E4M3 bound 256 for it) the median wall
time of the C++ kernel into preallocated outputs, the bandwidth counted as bytes read + written (x once per
pass over it: twice, since the per-tensor amax comes before any scale; each usage's packed data and E4M3
scales once), and that as a fraction of `y.copy_(x)` timed alternately with it; the module path
(`NVFP4Quantizer(...)(x)`, new outputs per call) and the reference. One table per thread count.
`--stages`: instead, where the time goes, on one thread in CPU time (what a loaded machine distorts least): the
kernel's passes and usages measured alone (the amaxes given, or not), and the cost of each option and of the module
path as the difference of two of them (`stage_rows`).
`main(argv)` is the entry point for `python -m engine bench nvfp4`.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

from bench_quantize import DTYPES, Row, Scheme, bench_input, format_table, measure
from common import machine_line, torch_threads
from engine.ops import native
from engine.ops import nvfp4 as ref
from engine.quantizers import NVFP4Quantizer

VARIANTS = {  # name -> (rowwise, columnwise, two_d, rht, stochastic rounding, 4over6 error mode or None)
    "both usages": (True, True, False, False, False, None),
    "both usages rht": (True, True, False, True, False, None),
    "both usages sr": (True, True, False, False, True, None),
    "both usages rht sr": (True, True, False, True, True, None),
    "16x16 tiles (weights)": (True, True, True, False, False, None),
    "rowwise only": (True, False, False, False, False, None),
    "columnwise only rht": (False, True, False, True, False, None),
    "both usages 4over6 MAE": (True, True, False, False, False, "MAE"),
    "both usages 4over6 MSE": (True, True, False, False, False, "MSE"),
    "16x16 tiles 4over6 MAE": (True, True, True, False, False, "MAE"),
}


def schemes(x: torch.Tensor) -> list[Scheme]:
    m, k = x.shape
    read = x.numel() * x.element_size()
    counter = torch.tensor([1234, 0])
    out = []
    for name, (rows, cols, two_d, rht, sr, four_over_six) in VARIANTS.items():
        bufs = {}
        if rows:
            bufs |= {"out_row_data": torch.empty(m, -(-k // 2), dtype=torch.uint8),
                     "out_row_scales": torch.empty(m, -(-k // 16), dtype=torch.float8_e4m3fn)}
        if cols:
            bufs |= {"out_col_data": torch.empty(k, -(-m // 2), dtype=torch.uint8),
                     "out_col_scales": torch.empty(k, -(-m // 16), dtype=torch.float8_e4m3fn)}
        opts = {"rowwise": rows, "columnwise": cols, "two_d": two_d, "rht": rht}
        module = NVFP4Quantizer(with_rht=rht, with_2d_quantization=two_d, stochastic_rounding=sr,
                                rowwise=rows, columnwise=cols)
        note = "out= all; x read twice"
        if four_over_six:  # TE's defaults for 4over6 tensors: E4M3 bound 256
            opts |= {"four_over_six": True, "four_over_six_err_mode": four_over_six, "four_over_six_e4m3_max": 256}
            module = functools.partial(native.quantize_nvfp4, **opts)  # the quantizer has no 4over6 yet
            note += "; E4M3 bound 256; module path: native without out="
        rbits = {}
        if sr:  # the reference takes the random bits as tensors: made once, outside the timing
            rbits = {"rbits": torch.randint(0, 256, (m, k), dtype=torch.uint8) if rows else None,
                     "rbits_t": torch.randint(0, 256, (k, m), dtype=torch.uint8) if cols else None}
        out.append(Scheme(
            name,
            lambda o=opts, b=bufs, s=sr: native.quantize_nvfp4(x, **o, counter=counter if s else None, **b),
            lambda o=opts, r=rbits: ref.quantize(x, **o, **r),
            lambda q=module: q(x),
            2 * read + sum(t.numel() for t in bufs.values()), note))
    return out


def run(m: int, k: int, dtype: torch.dtype, runs: int, warmup: int, reference_runs: int) -> tuple[list[Row], float]:
    x = bench_input(m, k, dtype)
    return measure(x, schemes(x), runs, warmup, reference_runs)


def thread_ms(fn: Callable[[], object], runs: int) -> float:
    """Median CPU time of this thread per call of fn, in ms (after one warm-up call)."""
    fn()
    times = []
    for _ in range(runs):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times) * 1e3


# (stage, what it runs): the kernel into preallocated outputs with the options named; "given": both amaxes given (no
# amax pass); "module": NVFP4Quantizer(...)(x), new outputs per call.
STAGES = {
    "copy_": ("copy",),
    "both usages": ("native", True, True, False, False, False),
    "both usages, amaxes given": ("native", True, True, False, False, True),
    "rowwise alone, amax given": ("native", True, False, False, False, True),
    "columnwise alone, amax given": ("native", False, True, False, False, True),
    "columnwise alone rht, amax given": ("native", False, True, True, False, True),
    "both usages rht": ("native", True, True, True, False, False),
    "both usages rht, amaxes given": ("native", True, True, True, False, True),
    "both usages sr, amaxes given": ("native", True, True, False, True, True),
    "both usages rht sr": ("native", True, True, True, True, False),
    "module path, both usages": ("module", False, False),
    "module path, both usages rht sr": ("module", True, True),
}
# (derived stage, minuend, subtrahend): the cost of one pass or option as the difference of two measured stages.
DERIVED = (
    ("amax pass (x read once more)", "both usages", "both usages, amaxes given"),
    ("rht amax pass (the RHT of x^T's max)", "both usages rht", "both usages rht, amaxes given"),
    ("fused both vs rowwise + columnwise alone", "both usages, amaxes given", None),
    ("rht in the quantize pass", "columnwise alone rht, amax given", "columnwise alone, amax given"),
    ("stochastic rounding (bits + rounding)", "both usages sr, amaxes given", "both usages, amaxes given"),
    ("module path over the kernel (outputs, Python)", "module path, both usages", "both usages"),
)


def stage_rows(x: torch.Tensor, runs: int) -> list[tuple[str, float]]:
    """(stage, single-thread CPU ms) for STAGES, then DERIVED (the difference of two stages; the fused row: both
    usages less the sum of the two usages alone, negative when the one read of x saves time)."""
    m, k = x.shape
    amax = x.float().abs().amax().reshape(1)
    counter = torch.tensor([1234, 0])
    y = torch.empty_like(x)
    bufs = {"out_row_data": torch.empty(m, -(-k // 2), dtype=torch.uint8),
            "out_row_scales": torch.empty(m, -(-k // 16), dtype=torch.float8_e4m3fn),
            "out_col_data": torch.empty(k, -(-m // 2), dtype=torch.uint8),
            "out_col_scales": torch.empty(k, -(-m // 16), dtype=torch.float8_e4m3fn)}

    def runner(spec: tuple) -> Callable[[], object]:
        if spec[0] == "copy":
            return lambda: y.copy_(x)
        if spec[0] == "module":
            quantizer = NVFP4Quantizer(with_rht=spec[1], stochastic_rounding=spec[2])
            return lambda: quantizer(x)
        _, rows, cols, rht, sr, given = spec
        kw = {name: t for name, t in bufs.items() if ("row" in name and rows) or ("col" in name and cols)}
        if given:
            kw |= {"amax": amax if rows else None, "amax_t": amax if cols else None}
        return lambda: native.quantize_nvfp4(x, rowwise=rows, columnwise=cols, rht=rht,
                                             counter=counter if sr else None, **kw)

    with torch_threads(1):
        ms = {name: thread_ms(runner(spec), runs) for name, spec in STAGES.items()}
    out = list(ms.items())
    for name, a, b in DERIVED:
        less = ms[b] if b else ms["rowwise alone, amax given"] + ms["columnwise alone, amax given"]
        out.append((f"= {name}", ms[a] - less))
    return out


def format_stages(rows: list[tuple[str, float]], header: str) -> str:
    width = max(len(name) for name, _ in rows)
    copy_ms = rows[0][1]
    lines = [header, f"{'stage':{width}s}  thread ms  x copy_", f"{'-' * width}  ---------  -------"]
    lines += [f"{name:{width}s}  {t:9.3f}  {t / copy_ms:7.2f}" for name, t in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, nargs=2, default=(4096, 4096), metavar=("M", "K"))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reference-runs", type=int, default=1)
    parser.add_argument("--threads", default=None, help="comma-separated thread counts (default: torch's)")
    parser.add_argument("--isa", choices=("auto", *native.ISA_ORDER), default="auto")
    parser.add_argument("--stages", action="store_true",
                        help="single-thread CPU time per stage (passes, usages, options, module path) instead")
    args = parser.parse_args(argv)
    if not native.available():
        print(f"the C++ kernels are unavailable: {native.why_unavailable()}")
        return 1
    m, k = args.size
    counts = [int(t) for t in args.threads.split(",")] if args.threads else [torch.get_num_threads()]
    with native.use_isa(args.isa):
        if args.stages:
            x = bench_input(m, k, DTYPES[args.dtype])
            header = (f"NVFP4 quantize stages {m}x{k} {args.dtype}, kernels: {native.isa()}, 1 thread, CPU time, "
                      f"median of {args.runs} runs\n{machine_line()}")
            print(format_stages(stage_rows(x, args.runs), header))
            return 0
        for threads in counts:
            with torch_threads(threads):
                rows, back_to_back = run(m, k, DTYPES[args.dtype], args.runs, args.warmup, args.reference_runs)
            header = (f"NVFP4 quantize {m}x{k} {args.dtype}, kernels: {native.isa()}, threads: {threads}, "
                      f"median of {args.runs} runs\n{machine_line()}")
            print(format_table(rows, back_to_back, header))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
