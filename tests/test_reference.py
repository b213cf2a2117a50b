"""Tests of engine.ops.reference, the plain-PyTorch quantization of every scheme.

Expected values come from NUMERICS.md by hand (the arithmetic is in the comments) or from an
independent brute force written here: a saturating round-to-nearest-even onto the decoded
code table, and per-tile scale rules in plain Python (fp32 rounding via a float64 -> float32
conversion). Nothing is copied from running the code under test.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.formats import E4M3, E5M2
from engine.ops import reference as ref

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
FMT = {E4: E4M3, E5: E5M2}
FP8_DTYPES = [E4, E5]
IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FLT_MAX = torch.finfo(torch.float32).max
FMAX = {E4: 448.0, E5: 57344.0}
EMAX = {E4: 8, E5: 15}  # OCP MX emax of the element formats
HALF_ULP = {E4: 2.0**-4, E5: 2.0**-3}  # half an ulp, relative: 3 and 2 mantissa bits
MIN_SUB = {E4: 2.0**-9, E5: 2.0**-16}

fp8_ids = ["e4m3", "e5m2"]
dtype_ids = ["fp32", "bf16", "fp16"]
param_fp8 = pytest.mark.parametrize("fp8", FP8_DTYPES, ids=fp8_ids)
param_in = pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=dtype_ids)

PROPERTY = settings(max_examples=50, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Small tensors: intra-op threads only add OpenMP spin-waits (10x slower on a busy 2-core
    machine). Restored after this module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# =============================================================================== helpers
def to_f32(v: float) -> float:
    """Round a Python float to the nearest fp32 (RNE, overflow -> inf, subnormals kept)."""
    return torch.tensor(v, dtype=torch.float64).float().item()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def expected_codes(y: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """Saturating RNE by search on the decoded code table: |y| clamped to max, the nearer of the
    two codes around it, ties to the even code (mantissa LSB 0); sign bit copied from y (so -0.0
    is 0x80). NaN positions get 0 (check them apart)."""
    fmt = FMT[fp8]
    codes = torch.arange(128, dtype=torch.int64)
    values = fmt.decode(codes)
    keep = torch.isfinite(values)
    codes, values = codes[keep], values[keep]  # increasing with the code
    flat = y.reshape(-1)
    mag = torch.nan_to_num(flat.double().abs(), nan=0.0).clamp(max=fmt.max)
    hi = torch.searchsorted(values, mag).clamp(max=len(values) - 1)  # values[hi] >= mag
    lo = (hi - 1).clamp(min=0)  # values[lo] < mag (or lo == hi == 0 for mag == 0)
    d_lo, d_hi = mag - values[lo], values[hi] - mag
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    mcodes = torch.where(take_hi, codes[hi], codes[lo])
    sign = torch.signbit(flat).to(torch.int64) << 7
    result = torch.where(torch.isnan(flat), torch.zeros_like(mcodes), mcodes | sign)
    return result.to(torch.uint8).reshape(y.shape)


def assert_cast(got: torch.Tensor, y: torch.Tensor, fp8: torch.dtype) -> None:
    """`got` (FP8) is the saturating RNE cast of the fp32 values `y`, NaN where y is NaN."""
    assert got.dtype == fp8
    assert got.shape == y.shape
    nan = torch.isnan(y)
    assert torch.equal(torch.isnan(got.float()), nan)
    exp = expected_codes(y, fp8)
    g = bits(got)
    bad = torch.nonzero((g != exp) & ~nan)
    assert bad.numel() == 0, [(tuple(i.tolist()), y[tuple(i)].item(), g[tuple(i)].item(), exp[tuple(i)].item())
                              for i in bad[:5]]


def hand_scale(amax: float, fp8: torch.dtype, *, pow2: bool, eps: float = 0.0, value_for_inf: float = FLT_MAX) -> float:
    """The current-scaling rule of NUMERICS.md, in plain Python."""
    a = to_f32(eps) if amax < eps else amax
    if a == 0 or math.isinf(a) or math.isnan(a):
        return 1.0
    s = to_f32(FMAX[fp8] / a)  # fp32 quotient (double rounding is innocuous for a division)
    if math.isinf(s):
        s = to_f32(value_for_inf)
    if pow2:
        s = 2.0 ** (math.frexp(s)[1] - 1)  # largest power of two <= s
    return s


def hand_rceil(amax: float, fp8: torch.dtype) -> int:
    """e8m0 code: d = fp32(amax * fp32(1/fp8_max)), smallest 2^k >= d, k in [-127, 127]."""
    if math.isnan(amax):
        return 255
    d = to_f32(to_f32(amax) * to_f32(1.0 / FMAX[fp8]))  # exact double product, one fp32 rounding
    if d > 2.0**127:
        return 254
    if d == 0:
        return 0
    m, e = math.frexp(d)  # d = m * 2^e, 0.5 <= m < 1
    k = e - 1 if m == 0.5 else e
    return max(k, -127) + 127


def hand_floor(amax: float, fp8: torch.dtype) -> int:
    """OCP rule: floor(log2(amax)) - emax, clamped to [-127, 127], + 127; inf/NaN -> 255."""
    if not math.isfinite(amax):
        return 255
    if amax == 0:
        return 0
    floor_log2 = math.frexp(amax)[1] - 1
    return min(max(floor_log2 - EMAX[fp8], -127), 127) + 127


def expand_grid(grid: torch.Tensor, tile: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """Element (r, c) gets grid[r // tile_rows, c // tile_cols]."""
    rows = torch.arange(shape[0]) // tile[0]
    cols = torch.arange(shape[1]) // tile[1]
    return grid[rows][:, cols]


def tile_amaxes(x2d: torch.Tensor, tile: tuple[int, int]) -> list[list[float]]:
    """max |x| of each tile, by slicing (NaN propagates)."""
    m, k = x2d.shape
    tr, tc = tile
    return [[x2d[i:i + tr, j:j + tc].abs().max().item() for j in range(0, k, tc)] for i in range(0, m, tr)]


def expected_tiled(x2d: torch.Tensor, tile, fp8, *, rule: str, pow2: bool = True, value_for_inf: float = FLT_MAX):
    """(values to cast, expected stored scales) for a tiled scheme on the fp32 2D tensor x2d.

    rule "scale": stored scale_inv = fp32(1/s), elements x*s. rule "rceil"/"floor": stored e8m0
    codes, elements x * 2^(127 - code) (NaN for code 255)."""
    amaxes = tile_amaxes(x2d, tile)
    if rule == "scale":
        scales = [[hand_scale(a, fp8, pow2=pow2, value_for_inf=value_for_inf) for a in row] for row in amaxes]
        mult = torch.tensor(scales, dtype=torch.float32)
        stored = torch.tensor([[to_f32(1.0 / s) for s in row] for row in scales], dtype=torch.float32)
    else:
        fn = hand_rceil if rule == "rceil" else hand_floor
        codes = [[fn(a, fp8) for a in row] for row in amaxes]
        mult = torch.tensor([[math.nan if c == 255 else 2.0 ** (127 - c) for c in row] for row in codes],
                            dtype=torch.float32)
        stored = torch.tensor(codes, dtype=torch.uint8)
    return x2d * expand_grid(mult, tile, tuple(x2d.shape)), stored


def tiled_tensor(shape2d, tile, amaxes, dtype, seed=0) -> torch.Tensor:
    """x [M, K] in `dtype` whose tile (i, j) has max |x| exactly amaxes[i][j] (values
    representable in every input dtype): uniform in (-a, a), one element set to +-a."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(shape2d, generator=g) * 2 - 1)
    tr, tc = tile
    for i, row in enumerate(amaxes):
        for j, a in enumerate(row):
            t = x[i * tr:(i + 1) * tr, j * tc:(j + 1) * tc]
            if a == 0:
                t.zero_()  # +0.0 everywhere (0 * negative would be -0.0)
            else:
                t.mul_(a)
                t[0, 0] = a if (i + j) % 2 == 0 else -a
    return x.to(dtype)


def assert_same_float(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal values, NaN in the same places, same sign of zero."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan], expected[~nan])
    assert torch.equal(torch.signbit(got[~nan]), torch.signbit(expected[~nan]))


def random_input(shape, dtype, seed, lo=-3.0, hi=3.0, zeros=0.0) -> torch.Tensor:
    """sign * 2^u, u uniform in [lo, hi], a fraction of exact zeros."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(shape, generator=g, dtype=torch.float64) * (hi - lo) + lo
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0).double()
    x = sign * torch.exp2(u)
    x = torch.where(torch.rand(shape, generator=g) < zeros, torch.zeros_like(x), x)
    return x.to(dtype)


