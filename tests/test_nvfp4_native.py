"""The C++ NVFP4 kernel (engine.ops.native.quantize_nvfp4, the registry's CPU entry) against the reference.

Bit for bit with `engine.ops.nvfp4.quantize` (data, E4M3 scales, amaxes; NaN included) for every
combination of usages x 2D tiles x RHT x stochastic rounding x given amaxes, on random data with
outliers and the edge cases (zeros, all-zero blocks, subnormal and zero block scales, +-max, inf, NaN,
odd and empty shapes, 3D input, exact ties of E2M1, E4M3 and the RHT's bf16 rounding), on both kernel
levels of the machine (baseline, avx2, avx512). Stochastic rounding: the same bits as `nvfp4_sr.random_bits` for the same
counter, and the counter advanced alike. Bad arguments get errors naming them.
"""

from __future__ import annotations

import functools
import types
import itertools
import math
import warnings

import pytest
import torch

from engine.ops import native, nvfp4, registry
from engine.quantizers import NVFP4Quantizer
from engine.schemes import RHT_SIGNS, SCHEMES
from tests.nvfp4_4over6_cases import FIELDS, mismatches, raw

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
RHT_SCHEME, PLAIN_SCHEME = SCHEMES["nvfp4_rht_e2m1"], SCHEMES["nvfp4_e2m1"]


# every instruction-set level this machine runs (each has its own compiled copy of the kernels)
ISAS = tuple(native.available_isas()) if native.available() else ("baseline",)


@pytest.fixture(params=ISAS)
def isa(request):
    assert native.available(), native.why_unavailable()
    with native.use_isa(request.param):
        yield request.param


