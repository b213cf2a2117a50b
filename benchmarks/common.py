"""Timing helpers shared by the benchmarks: medians of repeated runs, printed as plain tables."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Callable

import torch


def machine_line() -> str:
    """Where a table was measured, for its header: the CPU model and the instruction set engine's C++ kernels run
    (inside `native.use_isa`: the forced one), with the levels this CPU and build have."""
    from engine.machine import cpu_info
    from engine.ops import native

    if not native.available():
        return f"CPU: {cpu_info().model}; engine's C++ kernels: unavailable ({native.why_unavailable()[:200]})"
    return f"CPU: {cpu_info().model}; engine's C++ kernels: {native.isa()} (available: {', '.join(native.available_isas())})"


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `n` inside the block (None: unchanged), given back after, so callers and
    tests in the same process keep their setting."""
    previous = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def median_seconds(fn: Callable[[], object], *, repeat: int = 7, warmup: int = 2, min_time: float = 0.0) -> float:
    """Median wall time of fn() over `repeat` runs (after `warmup` untimed runs).

    With `min_time`, each sample loops fn() until it has run that long, for calls of a few µs.
    """
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time:
                break
        samples.append(elapsed / calls)
    return statistics.median(samples)


def least_disturbed_cpu_seconds(fns: dict[str, Callable[[], object]], *, blocks: int = 40, calls: int = 50,
                                warmup: int = 50) -> dict[str, float]:
    """Per-call thread CPU time of each fn, the least of `blocks` blocks of `calls` calls, the fns interleaved
    block by block.

    On a shared machine wall-time medians swing 2-3x; the calling thread's CPU time over the
    least disturbed block, with every variant measured alternately, is what a quiet machine
    would show (for single-threaded work: set torch.set_num_threads(1) first).
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(blocks):
        for name, fn in fns.items():
            start = time.thread_time()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.thread_time() - start) / calls)
    return best


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