# ----------------------------------------------------------------- every scheme, one interface
class Result(NamedTuple):
    x: torch.Tensor        # fp32 input in the data's 2D orientation
    data: torch.Tensor     # FP8 data, 2D, same orientation
    scale: torch.Tensor    # stored scale: scale_inv (fp32) or e8m0 codes (uint8)
    deq: torch.Tensor      # engine's dequantize to fp32, 2D, same orientation
    factor: torch.Tensor   # per-element dequantization factor (float64), same orientation
    tile: tuple[int, int]  # tile of the data orientation (per tensor: the whole tensor)
    transposed: bool       # data orientation is the transpose of the input's 2D view


TENSOR_SCHEMES = ["tensor", "tensor_pow2", "tensor_col"]
BLOCK_SCHEMES = ["block1d", "block1d_fp32", "block1d_col", "block2d", "block2d_fp32", "block2d_col"]
MX_SCHEMES = ["mx_rceil", "mx_floor", "mx_rceil_col", "mx_floor_col"]
ALL_SCHEMES = TENSOR_SCHEMES + BLOCK_SCHEMES + MX_SCHEMES


def run(scheme: str, x: torch.Tensor, fp8: torch.dtype) -> Result:
    x2d = x.float().reshape(-1, x.shape[-1])
    col = scheme.endswith("_col")
    if scheme.startswith("tensor"):
        data, si, _ = ref.quantize_current_scaling(x, fp8, force_pow_2_scales=scheme == "tensor_pow2")
        data = ref.transpose_2d(data) if col else data.reshape(x2d.shape)
        xo = x2d.t() if col else x2d
        deq = ref.dequantize_per_tensor(data, si, torch.float32)
        return Result(xo, data, si.reshape(1, 1), deq, si.double().expand(xo.shape), tuple(xo.shape), col)
    if scheme.startswith("block"):
        pow2 = "fp32" not in scheme
        tile = (1, 128) if "1d" in scheme else (128, 128)
        fn = ref.quantize_block_1d if "1d" in scheme else ref.quantize_block_2d
        data, si = fn(x, fp8, force_pow_2_scales=pow2, columnwise=col)
        deq = ref.dequantize_block(data, si, tile_rows=tile[0], tile_cols=tile[1], dtype=torch.float32)
        xo = x2d.t() if col else x2d
        return Result(xo, data, si, deq, expand_grid(si.double(), tile, tuple(data.shape)), tile, col)
    mode = "rceil" if "rceil" in scheme else "floor"
    data, codes = ref.quantize_mxfp8(x, fp8, scale_mode=mode, columnwise=col)
    assert data.shape == x.shape  # MX data is never transposed
    deq = ref.dequantize_mxfp8(data, codes, dtype=torch.float32, columnwise=col).reshape(x2d.shape)
    tile = (32, 1) if col else (1, 32)
    factor = expand_grid(torch.exp2(codes.double() - 127), tile, tuple(x2d.shape))
    return Result(x2d, data.reshape(x2d.shape), codes, deq, factor, tile, False)


def expected_for(scheme: str, x: torch.Tensor, fp8: torch.dtype):
    """Independent (values to cast, stored scales) for `scheme`, in the data orientation."""
    x2d = x.float().reshape(-1, x.shape[-1])
    col = scheme.endswith("_col")
    if scheme.startswith("tensor"):
        xo = x2d.t() if col else x2d
        return expected_tiled(xo, tuple(xo.shape), fp8, rule="scale", pow2=scheme == "tensor_pow2")
    if scheme.startswith("block"):
        xo = x2d.t() if col else x2d  # 2D columnwise: square tiles of x.t() are the transposed tiles of x
        tile = (1, 128) if "1d" in scheme else (128, 128)
        return expected_tiled(xo, tile, fp8, rule="scale", pow2="fp32" not in scheme,
                              value_for_inf=torch.finfo(x.dtype).max)
    return expected_tiled(x2d, (32, 1) if col else (1, 32), fp8, rule="rceil" if "rceil" in scheme else "floor")


def assert_matches_expected(scheme, x, fp8):
    r = run(scheme, x, fp8)
    y, stored = expected_for(scheme, x, fp8)
    assert r.scale.shape == stored.shape
    if stored.dtype == torch.uint8:
        assert r.scale.dtype == torch.uint8
        assert torch.equal(r.scale, stored)
    else:
        assert_same_float(r.scale, stored)
    assert_cast(r.data, y, fp8)
    return r


# ===================================================================== input validation
QUANTIZE_CALLS = {
    "quantize_per_tensor": lambda x, fp8=E4: ref.quantize_per_tensor(x, torch.ones(1), fp8),
    "quantize_current_scaling": lambda x, fp8=E4: ref.quantize_current_scaling(x, fp8),
    "quantize_block_1d": lambda x, fp8=E4: ref.quantize_block_1d(x, fp8),
    "quantize_block_1d_col": lambda x, fp8=E4: ref.quantize_block_1d(x, fp8, columnwise=True),
    "quantize_block_2d": lambda x, fp8=E4: ref.quantize_block_2d(x, fp8),
    "quantize_mxfp8_rceil": lambda x, fp8=E4: ref.quantize_mxfp8(x, fp8),
    "quantize_mxfp8_floor": lambda x, fp8=E4: ref.quantize_mxfp8(x, fp8, scale_mode="floor"),
    "quantize_mxfp8_col": lambda x, fp8=E4: ref.quantize_mxfp8(x, fp8, columnwise=True),
}


@pytest.mark.parametrize("call", list(QUANTIZE_CALLS))
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.float64, E4])
def test_rejects_non_high_precision_input(call, dtype):
    x = torch.zeros(32, 32).to(dtype)
    with pytest.raises(TypeError, match=r"^x: .*got " + str(dtype)):
        QUANTIZE_CALLS[call](x)


@pytest.mark.parametrize("call", list(QUANTIZE_CALLS))
def test_rejects_non_tensor_input(call):
    with pytest.raises(TypeError, match=r"^x: expected a torch.Tensor, got list"):
        QUANTIZE_CALLS[call]([[1.0] * 32] * 32)


@pytest.mark.parametrize("call", list(QUANTIZE_CALLS))
@pytest.mark.parametrize("target", [torch.bfloat16, torch.float32, torch.float8_e8m0fnu])
def test_rejects_non_fp8_target_dtype(call, target):
    with pytest.raises(TypeError, match=r"^fp8_dtype: "):
        QUANTIZE_CALLS[call](torch.ones(32, 32), target)


@pytest.mark.parametrize("fn", [ref.e8m0_rceil, ref.e8m0_floor, ref.cast_to_fp8], ids=["rceil", "floor", "cast"])
@pytest.mark.parametrize("target", [torch.float32, torch.float8_e8m0fnu])
def test_scale_functions_reject_non_fp8_element_dtype(fn, target):
    with pytest.raises(TypeError, match=r"^fp8_dtype: "):
        fn(torch.ones(4), target)


@pytest.mark.parametrize(
    "shape, columnwise, scale_shape",
    [
        ((32, 33), False, (32, 2)),  # K = 33: one full block and a partial block of 1
        ((2, 3, 40), False, (6, 2)),  # K = 40: blocks of 32 and 8
        ((33, 64), False, (33, 2)),  # rowwise: M needs nothing
        ((33, 64), True, (2, 64)),  # M = 33: blocks of 32 and 1 along M
        ((2, 3, 32), True, (1, 32)),  # M = 6: one partial block
        ((5,), True, (1, 5)),  # a 1D tensor is [1, 5]
        ((1, 1), False, (1, 1)),
        ((7, 129), True, (1, 129)),
        ((7, 129), False, (7, 5)),
    ],
)
@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_mx_partial_blocks(shape, columnwise, scale_shape, mode):
    """A dim that is not a multiple of 32 ends in a partial block whose scale comes from the
    elements it has (the brute force slices the blocks, it never pads)."""
    x = random_input(shape, torch.float32, seed=math.prod(shape), lo=-8, hi=8)
    # make the partial block's amax differ from its neighbour's, so a wrong split shows
    x.view(-1)[-1] = 300.0
    scheme = f"mx_{mode}_col" if columnwise else f"mx_{mode}"
    r = assert_matches_expected(scheme, x, E4)
    assert r.scale.shape == scale_shape
    assert torch.equal(r.deq.reshape(shape), ref.dequantize_mxfp8(
        r.data.reshape(shape), r.scale, dtype=torch.float32, columnwise=columnwise))


@pytest.mark.parametrize("mode", ["round", "RCEIL", "ceil", ""])
def test_mx_unknown_scale_mode_raises(mode):
    with pytest.raises(ValueError, match="scale_mode") as info:
        ref.quantize_mxfp8(torch.ones(32, 32), E4, scale_mode=mode)
    assert repr(mode) in str(info.value)