# ------------------------------------------------------------------------------------------ inputs
def _finite_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def cases(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Inputs in `dtype`: random with outliers, and the edge cases."""
    g = torch.Generator().manual_seed(1)
    big = _finite_max(dtype)
    out = {}
    x = torch.randn(64, 130, generator=g) * torch.exp2(torch.randint(-6, 7, (64, 130), generator=g).float())
    x.view(-1, 10)[:, 3] *= 300  # outliers
    out["random+outliers"] = x.to(dtype)
    one = torch.rand(32, 48, generator=g) * 0.01
    one.view(32, 3, 16)[:, :, 5] = torch.randn(32, 3, generator=g) * 50  # one outlier per block
    out["one-outlier-per-block"] = one.to(dtype)
    out["zeros"] = torch.zeros(32, 48, dtype=dtype)
    z = torch.randn(48, 64, generator=g)
    z[:, 16:32] = 0  # all-zero rowwise blocks
    z[16:32] = 0  # all-zero columnwise blocks and 2D tiles
    z[40, 3] = -0.0
    out["zero-blocks"] = z.to(dtype)
    # tiny blocks next to a huge tensor amax: subnormal and zero E4M3 block scales
    span = -torch.arange(32, dtype=torch.float32)[:, None].expand(32, 32) * (2.0 if dtype != torch.float16 else 0.6)
    tiny = torch.rand(32, 32, generator=g) * torch.exp2(span) * (big / 4)
    tiny[0, 0] = big / 2
    out["tiny-next-to-huge"] = tiny.to(dtype)
    pm = torch.randn(32, 32, generator=g)
    pm[::3, ::5] = big
    pm[1::4, 2::7] = -big
    out["+-max"] = pm.to(dtype)
    inf = torch.randn(32, 40, generator=g)
    inf[3, 7], inf[20, 33] = float("inf"), float("-inf")
    out["inf"] = inf.to(dtype)
    nan = torch.randn(32, 40, generator=g)
    nan[5, 9] = float("nan")
    nan_bits = nan.to(dtype)
    nan_bits.view(-1)[100] = torch.tensor(float("-nan")).to(dtype)
    out["nan"] = nan_bits
    # bf16 rounding ties of the RHT: integers whose +-1/4 sums need more than 8 significant bits
    out["rht-ties"] = torch.randint(-256, 257, (32, 48), generator=g).float().to(dtype)
    # the RHT's summation order shows: tokens 2 and 3 of every 16 cancel in the first butterfly stage (for even
    # outputs) and would swallow token 0 in a plain sum over the tokens
    order = torch.randn(32, 48, generator=g)
    order.view(2, 16, 48)[:, 2:4] = 2.0**12 if dtype == torch.float16 else 2.0**40
    out["rht-order"] = order.to(dtype)
    for shape in ((17, 33), (1, 1), (16, 7), (33, 17), (0, 64), (32, 0), (0, 0)):
        out[f"shape {shape}"] = (torch.randn(*shape, generator=g) * 10).to(dtype)
    out["3d"] = (torch.randn(2, 24, 35, generator=g) * 3).to(dtype)
    out["1d"] = (torch.randn(40, generator=g)).to(dtype)
    return out


def ties(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact ties, with the tensor amax each needs (given): E2M1 midpoints (amax 2688: S_enc = 1 and blocks of
    amax 6 have scale 1, so x * enc = x) and E4M3 midpoints of the block scales (amax 448: S_enc * (1/6) = 1)."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    e2m1 = torch.zeros(16, 16)
    e2m1[:, 0] = 6.0
    e2m1[:7, 1:8] = mids  # row i: the midpoints, their negatives below
    e2m1[7:14, 1:8] = -mids
    e2m1[14, 1:8], e2m1[15, 1:8] = torch.nextafter(mids, torch.zeros(7)), torch.nextafter(mids, torch.full((7,), 9.0))
    codes = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3_mids = torch.cat([(codes[:-1] + codes[1:]) / 2, torch.tensor([464.0, 470.0])])  # 464: 448 / 480 tie
    e4m3 = torch.zeros(e4m3_mids.numel(), 16)
    e4m3[:, 3] = e4m3_mids
    return e2m1.to(dtype), e4m3.to(dtype)


# ------------------------------------------------------------------------------------------ helpers
def reference(x: torch.Tensor, scheme, counter: torch.Tensor | None, **opts) -> dict:
    out, _ = registry.quantize_nvfp4_reference(x, scheme, rng_counter=counter, **opts)
    return out


def kernel(x: torch.Tensor, scheme, counter: torch.Tensor | None, **opts) -> dict:
    out, _ = registry.quantize_nvfp4(native, x, scheme, rng_counter=counter, **opts)
    return out


OPTIONS = [
    dict(rowwise=rw, columnwise=cw, two_d=two_d, rht=rht, sr=sr, given=given)
    for (rw, cw), two_d, rht, sr, given in itertools.product(
        ((True, True), (True, False), (False, True)), (False, True), (False, True), (False, True), (False, True))
    if not (two_d and rht)
]


def compare(x: torch.Tensor, rowwise: bool, columnwise: bool, two_d: bool, rht: bool, sr: bool, given: bool,
            amaxes: tuple[float, float] = (5.0, 1e-3)) -> list[str]:
    scheme = RHT_SCHEME if rht else PLAIN_SCHEME
    m = math.prod(x.shape[:-1]) if x.dim() else 1  # the rows of x's 2D view
    opts = dict(rowwise=rowwise, columnwise=columnwise, two_d=two_d)
    if given:
        opts.update(amax_rowwise=torch.tensor([amaxes[0]]), amax_columnwise=torch.tensor([amaxes[1]]))
    counters = [torch.tensor([-(2**40) - 3, 2**32 - 77]) if sr else None for _ in range(2)]
    if rht and columnwise and m % 16:
        for fn, c in ((kernel, counters[0]), (reference, counters[1])):
            with pytest.raises(ValueError, match="multiple of 16"):
                fn(x, scheme, c, **opts)
        return []
    bad = mismatches(kernel(x, scheme, counters[0], **opts), reference(x, scheme, counters[1], **opts))
    if sr and not torch.equal(counters[0], counters[1]):
        bad.append(f"counter {counters[0].tolist()} vs {counters[1].tolist()}")
    return bad


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_option_matches_the_reference_bitwise(isa, dtype):
    bad = []
    for name, x in cases(dtype).items():
        for opt in OPTIONS:
            bad += [f"{name} {opt}: {b}" for b in compare(x, **opt)]
    assert not bad, bad[:10]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ties_of_elements_and_scales_round_as_the_reference(isa, dtype):
    e2m1, e4m3 = ties(dtype)
    bad = []
    for x, amax in ((e2m1, 2688.0), (e4m3, 448.0)):
        for opt in OPTIONS:
            if opt["given"]:
                bad += [f"{tuple(x.shape)} {opt}: {b}" for b in compare(x, **opt, amaxes=(amax, amax))]
    assert not bad, bad[:10]
    # the ties are where the reference says they are: E2M1 midpoints to the even code, E4M3 ones too
    out = reference(e2m1, PLAIN_SCHEME, None, rowwise=True, columnwise=False, amax_rowwise=torch.tensor([2688.0]))
    # 6, 0.25 | 0.75, 1.25 | 1.75, 2.5 | 3.5, 5 -> codes 7, 0 | 2, 2 | 4, 4 | 6, 6 (ties to the even code)
    low = out["rowwise_data"][0, :4] & 0xF
    assert low.tolist() == [7, 2, 4, 6] and (out["rowwise_data"][0, :4] >> 4).tolist() == [0, 2, 4, 6]


def _tiled(x: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """x's 2D view repeated to m x k."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2.repeat(-(-m // x2.shape[0]), -(-k // x2.shape[1]))[:m, :k].contiguous()


# Whole 16 x 128 tiles, whole bands of 8 strips (M % 128 == 0: whole 64-byte lines of columnwise data) and their
# partial edges (odd K, M not a multiple of 16)
FAST_SHAPES = ((256, 260), (137, 257))
FAST_OPTIONS = [opt for opt in OPTIONS if not opt["sr"]]  # 16x16 tiles too: one tensor scale takes the fast path


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_whole_finite_tiles_whose_rht_overflows_match_the_reference_bitwise(isa, dtype):
    """Finite whole tiles (no inf / NaN in x) whose RHT sums overflow to inf and inf - inf (NaN): the kernel
    drops its NaN masking only in tiles whose RHT cannot overflow."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(32, 256, generator=g) * 3).to(dtype)
    # columns 0..127 of the first strip: 2^127 times the RHT's signs, so that its 16 products with them are all
    # 2^125, whose sum overflows (the transform's first output inf, the second inf - inf)
    x[:16, :128] = (torch.tensor(RHT_SIGNS, dtype=torch.float32)[:, None] * 2.0**127).to(dtype)
    x[:16, 128:] *= 2.0**120  # finite RHT outputs next to it, of large values
    assert torch.isfinite(x).all()
    bad = [f"{opt}: {b}" for opt in FAST_OPTIONS if opt["rht"] for b in compare(x, **opt, amaxes=(1e38, 1e38))]
    assert not bad, bad[:10]


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_whole_tiles_and_bands_match_the_reference_bitwise(isa, dtype):
    """The AVX-512 kernel's fast path (round to nearest, tiles without inf / NaN) on the edge cases
    tiled to whole tiles and bands, next to tiles the fallback takes (inf, NaN), with the ties at their amaxes."""
    bad = []
    for name, x in cases(dtype).items():
        for m, k in FAST_SHAPES if x.numel() else ():
            big = _tiled(x, m, k)
            bad += [f"{name} {m}x{k} {opt}: {b}" for opt in FAST_OPTIONS for b in compare(big, **opt)]
    for x, amax in zip(ties(dtype), (2688.0, 448.0)):
        big = _tiled(x, 256, 260)
        bad += [f"ties {opt}: {b}" for opt in FAST_OPTIONS if opt["given"]
                for b in compare(big, **opt, amaxes=(amax, amax))]
    assert not bad, bad[:10]


def test_every_row_count_of_a_strip_matches_the_reference_bitwise(isa):
    """The fast path packs the rowwise bytes 4 rows at a time and keeps a band's 8 strips a cache line apart: a last
    strip of every height 1..16 (partial 4-row groups, a partial tile of 37 columns), and whole bands of 512
    columns (strip stride a multiple of 4 KiB but for the padding) next to a partial band."""
    g = torch.Generator().manual_seed(7)
    bad = []
    for m, k in [(16 + r, 293) for r in range(1, 17)] + [(147, 512)]:
        x = (torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-6, 7, (m, k), generator=g).float())).bfloat16()
        bad += [f"{m}x{k}: {b}" for b in compare(x, rowwise=True, columnwise=True, two_d=False, rht=False, sr=False,
                                                 given=False)]
    assert not bad, bad[:10]


def _normal_scale_tiles(dtype: torch.dtype) -> torch.Tensor:
    """256 x 256 with every 1x16 and 16x1 block's E4M3 scale normal at amax 448 (S_enc * (1/6) = 1, so a block's
    scale is its amax rounded to E4M3): values in [0.5, 1.5), one element per row block just below an E4M3
    midpoint (the scale rounds down: |x * enc| up to 6 * 1.0625) or on one, and E2M1 midpoints times the scale."""
    g = torch.Generator().manual_seed(5)
    x = torch.rand(256, 256, generator=g) + 0.5
    codes = torch.arange(8, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = ((codes[:-1] + codes[1:]) / 2).to(dtype)
    below = torch.nextafter(mids, torch.zeros_like(mids))
    picks = torch.cat([mids, below])[torch.randint(0, 2 * mids.numel(), (256, 16), generator=g)].float()
    x.view(256, 16, 16)[:, :, 7] = picks * torch.where(torch.rand(256, 16, generator=g) < 0.5, -1.0, 1.0)
    e2m1 = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]) / 6
    x.view(256, 16, 16)[::3, :, 2] = e2m1[torch.randint(0, 7, (86, 16), generator=g)] * x.view(256, 16, 16)[::3, :, 7].abs()
    return x.to(dtype)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_tiles_without_the_clamp_match_the_reference_bitwise(isa, dtype):
    """The AVX-512 fast path leaves out the clamp at 6 in tiles whose block scales are all normal and unsaturated
    (|x * enc| < 7 there): such tiles at their largest ratio (scales rounded down), next to tiles that need the
    clamp (a subnormal or zero scale, a saturated scale under a given amax, amaxes outside [2^-90, 2^90])."""
    x = _normal_scale_tiles(dtype)
    mixed = x.clone()
    mixed[16:32, 128:144] = 0  # one tile with zero blocks (zero scales)
    # a tile whose scales are normal but for subnormal ones: block amaxes near 1.45 * 2^-9 round down to the
    # smallest subnormal code, so |x * enc| reaches ~8.7 (no zero scales in the tile)
    mixed[64:80, 0:16] = (torch.rand(16, 16, generator=torch.Generator().manual_seed(6)) * 0.0018 + 0.001).to(dtype)
    bad = []
    for name, t in (("normal", x), ("mixed", mixed)):
        for opt in FAST_OPTIONS:
            if opt["given"]:
                # 300: the blocks of amax above ~310 saturate (key * S_enc / 6 above 464), the others do not
                for amaxes in ((448.0, 448.0), (300.0, 300.0), (100.0, 448.0), (448.0, 2.0)):
                    bad += [f"{name} {amaxes} {opt}: {b}" for b in compare(t, **opt, amaxes=amaxes)]
            else:
                bad += [f"{name} {opt}: {b}" for b in compare(t, **opt)]
    for k in (-100, 100, -60, 60):  # tensor amaxes outside [2^-90, 2^90], and inside
        scaled = (x.float() * 2.0**k).to(dtype)
        for opt in FAST_OPTIONS:
            amaxes = (448.0 * 2.0**k, 448.0 * 2.0**k)
            bad += [f"2^{k} {opt}: {b}" for b in compare(scaled, **opt, amaxes=amaxes)]
    assert not bad, bad[:10]


def test_fast_path_on_two_threads(isa):
    """Two threads: a thread's range of tiles then starts inside a strip and inside a band."""
    inputs = cases(torch.bfloat16)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    bad = []
    try:
        for name in ("random+outliers", "nan"):
            for m, k in ((256, 260), (240, 260)):
                big = _tiled(inputs[name], m, k)
                bad += [f"{name} {m}x{k} {opt}: {b}" for opt in FAST_OPTIONS if opt["rowwise"] and opt["columnwise"]
                        for b in compare(big, **opt)]
    finally:
        torch.set_num_threads(previous)
    assert not bad, bad[:10]


