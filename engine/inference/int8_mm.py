"""Exact int8 x int8 -> int32 GEMMs on the CPU: which of torch's gives the exact sums here, decided once per process.

`torch._int_mm` and oneDNN's u8 x s8 GEMM (the prepacked weights of `Int8DynamicActivationInt8Weight`) give the
exact int32 sums where oneDNN multiplies int8 with int32 accumulation (VNNI's vpdpbusd, AMX). Without VNNI (AVX2
CPUs such as AMD Zen 3, Intel before Ice Lake) oneDNN makes the signed activations unsigned (q + 128) and
multiplies through vpmaddubsw, whose 16-bit sums of two products saturate: 2 * 255 * 127 = 64770 > 32767, so
sums of large same-signed values come out wrong (seen: 104.9 where the exact sums give 3152.8). An unsigned
activation of at most 128 cannot saturate (2 * 128 * 127 = 32512): a signed one of at most 0.

So where `torch._int_mm` is not exact, `int32_mm` splits q into two operands in [-127, 0], neg = min(q, 0) and
pos = min(-q, 0) (q = neg - pos), runs one `torch._int_mm` on the two stacked ([2M, K]: the weight is read once)
and subtracts the halves: exact int32 sums for twice the multiply-adds (the layer at 4096x4096 under the AVX2
emulation: 0.85x fp32 `F.linear`'s speed at M = 1, 1.6x at M = 16, 1.1-1.3x at M = 256; README). Where even that
is not exact the sums come from an fp64 matmul (exact below 2^53; 4-12x slower than fp32 `F.linear`), with a
one-time warning.

Each path is checked by a probe, not chosen by CPU flags: what oneDNN runs also follows ONEDNN_MAX_CPU_ISA, its
build and its version, which the flags do not show. A probe runs the path on crafted operands whose pair sums
overflow 16 bits (rows of 127, of -127, alternating and random, against the same kinds of weight rows) at M = 1,
5 and 37 and compares with exact int64 sums; all probes together take a few milliseconds, once per process.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch

#: the shapes the probes run (M values, K, N): odd sizes, GEMV and GEMM kernels
PROBE_MS = (1, 5, 37)
PROBE_K = 320  # 320 * 127 * 127 < 2^24: the prepacked path's fp32 sums stay exact
PROBE_N = 48


def probe_operands(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [m, PROBE_K], w int8 [PROBE_N, PROBE_K]): rows of 127, of -127, of alternating +-127 and random ones,
    so that some u8 x s8 pair sums pass 16 bits in each sign."""
    gen = torch.Generator().manual_seed(m)
    kinds = torch.tensor([[127, 127], [-127, -127], [127, -127]], dtype=torch.int8).repeat(1, PROBE_K // 2)

    def rows(count: int) -> torch.Tensor:
        out = torch.randint(-127, 128, (count, PROBE_K), generator=gen, dtype=torch.int8)
        out[: len(kinds)] = kinds[:count]
        return out

    return rows(m), rows(PROBE_N)


def exact_sums(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """q [M, K] @ w [N, K]^T in int64: exact."""
    return q.long() @ w.long().t()


def gives_exact_sums(mm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> bool:
    """Whether `mm(q, w)` (int8 [M, K], int8 [N, K] -> sums [M, N], int32 or their fp32 values) equals the exact
    sums on every probe; an error counts as not exact."""
    with torch.no_grad():
        for m in PROBE_MS:
            q, w = probe_operands(m)
            try:
                got = mm(q, w)
            except RuntimeError:
                return False
            if got.shape != (m, PROBE_N) or not torch.equal(got.double(), exact_sums(q, w).double()):
                return False
    return True


def int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch._int_mm(a, b^T): a [M, K], b [N, K] int8 -> int32 [M, N], exact only where `int_mm_exact()`."""
    return torch._int_mm(a, b.t())


def sign_split_int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b^T as int32 through `int_mm` on operands in [-127, 0] only (see the module's docstring)."""
    m = a.shape[0]
    halves = int_mm(torch.cat([a.clamp(max=0), a.clamp(min=0).neg_()]), b)  # a = neg - pos
    return halves[:m] - halves[m:]


def float64_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b^T through an fp64 matmul of the int values, exact below 2^53 (K < 2^39), as int32."""
    return (a.double() @ b.double().t()).to(torch.int32)


@functools.cache
def int_mm_exact() -> bool:
    """Whether `torch._int_mm` gives exact int32 sums in this process (a probe, run once)."""
    return gives_exact_sums(int_mm)


@functools.cache
def sign_split_exact() -> bool:
    """Whether `sign_split_int_mm` gives exact int32 sums in this process (a probe, run once)."""
    return gives_exact_sums(sign_split_int_mm)


@functools.cache
def method() -> str:
    """The exact int32 GEMM `int32_mm` runs here: "int_mm", "int_mm_sign_split" or "float64" (then warns once)."""
    if int_mm_exact():
        return "int_mm"
    if sign_split_exact():
        return "int_mm_sign_split"
    warnings.warn("engine: torch._int_mm does not give exact int32 sums on this CPU, even on operands that cannot "
                  "saturate; Int8DynamicActivationInt8Weight's GEMM runs as an fp64 matmul (exact, several times "
                  "slower than an fp32 GEMM)", RuntimeWarning, stacklevel=3)
    return "float64"


_METHODS = {"int_mm": int_mm, "int_mm_sign_split": sign_split_int_mm, "float64": float64_mm}


def int32_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a[M, K] @ b[N, K]^T for int8 operands with values in [-127, 127] (what `rowwise_int8` makes), as exact int32
    sums (for K < 2^17), by `method()`."""
    return _METHODS[method()](a, b)


# ------------------------------------------------------------------------------ oneDNN's prepacked u8 x s8 GEMM
def prepack(w: torch.Tensor) -> torch.Tensor:
    """int8 w [N, K] in oneDNN's prepacked layout (an opaque tensor)."""
    return torch.ops.onednn.qlinear_prepack(w, None)


def prepacked_sums(xq_biased: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """The fp32 values of the int32 sums (xq_biased - 128) @ w^T: oneDNN's u8 x s8 GEMM on x as q + 128 (uint8 [M,
    K]) with zero point 128 and its own scales 1. Exact only where `prepacked_exact()`."""
    ones = torch.ones(n)
    return torch.ops.onednn.qlinear_pointwise(xq_biased, 1.0, 128, packed, ones, torch.zeros(n, dtype=torch.long),
                                              None, 1.0, 0, torch.float32, "none", [], "")


@functools.cache
def prepacked_exact() -> bool:
    """Whether oneDNN's prepacked u8 x s8 GEMM gives exact sums in this process (a probe, run once; call it only
    where torch has oneDNN's int8 linear)."""
    def mm(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return prepacked_sums((q.to(torch.int16) + 128).to(torch.uint8), prepack(w), w.shape[0])

    return gives_exact_sums(mm)