# ================================================================================== amax
@param_in
def test_amax_value_shape_and_dtype(in_dtype):
    x = torch.tensor([[[1.0, -3.0], [2.0, 0.5]], [[-0.25, 2.5], [0.0, -1.0]]], dtype=in_dtype)
    a = ref.amax(x)
    assert a.dtype == torch.float32 and a.shape == (1,)
    assert a.item() == 3.0


@param_in
@pytest.mark.parametrize("special", [math.nan, math.inf, -math.inf])
def test_amax_nan_propagates_and_inf_is_inf(in_dtype, special):
    x = torch.tensor([1.0, -2.0, special, 5.0], dtype=in_dtype).reshape(2, 1, 2)
    a = ref.amax(x).item()
    if math.isnan(special):
        assert math.isnan(a)
    else:
        assert a == math.inf
    # NaN wins over inf, wherever they are
    y = torch.tensor([math.inf, math.nan, 1.0], dtype=in_dtype)
    assert math.isnan(ref.amax(y).item()) and math.isnan(ref.amax(y.flip(0)).item())


@param_in
@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4, 5)])
def test_amax_empty_is_zero(in_dtype, shape):
    a = ref.amax(torch.empty(shape, dtype=in_dtype))
    assert a.dtype == torch.float32 and a.shape == (1,)
    assert a.item() == 0.0


# =========================================================================== cast_to_fp8
@param_in
@pytest.mark.parametrize(
    "fp8, pairs",
    [
        # 448 = 1.75 * 2^8: S.1111.110 = 0x7E; saturation sends everything above it there.
        (E4, [(math.inf, 0x7E), (-math.inf, 0xFE), (1e4, 0x7E), (-500.0, 0xFE), (464.0, 0x7E),
              (449.0, 0x7E), (448.0, 0x7E), (-448.0, 0xFE), (0.0, 0x00), (-0.0, 0x80), (1.0, 0x38)]),
        # 57344 = 1.75 * 2^15: S.11110.11 = 0x7B; 61440 is the midpoint to "65536" (inf code 0x7C).
        (E5, [(math.inf, 0x7B), (-math.inf, 0xFB), (6e4, 0x7B), (-61440.0, 0xFB), (57344.0, 0x7B),
              (0.0, 0x00), (-0.0, 0x80), (1.0, 0x3C)]),
    ],
    ids=fp8_ids,
)
def test_cast_saturates_by_hand(in_dtype, fp8, pairs):
    values = [v for v, _ in pairs if abs(v) <= torch.finfo(in_dtype).max or math.isinf(v)]
    codes = [c for v, c in pairs if abs(v) <= torch.finfo(in_dtype).max or math.isinf(v)]
    got = ref.cast_to_fp8(torch.tensor(values, dtype=in_dtype), fp8)
    assert got.dtype == fp8
    assert bits(got).tolist() == codes


@param_in
@param_fp8
def test_cast_nan_stays_nan(in_dtype, fp8):
    got = ref.cast_to_fp8(torch.tensor([math.nan, 1.0, -math.nan], dtype=in_dtype), fp8)
    assert torch.isnan(got.float()).tolist() == [True, False, True]


# NaNs of both signs with non-default payloads, quiet and signalling, as raw bits
NAN_BITS = {
    torch.float32: [0x7FC00000, 0xFFC00000, 0x7FC12345, 0xFFFFFFFF, 0x7F800001, 0xFF812345],
    torch.bfloat16: [0x7FC0, 0xFFC0, 0x7FC1, 0xFFFF, 0x7F81, 0xFF81],
    torch.float16: [0x7E00, 0xFE00, 0x7E01, 0xFFFF, 0x7C01, 0xFC01],
}


def nans(in_dtype: torch.dtype, repeat: int = 1) -> torch.Tensor:
    """Every NaN of NAN_BITS[in_dtype], `repeat` times over, built from its bits."""
    b = torch.tensor(NAN_BITS[in_dtype] * repeat, dtype=torch.int64)
    return (b.to(torch.int32) if in_dtype == torch.float32 else b.to(torch.int16)).view(in_dtype)


@param_in
@param_fp8
@pytest.mark.parametrize("repeat", [1, 40], ids=["short", "long"])  # torch's scalar and vector loops
def test_every_nan_casts_to_the_canonical_0x7f(in_dtype, fp8, repeat):
    x = nans(in_dtype, repeat)
    assert torch.isnan(x).all() and torch.signbit(x).any() and not torch.signbit(x).all()
    assert bits(ref.cast_to_fp8(x, fp8)).tolist() == [0x7F] * len(x)


@param_in
@pytest.mark.parametrize("which", range(6))
def test_nan_amax_is_the_canonical_0x7fc00000(in_dtype, which):
    x = torch.ones(50, dtype=in_dtype)
    x[17] = nans(in_dtype)[which]
    assert ref.amax(x).view(torch.int32).tolist() == [0x7FC00000]
    _, _, a = ref.quantize_current_scaling(x, E4)
    assert a.view(torch.int32).tolist() == [0x7FC00000]


