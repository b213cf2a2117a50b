"""Independent, deliberately slow computations the tests compare `engine` against.

Written from the format definitions (sign / exponent / mantissa bits, bias) and the
README's "Layouts of the quantized buffers" table, never from engine's code: nothing here
imports `engine`. Values are float64, where every FP8 value times an fp32 or E8M0 scale
is exact, so a dequantized value here is the exact value a buffer stands for.

* `fp8_table` / `e8m0_value`: every code decoded from its bits.
* `dequantize`: one usage's (data, scale_inv) -> the exact value, element by element, with
  the scale of each element found by index arithmetic from the layout rules.
* `expected_scales` / `expected_codes`: the documented scale rules per block, and the
  round-to-nearest-even code of each element found by searching all codes of the format.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

# name: (exponent bits, mantissa bits, bias, IEEE-like: all-ones exponent is inf / NaN)
FORMATS = {"e4m3": (4, 3, 7, False), "e5m2": (5, 2, 15, True)}
ELEMENT_OF = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
LAYOUTS = ("tensor", "block1d", "block2d", "mx", "axiswise")
TILE = 128  # block scaling: 1x128 (1D) and 128x128 (2D) tiles
MX_BLOCK = 32
FLT_MAX = 3.4028234663852886e38  # (2 - 2^-23) * 2^127
E8M0_NAN = 255


@contextlib.contextmanager
def _one_thread():
    """Run on one intra-op thread: these loops issue many mid-sized torch ops, and on a busy 2-core
    machine each parallel op can stall at its barrier (measured 3-5x slower than one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def one_thread(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _one_thread():
            return fn(*args, **kwargs)

    return wrapper


# ------------------------------------------------------------------------------------------ codes
def decode_fp8(code: int, element: str) -> float:
    """The value of one FP8 byte, from its bits.

    E4M3 has no inf: its all-ones exponent holds normal numbers except S.1111.111 (0x7F,
    0xFF), the one NaN per sign. E5M2 is IEEE-like: all-ones exponent = inf (mantissa 0) or NaN.
    """
    e_bits, m_bits, bias, ieee = FORMATS[element]
    sign = -1.0 if code & 0x80 else 1.0
    exponent = (code >> m_bits) & ((1 << e_bits) - 1)
    mantissa = code & ((1 << m_bits) - 1)
    all_ones = (1 << e_bits) - 1
    if ieee and exponent == all_ones:
        return sign * math.inf if mantissa == 0 else math.nan
    if not ieee and exponent == all_ones and mantissa == (1 << m_bits) - 1:
        return math.nan
    if exponent == 0:  # subnormal: 0.mantissa * 2^(1 - bias)
        return sign * (mantissa / (1 << m_bits)) * 2.0 ** (1 - bias)
    return sign * (1 + mantissa / (1 << m_bits)) * 2.0 ** (exponent - bias)


@functools.cache
def fp8_table(element: str) -> torch.Tensor:
    """float64 value of each of the 256 codes (cached: do not modify)."""
    return torch.tensor([decode_fp8(c, element) for c in range(256)], dtype=torch.float64)


@functools.cache
def fp8_max(element: str) -> float:
    table = fp8_table(element)
    return table[torch.isfinite(table)].max().item()


def fp8_emax(element: str) -> int:
    """Unbiased exponent of the largest finite value (E4M3: 8, E5M2: 15)."""
    return math.frexp(fp8_max(element))[1] - 1


def e8m0_value(code: int) -> float:
    """An E8M0 scale: 2^(code - 127); 255 is NaN."""
    return math.nan if code == E8M0_NAN else 2.0 ** (code - 127)


@functools.cache
def e8m0_table() -> torch.Tensor:
    return torch.tensor([e8m0_value(c) for c in range(256)], dtype=torch.float64)


def element_name(dtype: torch.dtype) -> str:
    if dtype not in ELEMENT_OF:
        raise AssertionError(f"data dtype: expected float8_e4m3fn or float8_e5m2, got {dtype}")
    return ELEMENT_OF[dtype]


# ----------------------------------------------------------------------------------------- layouts
def dims_2d(shape) -> tuple[int, int]:
    """(M, K): M = product of the leading dims, K = the last dim."""
    return math.prod(shape[:-1]), shape[-1]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def buffer_shapes(layout: str, shape, *, columnwise: bool) -> tuple[tuple[int, ...], tuple[int, ...], torch.dtype]:
    """(data shape, scale_inv shape, scale_inv dtype) of one usage, as the README's layout table says."""
    m, k = dims_2d(shape)
    if layout == "tensor":
        return ((k, m) if columnwise else tuple(shape)), (1,), torch.float32
    if layout == "block1d":
        if columnwise:
            return (k, m), (k, _cdiv(m, TILE)), torch.float32
        return tuple(shape), (m, _cdiv(k, TILE)), torch.float32
    if layout == "block2d":
        if columnwise:
            return (k, m), (_cdiv(k, TILE), _cdiv(m, TILE)), torch.float32
        return tuple(shape), (_cdiv(m, TILE), _cdiv(k, TILE)), torch.float32
    if layout == "mx":
        return tuple(shape), ((_cdiv(m, MX_BLOCK), k) if columnwise else (m, _cdiv(k, MX_BLOCK))), torch.uint8
    if layout == "axiswise":  # one scale per row of x (rowwise) / per column of x (columnwise, data [K, M])
        return ((k, m), (k, 1), torch.float32) if columnwise else (tuple(shape), (m, 1), torch.float32)
    raise AssertionError(f"layout: expected one of {LAYOUTS}, got {layout!r}")


def _grid(m: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row index i and column index j of every element of the [M, K] view, each shaped [M, K]."""
    i = torch.arange(m).reshape(m, 1).expand(m, k)
    j = torch.arange(k).reshape(1, k).expand(m, k)
    return i, j


def data_index(layout: str, i: torch.Tensor, j: torch.Tensor, *, columnwise: bool):
    """Where element (i, j) of x's [M, K] view sits in the stored data (transposed [K, M] or not)."""
    if columnwise and layout != "mx":
        return j, i
    return i, j


def scale_index(layout: str, i: torch.Tensor, j: torch.Tensor, *, columnwise: bool):
    """Which scale_inv entry element (i, j) of x's [M, K] view uses."""
    if layout == "tensor":
        return torch.zeros_like(i), None
    if layout == "block1d":  # rowwise 1x128 tiles; columnwise 1x128 tiles of the [K, M] transpose
        return (j, i // TILE) if columnwise else (i, j // TILE)
    if layout == "block2d":  # 128x128 tiles; columnwise scales are the transposed grid
        return (j // TILE, i // TILE) if columnwise else (i // TILE, j // TILE)
    if layout == "mx":  # rowwise 1x32 blocks along K, columnwise 32x1 blocks along M; data in x's shape
        return (i // MX_BLOCK, j) if columnwise else (i, j // MX_BLOCK)
    if layout == "axiswise":  # one scale per row over all of K; columnwise, per column over all of M
        return (j, torch.zeros_like(j)) if columnwise else (i, torch.zeros_like(i))
    raise AssertionError(f"layout: expected one of {LAYOUTS}, got {layout!r}")


def check_buffers(data: torch.Tensor, scale_inv: torch.Tensor, layout: str, shape, *, columnwise: bool) -> None:
    """AssertionError unless (data, scale_inv) have the shapes and dtypes of the README's table."""
    want_data, want_scale, scale_dtype = buffer_shapes(layout, shape, columnwise=columnwise)
    usage = "columnwise" if columnwise else "rowwise"
    assert tuple(data.shape) == want_data, f"{usage}_data: shape {tuple(data.shape)}, README says {want_data}"
    assert tuple(scale_inv.shape) == want_scale, (
        f"{usage}_scale_inv: shape {tuple(scale_inv.shape)}, README says {want_scale}")
    assert scale_inv.dtype == scale_dtype, f"{usage}_scale_inv: dtype {scale_inv.dtype}, README says {scale_dtype}"
    element_name(data.dtype)


def _lookup(t: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor | None) -> torch.Tensor:
    return t.reshape(-1)[rows] if cols is None else t[rows, cols]


# ------------------------------------------------------------------------------------- dequantize
def scale_values(scale_inv: torch.Tensor) -> torch.Tensor:
    """float64 value of each stored scale_inv (fp32 as it is, uint8 as E8M0 codes)."""
    if scale_inv.dtype == torch.uint8:
        return e8m0_table()[scale_inv.long()]
    return scale_inv.double()


@one_thread
def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, *, layout: str, shape, columnwise: bool) -> torch.Tensor:
    """Exact float64 value (x's `shape`) of one usage: each element's code times its block's scale."""
    check_buffers(data, scale_inv, layout, shape, columnwise=columnwise)
    m, k = dims_2d(shape)
    i, j = _grid(m, k)
    stored = data.view(torch.uint8).reshape(-1, data.shape[-1])
    codes = _lookup(stored, *data_index(layout, i, j, columnwise=columnwise)).long()
    values = fp8_table(element_name(data.dtype))[codes]
    scales = _lookup(scale_values(scale_inv), *scale_index(layout, i, j, columnwise=columnwise))
    return (values * scales).reshape(shape)


def as_dtype(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A dequantized value as `dequantize(dtype)` documents it: computed in fp32, then cast to dtype."""
    return exact.float().to(dtype)


def assert_same_values(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal values, NaN where NaN, and the sign of every zero."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got64, want64 = got.double(), want.double()
    nan_got, nan_want = torch.isnan(got64), torch.isnan(want64)
    assert torch.equal(nan_got, nan_want), f"{what}: NaN at {(nan_got != nan_want).nonzero()[:4].tolist()}"
    ok = ~nan_want
    bad = ok & ((got64 != want64) | (torch.signbit(got64) != torch.signbit(want64)))
    if bad.any():
        where = bad.nonzero()[:4]
        pairs = [(tuple(w), got64[tuple(w)].item(), want64[tuple(w)].item()) for w in where.tolist()]
        raise AssertionError(f"{what}: {int(bad.sum())} values differ, e.g. (index, got, want) {pairs}")


# ------------------------------------------------------------------------------------ quantization
def block_amax(x: torch.Tensor, layout: str, *, columnwise: bool) -> torch.Tensor:
    """max|x| over each block (NaN if the block has a NaN), shaped like the stored scale_inv."""
    m, k = dims_2d(x.shape)
    a = x.reshape(m, k).double().abs()
    _, scale_shape, _ = buffer_shapes(layout, x.shape, columnwise=columnwise)
    i, j = _grid(m, k)
    rows, cols = scale_index(layout, i, j, columnwise=columnwise)
    flat = rows.reshape(-1) if cols is None else (rows * scale_shape[-1] + cols).reshape(-1)
    n = math.prod(scale_shape)
    finite_max = torch.zeros(n, dtype=torch.float64).scatter_reduce(
        0, flat, torch.nan_to_num(a, nan=0.0, posinf=math.inf).reshape(-1), "amax")
    nans = torch.zeros(n, dtype=torch.float64).scatter_add(0, flat, torch.isnan(a).double().reshape(-1))
    return torch.where(nans > 0, math.nan, finite_max).reshape(scale_shape)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """float64 values rounded to fp32 (to nearest even; overflow to inf), back as float64."""
    return t.float().double()


def _pow2_floor(s: torch.Tensor) -> torch.Tensor:
    """The largest power of two <= s (s > 0, finite)."""
    _, e = torch.frexp(s)  # s = m * 2^e, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(s), e - 1)


def current_scale(amax: torch.Tensor, element: str, *, pow2: bool, value_for_inf: float) -> torch.Tensor:
    """Current scaling: scale = fp8_max / amax in fp32; 1 where amax is 0, inf or NaN; value_for_inf
    where the division overflows; rounded down to a power of two when `pow2`."""
    scale = _fp32(fp8_max(element) / amax)  # one fp32 division (float64 first: double rounding is innocuous)
    scale = torch.where(torch.isinf(scale), value_for_inf, scale)
    scale = torch.where(torch.isfinite(amax) & (amax != 0), scale, 1.0)
    return _pow2_floor(scale) if pow2 else scale


def e8m0_rceil(amax: torch.Tensor, element: str) -> torch.Tensor:
    """RCEIL: d = amax * (1/fp8_max), both fp32 (as TE); the code of the smallest power of two >= d,
    clamped to [2^-127, 2^127]; NaN amax gives 255."""
    d = _fp32(_fp32(amax) * _fp32(torch.tensor(1.0 / fp8_max(element), dtype=torch.float64)))
    codes = []
    for v in d.reshape(-1).tolist():
        if math.isnan(v):
            codes.append(E8M0_NAN)
            continue
        e = -127
        while e < 127 and 2.0**e < v:  # the search itself: smallest e with 2^e >= d
            e += 1
        codes.append(e + 127)
    return torch.tensor(codes, dtype=torch.uint8).reshape(amax.shape)


def e8m0_floor(amax: torch.Tensor, element: str) -> torch.Tensor:
    """FLOOR (OCP MX): floor(log2 amax) - emax, clamped to [-127, 127]; amax 0 gives code 0; inf/NaN 255."""
    codes = []
    for v in amax.reshape(-1).tolist():
        if not math.isfinite(v):
            codes.append(E8M0_NAN)
            continue
        shared = -127 if v == 0 else (math.frexp(v)[1] - 1) - fp8_emax(element)
        codes.append(min(max(shared, -127), 127) + 127)
    return torch.tensor(codes, dtype=torch.uint8).reshape(amax.shape)


def e8m0_multiplier(codes: torch.Tensor) -> torch.Tensor:
    """What an E8M0 block's elements are multiplied by before the cast: 2^(127 - code), NaN for 255."""
    values = [math.nan if c == E8M0_NAN else 2.0 ** (127 - c) for c in codes.reshape(-1).tolist()]
    return torch.tensor(values, dtype=torch.float64).reshape(codes.shape)


def expected_scales(x: torch.Tensor, *, layout: str, element: str, rule: str, columnwise: bool,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(multiplier applied to each block before the cast, float64; scale_inv as the tensor must store it).

    rule: "delayed" (the given `scale`), "current" / "current_pow2" (the current-scaling rule on
    each block's amax; an overflowing scale becomes FLT_MAX for a whole tensor and the input
    dtype's max for a tile), "rceil" / "floor" (E8M0 codes; multiplier 2^(127 - code)).
    """
    _, scale_shape, _ = buffer_shapes(layout, x.shape, columnwise=columnwise)
    if rule == "delayed":
        multiplier = torch.full(scale_shape, _fp32(torch.tensor(scale, dtype=torch.float64)).item(),
                                dtype=torch.float64)
        return multiplier, _fp32(1.0 / multiplier).float()
    amax = block_amax(x, layout, columnwise=columnwise)
    if rule in ("current", "current_pow2"):
        value_for_inf = FLT_MAX if layout == "tensor" else torch.finfo(x.dtype).max
        multiplier = current_scale(amax, element, pow2=rule == "current_pow2", value_for_inf=value_for_inf)
        return multiplier, _fp32(1.0 / multiplier).float()
    codes = {"rceil": e8m0_rceil, "floor": e8m0_floor}[rule](amax, element)
    return e8m0_multiplier(codes), codes


@one_thread
def nearest_codes(p: torch.Tensor, element: str, chunk: int = 4096) -> torch.Tensor:
    """The code of each float64 value p found by searching every finite code: the nearest value,
    ties to the even code (even mantissa), beyond +-max the max (saturation), the sign of p
    (so -0.0 and small negatives give 0x80); NaN positions get 255 (any NaN code matches)."""
    table = fp8_table(element)
    magnitudes = torch.arange(128)
    magnitudes = magnitudes[torch.isfinite(table[magnitudes])]  # codes 0..126 (E4M3) / 0..123 (E5M2)
    values = table[magnitudes]
    assert bool((values[1:] > values[:-1]).all())  # so two equally near codes are neighbours
    top = values.max()
    flat = p.reshape(-1)
    out = torch.empty(flat.shape, dtype=torch.long)
    for start in range(0, flat.numel(), chunk):
        a = flat[start : start + chunk].abs()
        dist = (a[:, None] - values[None, :]).abs_()
        best, first = dist.min(dim=1)  # the first (lowest) of the nearest codes
        second = (first + 1).clamp(max=len(values) - 1)
        tie = (second != first) & (dist.gather(1, second[:, None]).squeeze(1) == best)
        code = torch.where(tie & (magnitudes[first] % 2 == 1), magnitudes[second], magnitudes[first])
        # saturation: beyond max (inf too) the max; the distances cannot tell huge values apart in fp64
        code = torch.where(a >= top, magnitudes[values.argmax()], code)
        code = torch.where(torch.signbit(flat[start : start + chunk]), code | 0x80, code)
        out[start : start + chunk] = torch.where(torch.isnan(a), 255, code)
    return out.reshape(p.shape)


def expected_codes(x: torch.Tensor, multiplier: torch.Tensor, *, layout: str, element: str,
                   columnwise: bool) -> torch.Tensor:
    """The codes (as stored: [K, M] for transposed columnwise data) of x quantized with the block
    multipliers: p = x * multiplier rounded to fp32 (math in fp32), then the nearest code of p."""
    m, k = dims_2d(x.shape)
    i, j = _grid(m, k)
    mult = _lookup(multiplier, *scale_index(layout, i, j, columnwise=columnwise))
    p = _fp32(x.reshape(m, k).double() * mult)
    codes = nearest_codes(p, element)
    data_shape, _, _ = buffer_shapes(layout, x.shape, columnwise=columnwise)
    stored = torch.empty((k, m) if columnwise and layout != "mx" else (m, k), dtype=torch.long)
    r, c = data_index(layout, i, j, columnwise=columnwise)
    stored[r, c] = codes
    return stored.reshape(data_shape)


@one_thread
def check_quantized(x: torch.Tensor, data: torch.Tensor, scale_inv: torch.Tensor, *, layout: str, rule: str,
                    columnwise: bool, scale: float | None = None) -> None:
    """AssertionError unless one usage of x's quantization follows the rules element by element.

    The stored scale_inv must be the rule's, bit for bit; each code must be the nearest code
    (RNE, saturating) of x times the multiplier the tensor carries - 1/scale_inv for power-of-2
    and E8M0 scales, the rule's fp32 scale (whose reciprocal was just checked) otherwise.
    """
    check_buffers(data, scale_inv, layout, x.shape, columnwise=columnwise)
    element = element_name(data.dtype)
    usage = "columnwise" if columnwise else "rowwise"
    multiplier, want_scale_inv = expected_scales(x, layout=layout, element=element, rule=rule,
                                                 columnwise=columnwise, scale=scale)
    if scale_inv.dtype == torch.uint8:
        bad = scale_inv != want_scale_inv
        carried = e8m0_multiplier(scale_inv)
    else:
        bad = scale_inv.view(torch.int32) != want_scale_inv.view(torch.int32)
        s = scale_inv.double()
        pow2 = torch.frexp(s).mantissa == 0.5
        carried = torch.where(pow2, 1.0 / s, multiplier)  # exact for a power of two
    if bad.any():
        where = bad.nonzero()[:4].tolist()
        raise AssertionError(f"{usage}_scale_inv: {int(bad.sum())} of {bad.numel()} differ from the rule {rule!r}, "
                             f"e.g. at {where}: got {[scale_inv[tuple(w)].item() for w in where]}, "
                             f"want {[want_scale_inv[tuple(w)].item() for w in where]}")
    want = expected_codes(x, carried, layout=layout, element=element, columnwise=columnwise)
    got = data.view(torch.uint8).long().reshape(want.shape)
    table = fp8_table(element)
    nan_want = want == 255
    bad = torch.where(nan_want, ~torch.isnan(table[got]), got != want)
    if bad.any():
        where = bad.nonzero()[:4].tolist()
        raise AssertionError(f"{usage}_data: {int(bad.sum())} of {bad.numel()} codes are not the nearest, e.g. at "
                             f"{where}: got {[hex(got[tuple(w)].item()) for w in where]}, "
                             f"want {[hex(want[tuple(w)].item()) for w in where]}")
