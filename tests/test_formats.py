"""Tests of engine.formats: the bit layouts, the derived limits, and torch's own FP8 dtypes.

Expectations come from NUMERICS.md / the OCP MX v1.0 spec (values written out by hand) or
from brute force over every code of a format; none are copied from running the code.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.formats import E2M1, E2M3, E3M2, E4M3, E5M2, E8M0, FORMATS, format_of, format_table, fp8_max

REPO = Path(__file__).resolve().parents[1]
TORCH_FORMATS = [E4M3, E5M2, E8M0]
MX_ELEMENT_FORMATS = [E2M1, E2M3, E3M2]
ALL_FORMATS = [E4M3, E5M2, E8M0, E2M1, E2M3, E3M2]
ids = [f.name for f in ALL_FORMATS]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Small tensors: intra-op threads only add OpenMP spin-waits (10x slower on a busy 2-core
    machine). Restored after this module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- helpers
def all_codes(fmt) -> torch.Tensor:
    return torch.arange(1 << fmt.bits, dtype=torch.int64)


def positive_finite_table(fmt) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, values) of every finite code with the sign bit clear, in code order."""
    codes = torch.arange(1 << (fmt.bits - 1), dtype=torch.int64)
    values = fmt.decode(codes)
    keep = torch.isfinite(values)
    return codes[keep], values[keep]


def nearest_even_codes(x: torch.Tensor, fmt) -> torch.Tensor:
    """Brute force round-to-nearest-even of (finite, |x| <= max) values onto the code table.

    Distance to every positive finite code; among the nearest, the even code (mantissa LSB 0)
    wins. The sign bit is copied from x, so -0.0 and small negatives become 0x80.
    """
    codes, values = positive_finite_table(fmt)
    mag = x.double().abs().reshape(-1)
    out = []
    for chunk in mag.split(4096):
        dist = (chunk[:, None] - values[None, :]).abs()
        nearest = dist == dist.min(dim=1, keepdim=True).values
        parity = torch.where(nearest, (codes % 2)[None, :], torch.full_like(dist, 2, dtype=torch.int64))
        out.append(codes[parity.argmin(dim=1)])
    magnitude_codes = torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)
    sign = torch.signbit(x.reshape(-1)).to(torch.int64) << (fmt.bits - 1)
    return (magnitude_codes | sign).to(torch.uint8).reshape(x.shape)


# ------------------------------------------------------------------ decode vs torch's dtypes
@pytest.mark.parametrize("fmt", TORCH_FORMATS, ids=lambda f: f.name)
def test_decode_matches_torch_for_all_256_codes(fmt):
    codes = torch.arange(256, dtype=torch.uint8)
    expected = codes.view(fmt.torch_dtype).double()
    got = fmt.decode(codes)
    assert got.dtype == torch.float64
    assert torch.equal(torch.isnan(got), torch.isnan(expected))
    finite = ~torch.isnan(expected)
    assert torch.equal(got[finite], expected[finite])
    assert torch.equal(torch.signbit(got[finite]), torch.signbit(expected[finite]))  # -0.0 too


@pytest.mark.parametrize(
    "fmt, nan_codes",
    [
        (E4M3, {0x7F, 0xFF}),  # S.1111.111 only
        (E5M2, {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF}),  # S.11111.{01,10,11}
        (E8M0, {0xFF}),
        (E2M1, set()),
        (E2M3, set()),
        (E3M2, set()),
    ],
    ids=ids,
)
def test_nan_codes(fmt, nan_codes):
    values = fmt.decode(all_codes(fmt))
    assert set(torch.nonzero(torch.isnan(values)).flatten().tolist()) == nan_codes


def test_e5m2_infinities():
    values = E5M2.decode(torch.tensor([0x7C, 0xFC]))  # S.11111.00
    assert values.tolist() == [math.inf, -math.inf]
    for fmt in (E4M3, E8M0, E2M1, E2M3, E3M2):
        assert not torch.isinf(fmt.decode(all_codes(fmt))).any(), fmt.name