def test_large_tensor_spans_threads_and_tiles(isa):
    """More tiles than threads, rows and columns not multiples of the tile: every split gives the same bits."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(272, 1000, generator=g) * torch.exp2(torch.randint(-10, 10, (272, 1000), generator=g))).bfloat16()
    bad = []
    for threads in (1, 2):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for opt in (dict(two_d=False, rht=True), dict(two_d=True, rht=False)):
                bad += compare(x, rowwise=True, columnwise=True, sr=True, given=False, **opt)
        finally:
            torch.set_num_threads(previous)
    assert not bad, bad


def test_stochastic_rounding_bits_and_counter():
    """The in-kernel bits are nvfp4_sr.random_bits of the counter (rowwise first, then columnwise), across the
    carries of the offset's word into its high half and for negative seeds and offsets, and the counter advances by
    both usages' elements."""
    x = torch.randn(16, 300) * 3
    for seed, offset in ((0, 0), (-5, 2**34 - 1001), (2**62 + 12345, -(2**40) - 3)):
        got_counter, want_counter = torch.tensor([seed, offset]), torch.tensor([seed, offset])
        got = kernel(x, PLAIN_SCHEME, got_counter, rowwise=True, columnwise=True)
        want = reference(x, PLAIN_SCHEME, want_counter, rowwise=True, columnwise=True)
        assert not mismatches(got, want), (seed, offset)
        assert got_counter.tolist() == want_counter.tolist() == [seed, offset + 2 * x.numel()]
    # another counter gives other bits (the kernel reads it)
    a = kernel(x, PLAIN_SCHEME, torch.tensor([1, 0]), rowwise=True, columnwise=False)["rowwise_data"]
    b = kernel(x, PLAIN_SCHEME, torch.tensor([2, 0]), rowwise=True, columnwise=False)["rowwise_data"]
    assert not torch.equal(a, b)


