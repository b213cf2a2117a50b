"""Bandwidth of the C++ quantization kernels, against a plain copy and the reference path.

    python benchmarks/bench_quantize.py [--size 4096 4096] [--dtype bf16] [--runs 15]

For every scheme: the median wall time of `--runs` runs (after warm-up), the bandwidth
counted as bytes read + bytes written by that scheme (input read once per pass over it,
every output written once), and that bandwidth as a fraction of `y.copy_(x)` into an
existing buffer of the input's size (copy moves 2x the input's bytes). The copy runs
alternately with the scheme's runs, so both see the same machine: on shared hosts the
memory bandwidth drifts by up to 2x within minutes, and a copy repeated back to back
(also printed) can be served partly from L3. Native outputs are preallocated and reused
(`out_*=` arguments); the reference path allocates its outputs (it has no `out=`). The
"module path" columns time the same work as the modules do it: the quantizer of that
recipe called on x (`quantizer(x)`), which returns new outputs on every call; each
row runs preallocated, copy_ and module path in turn, against the same copy_ baseline.
New outputs of 4 MiB and more reuse the idle buffers of earlier calls
(`engine.memory.output_buffer`); `--fresh-outputs` turns that off to show what fresh pages
cost (glibc maps large blocks anew on every allocation unless `ENGINE_MALLOC_TUNING=1`).
The reference runs fewer times (`--reference-runs`; 0 skips it): it is 40-100x slower.
`main(argv)` is the entry point for `python -m engine bench`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common import machine_line
from engine import memory
from engine.ops import native
from engine.ops import reference as ref
from engine.quantizers import (
    Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer, Float8RowwiseQuantizer, MXFP8Quantizer,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@dataclass
class Scheme:
    name: str
    native: Callable[[], object]
    reference: Callable[[], object]
    module: Callable[[], object]  # the same work through the recipe's quantizer: fresh outputs per call
    bytes_moved: int
    note: str


@dataclass
class Row:
    name: str
    native_ms: float
    native_gbs: float
    copy_gbs: float
    module_ms: float
    module_gbs: float
    reference_ms: float | None
    reference_gbs: float | None
    note: str

    @property
    def of_copy(self) -> float:
        return self.native_gbs / self.copy_gbs

    @property
    def module_of_copy(self) -> float:
        return self.module_gbs / self.copy_gbs


def median_seconds(fn: Callable[[], object], runs: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_medians(fns: list[Callable[[], object]], runs: int, warmup: int) -> list[float]:
    """Median time of each function, run in turn so all see the same machine
    (memory bandwidth on shared hosts drifts by 2x within minutes)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(runs):
        for fn, samples in zip(fns, times):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
    return [statistics.median(samples) for samples in times]