# --------------------------------------------------------------------------- MX element formats
# Positive values (with 0) of the OCP MX v1.0 element formats, written out from the spec tables.
OCP_POSITIVE_VALUES = {
    "E2M1": [0, 0.5, 1, 1.5, 2, 3, 4, 6],
    "E2M3": [
        0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875,  # subnormals m/8
        1, 1.125, 1.25, 1.375, 1.5, 1.625, 1.75, 1.875,
        2, 2.25, 2.5, 2.75, 3, 3.25, 3.5, 3.75,
        4, 4.5, 5, 5.5, 6, 6.5, 7, 7.5,
    ],
    "E3M2": [
        0, 0.0625, 0.125, 0.1875,  # subnormals m/4 * 2^-2
        0.25, 0.3125, 0.375, 0.4375,
        0.5, 0.625, 0.75, 0.875,
        1, 1.25, 1.5, 1.75,
        2, 2.5, 3, 3.5,
        4, 5, 6, 7,
        8, 10, 12, 14,
        16, 20, 24, 28,
    ],
}


@pytest.mark.parametrize("fmt", MX_ELEMENT_FORMATS, ids=lambda f: f.name)
def test_mx_element_values_match_ocp_spec(fmt):
    codes = all_codes(fmt)
    assert len(codes) == {"E2M1": 16, "E2M3": 64, "E3M2": 64}[fmt.name]
    values = fmt.decode(codes)
    half = len(codes) // 2
    positive = values[:half]
    # Codes with the sign bit clear are the OCP values, in increasing order.
    assert positive.tolist() == OCP_POSITIVE_VALUES[fmt.name]
    # The sign bit negates (and 0 becomes -0.0).
    negative = values[half:]
    assert torch.equal(negative, -positive)
    assert torch.signbit(negative).all()


# --------------------------------------------------------------- derived limits vs decode
@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=ids)
def test_limits_agree_with_decode(fmt):
    codes = all_codes(fmt)
    values = fmt.decode(codes)
    finite = values[torch.isfinite(values)]
    positive = finite[finite > 0]
    assert fmt.max == finite.max().item()
    if fmt.signed:
        assert -fmt.max == finite.min().item()
    if fmt.mantissa_bits == 0:  # E8M0: no zero, no subnormals
        assert fmt.min_subnormal is None
        assert fmt.min_normal == positive.min().item()
        return
    assert fmt.min_subnormal == positive.min().item()
    exponent_field = (codes >> fmt.mantissa_bits) & ((1 << fmt.exponent_bits) - 1)
    normals = values[(exponent_field != 0) & (values > 0) & torch.isfinite(values)]
    assert fmt.min_normal == normals.min().item()
    # Below min_normal sit exactly the 2^m - 1 subnormals, evenly spaced by min_subnormal.
    below = torch.unique(positive[positive < fmt.min_normal])
    expected = fmt.min_subnormal * torch.arange(1, 1 << fmt.mantissa_bits, dtype=torch.float64)
    assert torch.equal(below, expected)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=ids)
def test_max_exponent_is_exponent_of_max(fmt):
    # Docstring: "Unbiased exponent of the largest finite value" -> 2^emax <= max < 2^(emax+1).
    assert 2.0**fmt.max_exponent <= fmt.max < 2.0 ** (fmt.max_exponent + 1)


@pytest.mark.parametrize("fmt", TORCH_FORMATS, ids=lambda f: f.name)
def test_limits_agree_with_torch_finfo(fmt):
    info = torch.finfo(fmt.torch_dtype)
    assert fmt.max == info.max
    assert fmt.min_normal == info.smallest_normal