def test_stochastic_rounding_counter_carries_at_every_lane(isa):
    """The low half of the counter's word (index >> 2) wrapping inside a run of elements the kernel mixes together
    (32 columns of a row: 9 words, 16 rows of a column: 5), at every position of the run and every index mod 4:
    the lanes past it take the next high half."""
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(32, 160, generator=g) * 3).bfloat16()
    m, k = x.shape
    offsets = [2**34 - d for d in range(1, 37)] + [2**34 - m * k - d for d in range(1, 21)]  # rows, then columns
    bad = []
    for offset in offsets:
        got = kernel(x, PLAIN_SCHEME, torch.tensor([77, offset]), rowwise=True, columnwise=True)
        want = reference(x, PLAIN_SCHEME, torch.tensor([77, offset]), rowwise=True, columnwise=True)
        bad += [f"offset 2^34 - {2**34 - offset}: {b}" for b in mismatches(got, want)]
    assert not bad, bad[:10]


def _every_binade_with_scale_one() -> torch.Tensor:
    """[16, n] fp32: values of every binade from 2^-149 to 6 (random mantissas, both signs), the E2M1 grid values,
    their neighbours and midpoints, with 6 in row 0 and in every 16th column: with the tensor amax 2688 given,
    every block scale (rowwise and columnwise) is 1 (S_enc = 1, E4M3(6 / 6)), so each element is rounded as it is."""
    g = torch.Generator().manual_seed(11)
    exps = torch.arange(-149, 2).repeat_interleave(8)
    mant = torch.randint(0, 2**23, exps.shape, generator=g)
    swept = torch.ldexp(1.0 + mant.double() / 2**23, exps.double()).float()  # (below 2^-126: subnormal, rounded)
    swept = torch.cat([swept, 4.0 + 2.0 * torch.rand(16, generator=g)])  # and [4, 6)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    near = torch.cat([grid, torch.nextafter(grid, torch.zeros_like(grid)), torch.nextafter(grid, grid + 1)])
    values = torch.cat([swept, near]).repeat(3)
    values = values * torch.where(torch.rand(values.shape, generator=g) < 0.5, -1.0, 1.0)
    x = torch.cat([values, torch.zeros((-values.numel()) % (16 * 16))]).view(16, -1)
    x[0], x[:, ::16] = 6.0, 6.0
    return x


