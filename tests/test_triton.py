"""The Triton kernels (`engine.ops.triton`) against the reference, bit for bit, without a GPU.

Triton's interpreter (`TRITON_INTERPRET=1`) runs the kernels on CPU tensors, but it is
chosen when the `@triton.jit` functions are created, i.e. at import. So the kernels run in
worker subprocesses (this file executed as a script, `--worker`), never in the pytest
process: the workers compute every case's Triton outputs and save them with `torch.save`;
the tests here rebuild the same inputs (seeded), run `engine.ops.reference` and compare.

Comparisons are bitwise: FP8 data as uint8 codes, E8M0 codes exactly, fp32 scales and
amaxes by their bits, bf16 by its bits, NaN bits included (every backend writes the
canonical NaN of each format, whatever the sign and payload of the input NaN).

A third subprocess compiles every kernel for sm_80 and sm_90 (no GPU needed) and the PTX
is checked for what bit-exactness on a GPU relies on. The three run concurrently (the
machines have 2 cores); the file needs about 40 s of CPU time.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.formats import MX_ELEMENTS, format_of
from engine.ops import reference as ref
from engine.schemes import mx_scheme

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
HP_DTYPES = (F32, BF16, F16)
FLT_MAX = ref.FLT_MAX
REPO = Path(__file__).resolve().parents[1]
N_WORKERS = 2

# Values that exercise the cast at scale 1: zeros of both signs, fp32 subnormals, FP8
# subnormals and their midpoints (ties), exponent-boundary round-ups (7.98 -> 8 in E4M3),
# ties to even (1.0625 -> 1.0, 1.1875 -> 1.25 in E4M3), the maxima, values between max and
# the next binade (saturate), inf and NaN of both signs.
SPECIALS = [
    0.0, -0.0, 1e-45, -1e-45, 1e-40, -3e-39, 2.0**-126, 2.0**-9, -(2.0**-9), 2.0**-10, 3 * 2.0**-10,
    -(3 * 2.0**-10), 2.0**-16, 2.0**-17, 3 * 2.0**-17, 2.0**-6, 2.0**-14, 7.98, -7.98, 7.99, 15.9, 0.99,
    1.0625, 1.1875, -1.0625, 1.125, 240.0, 248.0, 440.0, 448.0, -448.0, 464.0, 470.0, 480.0, 500.0, -1e6,
    57344.0, -57344.0, 59392.0, 61440.0, 65504.0, 1e30, FLT_MAX, -FLT_MAX,
    math.inf, -math.inf, math.nan, -math.nan,
]

# NaNs of both signs with non-default payloads, quiet and signalling, as raw bits per dtype
NAN_BITS = {
    torch.float32: [0x7FC00000, 0xFFC00000, 0x7FC12345, 0xFFFFFFFF, 0x7F800001, 0xFF812345],
    torch.bfloat16: [0x7FC0, 0xFFC0, 0x7FC1, 0xFFFF, 0x7F81, 0xFF81],
    torch.float16: [0x7E00, 0xFE00, 0x7E01, 0xFFFF, 0x7C01, 0xFC01],
}


def nan_payloads(shape, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random values with one NaN of each kind in NAN_BITS at random places (set by bits)."""
    x = _spread(shape, g).to(dtype)
    n = x.numel()
    bits = torch.tensor(NAN_BITS[dtype], dtype=torch.int64)
    bits = bits.to(torch.int32) if dtype == torch.float32 else bits.to(torch.int16)
    flat = x.reshape(-1).view(bits.dtype)
    flat[torch.randperm(n, generator=g)[: len(bits)]] = bits[: min(n, len(bits))]
    return x


# ------------------------------------------------------------------------------------ inputs
def _spread(shape, g) -> torch.Tensor:
    """N(0,1) times 2^[-8, 8]: neighbouring blocks and tiles get different scales."""
    return torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 9, shape, generator=g).float())


def fp8_grid(fmt: torch.dtype) -> torch.Tensor:
    """Every finite non-negative value of `fmt`, ascending (fp32)."""
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt).float()
    vals = vals[torch.isfinite(vals) & (vals >= 0)]
    return torch.unique(vals)


def ties_values(fmt: torch.dtype) -> torch.Tensor:
    """Midpoints between consecutive `fmt` values (exact ties), the values themselves and the
    fp32 neighbours of the midpoints, both signs."""
    grid = fp8_grid(fmt)
    mids = (grid[1:] + grid[:-1]) / 2  # exact in fp32
    up = torch.nextafter(mids, torch.full_like(mids, math.inf))
    down = torch.nextafter(mids, torch.zeros_like(mids))
    v = torch.cat([grid, mids, up, down])
    return torch.cat([v, -v])


def dense_fp32(fmt: torch.dtype) -> torch.Tensor:
    """A dense fp32 sample around everything the cast does for `fmt`: every fp32 exponent from
    below half the smallest subnormal to above the max, with mantissas at every multiple of
    2^11 and their +-1 ulp neighbours (every rounding position of the cast, ties included),
    plus 2^18 random bit patterns over the whole fp32 range, both signs."""
    f = format_of(fmt)
    lo = 127 + (1 - f.bias - f.mantissa_bits) - 3
    hi = 127 + f.max_exponent + 2
    exps = torch.arange(lo, hi + 1, dtype=torch.int64)
    mant = torch.arange(0, 1 << 12, dtype=torch.int64) << 11
    mant = torch.cat([mant, mant + 1, (mant - 1).clamp(min=0)])
    bits = (exps[:, None] << 23 | mant[None, :]).reshape(-1)
    g = torch.Generator().manual_seed(1234)
    rand = torch.randint(0, 1 << 31, (1 << 18,), generator=g, dtype=torch.int64)
    bits = torch.cat([bits, rand, torch.arange(0, 1 << 12, dtype=torch.int64)])  # + fp32 subnormals
    bits = torch.cat([bits, bits | (1 << 31)])
    return bits.to(torch.int32).view(torch.float32)


