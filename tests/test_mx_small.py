"""MXFP4 / MXFP6 (E2M1, E2M3, E3M2 elements, E8M0 scales per 32): schemes, scale rules, the reference
quantize/dequantize, against the independent brute force of tests/mx_brute.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mx_brute
from engine.formats import E2M1, E2M3, E3M2
from engine.ops import reference as ref
from engine.schemes import SCHEMES, ScaleEncoding, mx_scheme

NAMES = ("e2m1", "e2m3", "e3m2")
SHAPES = [(70, 45), (2, 35, 33), (33, 1), (1, 64), (5, 0), (0, 3), ()]


def same_bytes(got: torch.Tensor, want: np.ndarray) -> bool:
    return got.dtype == torch.uint8 and tuple(got.shape) == tuple(want.shape) and np.array_equal(got.numpy(), want)


def test_schemes_are_registry_entries():
    assert {"mx_e2m1", "mx_e2m3", "mx_e3m2"} <= set(SCHEMES)
    fp4, fp6 = SCHEMES["mx_e2m1"], SCHEMES["mx_e3m2"]
    assert fp4.element is E2M1 and fp4.elements_per_byte == 2 and fp4.data_dtype == torch.uint8
    assert SCHEMES["mx_e2m3"].element is E2M3 and fp6.element is E3M2 and fp6.elements_per_byte == 1
    assert fp4.scale is ScaleEncoding.E8M0 and fp4.layout == "mx" and not fp4.derivable
    assert fp4.data_shape((4, 33), False) == (4, 17) and fp4.data_shape((4, 33), True) == (4, 17)
    assert fp6.data_shape((4, 33), True) == (4, 33)
    assert fp4.scale_shape((40, 33), False) == (40, 2) and fp4.scale_shape((40, 33), True) == (2, 33)
    assert mx_scheme("e2m1") is fp4 and mx_scheme(torch.float8_e4m3fn) is SCHEMES["mx_e4m3"]
    with pytest.raises(TypeError, match="element"):
        mx_scheme(torch.float16)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_quantize_matches_brute_force(name, mode, dtype):
    scheme = SCHEMES[f"mx_{name}"]
    for seed, shape in enumerate(SHAPES):
        x = mx_brute.edge_input(shape, dtype, seed)
        for columnwise in (False, True):
            data, scales = ref.quantize_blocked(x, scheme, columnwise=columnwise, scale_mode=mode)
            want_data, want_scales = mx_brute.quantize(x, name, mode, columnwise)
            what = f"{name} {mode} {dtype} {shape} columnwise={columnwise}"
            assert same_bytes(scales, want_scales), what
            assert same_bytes(data, want_data), what
            value = ref.dequantize_blocked(data, scales, scheme, shape=x.shape, columnwise=columnwise)
            exact = mx_brute.dequantize(want_data, want_scales, name, shape, columnwise)
            with np.errstate(over="ignore"):
                want = torch.from_numpy(np.asarray(exact, dtype=np.float64)).float()  # fp32: overflow -> inf
            assert torch.equal(value.isnan(), want.isnan()), what
            ok = ~want.isnan()
            assert torch.equal(value[ok], want[ok]), what


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_scale_rule_of_every_amax_binade_boundary(name, mode):
    """Each rule over amaxes at and around every power of two (and its product with max_elem), 0, subnormal,
    FLT_MAX, inf and NaN, against the brute-force rule."""
    top = mx_brute.SPEC[name][3]
    amaxes = [0.0, 1e-45, 1e-40, 1.2e-38, 3.4028234663852886e38, float("inf"), float("nan")]
    for e in range(-140, 128, 3):
        for base in (2.0 ** e, top * 2.0 ** e):
            v = np.float32(base)
            amaxes += [float(v), float(np.nextafter(v, np.float32(np.inf))), float(np.nextafter(v, np.float32(0)))]
    amax = torch.tensor(amaxes, dtype=torch.float32)
    got = ref.SCALE_MODES[mode](amax, {"e2m1": E2M1, "e2m3": E2M3, "e3m2": E3M2}[name]).tolist()
    want = [mx_brute.scale_code(v, name, mode) for v in amax.tolist()]
    bad = [(a, g, w) for a, g, w in zip(amaxes, got, want) if g != w]
    assert not bad, bad[:8]


def test_nan_block_scale_is_255_and_elements_are_zero_codes():
    x = torch.ones(1, 32)
    x[0, 3] = float("nan")
    for mode in ("rceil", "floor"):
        data, scales = ref.quantize_blocked(x, SCHEMES["mx_e2m1"], scale_mode=mode)
        assert scales.tolist() == [[255]] and data.eq(0).all()
    x[0, 3] = float("inf")
    data, scales = ref.quantize_blocked(x, SCHEMES["mx_e2m1"], scale_mode="floor")
    assert scales.tolist() == [[255]] and data.eq(0).all()
    data, scales = ref.quantize_blocked(x, SCHEMES["mx_e2m1"], scale_mode="rceil")
    assert scales.tolist() == [[254]]  # inf -> the largest scale; inf saturates to 6 -> dequantizes to inf
    value = ref.dequantize_blocked(data, scales, SCHEMES["mx_e2m1"], shape=x.shape)
    assert value[0, 3] == float("inf") and value[0, 0] == 0