def test_stochastic_rounding_of_every_binade_matches_the_reference(isa):
    """The kernel's fixed-point form of the stochastic rule (the carry of a's 8 bits below its grid step plus the
    random byte) against the reference's on elements of every fp32 binade, the grid values, their neighbours and
    midpoints, each rounded as it is (scale 1), with many random bytes each (both usages, several counters)."""
    x = _every_binade_with_scale_one()
    bad = []
    for seed in (3, 4, 5, 6):
        opts = dict(rowwise=True, columnwise=True, amax_rowwise=torch.tensor([2688.0]),
                    amax_columnwise=torch.tensor([2688.0]))
        got = kernel(x, PLAIN_SCHEME, torch.tensor([seed, 0]), **opts)
        want = reference(x, PLAIN_SCHEME, torch.tensor([seed, 0]), **opts)
        bad += [f"seed {seed}: {b}" for b in mismatches(got, want)]
    assert not bad, bad[:10]


@functools.lru_cache(maxsize=None)
def _streamed_case() -> tuple[torch.Tensor, dict]:
    """2048 x 4096 bf16 (4 MB of packed data per usage: the kernel writes both around the caches, in whole lines) and
    the reference's outputs for both usages, the RHT'd columnwise one and stochastic rounding."""
    g = torch.Generator().manual_seed(12)
    x = (torch.randn(2048, 4096, generator=g) * 3).bfloat16()
    return x, reference(x, RHT_SCHEME, torch.tensor([5, 0]), rowwise=True, columnwise=True)