@param_in
def test_nan_bits_of_every_scheme(in_dtype):
    """A NaN anywhere: its FP8 code is 0x7F (per-tensor, block), its MX block is 0x7F throughout
    with the E8M0 code 0xFF, the amax is 0x7FC00000."""
    x = torch.full((64, 128), 2.0, dtype=in_dtype)
    x.view(-1)[[5, 200, 6000]] = nans(in_dtype)[[1, 3, 5]]  # negative NaNs with payloads
    nan = torch.isnan(x)
    q = ref.quantize_per_tensor(x, torch.tensor([4.0]), E5)
    assert torch.equal(bits(q)[nan], torch.full((3,), 0x7F, dtype=torch.uint8))
    _, data_t, amax = ref.cast_transpose(x, torch.tensor([4.0]), E4)
    assert torch.equal(bits(data_t)[nan.t()], torch.full((3,), 0x7F, dtype=torch.uint8))
    assert amax.view(torch.int32).tolist() == [0x7FC00000]
    for data, _ in (ref.quantize_block_1d(x, E4), ref.quantize_block_2d(x, E4)):
        assert torch.equal(bits(data)[nan], torch.full((3,), 0x7F, dtype=torch.uint8))
    for mode in ("rceil", "floor"):
        data, codes = ref.quantize_mxfp8(x, E4, scale_mode=mode)
        assert codes.view(-1)[[5 // 32, 200 // 32, 6000 // 32]].tolist() == [0xFF] * 3
        assert bits(data)[0, :32].tolist() == [0x7F] * 32  # the whole block of element 5
        data, codes = ref.quantize_mxfp8(x, E4, scale_mode=mode, columnwise=True)
        assert codes[0, 5].item() == 0xFF and bits(data)[:32, 5].tolist() == [0x7F] * 32


@param_fp8
def test_cast_matches_bruteforce_rne(fp8):
    fmt = FMT[fp8]
    g = torch.Generator().manual_seed(7)
    n = 6000
    # magnitudes from well below the smallest subnormal to 16x above max, both signs
    lo, hi = math.log2(fmt.min_subnormal) - 3, math.log2(fmt.max) + 4
    x = torch.exp2(torch.rand(n, generator=g, dtype=torch.float64) * (hi - lo) + lo).float()
    x = torch.where(torch.rand(n, generator=g) < 0.5, -x, x)
    codes = torch.arange(128, dtype=torch.int64)
    v = fmt.decode(codes)
    v = v[torch.isfinite(v)].float()
    mids = (v[:-1] + v[1:]) / 2  # exact ties
    x = torch.cat([x, mids, -mids, v, -v]).reshape(2, -1)
    assert_cast(ref.cast_to_fp8(x, fp8), x, fp8)


# ========================================================================= compute_scale
# (fp8, amax, pow2, extra kwargs, expected scale) -- derived by hand.
SCALE_CASES = [
    (E4, 3.0, False, {}, to_f32(448 / 3)),  # 149.333... rounded to fp32
    (E4, 3.0, True, {}, 128.0),  # 149.33 in [2^7, 2^8) -> 2^7 (round DOWN)
    (E4, 3.5, True, {}, 128.0),  # 448/3.5 = 128 exactly
    (E4, 3.5 + 2.0**-22, True, {}, 64.0),  # next fp32 above 3.5 (ulp 2^-22): 448/amax < 128 -> 2^6
    (E4, 448.0, False, {}, 1.0),
    (E4, 448.0, True, {}, 1.0),
    (E4, 500.0, False, {}, to_f32(0.896)),  # 448/500
    (E4, 500.0, True, {}, 0.5),  # 0.896 in [2^-1, 2^0)
    (E4, 0.0, False, {}, 1.0),  # degenerate amax -> 1
    (E4, 0.0, True, {}, 1.0),
    (E4, math.inf, False, {}, 1.0),
    (E4, math.nan, False, {}, 1.0),
    (E4, math.nan, True, {}, 1.0),
    (E4, 2.0**-149, False, {}, FLT_MAX),  # 448 * 2^149 overflows fp32 -> FLT_MAX
    (E4, 2.0**-149, True, {}, 2.0**127),  # FLT_MAX with the mantissa cleared
    (E4, 2.0**-149, False, {"value_for_inf": 65504.0}, 65504.0),
    (E4, 2.0**-149, True, {"value_for_inf": 65504.0}, 32768.0),  # 65504 -> 2^15
    (E4, 2.0**-120, False, {}, FLT_MAX),  # 1.75 * 2^128 > FLT_MAX
    (E4, 2.0**-119, False, {}, 1.75 * 2.0**127),  # 448 * 2^119 is finite
    (E4, 2.0**-119, True, {}, 2.0**127),
    (E4, 0.0, True, {"amax_epsilon": 1e-3}, 262144.0),  # 448/0.001 = 448000 in [2^18, 2^19)
    (E4, 0.5, False, {"amax_epsilon": 1.0}, 448.0),  # max(0.5, 1) = 1
    (E4, 2.0, False, {"amax_epsilon": 1.0}, 224.0),  # eps below amax: no effect
    (E5, 3.0, False, {}, to_f32(57344 / 3)),  # 19114.67 rounded to fp32
    (E5, 3.0, True, {}, 16384.0),  # 19114.67 in [2^14, 2^15)
    (E5, 57344.0, True, {}, 1.0),
    (E5, 448.0, False, {}, 128.0),  # 57344/448 = 128 exactly
    (E5, 1e5, True, {}, 0.5),  # 0.57344 in [2^-1, 2^0)
    (E5, 0.0, False, {}, 1.0),
    (E5, math.inf, True, {}, 1.0),
]


@pytest.mark.parametrize("fp8, amax, pow2, kwargs, expected", SCALE_CASES)
def test_compute_scale_by_hand(fp8, amax, pow2, kwargs, expected):
    s = ref.compute_scale(torch.tensor([amax], dtype=torch.float32), fp8, force_pow_2_scales=pow2, **kwargs)
    assert s.dtype == torch.float32 and s.shape == (1,)
    assert s.item() == expected
    # and the independent plain-Python rule agrees with the hand value
    assert hand_scale(amax, fp8, pow2=pow2, eps=kwargs.get("amax_epsilon", 0.0),
                      value_for_inf=kwargs.get("value_for_inf", FLT_MAX)) == expected


@param_fp8
@pytest.mark.parametrize("pow2", [False, True])
def test_compute_scale_is_elementwise(fp8, pow2):
    amaxes = [3.0, 0.0, math.inf, math.nan, 448.0, 2.0**-149, 1e-3, 1e30, 7.0, 0.1, 65504.0, 1.0]
    s = ref.compute_scale(torch.tensor(amaxes).reshape(3, 4), fp8, force_pow_2_scales=pow2)
    assert s.shape == (3, 4) and s.dtype == torch.float32
    assert s.flatten().tolist() == [hand_scale(to_f32(a), fp8, pow2=pow2) for a in amaxes]


@PROPERTY
@given(amax=st.floats(min_value=0.0, max_value=FLT_MAX, width=32, allow_subnormal=True),
       fp8=st.sampled_from(FP8_DTYPES))
def test_compute_scale_pow2_is_the_power_of_two_below(amax, fp8):
    s_fp32 = ref.compute_scale(torch.tensor([amax]), fp8).item()
    s_pow2 = ref.compute_scale(torch.tensor([amax]), fp8, force_pow_2_scales=True).item()
    assert s_fp32 == hand_scale(amax, fp8, pow2=False)
    assert math.frexp(s_pow2)[0] == 0.5  # a power of two
    assert s_pow2 <= s_fp32 < 2 * s_pow2


# ======================================================= per-tensor: quantize / dequantize
@param_in
@param_fp8
@pytest.mark.parametrize("pow2", [True, False])
def test_current_scaling_by_hand(in_dtype, fp8, pow2):
    x = torch.tensor([[1.0, -3.0, 2.0, 0.5], [0.25, -1.5, 3.0, 0.0]], dtype=in_dtype).reshape(2, 2, 2)
    data, scale_inv, amax = ref.quantize_current_scaling(x, fp8, force_pow_2_scales=pow2)
    assert data.shape == x.shape and data.dtype == fp8
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (1,)
    assert amax.tolist() == [3.0]
    if pow2:
        # E4M3: 448/3 -> 2^7; E5M2: 57344/3 -> 2^14. Every x * 2^k here is exact in the format.
        s = 128.0 if fp8 == E4 else 16384.0
        assert scale_inv.item() == 1 / s
        assert data.float().flatten().tolist() == [v * s for v in [1, -3, 2, 0.5, 0.25, -1.5, 3, 0]]
    else:
        s = to_f32(FMAX[fp8] / 3)
        assert scale_inv.item() == to_f32(1 / s)
        assert_cast(data, x.float() * s, fp8)


@param_in
@param_fp8
def test_current_scaling_amax_epsilon(in_dtype, fp8):
    x = torch.zeros(3, 5, dtype=in_dtype)
    x[1, 2] = 0.25
    data, scale_inv, amax = ref.quantize_current_scaling(x, fp8, amax_epsilon=1.0)
    assert amax.item() == 0.25  # the recorded amax is the tensor's, not the clamped one
    assert scale_inv.item() == to_f32(1 / FMAX[fp8])  # scale = fp8_max / max(0.25, 1)
    assert data.float()[1, 2].item() == 0.25 * FMAX[fp8] and data.float().sum().item() == 0.25 * FMAX[fp8]


@param_in
@param_fp8
def test_current_scaling_edge_cases_by_hand(in_dtype, fp8):
    m = FMAX[fp8]
    # all zeros: amax 0 -> scale 1, data zeros
    data, si, amax = ref.quantize_current_scaling(torch.zeros(3, 5, dtype=in_dtype), fp8)
    assert amax.item() == 0 and si.item() == 1 and (bits(data) == 0).all()
    # NaN: amax NaN -> scale 1; NaN stays NaN, the rest is cast unscaled
    data, si, amax = ref.quantize_current_scaling(torch.tensor([1.0, math.nan, -2.0], dtype=in_dtype), fp8)
    assert math.isnan(amax.item()) and si.item() == 1
    assert torch.isnan(data.float()).tolist() == [False, True, False]
    assert data.float()[[0, 2]].tolist() == [1.0, -2.0]
    # inf: amax inf -> scale 1; inf saturates to max
    data, si, amax = ref.quantize_current_scaling(torch.tensor([1.0, -math.inf, -2.0], dtype=in_dtype), fp8)
    assert amax.item() == math.inf and si.item() == 1
    assert data.float().tolist() == [1.0, -m, -2.0]
    # +-max: scale 1, exact
    data, si, _ = ref.quantize_current_scaling(torch.tensor([m, -m, 0.5], dtype=in_dtype), fp8)
    assert si.item() == 1 and data.float().tolist() == [m, -m, 0.5]
    # empty: amax 0, scale 1
    data, si, amax = ref.quantize_current_scaling(torch.empty(0, 4, dtype=in_dtype), fp8)
    assert data.shape == (0, 4) and si.item() == 1 and amax.item() == 0


@param_in
def test_current_scaling_subnormal_input_overflows_scale_to_flt_max(in_dtype):
    tiny = torch.finfo(in_dtype).tiny
    x = torch.tensor([tiny / 4, -tiny / 8, tiny / 2], dtype=in_dtype)  # all subnormal in in_dtype
    data, si, amax = ref.quantize_current_scaling(x, E4)
    a = tiny / 2
    assert amax.item() == a
    s = hand_scale(a, E4, pow2=False)
    if in_dtype != torch.float16:  # 448 / 2^-127 (bf16, fp32 subnormals) overflows fp32
        assert s == FLT_MAX
    assert si.item() == to_f32(1 / s)
    assert_cast(data, x.float() * s, E4)


@param_in
@param_fp8
@pytest.mark.parametrize("scale", [2.0, 0.1, 1e-3])
def test_quantize_per_tensor_keeps_shape_and_rounds(in_dtype, fp8, scale):
    x = random_input((2, 3, 17), in_dtype, seed=3, lo=-12, hi=12)
    s = torch.tensor([scale], dtype=torch.float32)
    data = ref.quantize_per_tensor(x, s, fp8)
    assert data.shape == x.shape
    assert_cast(data, x.float() * to_f32(scale), fp8)


@param_fp8
@pytest.mark.parametrize("pow2", [True, False])
def test_per_tensor_columnwise_is_quantized_transpose(fp8, pow2):
    x = random_input((2, 3, 17), torch.bfloat16, seed=4)
    data, si, _ = ref.quantize_current_scaling(x, fp8, force_pow_2_scales=pow2)
    col = ref.transpose_2d(data)
    assert col.shape == (17, 6) and col.is_contiguous()
    x_t = x.reshape(6, 17).t().contiguous()
    data_t, si_t, _ = ref.quantize_current_scaling(x_t, fp8, force_pow_2_scales=pow2)
    assert torch.equal(bits(col), bits(data_t)) and torch.equal(si, si_t)


@pytest.mark.parametrize("shape, shape_2d", [((2, 3, 4), (6, 4)), ((5,), (1, 5)), ((), (1, 1)), ((4, 1), (4, 1))])
def test_transpose_2d(shape, shape_2d):
    codes = (torch.arange(math.prod(shape), dtype=torch.int64) % 126).to(torch.uint8).reshape(shape)
    t = ref.transpose_2d(codes.view(E4))
    assert t.dtype == E4 and t.is_contiguous()
    assert t.shape == (shape_2d[1], shape_2d[0])
    m, k = shape_2d
    for r in range(m):
        for c in range(k):
            assert bits(t)[c, r].item() == codes.flatten()[r * k + c].item()


@param_fp8
@pytest.mark.parametrize("rowwise, columnwise", [(True, True), (True, False), (False, True)])
def test_cast_transpose(fp8, rowwise, columnwise):
    x = random_input((5, 37), torch.bfloat16, seed=12, lo=-8, hi=4)  # |x| <= 16
    x[2, 3] = -20.0  # the amax
    scale = torch.tensor([to_f32(FMAX[fp8] / 20)])
    data, data_t, a = ref.cast_transpose(x, scale, fp8, rowwise=rowwise, columnwise=columnwise)
    assert a.tolist() == [20.0]
    y = x.float() * scale.item()
    if rowwise:
        assert_cast(data, y, fp8)
    else:
        assert data is None
    if columnwise:
        assert data_t.shape == (37, 5) and data_t.is_contiguous()
        assert_cast(data_t, y.t(), fp8)
    else:
        assert data_t is None
    with pytest.raises(TypeError, match=r"^x2d: "):
        ref.cast_transpose(x.double(), scale, fp8)


@param_fp8
def test_fp8_to_bf16_is_exact(fp8):
    codes = torch.arange(256, dtype=torch.uint8)
    got = ref.fp8_to_bf16(codes.view(fp8))
    assert got.dtype == torch.bfloat16
    expected = FMT[fp8].decode(codes)
    assert_same_float(got.double(), expected)


@param_in
@param_fp8
@pytest.mark.parametrize("scale_inv", [0.5, 4.0, to_f32(1 / 3)])
def test_dequantize_per_tensor_all_codes(in_dtype, fp8, scale_inv):
    codes = torch.arange(256, dtype=torch.uint8).reshape(2, 8, 16)
    data = codes.view(fp8)
    got = ref.dequantize_per_tensor(data, torch.tensor([scale_inv]), in_dtype)
    # decode * scale_inv is exact in float64 (<= 4 significant bits times 24); one fp32 rounding,
    # then the cast to the output dtype
    expected = (FMT[fp8].decode(codes) * scale_inv).float().to(in_dtype)
    assert_same_float(got, expected)


# =============================================================================== block scaling
# pow2 tile scales, by hand:
#   E4M3: 448/3 = 149.3 -> 2^7; 448/448 = 1; 448/0.375 = 1194.7 -> 2^10; 448/5 = 89.6 -> 2^6; amax 0 -> 1
#   E5M2: 57344/3 = 19114.7 -> 2^14; 57344/448 = 128; 57344/0.375 = 152917.3 -> 2^17; 57344/5 = 11468.8 -> 2^13
POW2_TILE_SCALE = {
    E4: {3.0: 128.0, 448.0: 1.0, 0.375: 1024.0, 5.0: 64.0, 0.0: 1.0},
    E5: {3.0: 16384.0, 448.0: 128.0, 0.375: 131072.0, 5.0: 8192.0, 0.0: 1.0},
}


def tile_scale(fp8, amax, pow2):
    if pow2:
        return POW2_TILE_SCALE[fp8][amax]
    return 1.0 if amax == 0 else to_f32(FMAX[fp8] / amax)  # fp32 quotient


def check_hand_tiles(data, scale_inv, x2d, amaxes, tile, fp8, pow2):
    scales = [[tile_scale(fp8, a, pow2) for a in row] for row in amaxes]
    expected_si = torch.tensor([[to_f32(1 / s) for s in row] for row in scales], dtype=torch.float32)
    assert scale_inv.dtype == torch.float32
    assert torch.equal(scale_inv, expected_si)
    assert_cast(data, x2d.float() * expand_grid(torch.tensor(scales), tile, tuple(x2d.shape)), fp8)


CYCLE = [3.0, 448.0, 0.375, 5.0, 0.0]


@param_in
@param_fp8
@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "fp32scale"])
@pytest.mark.parametrize("lead", [(), (1,)], ids=["2d", "3d"])
def test_block_1d_rowwise_by_hand(in_dtype, fp8, pow2, lead):
    amaxes = [[3.0, 448.0], [0.0, 0.375]]
    x2d = tiled_tensor((2, 256), (1, 128), amaxes, in_dtype)
    data, scale_inv = ref.quantize_block_1d(x2d.reshape(*lead, 2, 256), fp8, force_pow_2_scales=pow2)
    assert data.shape == (2, 256) and scale_inv.shape == (2, 2)
    check_hand_tiles(data, scale_inv, x2d, amaxes, (1, 128), fp8, pow2)
    # the all-zero tile: scale_inv 1 and zero codes
    assert scale_inv[1, 0].item() == 1.0 and (bits(data)[1, :128] == 0).all()
    # the tile whose amax is fp8_max keeps its values (scale 1 for E4M3)
    if fp8 == E4:
        assert scale_inv[0, 1].item() == 1.0