def mx_ties_values() -> torch.Tensor:
    """Grid values of E2M1, E2M3 and E3M2, their midpoints (exact ties) and the fp32 neighbours of
    those, times 1 and 2^-3 (other binades and subnormals of each grid), both signs."""
    vals = []
    for fmt in MX_ELEMENTS.values():
        grid = fmt.decode(torch.arange(1 << (fmt.bits - 1))).float()
        mids = (grid[1:] + grid[:-1]) / 2
        vals += [grid, mids, torch.nextafter(mids, torch.full_like(mids, math.inf)),
                 torch.nextafter(mids, torch.zeros_like(mids))]
    v = torch.cat(vals)
    v = torch.cat([v, v * 0.125])
    return torch.cat([v, -v])


@dataclass(frozen=True)
class Inp:
    """A deterministic input: `kind` of values, 2D `shape` (or any shape), dtype, seed,
    `transposed`: the tensor is built as shape[::-1] and passed as its `.t()` view."""

    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype = F32
    seed: int = 0
    fmt: torch.dtype = E4  # the FP8 format `ties` values are made for
    transposed: bool = False


def make_input(inp: Inp) -> torch.Tensor:
    g = torch.Generator().manual_seed(inp.seed)
    shape = tuple(reversed(inp.shape)) if inp.transposed else inp.shape
    n = math.prod(shape)
    if inp.kind == "rand":
        x = _spread(shape, g)
    elif inp.kind == "specials":  # random values with ~1 in 8 replaced by specials
        x = _spread(shape, g).reshape(-1)
        sp = torch.tensor(SPECIALS, dtype=torch.float32)
        pos = torch.randperm(n, generator=g)[: max(1, n // 8)]
        x[pos] = sp[torch.arange(len(pos)) % len(sp)]
        x = x.reshape(shape)
    elif inp.kind == "finite_specials":  # the same without inf/NaN, so tile scales are not 1
        x = _spread(shape, g).reshape(-1)
        sp = torch.tensor([v for v in SPECIALS if math.isfinite(v) and abs(v) < 1e6], dtype=torch.float32)
        pos = torch.randperm(n, generator=g)[: max(1, n // 8)]
        x[pos] = sp[torch.arange(len(pos)) % len(sp)]
        x = x.reshape(shape)
    elif inp.kind == "ties":  # exact ties etc. of `fmt`, shuffled, at scale 1
        t = ties_values(inp.fmt)
        x = t[torch.randint(0, len(t), (n,), generator=g)].reshape(shape)
    elif inp.kind == "ties_with_max":  # ties, and every row/tile/block holds +-fp8_max: scale exactly 1
        t = ties_values(inp.fmt)
        x = t[torch.randint(0, len(t), (n,), generator=g)].reshape(shape).clone()
        x[..., ::32] = ref.fp8_max(inp.fmt)
    elif inp.kind == "mx_ties":  # every MX element grid value, midpoint and fp32 neighbour; 6 or 28 per block
        x = mx_ties_values()[torch.randint(0, len(mx_ties_values()), (n,), generator=g)].reshape(shape).clone()
        x[..., ::32] = 6.0
        x[..., 1::32] = -28.0
        x[::32] = 7.5
    elif inp.kind == "zeros":
        x = torch.zeros(shape)
        x.reshape(-1)[::3] = -0.0
    elif inp.kind == "subnormal":  # fp32 subnormals only: amax tiny, block scales overflow
        x = (torch.rand(shape, generator=g) - 0.5) * 2.0**-127
    elif inp.kind == "tiny":  # below E4M3/E5M2 min subnormal at scale 1, still fp32-normal
        x = _spread(shape, g) * 2.0**-30
    elif inp.kind == "huge":  # near FLT_MAX: E8M0 codes near the top
        x = torch.rand(shape, generator=g) * FLT_MAX
    elif inp.kind == "outlier":  # one huge value in the first block/tile, the rest normal
        x = _spread(shape, g)
        x.reshape(-1)[n // 3] = 3e4
        x.reshape(-1)[0] = -6e4
    elif inp.kind == "nan_inf":  # a NaN in one block/tile, +-inf in others
        x = _spread(shape, g).reshape(-1)
        if n:
            x[0] = math.nan
            x[n // 2] = math.inf
            x[-1] = -math.nan
            x[n // 3] = -math.inf
        x = x.reshape(shape)
    elif inp.kind == "nan_payloads":  # NaNs of both signs and several payloads, by bits, in inp.dtype
        x = nan_payloads(shape, inp.dtype, g)
        return x.t() if inp.transposed else x
    elif inp.kind == "all_bf16":  # every bf16 bit pattern
        x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    elif inp.kind == "dense_fp32":
        x = dense_fp32(inp.fmt)
    elif inp.kind == "codes":  # every byte, viewed as `fmt`
        x = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(n // 256 + 1)[:n]
        x = x[torch.randperm(n, generator=g)] if inp.seed else x
        x = x.reshape(shape).view(inp.fmt)
        return x.t() if inp.transposed else x
    elif inp.kind == "int":
        return torch.ones(shape, dtype=torch.int32)
    elif inp.kind == "f64":
        return torch.ones(shape, dtype=torch.float64)
    else:
        raise ValueError(inp.kind)
    x = x.to(inp.dtype)
    return x.t() if inp.transposed else x


# ------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    op: str  # cast | amax | cast_transpose | block | mx | mx_coded | bf16
    inp: Inp
    fmt: torch.dtype | None = E4
    kw: tuple = ()  # keyword arguments as sorted (name, value) pairs
    scale: float | None = None  # cast_transpose
    name: str = field(default="")

    @property
    def id(self) -> str:
        i = self.inp
        parts = [self.op, i.kind, "x".join(map(str, i.shape)), str(i.dtype).removeprefix("torch.")]
        if self.fmt is not None:
            parts.append(str(self.fmt).removeprefix("torch.float8_").removeprefix("torch."))
        if i.transposed:
            parts.append("T")
        if i.seed:
            parts.append(f"s{i.seed}")
        if self.scale is not None:
            parts.append(f"scale={self.scale:g}")
        parts += [f"{k}={v}" for k, v in self.kw]
        if self.name:
            parts.append(self.name)
        return "-".join(parts)


def _kw(**kw: Any) -> tuple:
    return tuple(sorted(kw.items()))


def build_cases() -> list[Case]:
    c: list[Case] = []
    # -- the rounding helper alone: every bf16 pattern, a dense fp32 sample, the specials
    for fmt in (E4, E5):
        c.append(Case("cast", Inp("all_bf16", (1 << 16,)), fmt))
        c.append(Case("cast", Inp("dense_fp32", (0,), fmt=fmt), fmt))
        c.append(Case("cast", Inp("specials", (64, 65)), fmt))
        for dt in HP_DTYPES:
            c.append(Case("cast", Inp("nan_payloads", (16, 40), dt), fmt))
    # -- amax
    for dt in HP_DTYPES:
        for shape in [(1, 1), (3, 5), (7, 129), (130, 257)]:
            c.append(Case("amax", Inp("rand", shape, dt), None))
        c.append(Case("amax", Inp("nan_inf", (130, 257), dt), None))
        c.append(Case("amax", Inp("specials", (33, 70), dt, seed=1), None))
        c.append(Case("amax", Inp("nan_payloads", (2, 3), dt), None))  # NaNs only: payloads decide
        c.append(Case("amax", Inp("nan_payloads", (33, 70), dt), None))
    c.append(Case("amax", Inp("zeros", (17, 9)), None))
    c.append(Case("amax", Inp("subnormal", (17, 9)), None))
    c.append(Case("amax", Inp("rand", (0, 5)), None))
    c.append(Case("amax", Inp("rand", (2, 3, 40)), None))
    c.append(Case("amax", Inp("rand", (70, 33), transposed=True), None))
    c.append(Case("amax", Inp("rand", (64, 16384)), None))  # many programs: the atomic max
    c.append(Case("amax", Inp("int", (4, 32)), None))  # other dtypes: same definition (torch ops)
    c.append(Case("amax", Inp("f64", (4, 32)), None))
    # -- cast_transpose
    for fmt in (E4, E5):
        for dt in HP_DTYPES:
            for shape in [(1, 1), (3, 5), (7, 129)]:
                c.append(Case("cast_transpose", Inp("rand", shape, dt), fmt, scale=3.0))
            c.append(Case("cast_transpose", Inp("specials", (130, 257), dt), fmt, scale=1.0))
        for scale in (0.125, 3.0, 1e4, 1e-3):
            c.append(Case("cast_transpose", Inp("rand", (67, 45), seed=2), fmt, scale=scale))
        for dt in (F32, BF16, F16):
            c.append(Case("cast_transpose", Inp("ties", (40, 97), dt, fmt=fmt), fmt, scale=1.0))
        c.append(Case("cast_transpose", Inp("nan_inf", (65, 66)), fmt, scale=0.75))
        for dt in HP_DTYPES:
            c.append(Case("cast_transpose", Inp("nan_payloads", (33, 70), dt), fmt, scale=3.0))
        c.append(Case("cast_transpose", Inp("rand", (9, 9), seed=3), fmt, scale=-math.nan))
    for rw, cw in [(True, False), (False, True), (False, False)]:
        c.append(Case("cast_transpose", Inp("specials", (33, 70), BF16), E4, _kw(rowwise=rw, columnwise=cw), 2.0))
    c.append(Case("cast_transpose", Inp("rand", (70, 33), F16, transposed=True), E4, scale=5.0))
    c.append(Case("cast_transpose", Inp("zeros", (9, 9)), E4, scale=7.0))
    c.append(Case("cast_transpose", Inp("subnormal", (9, 9)), E5, scale=2.0**100))
    c.append(Case("cast_transpose", Inp("rand", (0, 7)), E4, scale=1.0))
    c.append(Case("cast_transpose", Inp("rand", (7, 0)), E4, scale=1.0))
    c.append(Case("cast_transpose", Inp("specials", (1024, 1024)), E4, scale=1.5))
    # -- float8 block scaling
    for fmt in (E4, E5):
        for tr in (1, 128):
            for dt in HP_DTYPES:
                c.append(Case("block", Inp("specials", (130, 257), dt), fmt,
                              _kw(tile_rows=tr, value_for_inf=ref.block_value_for_inf(dt))))
            c.append(Case("block", Inp("rand", (130, 257), seed=3), fmt, _kw(tile_rows=tr, force_pow_2_scales=False)))
            c.append(Case("block", Inp("finite_specials", (130, 257), seed=4), fmt,
                          _kw(tile_rows=tr, force_pow_2_scales=False)))
            c.append(Case("block", Inp("ties_with_max", (130, 257), fmt=fmt), fmt, _kw(tile_rows=tr)))
            c.append(Case("block", Inp("outlier", (130, 257)), fmt, _kw(tile_rows=tr)))
            c.append(Case("block", Inp("nan_inf", (130, 257)), fmt, _kw(tile_rows=tr)))
            for dt in HP_DTYPES:
                c.append(Case("block", Inp("nan_payloads", (130, 140), dt), fmt, _kw(tile_rows=tr)))
    for tr in (1, 128):
        for shape in [(1, 1), (3, 5), (7, 129), (257, 130)]:
            c.append(Case("block", Inp("rand", shape, seed=5), E4, _kw(tile_rows=tr)))
        c.append(Case("block", Inp("rand", (130, 257), BF16, transposed=True), E4, _kw(tile_rows=tr)))
        c.append(Case("block", Inp("specials", (257, 130), F16, transposed=True), E4, _kw(tile_rows=tr)))
        for pow2 in (True, False):
            c.append(Case("block", Inp("subnormal", (130, 200)), E4, _kw(tile_rows=tr, force_pow_2_scales=pow2)))
            c.append(Case("block", Inp("subnormal", (130, 200)), E4,
                          _kw(tile_rows=tr, force_pow_2_scales=pow2, value_for_inf=65504.0)))
            c.append(Case("block", Inp("zeros", (130, 200)), E4, _kw(tile_rows=tr, force_pow_2_scales=pow2)))
            c.append(Case("block", Inp("tiny", (130, 200)), E4,
                          _kw(tile_rows=tr, force_pow_2_scales=pow2, amax_epsilon=1e-12)))
        c.append(Case("block", Inp("zeros", (130, 200)), E4, _kw(tile_rows=tr, amax_epsilon=1e-3)))
        c.append(Case("block", Inp("rand", (0, 7)), E4, _kw(tile_rows=tr)))
        c.append(Case("block", Inp("rand", (1024, 1024)), E4, _kw(tile_rows=tr)))
    c.append(Case("block", Inp("rand", (13, 17), seed=6), E4, _kw(tile_rows=3, tile_cols=5)))  # any tile size
    c.append(Case("block", Inp("rand", (200, 300), seed=7), E5, _kw(tile_rows=64, tile_cols=96)))
    # -- MXFP8
    for fmt in (E4, E5):
        for mode in ("rceil", "floor"):
            for cw in (False, True):
                for dt in HP_DTYPES:
                    c.append(Case("mx", Inp("specials", (64, 96), dt), fmt, _kw(scale_mode=mode, columnwise=cw)))
                for kind in ("ties_with_max", "zeros", "subnormal", "tiny", "huge", "outlier", "nan_inf"):
                    c.append(Case("mx", Inp(kind, (64, 64), fmt=fmt), fmt, _kw(scale_mode=mode, columnwise=cw)))
                for dt in HP_DTYPES:
                    c.append(Case("mx", Inp("nan_payloads", (64, 64), dt), fmt, _kw(scale_mode=mode, columnwise=cw)))
    for cw in (False, True):
        for shape in [(32, 32), (2, 32, 64), (96, 160), (7, 45), (33, 70), (0, 64)]:
            c.append(Case("mx", Inp("rand", shape, seed=8), E4, _kw(columnwise=cw)))
        c.append(Case("mx", Inp("rand", (96, 64), BF16, transposed=True), E4, _kw(columnwise=cw)))
    c.append(Case("mx", Inp("ties", (64, 64), fmt=E4), E4, _kw(scale_mode="floor")))
    c.append(Case("mx", Inp("specials", (1024, 1024)), E4, _kw(columnwise=True)))
    # -- MXFP4 / MXFP6 (both usages per launch unless asked otherwise)
    for element in MX_ELEMENTS:
        for mode in ("rceil", "floor"):
            for kind in ("specials", "mx_ties", "zeros", "subnormal", "huge", "outlier", "nan_inf"):
                shape = (64, 96) if kind in ("specials", "mx_ties") else (64, 64)
                c.append(Case("mx_coded", Inp(kind, shape), None, _kw(element=element, scale_mode=mode)))
        for dt in HP_DTYPES:
            c.append(Case("mx_coded", Inp("nan_payloads", (64, 64), dt), None, _kw(element=element)))
            c.append(Case("mx_coded", Inp("specials", (33, 70), dt, seed=1), None,
                          _kw(element=element, scale_mode="floor")))
        for shape in [(1, 1), (7, 45), (33, 71), (2, 32, 65), (0, 64), (64, 0)]:
            c.append(Case("mx_coded", Inp("rand", shape, seed=10), None, _kw(element=element)))
        c.append(Case("mx_coded", Inp("rand", (96, 65), BF16, transposed=True), None, _kw(element=element)))
        for rw, cw in ((True, False), (False, True)):
            c.append(Case("mx_coded", Inp("specials", (40, 70), BF16), None,
                          _kw(element=element, rowwise=rw, columnwise=cw)))
    c.append(Case("mx_coded", Inp("rand", (256, 512), seed=11), None, _kw(element="e2m1")))
    # -- FP8 -> bf16
    for fmt in (E4, E5):
        c.append(Case("bf16", Inp("codes", (256,), fmt=fmt), fmt))
        c.append(Case("bf16", Inp("codes", (24, 40), seed=9, fmt=fmt, transposed=True), fmt))
    c.append(Case("bf16", Inp("codes", (0, 3), fmt=E4), E4))
    # -- errors: the same exception type as the reference
    for op in ("cast_transpose", "mx"):
        for kind in ("int", "f64"):
            c.append(Case(op, Inp(kind, (4, 32)), E4, scale=1.0 if op == "cast_transpose" else None, name="error"))
    for kind in ("int", "f64"):  # the reference's quantize_block takes any dtype (its callers check)
        c.append(Case("block", Inp(kind, (4, 32)), E4, _kw(tile_rows=1)))
    c.append(Case("cast_transpose", Inp("rand", (4, 32)), F16, scale=1.0, name="error"))
    c.append(Case("block", Inp("rand", (4, 32)), torch.int8, _kw(tile_rows=1), name="error"))
    c.append(Case("mx", Inp("rand", (4, 32)), F16, name="error"))
    c.append(Case("mx", Inp("rand", (4, 32)), E4, _kw(scale_mode="nearest"), name="error"))
    c.append(Case("mx_coded", Inp("int", (4, 32)), None, _kw(element="e2m1"), name="error"))
    c.append(Case("mx_coded", Inp("rand", (4, 32)), None, _kw(element="e3m2", scale_mode="nearest"), name="error"))
    ids = [x.id for x in c]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    return c


CASES = build_cases()
BY_ID = {c.id: c for c in CASES}


def run_case(mod, case: Case):
    """Run `case` through `mod` (the reference, or engine.ops.triton in a worker)."""
    x = make_input(case.inp)
    kw = dict(case.kw)
    if case.op == "cast":  # the rounding helper alone (the reference: clamp + torch's cast)
        if mod is ref:
            return (ref.cast_to_fp8(x, case.fmt),)
        from engine.ops.triton import fp8_bits

        return (fp8_bits.cast_to_fp8(x, case.fmt, block=1 << 16),)
    if case.op == "amax":
        return (mod.amax(x),)
    if case.op == "cast_transpose":
        return mod.cast_transpose(x, torch.tensor([case.scale]), case.fmt, **kw)
    if case.op == "block":
        kw.setdefault("tile_cols", 128)
        return mod.quantize_block(x, case.fmt, **kw)
    if case.op == "mx":
        return mod.quantize_mxfp8(x, case.fmt, **kw)
    if case.op == "mx_coded":
        kw["element"] = MX_ELEMENTS[kw["element"]]
        return mod.quantize_mx_coded(x, **kw) if mod is not ref else reference_mx_coded(x, **kw)
    if case.op == "bf16":
        return (mod.fp8_to_bf16(x),)
    raise ValueError(case.op)


def reference_mx_coded(x: torch.Tensor, element, scale_mode: str = "rceil", rowwise: bool = True,
                       columnwise: bool = True) -> tuple:
    """The reference's two usages in the order of `quantize_mx_coded`: (data, codes, data_t, codes_t)."""
    ref.check_input(x)
    scheme = mx_scheme(element)
    out = [None] * 4
    for i, (usage, wanted) in enumerate((("rowwise", rowwise), ("columnwise", columnwise))):
        if wanted:
            out[2 * i], out[2 * i + 1] = ref.quantize_blocked(x, scheme, columnwise=usage == "columnwise",
                                                              scale_mode=scale_mode)
    return tuple(out)


# ------------------------------------------------------------------------------- the workers
def _partition(cases: list[Case], count: int) -> list[list[Case]]:
    """Split the cases into `count` groups of about equal interpreter time (greedy on a cost
    estimate: elements, plus a fixed cost per launch)."""
    groups: list[list[Case]] = [[] for _ in range(count)]
    load = [0.0] * count
    for case in sorted(cases, key=lambda c: -(math.prod(c.inp.shape) + 20_000)):
        i = load.index(min(load))
        groups[i].append(case)
        load[i] += math.prod(case.inp.shape) + 20_000
    return groups


def _worker(out_path: str, index: int, count: int) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "the worker must run under TRITON_INTERPRET=1"
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore", category=RuntimeWarning)  # numpy's overflow notes in the interpreter
    import engine.ops.triton as triton_ops

    results: dict[str, Any] = {}
    start = time.perf_counter()
    for case in _partition(CASES, count)[index]:
        t0 = time.perf_counter()
        try:
            out = run_case(triton_ops, case)
            results[case.id] = {"out": tuple(out), "seconds": time.perf_counter() - t0}
        except Exception as exc:  # recorded; the test decides whether an error was expected
            results[case.id] = {"error": type(exc).__name__, "message": str(exc), "seconds": time.perf_counter() - t0}
    from engine.ops.triton.fp8_bits import fp8_params

    results["__meta__"] = {"seconds": time.perf_counter() - start, "interpret": os.environ["TRITON_INTERPRET"],
                           "fp8_params": {str(d): tuple(fp8_params(d)) for d in (E4, E5)}}
    torch.save(results, out_path)


# ------------------------------------------------------- compiling for real GPUs, without one
# Triton compiles for a given target without a device (its ptxas is bundled): every kernel is
# compiled to PTX and cubin for sm_80 and sm_90 with the launchers' argument types, which
# catches what the permissive interpreter does not (types, layouts, unsupported ops), and the
# PTX is checked for what bit-exactness relies on.
_PTR = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}
_E4M3_C = dict(MAN_BITS=3, BIAS=7, MAX_CODE=0x7E)
_E5M2_C = dict(MAN_BITS=2, BIAS=15, MAX_CODE=0x7B)
GPU_ARCHS = (80, 90)
# launch options a launcher passes besides num_warps (compiled with them here, as it runs)
LAUNCH_OPTIONS = {"nvfp4_4over6._nvfp4_4over6_kernel": {"enable_fp_fusion": False}}


def _compile_jobs() -> list[tuple[str, str, dict, dict]]:
    """(module, kernel, argument types, constexprs) for every kernel and the configurations
    the launchers use."""
    jobs = []
    for dt in ("fp32", "bf16"):
        jobs.append(("fp8_bits", "_fp32_to_fp8_kernel", dict(x_ptr=_PTR[dt], out_ptr="*u8", n="i32"),
                     dict(_E4M3_C, BLOCK=1024)))
    jobs.append(("cast_transpose", "_amax_kernel", dict(x_ptr="*bf16", amax_ptr="*i32", n="i32"), dict(BLOCK=4096)))
    for dt, (rw, cw), fmt in [("fp32", (True, True), _E4M3_C), ("fp16", (True, False), _E5M2_C),
                              ("bf16", (False, True), _E4M3_C)]:
        jobs.append(("cast_transpose", "_cast_transpose_kernel",
                     dict(x_ptr=_PTR[dt], scale_ptr="*fp32", out_ptr="*u8" if rw else "*i32",
                          out_t_ptr="*u8" if cw else "*i32", amax_ptr="*i32", M="i32", K="i32",
                          stride_xm="i32", stride_xk="i32"),
                     dict(fmt, ROWWISE=rw, COLUMNWISE=cw, BLOCK_M=64, BLOCK_K=64)))
    block_types = dict(out_ptr="*u8", sinv_ptr="*fp32", M="i32", K="i32", stride_xm="i32", stride_xk="i32",
                       n_tiles_k="i32", eps_bits="i32", vfi_bits="i32")
    for dt, pow2 in (("bf16", True), ("fp32", False)):
        jobs.append(("block", "_block_rows_kernel", dict(block_types, x_ptr=_PTR[dt]),
                     dict(_E4M3_C, FP8_MAX=448.0, POW2=pow2, TILE_C=128, TILE_C_P2=128, ROWS=32)))
        jobs.append(("block", "_block_tiles_kernel", dict(block_types, x_ptr=_PTR[dt]),
                     dict(_E4M3_C, FP8_MAX=448.0, POW2=pow2, TILE_R=128, TILE_C=128, TILE_C_P2=128, CHUNK=32)))
    for dt, floor, cw in (("bf16", False, False), ("fp32", True, True), ("fp16", False, True)):
        jobs.append(("mxfp8", "_mxfp8_kernel",
                     dict(x_ptr=_PTR[dt], out_ptr="*u8", code_ptr="*u8", M="i32", K="i32", stride_xm="i32",
                          stride_xk="i32", rcp_bits="i32"),
                     dict(_E4M3_C, EMAX=8, FLOOR=floor, COLUMNWISE=cw, BLOCK_M=64, BLOCK_K=128)))
    for dt, (man, bias, bits, emax), floor, (rw, cw) in (("bf16", (1, 1, 4, 2), False, (True, True)),
                                                         ("fp32", (3, 1, 6, 2), True, (True, False)),
                                                         ("fp16", (2, 3, 6, 4), False, (False, True))):
        jobs.append(("mx_small", "_mx_small_kernel",
                     dict(x_ptr=_PTR[dt], row_ptr="*u8", row_code_ptr="*u8", col_ptr="*u8", col_code_ptr="*u8",
                          M="i32", K="i32", stride_xm="i32", stride_xk="i32", rcp_bits="i32"),
                     dict(MAN_BITS=man, BIAS=bias, CODE_BITS=bits, EMAX=emax, FLOOR=floor, ROWWISE=rw,
                          COLUMNWISE=cw, BLOCK_M=64, BLOCK_K=128)))
    for dt, two_d, sr in (("bf16", False, True), ("fp32", True, False), ("fp16", False, False)):
        jobs.append(("nvfp4", "_nvfp4_kernel",
                     dict(x_ptr=_PTR[dt], data_ptr="*u8", scale_ptr="*u8", amax_params_ptr="*fp32",
                          counter_ptr="*i64" if sr else "*fp32", R="i32", C="i32", stride_xr="i32", stride_xc="i32",
                          index_base="i64"),
                     dict(TWO_D=two_d, STOCHASTIC=sr, BLOCK_R=64, BLOCK_C=128)))
    jobs.append(("nvfp4", "_rht_kernel", dict(x_ptr="*bf16", h_ptr="*fp32", y_ptr="*i16", M="i32", K="i32",
                                               stride_xm="i32", stride_xk="i32"), dict(BLOCK_J=8, BLOCK_K=64)))
    for dt, two_d, mse in (("bf16", False, True), ("fp32", True, True), ("fp16", False, False), ("bf16", True, False)):
        jobs.append(("nvfp4_4over6", "_nvfp4_4over6_kernel",
                     dict(x_ptr=_PTR[dt], data_ptr="*u8", scale_ptr="*u8", params_ptr="*fp32", R="i32", C="i32",
                          stride_xr="i32", stride_xc="i32"),
                     dict(TWO_D=two_d, MSE=mse, BLOCK_R=64, BLOCK_C=128)))
    for fmt in ((3, 4, 7, False), (2, 5, 15, True)):
        jobs.append(("convert", "_fp8_to_bf16_kernel", dict(in_ptr="*u8", out_ptr="*i16", n="i32"),
                     dict(zip(("MAN_BITS", "EXP_BITS", "BIAS", "IEEE_LIKE"), fmt), BLOCK=4096)))
    return jobs


def _compile_worker(out_path: str) -> None:
    import importlib
    import json
    import re
    import warnings

    assert not os.environ.get("TRITON_INTERPRET"), "compiling needs the real (non-interpreted) JIT"
    warnings.simplefilter("ignore")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    report = []
    for module, kernel, types, consts in _compile_jobs():
        fn = getattr(importlib.import_module(f"engine.ops.triton.{module}"), kernel)
        sig = {name: ("constexpr" if name in consts else types[name]) for name in fn.arg_names}
        options = {"num_warps": 4, **LAUNCH_OPTIONS.get(f"{module}.{kernel}", {})}
        for arch in GPU_ARCHS:
            entry = {"kernel": f"{module}.{kernel}", "arch": arch, "consts": repr(consts)}
            try:
                k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", arch, 32),
                                   options=options)
                ptx = k.asm["ptx"]
                entry.update(
                    cubin_bytes=len(k.asm["cubin"]),
                    f32_ops=sorted(set(re.findall(r"\b(?:add|sub|mul|div|fma|mad|max|min|rcp)\.[a-z.]*f32\b", ptx))),
                    fp8_cvt=sorted(set(re.findall(r"\bcvt\.[a-z0-9.]*e[45]m[23][a-z0-9.]*", ptx))),
                )
            except Exception as exc:  # reported, and the test fails on it
                entry["error"] = f"{type(exc).__name__}: {exc}"[:3000]
            report.append(entry)
    with open(out_path, "w") as f:
        json.dump(report, f)


# ---------------------------------------------------------------------- running the subprocesses
@pytest.fixture(scope="module")
def subprocess_results(tmp_path_factory) -> dict[str, Any]:
    """Start the interpreter workers and the GPU-compile check at once (they overlap on the
    two cores), wait for all, and load what they wrote."""
    import json

    tmp = tmp_path_factory.mktemp("triton")
    base = dict(os.environ, OMP_NUM_THREADS="1")
    base["PYTHONPATH"] = os.pathsep.join([str(REPO), base.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    base.pop("TRITON_INTERPRET", None)
    procs = []
    for i in range(N_WORKERS):
        path = tmp / f"worker{i}.pt"
        procs.append(("interp", path, [sys.executable, __file__, "--worker", str(path), str(i), str(N_WORKERS)],
                      dict(base, TRITON_INTERPRET="1")))
    path = tmp / "compile.json"
    procs.append(("compile", path, [sys.executable, __file__, "--compile", str(path)], base))
    running = [(kind, path, subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True))
               for kind, path, cmd, env in procs]
    merged: dict[str, Any] = {"__meta__": []}
    compiled = None
    for kind, path, proc in running:
        try:
            _, err = proc.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        assert proc.returncode == 0, f"{kind} subprocess failed:\n{err[-5000:]}"
        if kind == "compile":
            with open(path) as f:
                compiled = json.load(f)
        else:
            part = torch.load(path, weights_only=False)
            merged["__meta__"].append(part.pop("__meta__"))
            merged.update(part)
    return {"interp": merged, "compile": compiled}


@pytest.fixture(scope="module")
def triton_results(subprocess_results) -> dict[str, Any]:
    return subprocess_results["interp"]


@pytest.fixture(scope="module")
def gpu_compile_report(subprocess_results) -> list[dict]:
    return subprocess_results["compile"]


# ------------------------------------------------------------------------------- comparisons
def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in (E4, E5):
        return t.view(torch.uint8)
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    return t


def assert_same(got, want, what: str) -> None:
    if want is None:
        assert got is None, f"{what}: expected None"
        return
    assert isinstance(got, torch.Tensor), f"{what}: expected a tensor, got {type(got).__name__}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.is_contiguous(), f"{what}: not contiguous"
    g, w = _bits(got).reshape(-1), _bits(want).reshape(-1)  # NaN bits included
    bad = (g != w).nonzero().flatten()
    if len(bad):
        i = int(bad[0])
        gv, wv = got.reshape(-1)[i], want.reshape(-1)[i]
        raise AssertionError(f"{what}: {len(bad)} of {g.numel()} differ; first at flat index {i}: "
                             f"got bits {int(g[i])} ({float(gv.float())}), want bits {int(w[i])} ({float(wv.float())})")


def check_case(case: Case, results: dict[str, Any]) -> None:
    res = results[case.id]
    if case.name == "error":
        with pytest.raises(Exception) as info:
            run_case(ref, case)
        assert "error" in res, f"expected {type(info.value).__name__} like the reference, got outputs"
        assert res["error"] == type(info.value).__name__, (res["error"], res["message"], info.value)
        return
    assert "error" not in res, f"{res.get('error')}: {res.get('message')}"
    want = run_case(ref, case)
    got = res["out"]
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert_same(g, w, f"{case.id} output {k}")


def _ids(op: str) -> list[str]:
    return [c.id for c in CASES if c.op == op]


# ------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("case_id", _ids("cast"))
def test_rounding_helper_matches_torch(case_id, triton_results):
    """fp32_to_fp8_bits on all 2^16 bf16 patterns, a dense fp32 sample and the specials."""
    check_case(BY_ID[case_id], triton_results)


@pytest.mark.parametrize("case_id", _ids("amax"))
def test_amax(case_id, triton_results):
    check_case(BY_ID[case_id], triton_results)


@pytest.mark.parametrize("case_id", _ids("cast_transpose"))
def test_cast_transpose(case_id, triton_results):
    check_case(BY_ID[case_id], triton_results)


@pytest.mark.parametrize("case_id", _ids("block"))
def test_quantize_block(case_id, triton_results):
    check_case(BY_ID[case_id], triton_results)


@pytest.mark.parametrize("case_id", _ids("mx"))
def test_quantize_mxfp8(case_id, triton_results):
    check_case(BY_ID[case_id], triton_results)


@pytest.mark.parametrize("case_id", _ids("mx_coded"))
def test_quantize_mx_coded(case_id, triton_results):
    """MXFP4 / MXFP6 (E2M1, E2M3, E3M2), both usages from one launch, against the reference."""
    check_case(BY_ID[case_id], triton_results)


@pytest.mark.parametrize("case_id", _ids("bf16"))
def test_fp8_to_bf16(case_id, triton_results):
    check_case(BY_ID[case_id], triton_results)


def test_cases_cover_the_brief():
    """The case list has what the kernels must be checked on (guards against it shrinking)."""
    ops = {c.op for c in CASES}
    assert ops == {"cast", "amax", "cast_transpose", "block", "mx", "mx_coded", "bf16"}
    coded = [c for c in CASES if c.op == "mx_coded" and c.name != "error"]
    assert {dict(c.kw)["element"] for c in coded} == set(MX_ELEMENTS)
    assert {(dict(c.kw)["element"], dict(c.kw).get("scale_mode", "rceil")) for c in coded} == {
        (e, m) for e in MX_ELEMENTS for m in ("rceil", "floor")}
    assert {c.inp.dtype for c in coded} == set(HP_DTYPES) and any(c.inp.transposed for c in coded)
    assert {c.inp.kind for c in coded} >= {"specials", "mx_ties", "zeros", "subnormal", "huge", "nan_inf",
                                           "nan_payloads", "rand"}
    for op in ("cast_transpose", "block", "mx"):
        sel = [c for c in CASES if c.op == op and c.name != "error"]
        assert {c.inp.dtype for c in sel} == set(HP_DTYPES), op
        assert {c.fmt for c in sel} == {E4, E5}, op
        assert any(c.inp.transposed for c in sel), op
        assert any(max(c.inp.shape) >= 1024 for c in sel), op
    assert {dict(c.kw).get("scale_mode", "rceil") for c in CASES if c.op == "mx"} >= {"rceil", "floor"}
    assert {dict(c.kw).get("force_pow_2_scales", True) for c in CASES if c.op == "block"} == {True, False}
    assert {dict(c.kw).get("tile_rows") for c in CASES if c.op == "block"} >= {1, 128}
    # NaNs of both signs and several payloads, in every input dtype, for every op and format
    for op in ("cast", "amax", "cast_transpose", "block", "mx"):
        sel = [c for c in CASES if c.op == op and c.inp.kind == "nan_payloads"]
        assert {c.inp.dtype for c in sel} == set(HP_DTYPES), op
        if op != "amax":
            assert {c.fmt for c in sel} == {E4, E5}, op
    mx_nan = {(dict(c.kw).get("scale_mode"), dict(c.kw).get("columnwise")) for c in CASES
              if c.op == "mx" and c.inp.kind == "nan_payloads"}
    assert mx_nan == {(m, cw) for m in ("rceil", "floor") for cw in (False, True)}
    # the values the interpreter's own FP8 cast gets wrong are among the specials
    for v in (7.98, 1.0625, 3 * 2.0**-10, 500.0, 1e30):
        assert v in SPECIALS
    want = ref.cast_to_fp8(torch.tensor([7.98, 1.0625, 1.1875, 3 * 2.0**-10, 500.0]), E4).float()
    assert want.tolist() == [8.0, 1.0, 1.25, 2.0**-8, 448.0]


def test_workers_ran_under_the_interpreter(triton_results):
    meta = triton_results["__meta__"]
    assert len(meta) == N_WORKERS and all(m["interpret"] == "1" for m in meta)
    assert {k for k in triton_results if k != "__meta__"} == set(BY_ID)


def test_kernel_format_constants_match_engine_formats(triton_results):
    """The constants the kernels are specialised on (fp8_bits.fp8_params) follow engine.formats."""
    for d in (E4, E5):
        f = format_of(d)
        man, exp, bias, max_code, ieee_like, max_value, emax = triton_results["__meta__"][0]["fp8_params"][str(d)]
        assert (man, exp, bias, ieee_like, max_value, emax) == (
            f.mantissa_bits, f.exponent_bits, f.bias, f.ieee_like, f.max, f.max_exponent)
        assert float(f.decode(torch.tensor([max_code]))) == f.max
        assert float(f.decode(torch.tensor([max_code + 1]))) > f.max or math.isnan(f.decode(torch.tensor([max_code + 1])))


def test_kernels_compile_for_gpus(gpu_compile_report):
    """Every kernel compiles to cubin for sm_80 and sm_90, with no FP8 conversion instruction
    (the codes come from integer ops), IEEE divisions only (`div.rn.f32`, never the
    approximate `div.full`/`div.approx` that Triton's `/` lowers to), no flush-to-zero and
    no fused multiply-adds on fp32."""
    assert len(gpu_compile_report) == len(_compile_jobs()) * len(GPU_ARCHS)
    for e in gpu_compile_report:
        what = f"{e['kernel']} sm_{e['arch']} {e['consts']}"
        assert "error" not in e, f"{what}: {e.get('error')}"
        assert e["cubin_bytes"] > 0, what
        assert e["fp8_cvt"] == [], f"{what}: {e['fp8_cvt']}"
        for op in e["f32_ops"]:
            assert ".ftz" not in op and not op.startswith(("fma", "mad", "rcp")), f"{what}: {op}"
            assert not op.startswith("div") or op == "div.rn.f32", f"{what}: {op}"
    ops = {op for e in gpu_compile_report for op in e["f32_ops"]}
    assert "div.rn.f32" in ops and "mul.f32" in ops  # the scale rule's divisions and the scaling multiply


if __name__ == "__main__" and len(sys.argv) >= 2 and sys.argv[1] == "--worker":
    _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
if __name__ == "__main__" and len(sys.argv) >= 2 and sys.argv[1] == "--compile":
    _compile_worker(sys.argv[2])