@pytest.mark.parametrize(
    "fmt, bits, max_, min_normal, min_subnormal",
    [
        (E4M3, 8, 448.0, 2.0**-6, 2.0**-9),
        (E5M2, 8, 57344.0, 2.0**-14, 2.0**-16),
        (E8M0, 8, 2.0**127, 2.0**-127, None),
        (E2M1, 4, 6.0, 1.0, 0.5),
        (E2M3, 6, 7.5, 1.0, 0.125),
        (E3M2, 6, 28.0, 0.25, 0.0625),
    ],
    ids=ids,
)
def test_table_values(fmt, bits, max_, min_normal, min_subnormal):
    assert fmt.bits == bits
    assert fmt.max == max_
    assert fmt.min_normal == min_normal
    assert fmt.min_subnormal == min_subnormal


@pytest.mark.parametrize(
    "fmt, emax",
    # OCP MX v1.0: emax of E4M3 8, E5M2 15, E2M1 2, E2M3 2, E3M2 4; E8M0 spans 2^-127..2^127.
    [(E4M3, 8), (E5M2, 15), (E8M0, 127), (E2M1, 2), (E2M3, 2), (E3M2, 4)],
    ids=ids,
)
def test_max_exponent_table(fmt, emax):
    assert fmt.max_exponent == emax


def test_bias_table():
    biases = {f.name: f.bias for f in ALL_FORMATS}
    assert biases == {"E4M3": 7, "E5M2": 15, "E8M0": 127, "E2M1": 1, "E2M3": 1, "E3M2": 3}


# ------------------------------------------------------------------------ dtype helpers
def test_fp8_max_values():
    assert fp8_max(torch.float8_e4m3fn) == 448.0
    assert fp8_max(torch.float8_e5m2) == 57344.0


def test_format_of_maps_dtypes():
    assert format_of(torch.float8_e4m3fn) is E4M3
    assert format_of(torch.float8_e5m2) is E5M2
    assert format_of(torch.float8_e8m0fnu) is E8M0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.float8_e8m0fnu])