@param_in
@param_fp8
@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "fp32scale"])
def test_block_1d_partial_edge_tiles(in_dtype, fp8, pow2):
    # [130, 260]: tiles of 1x128, the last one 4 wide; tile (i, j) has amax CYCLE[(i + j) % 5]
    amaxes = [[CYCLE[(i + j) % 5] for j in range(3)] for i in range(130)]
    x2d = tiled_tensor((130, 260), (1, 128), amaxes, in_dtype)
    data, scale_inv = ref.quantize_block_1d(x2d, fp8, force_pow_2_scales=pow2)
    assert data.shape == (130, 260) and scale_inv.shape == (130, 3)
    check_hand_tiles(data, scale_inv, x2d, amaxes, (1, 128), fp8, pow2)


@param_in
@param_fp8
@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "fp32scale"])
@pytest.mark.parametrize("lead", [(260,), (2, 130)], ids=["2d", "3d"])
def test_block_1d_columnwise_is_rowwise_rule_on_transpose(in_dtype, fp8, pow2, lead):
    # Build the tiles on xt = x.t() ([K, M] = [130, 260]); x itself is [M, K] = [260, 130].
    amaxes = [[CYCLE[(i + 2 * j) % 5] for j in range(3)] for i in range(130)]
    xt = tiled_tensor((130, 260), (1, 128), amaxes, in_dtype, seed=1)
    x = xt.t().contiguous().reshape(*lead, 130)
    data, scale_inv = ref.quantize_block_1d(x, fp8, force_pow_2_scales=pow2, columnwise=True)
    assert data.shape == (130, 260)  # [K, M]
    assert scale_inv.shape == (130, 3)  # [K, ceil(M/128)]
    check_hand_tiles(data, scale_inv, xt, amaxes, (1, 128), fp8, pow2)


@param_in
@param_fp8
@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "fp32scale"])
@pytest.mark.parametrize("lead", [(130,), (2, 65)], ids=["2d", "3d"])
def test_block_2d_by_hand(in_dtype, fp8, pow2, lead):
    amaxes = [[3.0, 448.0, 0.375], [5.0, 0.0, 3.0]]  # 2x3 tiles of 128x128, partial at the edges
    x2d = tiled_tensor((130, 260), (128, 128), amaxes, in_dtype, seed=2)
    x = x2d.reshape(*lead, 260)
    data, scale_inv = ref.quantize_block_2d(x, fp8, force_pow_2_scales=pow2)
    assert data.shape == (130, 260) and scale_inv.shape == (2, 3)
    check_hand_tiles(data, scale_inv, x2d, amaxes, (128, 128), fp8, pow2)
    data_c, scale_inv_c = ref.quantize_block_2d(x, fp8, force_pow_2_scales=pow2, columnwise=True)
    assert data_c.shape == (260, 130) and scale_inv_c.shape == (3, 2)
    assert data_c.is_contiguous() and scale_inv_c.is_contiguous()
    assert torch.equal(bits(data_c), bits(data).t()) and torch.equal(scale_inv_c, scale_inv.t())


