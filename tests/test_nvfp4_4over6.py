"""NVFP4 "4over6" in the reference (`engine.ops.nvfp4.quantize(four_over_six=True)`, `engine.ops.nvfp4_4over6`).

* Bit for bit Transformer Engine's reference quantizer: tests/fixtures/nvfp4_4over6/te_reference.safetensors holds
  TE's own outputs (codes, E4M3 scale bytes, amax) on fixed inputs, written by tests/fixtures/make_nvfp4_4over6.py
  from a TE snapshot (the CI has none: this file reads only the fixture).
* The choice is the better candidate: an independent scalar quantizer (float32 scalars, grid searches for the
  E4M3 and E2M1 roundings) builds both candidates of every block, their errors are summed in float64 by a
  direct loop, and the block must hold one of the two, the smaller-error one unless the two errors tie up to
  fp32 rounding.
* The refusals (the RHT, stochastic rounding, bad option values) and the dequantize bound E.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from engine.ops import nvfp4

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "nvfp4_4over6" / "te_reference.safetensors"
USAGES = (("rowwise", "row"), ("columnwise", "col"))


def _load_fixture() -> tuple[dict, dict[str, torch.Tensor]]:
    with safe_open(str(FIXTURE), "pt") as f:
        return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}


META, TENSORS = _load_fixture()
CASES = json.loads(META["cases"])


def quantize_4over6(x: torch.Tensor, opts: dict, **kw) -> dict:
    return nvfp4.quantize(x, rowwise=opts["rowwise"], columnwise=opts["columnwise"], two_d=opts["two_d"],
                          four_over_six=True, four_over_six_err_mode=opts["err_mode"],
                          four_over_six_e4m3_max=opts["e4m3_max"], **kw)


# ------------------------------------------------------------------------------------ TE's reference
@pytest.mark.parametrize("name", list(CASES))
def test_reference_is_te_reference_bit_for_bit(name):
    opts = CASES[name]
    out = quantize_4over6(TENSORS[f"{opts['input']}.x"], opts)
    for usage, key in USAGES:
        if not opts[usage]:
            assert out[f"{usage}_data"] is None
            continue
        te_data = TENSORS[f"{name}.{key}_data"]
        data = out[f"{usage}_data"]
        # TE's reference drops the last nibble of an odd dim (its data is [rows, dim // 2]): compare that prefix
        assert data.shape[0] == te_data.shape[0] and data.shape[1] - te_data.shape[1] in (0, 1)
        assert torch.equal(data[:, :te_data.shape[1]], te_data), f"{usage} codes"
        assert torch.equal(out[f"{usage}_scale_inv"].view(torch.uint8), TENSORS[f"{name}.{key}_scales"]), \
            f"{usage} scales"
        assert torch.equal(out[f"amax_{usage}"].view(torch.int32), TENSORS[f"{name}.amax_{key}"].view(torch.int32))


def test_the_fixture_covers_the_options_and_both_choices():
    """Every option value appears, and TE kept map-to-4 for some blocks and map-to-6 for others (scale bytes
    that differ from plain NVFP4's at E = 448 show map-to-4)."""
    assert len(META["te_commit"]) == 40 and META["te_file"].endswith("custom_recipes/reference_nvfp4.py")
    for key, values in (("two_d", {False, True}), ("err_mode", {"MAE", "MSE"}), ("e4m3_max", {448, 256})):
        assert {c[key] for c in CASES.values()} == values, key
    assert {(c["rowwise"], c["columnwise"]) for c in CASES.values()} == {(True, True), (True, False), (False, True)}
    assert {TENSORS[f"{c['input']}.x"].dtype for c in CASES.values()} == {torch.float32, torch.bfloat16, torch.float16}
    kept4 = kept6 = 0
    for name, opts in CASES.items():
        if opts["e4m3_max"] != 448 or not opts["rowwise"]:
            continue
        x = TENSORS[f"{opts['input']}.x"]
        if not torch.isfinite(x).all():
            continue
        plain = nvfp4.quantize(x, columnwise=False, two_d=opts["two_d"])["rowwise_scale_inv"].view(torch.uint8)
        same = TENSORS[f"{name}.row_scales"] == plain
        kept6, kept4 = kept6 + int(same.sum()), kept4 + int((~same).sum())
    assert kept4 > 100 and kept6 > 100, (kept4, kept6)
    inputs = {c["input"] for c in CASES.values()}
    for kind in ("zeros", "equal", "subnormal", "max", "inf", "nan", "negzero"):
        assert any(i.startswith(kind) for i in inputs), kind


def test_the_fixture_pins_the_order_of_operations():
    """The order inputs (tests/fixtures/nvfp4_4over6_near_ties.py) are there for every mode and bound, and on
    some 16x16 tiles TE's two usages chose differently (each sums its own errors)."""
    order = {(c["err_mode"], c["e4m3_max"], c["two_d"]) for c in CASES.values() if c.get("order")}
    assert order == {(m, e, td) for m in ("MAE", "MSE") for e in (448, 256) for td in (False, True)}
    differ = 0
    for name, opts in CASES.items():
        if opts["two_d"] and opts["rowwise"] and opts["columnwise"]:
            row_tiles = TENSORS[f"{name}.row_scales"][::16]
            col_tiles = TENSORS[f"{name}.col_scales"][::16]
            differ += int((row_tiles != col_tiles.t()).sum())
    assert differ > 0


# ------------------------------------------------------------------------------ brute force, float64
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E4M3_VALUES = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double().tolist()  # codes 0..0x7E
f32 = np.float32


def e4m3_code(v: np.float32) -> int:
    """Nearest finite E4M3 code of v >= 0, ties to the even code, saturating (a search over the codes)."""
    v = min(float(v), 448.0)
    return min(range(0x7F), key=lambda c: (abs(E4M3_VALUES[c] - v), c % 2))


def e2m1_code(v: np.float32) -> int:
    """Nearest E2M1 code of v, ties to the even code, saturating; the sign code iff v < 0."""
    a = min(abs(float(v)), 6.0)
    code = min(range(8), key=lambda c: (abs(E2M1_GRID[c] - a), c % 2))
    return code | 8 if v < 0 else code


def candidates(block: np.ndarray, amax: float, e4m3_max: float) -> list[tuple[int, list[int]]]:
    """[(scale code, element codes)] of map-to-4 and map-to-6 for a finite block (numpy float32 scalars)."""
    s_enc = f32(e4m3_max * 6.0) / f32(amax) if amax > 0 else f32(np.finfo(np.float32).max)
    s_enc = min(s_enc, f32(np.finfo(np.float32).max))
    s_dec = f32(1.0) / s_enc
    base = (f32(np.abs(block).max()) / f32(6.0)) * s_enc
    out = []
    for s in (base * f32(1.5), base):
        code = e4m3_code(s)
        with np.errstate(divide="ignore"):
            enc = min(f32(1.0) / (f32(E4M3_VALUES[code]) * s_dec), f32(np.finfo(np.float32).max))
        out.append((code, [e2m1_code(f32(v) * enc) for v in block.ravel()]))
    return out


def error64(block: np.ndarray, scale_code: int, codes: list[int], amax: float, e4m3_max: float, mode: str) -> float:
    """sum over the block of |q * s * amax / (6 E) - x| (MAE) or its square (MSE), in float64."""
    total = 0.0
    for v, c in zip(block.ravel().tolist(), codes):
        q = math.copysign(E2M1_GRID[c & 7], -1.0 if c & 8 else 1.0)
        d = q * E4M3_VALUES[scale_code] * amax / (6.0 * e4m3_max) - v
        total += abs(d) if mode == "MAE" else d * d
    return total


def blocks_of(out: dict, usage: str, x2d: np.ndarray, two_d: bool):
    """(block of x as float32 [rows, 16] or [16, 16], engine's scale code, engine's codes in the block's order)."""
    src = x2d if usage == "rowwise" else x2d.T
    rows, cols = src.shape
    pad = np.zeros((-(-rows // 16) * 16, -(-cols // 16) * 16), dtype=np.float32)
    pad[:rows, :cols] = src
    data = out[f"{usage}_data"]
    codes = torch.stack([data & 0xF, data >> 4], dim=-1).reshape(rows, -1)[:, :cols]
    full = np.zeros(pad.shape, dtype=np.int64)
    full[:rows, :cols] = codes.numpy()
    scales = out[f"{usage}_scale_inv"].view(torch.uint8).numpy()
    height = 16 if two_d else 1
    for r in range(0, rows, height):
        for c in range(0, cols, 16):
            yield (pad[r:r + height, c:c + 16], int(scales[r, c // 16]), full[r:r + height, c:c + 16].ravel().tolist())


BRUTE = [  # (id, input, two_d, err mode, E, given amaxes)
    ("normal-1d-mae-448", lambda g: torch.randn(32, 48, generator=g), False, "MAE", 448, None),
    ("heavy-1d-mse-256", lambda g: torch.randn(24, 40, generator=g) * torch.exp(2 * torch.randn(24, 40, generator=g)),
     False, "MSE", 256, None),
    ("wide-bf16-1d-mae-256", lambda g: (torch.randn(20, 64, generator=g) * torch.logspace(-5, 3, 64)).bfloat16(),
     False, "MAE", 256, None),
    ("normal-2d-mse-448", lambda g: torch.randn(40, 36, generator=g), True, "MSE", 448, None),
    ("heavy-2d-mae-256", lambda g: torch.randn(32, 32, generator=g) * torch.exp(2 * torch.randn(32, 32, generator=g)),
     True, "MAE", 256, None),
    ("given-amaxes-1d-mse-448", lambda g: torch.randn(16, 32, generator=g), False, "MSE", 448, (7.5, 0.25)),
]


@pytest.mark.parametrize("make, two_d, mode, e4m3_max, given", [b[1:] for b in BRUTE], ids=[b[0] for b in BRUTE])
def test_the_kept_candidate_has_the_smaller_float64_error(make, two_d, mode, e4m3_max, given):
    x = make(torch.Generator().manual_seed(len(mode) + e4m3_max + two_d))
    amaxes = {} if given is None else dict(amax=torch.tensor([given[0]]), amax_t=torch.tensor([given[1]]))
    out = nvfp4.quantize(x, two_d=two_d, four_over_six=True, four_over_six_err_mode=mode,
                         four_over_six_e4m3_max=e4m3_max, **amaxes)
    x2d = x.float().numpy()
    decided = {4: 0, 6: 0}
    for usage, _ in USAGES:
        amax = float(np.abs(x2d).max()) if given is None else given[usage == "columnwise"]
        for block, scale, codes in blocks_of(out, usage, x2d, two_d):
            (s4, q4), (s6, q6) = candidates(block, amax, e4m3_max)
            assert (scale, codes) in ((s4, q4), (s6, q6)), (usage, block, scale, s4, s6)
            if (s4, q4) == (s6, q6):
                continue
            e4, e6 = (error64(block, s, q, amax, e4m3_max, mode) for s, q in ((s4, q4), (s6, q6)))
            tie = abs(e4 - e6) <= 1e-5 * max(e4, e6) + 1e-300
            if not tie:
                assert (scale, codes) == ((s4, q4) if e4 < e6 else (s6, q6)), (usage, e4, e6)
                decided[4 if e4 < e6 else 6] += 1
    assert decided[4] > 0 and decided[6] > 0, decided


# ----------------------------------------------------------------------------------------- options
def test_without_four_over_six_the_bits_are_plain_nvfp4_whatever_e4m3_max():
    """TE ignores the E4M3 bound without 4over6 (its quantizer keeps 448); so does engine."""
    x = torch.randn(32, 48, generator=torch.Generator().manual_seed(0))
    plain = nvfp4.quantize(x, two_d=True)
    with_options = nvfp4.quantize(x, two_d=True, four_over_six=False, four_over_six_err_mode="MSE",
                                  four_over_six_e4m3_max=256)
    for key, v in plain.items():
        assert torch.equal(v.view(torch.uint8), with_options[key].view(torch.uint8)), key


def test_dequantize_with_the_256_bound():
    """`dequantize_2d(e4m3_max=256)` scales by 1/(6 * 256): each value within its block's E2M1 half step of x
    (with 448's factor every value would be off by a factor 1536/2688)."""
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)) * 3.0
    out = nvfp4.quantize(x, columnwise=False, four_over_six=True, four_over_six_e4m3_max=256)
    y = nvfp4.dequantize_2d(out["rowwise_data"], out["rowwise_scale_inv"], out["amax_rowwise"], 64, e4m3_max=256)
    step = out["rowwise_scale_inv"].float().repeat_interleave(16, 1) * out["amax_rowwise"] / 1536.0  # one E2M1 unit
    assert ((y - x).abs() <= step * 1.0001).all()  # at most half of the largest step (2 units)
    assert ((y - x).abs() > step * 0.001).any()
    with pytest.raises(ValueError, match="e4m3_max: expected 448 or 256"):
        nvfp4.dequantize_2d(out["rowwise_data"], out["rowwise_scale_inv"], out["amax_rowwise"], 64, e4m3_max=300)


REFUSALS = [
    (dict(rht=True), ValueError, "four_over_six and rht"),
    (dict(rbits=torch.zeros(16, 32, dtype=torch.uint8)), ValueError, "four_over_six and stochastic rounding"),
    (dict(rbits_t=torch.zeros(32, 16, dtype=torch.uint8)), ValueError, "four_over_six and stochastic rounding"),
    (dict(four_over_six_err_mode="mae"), ValueError, "four_over_six_err_mode: expected 'MAE' or 'MSE', got 'mae'"),
    (dict(four_over_six_err_mode="L1"), ValueError, "four_over_six_err_mode"),
    (dict(four_over_six_e4m3_max=300), ValueError, "four_over_six_e4m3_max: expected 448 or 256"),
    (dict(four_over_six_e4m3_max="448"), TypeError, "four_over_six_e4m3_max: expected a number"),
    (dict(four_over_six_e4m3_max=True), TypeError, "four_over_six_e4m3_max"),
]


@pytest.mark.parametrize("kw, exc, message", REFUSALS, ids=[str(r[0])[:40] for r in REFUSALS])
def test_refusals_name_the_argument(kw, exc, message):
    with pytest.raises(exc, match=message.replace("(", r"\(")):
        nvfp4.quantize(torch.randn(16, 32), four_over_six=True, **kw)


def test_four_over_six_must_be_a_bool():
    with pytest.raises(TypeError, match="four_over_six: expected a bool, got int"):
        nvfp4.quantize(torch.randn(16, 32), four_over_six=1)
    with pytest.raises(ValueError, match="four_over_six_err_mode"):  # a bad value is bad with 4over6 off too
        nvfp4.quantize(torch.randn(16, 32), four_over_six_err_mode="MAX")