def test_fp8_max_rejects_non_fp8_element_dtype(dtype):
    with pytest.raises(TypeError, match=r"^fp8_dtype: .*got " + str(dtype)):
        fp8_max(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_format_of_rejects_non_fp8_dtype(dtype):
    with pytest.raises(TypeError, match=r"^dtype: .*got " + str(dtype)):
        format_of(dtype)


# ----------------------------------------------------------------------------------- table
# (name, bits, exp, mant, bias, max, min normal, min subnormal, torch dtype), by hand.
EXPECTED_ROWS = {
    "E4M3": (8, 4, 3, 7, 448.0, 2.0**-6, 2.0**-9, "float8_e4m3fn"),
    "E5M2": (8, 5, 2, 15, 57344.0, 2.0**-14, 2.0**-16, "float8_e5m2"),
    "E8M0": (8, 8, 0, 127, 2.0**127, 2.0**-127, None, "float8_e8m0fnu"),
    "E2M1": (4, 2, 1, 1, 6.0, 1.0, 0.5, None),
    "E2M3": (6, 2, 3, 1, 7.5, 1.0, 0.125, None),
    "E3M2": (6, 3, 2, 3, 28.0, 0.25, 0.0625, None),
}


def check_table_text(text: str) -> None:
    lines = text.strip().splitlines()
    assert lines[0].split()[0] == "format"
    assert set(lines[1].replace(" ", "")) == {"-"}
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert set(rows) == set(EXPECTED_ROWS) == set(FORMATS)
    for name, (bits, exp, mant, bias, max_, min_normal, min_sub, dtype) in EXPECTED_ROWS.items():
        cells = rows[name]
        assert len(cells) == 9, cells
        assert [int(c) for c in cells[1:5]] == [bits, exp, mant, bias]
        assert float(cells[5]) == pytest.approx(max_, rel=1e-5)
        assert float(cells[6]) == pytest.approx(min_normal, rel=1e-5)
        if min_sub is None:
            assert cells[7] == "-"
        else:
            assert float(cells[7]) == pytest.approx(min_sub, rel=1e-5)
        assert cells[8] == ("-" if dtype is None else dtype)


def test_format_table_lists_every_format():
    check_table_text(format_table())


def test_cli_formats_prints_table():
    result = subprocess.run(
        [sys.executable, "-m", "engine", "formats"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    check_table_text(result.stdout)
    assert result.stdout.strip() == format_table().strip()


# ------------------------------------------- torch's cast: round to nearest even on the table
def rne_probe_values(fmt, n_random: int = 20000) -> torch.Tensor:
    """Codes, exact midpoints of adjacent codes, midpoints +- 1 fp32 ulp, random values
    spanning the subnormals up to max, and values below half the smallest subnormal."""
    _, values = positive_finite_table(fmt)
    values = values.float()
    mids = (values[:-1] + values[1:]) / 2  # one more bit than the format: exact in fp32
    up = torch.nextafter(mids, torch.full_like(mids, math.inf))
    down = torch.nextafter(mids, torch.full_like(mids, -math.inf))
    g = torch.Generator().manual_seed(1234)
    lo, hi = math.log2(fmt.min_subnormal) - 2, math.log2(fmt.max)
    rand = torch.exp2(torch.rand(n_random, generator=g, dtype=torch.float64) * (hi - lo) + lo).float()
    tiny = torch.tensor([fmt.min_subnormal / 2, fmt.min_subnormal / 4, fmt.min_subnormal * 0.75, 1e-30, 0.0])
    pos = torch.cat([values, mids, up, down, rand, tiny]).clamp(max=fmt.max)
    return torch.cat([pos, -pos])


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_torch_cast_is_round_to_nearest_even(fmt):
    x = rne_probe_values(fmt)
    assert x.abs().max().item() == fmt.max  # everything already clamped, as reference.cast_to_fp8 does
    got = x.to(fmt.torch_dtype).view(torch.uint8)
    expected = nearest_even_codes(x, fmt)
    mismatch = torch.nonzero(got != expected).flatten()
    assert mismatch.numel() == 0, [(x[i].item(), got[i].item(), expected[i].item()) for i in mismatch[:5]]


@pytest.mark.parametrize(
    "fmt, value, code",
    [
        # E4M3 binade [1, 2) has step 1/8: 1.0625 is the midpoint of 1.0 (0x38, even) and 1.125 (0x39).
        (E4M3, 1.0625, 0x38),
        # 1.1875 is the midpoint of 1.125 (0x39, odd) and 1.25 (0x3A, even) -> 1.25.
        (E4M3, 1.1875, 0x3A),
        # 432 is the midpoint of 416 (0x7D, odd) and 448 (0x7E, even) -> 448.
        (E4M3, 432.0, 0x7E),
        # 2^-10 is half the smallest subnormal: tie between 0 (even) and 2^-9 (0x01) -> 0.
        (E4M3, 2.0**-10, 0x00),
        # 3 * 2^-10 is between 2^-9 (0x01) and 2^-8 (0x02, even) -> 0x02.
        (E4M3, 3 * 2.0**-10, 0x02),
        # E5M2 binade [1, 2) has step 1/4: 1.125 -> 1.0 (0x3C, even); 1.375 -> 1.5 (0x3E).
        (E5M2, 1.125, 0x3C),
        (E5M2, 1.375, 0x3E),
        # 53248 is the midpoint of 49152 (0x7A, even) and 57344 (0x7B) -> 49152.
        (E5M2, 53248.0, 0x7A),
    ],
)
def test_torch_cast_ties_by_hand(fmt, value, code):
    for sign, sign_bit in ((1.0, 0x00), (-1.0, 0x80)):
        x = torch.tensor([sign * value], dtype=torch.float32)
        assert x.to(fmt.torch_dtype).view(torch.uint8).item() == code | sign_bit
        assert nearest_even_codes(x, fmt).item() == code | sign_bit  # the brute force agrees with the hand value