@param_in
@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "fp32scale"])
@pytest.mark.parametrize("dim", [1, 2])
def test_block_value_for_inf_is_input_dtype_max(in_dtype, pow2, dim):
    if in_dtype == torch.float16:
        # the smallest fp16 subnormal is 2^-24: 448 * 2^24 is finite, value_for_inf is unreachable
        tiny = 2.0**-24
        expected = hand_scale(tiny, E4, pow2=pow2)
        assert expected < FLT_MAX
    else:
        # smallest subnormal: 2^-149 (fp32), 2^-133 (bf16); 448 * 2^149 and 448 * 2^133 overflow fp32,
        # so the scale is the input dtype's max (not FLT_MAX for bf16), pow2: 2^127 for both
        tiny = 2.0**-149 if in_dtype == torch.float32 else 2.0**-133
        expected = 2.0**127 if pow2 else torch.finfo(in_dtype).max
    x = torch.full((128, 256), tiny, dtype=in_dtype)
    x[:, 128:] = 3.0  # the second tile(s): 448/3
    fn = ref.quantize_block_1d if dim == 1 else ref.quantize_block_2d
    data, scale_inv = fn(x, E4, force_pow_2_scales=pow2)
    assert scale_inv[0, 0].item() == to_f32(1 / expected)
    assert scale_inv[-1, -1].item() == to_f32(1 / tile_scale(E4, 3.0, pow2))
    assert_cast(data[:, :128], x[:, :128].float() * expected, E4)