def schemes(x: torch.Tensor, fp8: torch.dtype) -> list[Scheme]:
    m, k = x.shape
    n, es = x.numel(), x.element_size()
    scale = torch.tensor([3.0])
    e8 = torch.empty
    data, data_t, amax = e8(m, k, dtype=fp8), e8(k, m, dtype=fp8), e8(1)
    rows_1d, cols_1d = e8(m, -(-k // 128)), e8(k, -(-m // 128))
    data_t2 = e8(k, m, dtype=fp8)
    sinv_2d = e8(-(-m // 128), -(-k // 128))
    mx_row_codes = e8(m, -(-k // 32), dtype=torch.uint8)
    mx_col_codes = e8(-(-m // 32), k, dtype=torch.uint8)
    mx_col_data = e8(m, k, dtype=fp8)
    vfi = ref.block_value_for_inf(x.dtype)
    block = {"tile_cols": 128, "force_pow_2_scales": True, "amax_epsilon": 0.0, "value_for_inf": vfi}

    def current_native():
        a = native.amax(x, out=amax)
        s = ref.compute_scale(a, fp8)
        native.cast_transpose(x, s, fp8, out_data=data, out_data_t=data_t)

    def current_reference():
        a = ref.amax(x)
        s = ref.compute_scale(a, fp8)
        ref.cast_transpose(x, s, fp8)

    # the quantizers the recipes give the modules, with the usages of the preallocated row
    delayed_row = Float8Quantizer(scale.clone(), torch.zeros(1), fp8, columnwise=False)
    delayed = Float8Quantizer(scale.clone(), torch.zeros(1), fp8)
    current = Float8CurrentScalingQuantizer(fp8)
    block1d = Float8BlockQuantizer(fp8, block_scaling_dim=1)
    block2d = Float8BlockQuantizer(fp8, block_scaling_dim=2, columnwise=False)
    mx = MXFP8Quantizer(fp8)
    rowwise = Float8RowwiseQuantizer(fp8)
    rows_ax, cols_ax = e8(m, 1), e8(k, 1)
    axis = {"tile_rows": 1, "force_pow_2_scales": True, "amax_epsilon": 1e-12, "value_for_inf": vfi}

    return [
        Scheme("per-tensor cast+amax (rowwise)",
               lambda: native.cast_transpose(x, scale, fp8, columnwise=False, out_data=data, out_amax=amax),
               lambda: ref.cast_transpose(x, scale, fp8, columnwise=False),
               lambda: delayed_row(x),
               n * es + n, "out= data, amax"),
        Scheme("per-tensor cast+transpose+amax",
               lambda: native.cast_transpose(x, scale, fp8, out_data=data, out_data_t=data_t, out_amax=amax),
               lambda: ref.cast_transpose(x, scale, fp8),
               lambda: delayed(x),
               n * es + 2 * n, "out= data, data_t, amax"),
        Scheme("current scaling: amax, then cast+transpose", current_native, current_reference,
               lambda: current(x),
               2 * n * es + 2 * n, "out= data, data_t, amax; x read twice"),
        Scheme("block 1D (1x128) rowwise + columnwise",
               lambda: (native.quantize_block(x, fp8, tile_rows=1, **block, out_data=data, out_scale_inv=rows_1d),
                        native.quantize_block(x.t(), fp8, tile_rows=1, **block, out_data=data_t2,
                                              out_scale_inv=cols_1d)),
               lambda: (ref.quantize_block(x, fp8, tile_rows=1, **block),
                        ref.quantize_block(x.t(), fp8, tile_rows=1, **block)),
               lambda: block1d(x),
               2 * n * es + 2 * n + 4 * (rows_1d.numel() + cols_1d.numel()), "out= all; x read twice"),
        Scheme("block 2D (128x128)",
               lambda: native.quantize_block(x, fp8, tile_rows=128, **block, out_data=data, out_scale_inv=sinv_2d),
               lambda: ref.quantize_block(x, fp8, tile_rows=128, **block),
               lambda: block2d(x),
               n * es + n + 4 * sinv_2d.numel(), "out= all"),
        Scheme("MXFP8 rceil rowwise + columnwise",
               lambda: (native.quantize_mxfp8(x, fp8, out_data=data, out_scale=mx_row_codes),
                        native.quantize_mxfp8(x, fp8, columnwise=True, out_data=mx_col_data, out_scale=mx_col_codes)),
               lambda: (ref.quantize_mxfp8(x, fp8), ref.quantize_mxfp8(x, fp8, columnwise=True)),
               lambda: mx(x),
               2 * n * es + 2 * n + mx_row_codes.numel() + mx_col_codes.numel(), "out= all; x read twice"),
        Scheme("axiswise (rowwise) row + col",
               lambda: (native.quantize_block(x, fp8, tile_cols=k, **axis, out_data=data, out_scale_inv=rows_ax),
                        native.quantize_block(x.t(), fp8, tile_cols=m, **axis, out_data=data_t2,
                                              out_scale_inv=cols_ax)),
               lambda: (ref.quantize_block(x, fp8, tile_cols=k, **axis), ref.quantize_block(x.t(), fp8, tile_cols=m,
                                                                                            **axis)),
               lambda: rowwise(x),
               2 * n * es + 2 * n + 4 * (m + k), "out= all; x read twice"),
    ]


def bench_input(m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The quantize benches' x: seeded normals times powers of two in [2^-8, 2^8]."""
    g = torch.Generator().manual_seed(0)
    return (torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-8, 9, (m, k), generator=g).float())).to(dtype)


def measure(x: torch.Tensor, schemes: list[Scheme], runs: int, warmup: int,
            reference_runs: int) -> tuple[list[Row], float]:
    """The table rows of `schemes` on x, and the bandwidth of copies of x run back to back."""
    copy_dst = torch.empty_like(x)
    copy_bytes = 2 * x.numel() * x.element_size()
    back_to_back = copy_bytes / median_seconds(lambda: copy_dst.copy_(x), runs, warmup) / 1e9
    rows = []
    for s in schemes:
        # the copy runs in turn with the scheme's two paths: each row has its own baseline
        t, ct, mt = interleaved_medians([s.native, lambda: copy_dst.copy_(x), s.module], runs, warmup)
        rt = median_seconds(s.reference, reference_runs, 1) if reference_runs > 0 else None
        rows.append(Row(s.name, t * 1e3, s.bytes_moved / t / 1e9, copy_bytes / ct / 1e9,
                        mt * 1e3, s.bytes_moved / mt / 1e9,
                        None if rt is None else rt * 1e3, None if rt is None else s.bytes_moved / rt / 1e9, s.note))
    return rows, back_to_back


def run(m: int, k: int, dtype: torch.dtype, fp8: torch.dtype, runs: int, warmup: int,
        reference_runs: int) -> tuple[list[Row], float]:
    """The table rows, and the bandwidth of copies run back to back."""
    if not native.available():
        raise SystemExit(f"the C++ kernels are unavailable: {native.why_unavailable()}")
    x = bench_input(m, k, dtype)
    return measure(x, schemes(x, fp8), runs, warmup, reference_runs)


def format_table(rows: list[Row], back_to_back_gbs: float, header: str) -> str:
    cols = ("scheme", "native ms", "GB/s", "copy_ GB/s", "% of copy", "module path ms", "GB/s", "% of copy",
            "reference ms", "ref GB/s", "speedup", "outputs")
    body = []
    for r in rows:
        body.append((
            r.name, f"{r.native_ms:.3f}", f"{r.native_gbs:.1f}", f"{r.copy_gbs:.1f}", f"{100 * r.of_copy:.0f}%",
            f"{r.module_ms:.3f}", f"{r.module_gbs:.1f}", f"{100 * r.module_of_copy:.0f}%",
            "-" if r.reference_ms is None else f"{r.reference_ms:.1f}",
            "-" if r.reference_gbs is None else f"{r.reference_gbs:.2f}",
            "-" if r.reference_ms is None else f"{r.reference_ms / r.native_ms:.3g}x", r.note,
        ))
    table = [cols, *body]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    lines = [
        header,
        "copy_ GB/s: y.copy_(x) into an existing buffer of x's size, bytes read + written, timed alternately "
        "with each scheme (same cache state); % of copy = GB/s / copy_ GB/s",
        "native: the kernels into preallocated outputs (out=); module path: the recipe's quantizer, quantizer(x), "
        f"new outputs per call ({'fresh pages' if memory.REUSED_OUTPUT_MIN_BYTES > 2**62 else 'idle buffers reused'}"
        f"; malloc tuning: {memory.status()})",
        f"(copy_ run back to back instead: {back_to_back_gbs:.1f} GB/s; the 32 MB L3 can serve part of a repeat)",
    ]
    for i, line in enumerate(table):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, nargs=2, default=(4096, 4096), metavar=("M", "K"))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--fp8", choices=sorted(FP8), default="e4m3")
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reference-runs", type=int, default=3)
    parser.add_argument("--isa", choices=("auto", *native.ISA_ORDER), default="auto")
    parser.add_argument("--fresh-outputs", action="store_true",
                        help="the module path without reusing idle output buffers (engine.memory.output_buffer)")
    args = parser.parse_args(argv)
    reuse_from = memory.REUSED_OUTPUT_MIN_BYTES
    if args.fresh_outputs:
        memory.REUSED_OUTPUT_MIN_BYTES = 2**63  # given back below
    if not native.available():
        print(f"the C++ kernels are unavailable: {native.why_unavailable()}")
        return 1
    m, k = args.size
    try:
        with native.use_isa(args.isa):
            rows, back_to_back = run(m, k, DTYPES[args.dtype], FP8[args.fp8], args.runs, args.warmup,
                                     args.reference_runs)
            header = (f"quantize {m}x{k} {args.dtype} -> {args.fp8}, kernels: {native.isa()}, "
                      f"threads: {torch.get_num_threads()}, median of {args.runs} runs\n{machine_line()}")
        print(format_table(rows, back_to_back, header))
    finally:
        memory.REUSED_OUTPUT_MIN_BYTES = reuse_from
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