def test_outputs_streamed_around_the_caches_match_the_reference_bitwise(isa):
    """Outputs of at least 4 MB leave through stream stores (vec::store_stream), each tile's rows and each band's
    columns as whole lines: the same bits, on two threads (each ending its stores with a fence)."""
    x, want = _streamed_case()
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = kernel(x, RHT_SCHEME, torch.tensor([5, 0]), rowwise=True, columnwise=True)
    finally:
        torch.set_num_threads(previous)
    assert not mismatches(got, want)


@functools.lru_cache(maxsize=None)
def _big_nvfp4_input() -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return (torch.randn(64, 512, generator=g) * 4).bfloat16()


def test_the_quantizer_runs_the_kernel_without_a_warning_and_the_reference_when_forced(monkeypatch):
    x = _big_nvfp4_input()
    monkeypatch.delenv("ENGINE_BACKEND", raising=False)
    registry._resolve.cache_clear()
    calls = []
    real = native.quantize_nvfp4
    monkeypatch.setattr(native, "quantize_nvfp4", lambda *a, **k: calls.append(1) or real(*a, **k))
    quantizers = [NVFP4Quantizer(with_rht=True, stochastic_rounding=True, rng_counter=torch.tensor([7, 0]))
                  for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = quantizers[0](x).qstorage.buffers()
    assert calls == [1]
    monkeypatch.setenv("ENGINE_BACKEND", "reference")
    try:
        want = quantizers[1](x).qstorage.buffers()
    finally:
        registry._resolve.cache_clear()
    assert calls == [1]  # the forced reference did not call the kernel
    assert torch.equal(quantizers[0].rule.rng_counter, quantizers[1].rule.rng_counter)
    for field in FIELDS:
        assert torch.equal(raw(got[field]), raw(want[field])), field


def test_forced_triton_selects_the_triton_nvfp4_kernel(monkeypatch):
    """ENGINE_BACKEND=triton picks the Triton NVFP4 kernel (tests/test_triton_nvfp4.py checks its bits under
    the interpreter); on CUDA tensors it is the default."""
    import functools

    from engine.ops import triton as triton_kernels

    monkeypatch.setenv("ENGINE_BACKEND", "triton")
    registry._resolve.cache_clear()
    try:
        for layout in ("nvfp4", "nvfp4_rht"):
            fn = registry.kernel("quantize", layout, "cpu")
            assert isinstance(fn, functools.partial) and fn.func is registry.quantize_nvfp4
            assert fn.args == (triton_kernels,)
    finally:
        registry._resolve.cache_clear()
    monkeypatch.delenv("ENGINE_BACKEND")
    fn = registry.kernel("quantize", "nvfp4", "cuda")
    registry._resolve.cache_clear()
    assert fn.func is registry.quantize_nvfp4 and fn.args == (triton_kernels,)


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("call, error, match", [
    (lambda x: native.quantize_nvfp4([1.0]), TypeError, "x: expected a torch.Tensor"),
    (lambda x: native.quantize_nvfp4(x.int()), TypeError, "x: expected dtype"),
    (lambda x: native.quantize_nvfp4(x.to("meta")), TypeError, "x"),
    (lambda x: native.quantize_nvfp4(x, rowwise=1), TypeError, "rowwise: expected a bool"),
    (lambda x: native.quantize_nvfp4(x, rht="yes"), TypeError, "rht: expected a bool"),
    (lambda x: native.quantize_nvfp4(x, two_d=True, rht=True), ValueError, "two_d and rht"),
    (lambda x: native.quantize_nvfp4(x[:17], rht=True), ValueError, "multiple of 16"),
    (lambda x: native.quantize_nvfp4(x, amax=torch.tensor([3])), TypeError, "amax: expected a floating-point"),
    (lambda x: native.quantize_nvfp4(x, amax_t=torch.ones(2)), ValueError, "amax_t: expected a 1-element"),
    (lambda x: native.quantize_nvfp4(x, amax=3.0), TypeError, "amax"),
    (lambda x: native.quantize_nvfp4(x, counter=torch.zeros(2, dtype=torch.int32)), TypeError, "counter: expected"),
    (lambda x: native.quantize_nvfp4(x, counter=torch.zeros(3, dtype=torch.int64)), TypeError, "counter: expected"),
    (lambda x: native.quantize_nvfp4(x, counter=torch.zeros(2, dtype=torch.int64, device="meta")), TypeError,
     "counter"),
])
def test_bad_arguments_are_refused_with_their_name(call, error, match):
    with pytest.raises(error, match=match):
        call(torch.randn(32, 32))


def test_the_extension_checks_its_arguments_too():
    ext = native._ext()
    x = torch.randn(32, 32)
    with pytest.raises(TypeError, match="counter"):
        ext.quantize_nvfp4(x, True, True, False, False, None, None, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(TypeError, match="amax: expected a float32"):
        ext.quantize_nvfp4(x, True, True, False, False, torch.ones(1, dtype=torch.float64), None, None)
    with pytest.raises(ValueError, match="x: expected the 2D view"):
        ext.quantize_nvfp4(x[None], True, True, False, False, None, None, None)
    with pytest.raises(ValueError, match="multiple of 16"):
        ext.quantize_nvfp4(x[:5], True, True, False, True, None, None, None)


def test_the_stages_benchmark_names_every_stage_and_derives_the_differences(capsys):
    """`python -m engine bench nvfp4 --stages` on a tiny shape: a row per measured stage, and each derived row the
    difference of the two measured rows it names (recomputed here from the printed table)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_nvfp4

    threads = torch.get_num_threads()
    assert bench_nvfp4.main(["--stages", "--size", "32", "64", "--runs", "1"]) == 0
    out = capsys.readouterr().out
    assert f"kernels: {native.isa()}, 1 thread" in out
    printed = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[-1].replace(".", "", 1).lstrip("-").isdigit():
            printed[" ".join(parts[:-2])] = float(parts[-2])
    assert set(bench_nvfp4.STAGES) <= set(printed)
    for name, a, b in bench_nvfp4.DERIVED:
        less = printed[b] if b else printed["rowwise alone, amax given"] + printed["columnwise alone, amax given"]
        assert printed[f"= {name}"] == pytest.approx(printed[a] - less, abs=2.5e-3)
    assert torch.get_num_threads() == threads  # measured on one thread, this process's setting given back