@param_in
@param_fp8
@pytest.mark.parametrize("tile_rows, tile_cols", [(1, 128), (128, 128)])
def test_dequantize_block(in_dtype, fp8, tile_rows, tile_cols):
    g = torch.Generator().manual_seed(5)
    m, k = 130, 260
    codes = torch.randint(0, 256, (m, k), generator=g, dtype=torch.int64)
    codes = torch.where(torch.isnan(FMT[fp8].decode(codes)), 0, codes).to(torch.uint8)
    grid = (-(-m // tile_rows), -(-k // tile_cols))
    si = torch.exp2(torch.randint(-20, 5, grid, generator=g).float()) * torch.tensor([1.0, to_f32(1 / 3)])[
        torch.randint(0, 2, grid, generator=g)]
    got = ref.dequantize_block(codes.view(fp8), si, tile_rows=tile_rows, tile_cols=tile_cols, dtype=in_dtype)
    expected = torch.empty(m, k, dtype=torch.float64)
    for r in range(0, m, tile_rows):
        for c in range(0, k, tile_cols):
            expected[r:r + tile_rows, c:c + tile_cols] = (
                FMT[fp8].decode(codes[r:r + tile_rows, c:c + tile_cols]) * si[r // tile_rows, c // tile_cols].item())
    assert_same_float(got, expected.float().to(in_dtype))  # exact product, one fp32 rounding, cast


@pytest.mark.parametrize("scheme", BLOCK_SCHEMES + MX_SCHEMES)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_single_outlier_only_changes_its_own_tile(scheme, in_dtype):
    x = random_input((256, 384), in_dtype, seed=6, lo=-2, hi=2)
    y = x.clone()
    y[5, 200] = 1e4
    a, b = run(scheme, x, E4), run(scheme, y, E4)
    r, c = (200, 5) if a.transposed else (5, 200)  # the outlier in the data orientation
    tr, tc = a.tile
    rows, cols = torch.arange(a.data.shape[0]), torch.arange(a.data.shape[1])
    in_tile = (rows // tr == r // tr)[:, None] & (cols // tc == c // tc)[None, :]
    assert torch.equal(bits(a.data)[~in_tile], bits(b.data)[~in_tile])
    assert torch.equal(a.factor[~in_tile], b.factor[~in_tile])
    assert (b.factor[in_tile] > a.factor[in_tile]).all()  # the outlier's tile got a coarser scale
    assert b.deq[r, c].item() == pytest.approx(1e4, rel=HALF_ULP[E4])


# ================================================================================== MXFP8
def hand_e8m0_cases():
    # E4M3: fp32(1/448) = 2^-9 * (8/7 + 6/7 * 2^-24) (rounded up); 448 * it = 1 + 0.75 * 2^-24 -> 1.0
    e4 = [
        (448.0, 127),  # d = 1.0
        (448.0 + 2.0**-15, 128),  # next fp32 above 448: d = 1 + 2^-23, rounds up to 2^1
        (224.0, 126),  # d = 0.5
        (1.0, 119),  # d = 2^-8.8 -> 2^-8
        (3.0, 120),  # d = 2^-7.2 -> 2^-7
        (0.125, 116),  # d = 2^-11.8 -> 2^-11
        (0.0, 0),
        (math.nan, 255),
        (math.inf, 254),
        (448.0 * 2.0**-127, 0),  # d = 2^-127 (subnormal, <= 2^-127)
        (448.0 * 2.0**-127 * 1.25, 1),  # d = 1.25 * 2^-127 (subnormal, > 2^-127) -> 2^-126
        (448.0 * 2.0**-126, 1),  # d = 2^-126 exactly (normal)
        (2.0**-149, 0),  # d underflows to 0
        (FLT_MAX, 247),  # d = 2^128 / 2^8.8 = 2^119.2 -> 2^120
    ]
    # E5M2: 57344 = 448 * 2^7, the same rounding of the reciprocal
    e5 = [
        (57344.0, 127),
        (57344.0 + 2.0**-8, 128),  # next fp32 above 57344
        (1.0, 112),  # 2^-15.8 -> 2^-15
        (3.0, 113),  # 2^-14.2 -> 2^-14
        (0.0, 0),
        (math.nan, 255),
        (math.inf, 254),
    ]
    return [(E4, a, c) for a, c in e4] + [(E5, a, c) for a, c in e5]


@pytest.mark.parametrize("fp8, amax, code", hand_e8m0_cases())
def test_e8m0_rceil_by_hand(fp8, amax, code):
    got = ref.e8m0_rceil(torch.tensor([amax], dtype=torch.float32), fp8)
    assert got.dtype == torch.uint8 and got.tolist() == [code]
    assert hand_rceil(amax, fp8) == code  # the plain-Python rule agrees


@pytest.mark.parametrize(
    "fp8, amax, code",
    [
        (E4, 1.0, 119),  # 0 - 8 = -8
        (E4, 1.9375, 119),  # floor(log2 1.9375) = 0
        (E4, 2.0, 120),
        (E4, 448.0, 127),  # floor(log2 448) = 8
        (E4, 2.0**-100, 19),  # -100 - 8 = -108
        (E4, 2.0**-120, 0),  # -128 clamps to -127
        (E4, 2.0**-130, 0),  # subnormal amax
        (E4, 0.0, 0),
        (E4, FLT_MAX, 246),  # 127 - 8 = 119
        (E4, math.inf, 255),
        (E4, math.nan, 255),
        (E5, 1.0, 112),  # 0 - 15
        (E5, 57344.0, 127),  # floor(log2 57344) = 15
        (E5, 2.0**-100, 12),  # -115
        (E5, 0.0, 0),
        (E5, math.nan, 255),
    ],
)
def test_e8m0_floor_by_hand(fp8, amax, code):
    got = ref.e8m0_floor(torch.tensor([amax], dtype=torch.float32), fp8)
    assert got.dtype == torch.uint8 and got.tolist() == [code]
    assert hand_floor(amax, fp8) == code


def amax_sweep() -> torch.Tensor:
    """fp32 amaxes: random bit patterns (every exponent, subnormals), powers of two times
    fp8-max-like factors, and their fp32 neighbours."""
    g = torch.Generator().manual_seed(11)
    random = torch.randint(0, 0x7F800000, (3000,), generator=g, dtype=torch.int32).view(torch.float32)
    pow2 = torch.exp2(torch.arange(-149, 128, dtype=torch.float64))
    grid = (pow2[:, None] * torch.tensor([1.0, 1.75, 1.5, 1.25, 1.875], dtype=torch.float64)).float().flatten()
    grid = grid[torch.isfinite(grid)]
    inf = torch.full_like(grid, math.inf)
    return torch.cat([random, grid, torch.nextafter(grid, inf), torch.nextafter(grid, -inf).abs()])


@param_fp8
@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_e8m0_rules_match_bruteforce_sweep(fp8, mode):
    a = amax_sweep()
    fn, hand = (ref.e8m0_rceil, hand_rceil) if mode == "rceil" else (ref.e8m0_floor, hand_floor)
    got = fn(a, fp8).tolist()
    expected = [hand(v, fp8) for v in a.tolist()]
    bad = [(v, g_, e) for v, g_, e in zip(a.tolist(), got, expected) if g_ != e]
    assert not bad, bad[:5]


def test_e8m0_to_float_all_codes():
    codes = torch.arange(256, dtype=torch.int64)
    got = ref.e8m0_to_float(codes.to(torch.uint8))
    assert got.dtype == torch.float32
    assert math.isnan(got[255].item())
    assert got[:255].double().tolist() == [2.0 ** (c - 127) for c in range(255)]
    # torch's own E8M0 dtype agrees
    assert_same_float(got, codes.to(torch.uint8).view(torch.float8_e8m0fnu).float())


def test_e8m0_to_element_scale_all_codes():
    got = ref.e8m0_to_element_scale(torch.arange(256, dtype=torch.uint8))
    assert math.isnan(got[255].item())
    assert got[:255].double().tolist() == [2.0 ** (127 - c) for c in range(255)]


# MX blocks of [3, 64] built by hand; per fp8: amaxes, RCEIL codes, FLOOR codes.
#   E4M3 RCEIL: 448 -> d=1 -> 127; 1 -> 2^-8.8 -> 119; 0 -> 0; 3 -> 2^-7.2 -> 120; 1.9375 -> 2^-7.85 -> 120;
#               0.125 -> 2^-11.8 -> 116.   FLOOR: floor(log2 a) - 8: 127, 119, 0, 120, 119, 116.
#   E5M2 RCEIL: 57344 -> 127; 1 -> 2^-15.8 -> 112; 0 -> 0; 3 -> 2^-14.2 -> 113; 1.9375 -> 2^-14.85 -> 113;
#               0.125 -> 2^-18.8 -> 109.   FLOOR: floor(log2 a) - 15: 127, 112, 0, 113, 112, 109.
MX_HAND = {
    E4: ([[448.0, 1.0], [0.0, 3.0], [1.9375, 0.125]], [[127, 119], [0, 120], [120, 116]],
         [[127, 119], [0, 120], [119, 116]]),
    E5: ([[57344.0, 1.0], [0.0, 3.0], [1.9375, 0.125]], [[127, 112], [0, 113], [113, 109]],
         [[127, 112], [0, 113], [112, 109]]),
}


def mx_hand_expectation(x2d, codes, tile):
    mult = torch.tensor([[2.0 ** (127 - c) for c in row] for row in codes], dtype=torch.float32)
    return x2d.float() * expand_grid(mult, tile, tuple(x2d.shape))


def check_mx_dequantize(data, codes, in_dtype, fp8, tile, columnwise):
    got = ref.dequantize_mxfp8(data, codes, dtype=in_dtype, columnwise=columnwise)
    assert got.dtype == in_dtype and got.shape == data.shape
    d2 = data.reshape(-1, data.shape[-1])
    factor = expand_grid(torch.exp2(codes.double() - 127), tile, tuple(d2.shape))
    expected = (FMT[fp8].decode(bits(d2)) * factor).float().to(in_dtype).reshape(data.shape)
    assert_same_float(got, expected)


@param_in
@param_fp8
@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("lead", [(), (1,)], ids=["2d", "3d"])
def test_mx_rowwise_by_hand(in_dtype, fp8, mode, lead):
    amaxes, rceil, floor = MX_HAND[fp8]
    codes_expected = rceil if mode == "rceil" else floor
    x2d = tiled_tensor((3, 64), (1, 32), amaxes, in_dtype, seed=8)
    x = x2d.reshape(*lead, 3, 64)
    data, codes = ref.quantize_mxfp8(x, fp8, scale_mode=mode)
    assert data.shape == x.shape and data.dtype == fp8
    assert codes.dtype == torch.uint8 and codes.tolist() == codes_expected
    assert_cast(data.reshape(3, 64), mx_hand_expectation(x2d, codes_expected, (1, 32)), fp8)
    # block (2, 0): its +1.9375 element (x[2, 0]) in FLOOR mode is 1.9375 * 2^8 = 496 (E4M3) or
    # 1.9375 * 2^15 = 63488 (E5M2): above max, saturates to 0x7E / 0x7B
    if mode == "floor":
        assert bits(data).reshape(3, 64)[2, 0].item() == (0x7E if fp8 == E4 else 0x7B)
    # the all-zero block has code 0 and zero data
    assert (bits(data).reshape(3, 64)[1, :32] == 0).all()
    check_mx_dequantize(data, codes, in_dtype, fp8, (1, 32), False)


@param_in
@param_fp8
@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("lead", [(64,), (2, 32)], ids=["2d", "3d"])
def test_mx_columnwise_by_hand(in_dtype, fp8, mode, lead):
    amaxes, rceil, floor = MX_HAND[fp8]
    codes_t = rceil if mode == "rceil" else floor  # built on x.t(): [3, 64] with 1x32 blocks
    xt = tiled_tensor((3, 64), (1, 32), amaxes, in_dtype, seed=9)
    x = xt.t().contiguous().reshape(*lead, 3)  # [M, K] = [64, 3]: 32x1 blocks along M
    data, codes = ref.quantize_mxfp8(x, fp8, scale_mode=mode, columnwise=True)
    assert data.shape == x.shape  # not transposed
    assert codes.shape == (2, 3)  # [M/32, K]
    assert codes.t().tolist() == codes_t
    assert_cast(data.reshape(64, 3), mx_hand_expectation(xt, codes_t, (1, 32)).t(), fp8)
    check_mx_dequantize(data, codes, in_dtype, fp8, (32, 1), True)


@param_fp8
@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_mx_special_blocks_by_hand(fp8, mode):
    m = FMAX[fp8]
    x = torch.ones(32, 128)
    x[0, 0] = math.inf  # block 0: inf
    x[0, 40] = math.nan  # block 1: NaN
    x[0, 64:96] = 0.0  # block 2: zeros
    x[0, 96] = -m  # block 3: amax = fp8 max
    data, codes = ref.quantize_mxfp8(x, fp8, scale_mode=mode)
    # inf: RCEIL d = inf -> 254 (elements * 2^-127: inf -> max, ones -> 0); FLOOR -> NaN code 255
    if mode == "rceil":
        assert codes[0, 0].item() == 254
        assert data[0, 0].float().item() == m and (data[0, 1:32].float() == 0).all()
    else:
        assert codes[0, 0].item() == 255 and torch.isnan(data[0, :32].float()).all()
    assert codes[0, 1].item() == 255 and torch.isnan(data[0, 32:64].float()).all()  # NaN spreads to the block
    assert codes[0, 2].item() == 0 and (bits(data)[0, 64:96] == 0).all()
    assert codes[0, 3].item() == 127 and data[0, 96].float().item() == -m  # scale 2^0
    assert (codes[1:] == (119 if fp8 == E4 else 112)).all()  # rows of ones: see the hand tables above
    deq = ref.dequantize_mxfp8(data, codes, dtype=torch.float32)
    assert torch.isnan(deq[0, 32:64]).all() and deq[0, 96].item() == -m and (deq[1:] == 1).all()


# ============================================== every scheme vs the independent brute force
SPECIAL_CASES = ["random", "zeros", "subnormal", "max", "above_max", "inf", "nan", "outlier"]


def special_input(case: str, shape, in_dtype, fp8, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = random_input(shape, torch.float32, seed, lo=-6, hi=6)
    flat = x.view(-1)
    n = flat.numel()
    pick = torch.randperm(n, generator=g)[: max(1, n // 7)]
    big = min(4 * FMAX[fp8], torch.finfo(in_dtype).max)
    if case == "zeros":
        x.zero_()
    elif case == "subnormal":
        x = x.abs().clamp(max=1) * torch.finfo(in_dtype).tiny * torch.sign(x)  # below tiny: subnormal
    elif case == "max":
        flat[pick] = FMAX[fp8] * torch.where(torch.rand(len(pick), generator=g) < 0.5, -1.0, 1.0)
    elif case == "above_max":
        flat[pick] = big * torch.where(torch.rand(len(pick), generator=g) < 0.5, -1.0, 1.0)
    elif case == "inf":
        flat[pick] = torch.where(torch.rand(len(pick), generator=g) < 0.5, -math.inf, math.inf)
    elif case == "nan":
        flat[pick] = math.nan
    elif case == "outlier":
        flat[n // 2] = 1e4
    return x.to(in_dtype)


@pytest.mark.parametrize("scheme", TENSOR_SCHEMES + BLOCK_SCHEMES)
@pytest.mark.parametrize("case", SPECIAL_CASES)
@param_fp8
@param_in
def test_tensor_and_block_schemes_special_values(scheme, case, fp8, in_dtype):
    x = special_input(case, (7, 129), in_dtype, fp8, seed=SPECIAL_CASES.index(case))
    r = assert_matches_expected(scheme, x, fp8)
    if case == "zeros":
        assert (r.scale == 1).all() and (bits(r.data) == 0).all()


@pytest.mark.parametrize("scheme", MX_SCHEMES)
@pytest.mark.parametrize("case", SPECIAL_CASES)
@param_fp8
@param_in
def test_mx_schemes_special_values(scheme, case, fp8, in_dtype):
    x = special_input(case, (64, 96), in_dtype, fp8, seed=SPECIAL_CASES.index(case))
    r = assert_matches_expected(scheme, x, fp8)
    if case == "zeros":
        assert (r.scale == 0).all() and (bits(r.data) == 0).all()
    if case == "nan":  # a NaN anywhere in a block makes its code 255 and every element NaN
        blocks_nan = (r.scale == 255)
        assert blocks_nan.any()
        assert torch.equal(torch.isnan(r.data.float()), expand_grid(blocks_nan, r.tile, tuple(r.data.shape)))


@pytest.mark.parametrize("scheme", TENSOR_SCHEMES + BLOCK_SCHEMES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (7, 129), (2, 3, 5), (130, 260)])
@param_fp8
@param_in
def test_tensor_and_block_schemes_odd_shapes(scheme, shape, fp8, in_dtype):
    x = random_input(shape, in_dtype, seed=math.prod(shape), lo=-10, hi=10, zeros=0.05)
    r = assert_matches_expected(scheme, x, fp8)
    m, k = math.prod(shape[:-1]), shape[-1]
    expected_shape = (k, m) if r.transposed else (m, k)
    assert r.data.shape == expected_shape
    if scheme.startswith("block1d"):
        assert r.scale.shape == (expected_shape[0], -(-expected_shape[1] // 128))
    if scheme.startswith("block2d"):
        assert r.scale.shape == (-(-expected_shape[0] // 128), -(-expected_shape[1] // 128))


@pytest.mark.parametrize("scheme", MX_SCHEMES)
@pytest.mark.parametrize("shape", [(32, 32), (64, 96), (2, 32, 64), (1, 1), (3, 5), (7, 129), (2, 17, 33)])
@param_fp8
@param_in
def test_mx_schemes_shapes(scheme, shape, fp8, in_dtype):
    x = random_input(shape, in_dtype, seed=math.prod(shape), lo=-10, hi=10, zeros=0.05)
    r = assert_matches_expected(scheme, x, fp8)
    m, k = math.prod(shape[:-1]), shape[-1]
    assert r.scale.shape == ((-(-m // 32), k) if scheme.endswith("_col") else (m, -(-k // 32)))


@pytest.mark.parametrize("fn", [ref.quantize_block_1d, ref.quantize_block_2d])
def test_block_empty_input(fn):
    data, scale_inv = fn(torch.empty(0, 5), E4)
    assert data.shape == (0, 5) and scale_inv.shape == (0, 1)


# ============================================================================ properties
def shapes_for(scheme: str):
    lead = st.sampled_from([(), (1,), (2,), (3,)])
    if scheme.startswith("mx"):  # multiples of 32 and partial blocks
        if scheme.endswith("_col"):
            return st.tuples(lead, st.integers(1, 100), st.integers(1, 70)).map(lambda t: (*t[0], t[1], t[2]))
        return st.tuples(lead, st.integers(1, 40), st.integers(1, 130)).map(lambda t: (*t[0], t[1], t[2]))
    rows = st.integers(1, 150) if "2d" in scheme else st.integers(1, 40)
    return st.tuples(lead, rows, st.integers(1, 300)).map(lambda t: (*t[0], t[1], t[2]))


@st.composite
def scheme_inputs(draw, scheme):
    shape = draw(shapes_for(scheme))
    fp8 = draw(st.sampled_from(FP8_DTYPES))
    in_dtype = draw(st.sampled_from(IN_DTYPES))
    lo = draw(st.integers(-14, 14))
    hi = draw(st.integers(lo, 15))  # 2^15 fits fp16; every value is normal in every input dtype
    seed = draw(st.integers(0, 2**31 - 1))
    zeros = draw(st.sampled_from([0.0, 0.1]))
    return random_input(shape, in_dtype, seed, lo=lo, hi=hi, zeros=zeros), fp8


def tile_max(values: torch.Tensor, tile) -> torch.Tensor:
    """Per-element: the max |value| of the element's tile (values 2D)."""
    m, k = values.shape
    tr, tc = tile
    out = torch.empty_like(values)
    for i in range(0, m, tr):
        for j in range(0, k, tc):
            out[i:i + tr, j:j + tc] = values[i:i + tr, j:j + tc].abs().max()
    return out


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
@PROPERTY
@given(data=st.data())
def test_roundtrip_error_bound(scheme, data):
    """|deq - x| <= max(rel * |x|, half the smallest subnormal step * scale_inv, saturation gap).

    rel is half an ulp (E4M3 2^-4, E5M2 2^-3); elements far below their tile's amax land in the
    FP8 subnormals, where the step is min_subnormal * scale_inv; FLOOR-mode MX saturates
    elements above max, by |x| - max * scale_inv. The slack 1 + 2^-16 covers fp32 rounding of
    x * scale and of scale_inv with non-power-of-2 scales."""
    x, fp8 = data.draw(scheme_inputs(scheme))
    r = run(scheme, x, fp8)
    xo, deq, f = r.x.double(), r.deq.double(), r.factor
    err = (deq - xo).abs()
    bound = torch.maximum(torch.maximum(HALF_ULP[fp8] * xo.abs(), 0.5 * MIN_SUB[fp8] * f), xo.abs() - FMAX[fp8] * f)
    bad = torch.nonzero(err > bound * (1 + 2.0**-16))
    assert bad.numel() == 0, [(xo[tuple(i)].item(), deq[tuple(i)].item(), f[tuple(i)].item()) for i in bad[:5]]
    if not scheme.startswith("mx_floor"):  # only FLOOR mode saturates finite inputs
        assert (err <= torch.maximum(HALF_ULP[fp8] * xo.abs(), 0.5 * MIN_SUB[fp8] * f) * (1 + 2.0**-16)).all()


@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "fp32scale"])
@PROPERTY
@given(data=st.data())
def test_per_tensor_requantize_with_same_scale_is_identical(pow2, data):
    x, fp8 = data.draw(scheme_inputs("tensor"))
    scale = ref.compute_scale(ref.amax(x), fp8, force_pow_2_scales=pow2)
    q1 = ref.quantize_per_tensor(x, scale, fp8)
    d1 = ref.dequantize_per_tensor(q1, ref.reciprocal(scale), torch.float32)
    q2 = ref.quantize_per_tensor(d1, scale, fp8)
    assert torch.equal(bits(q1), bits(q2))


@pytest.mark.parametrize("scheme", ["block1d", "block1d_col", "block2d", "block2d_col"] + MX_SCHEMES)
@PROPERTY
@given(data=st.data())
def test_requantize_power_of_2_schemes(scheme, data):
    """Quantizing the dequantized tensor again (pow2 scales) gives the same values; the bits
    and scales are the same except in tiles whose largest code is exactly max/2 (E4M3 224,
    E5M2 28672): there the rule picks a scale 2x finer and every code doubles. (For such a tile
    the new amax is max/2 * scale_inv, so max / new_amax is exactly 2 * scale.)"""
    x, fp8 = data.draw(scheme_inputs(scheme))
    r1 = run(scheme, x, fp8)
    x2 = (r1.deq.t() if r1.transposed else r1.deq).reshape(x.shape).to(torch.float32)
    r2 = run(scheme, x2, fp8)
    assert torch.equal(r2.deq, r1.deq)
    v1, v2 = FMT[fp8].decode(bits(r1.data)), FMT[fp8].decode(bits(r2.data))
    finer = tile_max(v1, r1.tile) == FMAX[fp8] / 2
    if scheme.startswith("mx_floor"):  # floor(log2(amax)) is unchanged: codes in [256, 448] stay in the binade
        assert not finer.any()  # a FLOOR tile max is in [256, 448] (E4M3) / [2^15, 57344] (E5M2)
        assert torch.equal(r2.scale, r1.scale) and torch.equal(bits(r2.data), bits(r1.data))
        return
    assert torch.equal(r2.factor, torch.where(finer, r1.factor / 2, r1.factor))
    assert torch.equal(bits(r2.data)[~finer], bits(r1.data)[~finer])
    assert torch.equal(v2[finer], 2 * v1[finer])
