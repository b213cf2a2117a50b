"""Quantization by contract: every registered scheme x every registered rule that fits it x every backend here.

The cases come from the registries (`engine.schemes.SCHEMES`, `engine.quantizers.RULE_ENTRIES`), so a new
scheme or rule is tested here by being registered. For each pair, the quantizer a `QuantizerSpec` builds
(delayed scaling: a quantizer over a given scale and amax record) quantizes random data with edge values
(signed zeros, subnormals, +-max, values past the elements' max, a zero row; inf and NaN too) into buffers
that must equal, bit for bit, those of the plain-PyTorch reference (`ENGINE_BACKEND=reference`), on every
native kernel set this CPU runs (`ENGINE_ISA` caps them). The Triton kernels are held to the same reference
by tests/test_registry.py and tests/test_triton*.py under the interpreter.

Dequantized values are then held to a bound computed in float64 from the element format alone: per block,
|value - x| <= amax_block * (2^-m + saturation) (+ a floor of amax * 2^-18 for two scale levels), where m is
the element's mantissa bits: a block scaled so its amax lands at most at the element's max rounds each
element by at most one ulp of the top binade, 2^-m * amax_block; "saturation" is what a scale rule lets
past the max (OCP's floor exponent: up to 1 - max / 2^(emax+1) of the amax; NVFP4's E4M3-rounded block
scale: 2^-3); NVFP4's subnormal E4M3 block scales (steps of 2^-9 of S_dec) add at most 6 * 2^-10 / 2688 of
the tensor amax, inside the floor. A wrong scale (off by 2 or more) breaks it.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.formats import IntFormat, element_format
from engine.ops import native
from engine.quantizers import RULE_ENTRIES, Quantizer
from engine.quantizers.rules import DelayedRule
from engine.recipes import QuantizerSpec
from engine.schemes import SCHEMES, Scheme
from tests.conftest import bits, special_input
from tests.test_native import ISAS

#: rule parameter variants per rule name (each registered rule runs at least its defaults)
VARIANTS = {"e8m0": [{}, {"scale_mode": "floor"}],
            "nvfp4": [{}, {"with_2d_quantization": True}, {"stochastic_rounding": True}, {"four_over_six": True},
                      {"four_over_six": True, "four_over_six_err_mode": "MSE", "with_2d_quantization": True}]}
SHAPES = ((48, 70), (2, 16, 33), (0, 32))  # token counts multiples of 16 (the RHT), odd last dims, empty


def cases() -> list[tuple[str, str, dict]]:
    found = []
    for scheme in SCHEMES.values():
        if isinstance(scheme.element, IntFormat) or scheme.data_dtype in (torch.int8,):
            continue  # integer schemes quantize weights for inference (tests/test_inference*.py)
        for entry in RULE_ENTRIES.values():
            if entry.fits(scheme):
                for params in VARIANTS.get(entry.name, [{}]):
                    if params.get("with_2d_quantization") and scheme.columnwise_transform is not None:
                        continue  # TE: 16x16 tiles for weights, the RHT for inputs and gradients, never both
                    try:  # settings the rule refuses for this scheme (4over6 with the RHT; E = 256 without 4over6)
                        quantizer(scheme.name, entry.name, params)
                    except ValueError:
                        continue
                    found.append((scheme.name, entry.name, params))
    return found



def quantizer(scheme: str, rule: str, params: dict) -> Quantizer:
    if RULE_ENTRIES[rule].stateful:  # delayed: a given scale (not a power of 2) and an amax record
        return Quantizer(SCHEMES[scheme], DelayedRule(torch.tensor([3.0]), torch.tensor([0.0])))
    return QuantizerSpec(scheme=scheme, rule=rule, params=params).make()


CASES = cases()


def run(case: tuple, x: torch.Tensor, backend: str, monkeypatch) -> dict:
    if backend == "reference":
        monkeypatch.setenv("ENGINE_BACKEND", "reference")
    else:
        monkeypatch.delenv("ENGINE_BACKEND", raising=False)
    q = quantizer(*case)
    st = q.quantize_storage(x)
    state = {f"rule.{k}": v for k, v in q.rule.state().items()}
    return {**{k: bits(v) for k, v in st.buffers().items()}, **{k: bits(v) for k, v in state.items()}}


def test_the_cases_cover_every_family():
    names = {c[0] for c in CASES}
    assert {"tensor_e4m3", "block1d_e4m3", "block2d_e5m2_pow2", "mx_e2m1", "mx_e3m2", "axiswise_e4m3",
            "nvfp4_e2m1", "nvfp4_rht_e2m1", "nvfp4_e256_e2m1"} <= names
    assert ("nvfp4_e2m1", "nvfp4", {"four_over_six": True}) in CASES
    assert {c[1] for c in CASES} == set(RULE_ENTRIES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{'-'.join(f'{k}={v}' for k, v in c[2].items())}")
@pytest.mark.parametrize("isa", ISAS)
def test_quantize_matches_the_reference_bitwise(case, isa, monkeypatch):
    assert native.available(), native.why_unavailable()
    bad = []
    for dtype in (torch.float32, torch.bfloat16):
        for shape in SHAPES:
            x = special_input(shape, dtype, seed=len(bad), nonfinite=True) if math.prod(shape) else \
                torch.empty(shape, dtype=dtype)
            want = run(case, x, "reference", monkeypatch)
            with native.use_isa(isa):
                got = run(case, x, "native", monkeypatch)
            assert set(got) == set(want)
            bad += [f"{dtype} {shape} {name}" for name in want
                    if (got[name] is None) != (want[name] is None) or
                    (want[name] is not None and not torch.equal(got[name], want[name]))]
    assert not bad, bad


def tile_amax(x2d: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Each element's tile amax (float64), tiles of rows x cols (0 = the whole dim) over x2d."""
    m, k = x2d.shape
    rows, cols = rows or m, cols or k
    pad = torch.nn.functional.pad(x2d.abs(), (0, -k % cols, 0, -m % rows))
    t = pad.reshape(pad.shape[0] // rows, rows, pad.shape[1] // cols, cols).amax(dim=(1, 3), keepdim=True)
    return t.expand(-1, rows, -1, cols).reshape(pad.shape)[:m, :k]


def bound(scheme: Scheme, params: dict, x2d: torch.Tensor, columnwise: bool) -> torch.Tensor:
    """The module docstring's bound for each element of one usage (its blocks in x's [M, K] view)."""
    fmt = element_format(scheme.element)
    block = scheme.columnwise_block if columnwise else scheme.rowwise_block
    rows, cols = (16, 16) if params.get("with_2d_quantization") else (block.rows, block.cols)
    saturation = 0.0
    if params.get("scale_mode") == "floor":
        saturation = 1 - fmt.max / 2.0 ** (fmt.max_exponent + 1)
    floor = 0.0
    if scheme.tensor_scale:
        saturation, floor = 2.0**-3, x2d.abs().max().item() * 2.0**-18
    if params.get("stochastic_rounding"):
        saturation += 2.0**-fmt.mantissa_bits  # rounds to either neighbour: up to one whole ulp
    return tile_amax(x2d, rows, cols) * (2.0**-fmt.mantissa_bits + saturation) + floor


@pytest.mark.parametrize("case", [c for c in CASES if not RULE_ENTRIES[c[1]].stateful],
                         ids=lambda c: f"{c[0]}-{c[1]}-{'-'.join(f'{k}={v}' for k, v in c[2].items())}")
def test_dequantize_is_within_the_elements_bound(case):
    """Each usage alone (a transformed one - NVFP4's RHT'd copy - is bounded in its own domain by
    tests/test_nvfp4_reference.py)."""
    scheme, params = SCHEMES[case[0]], case[2]
    for dtype in (torch.float32, torch.bfloat16):
        # +-fp32's max out: a power-of-2 scale's element max times its scale_inv overflows fp32 there (inf)
        x = special_input((48, 70), dtype, seed=3).clamp(-2.0**100, 2.0**100)
        x2d = x.double().reshape(-1, x.shape[-1])
        st = quantizer(*case).quantize_storage(x)
        for columnwise in (False, True):
            if scheme.transform(columnwise) is not None:
                continue
            alone = st.replace(**dict.fromkeys(scheme.usage_fields(not columnwise)))
            if scheme.rowwise_block.is_tensor and columnwise:
                alone = st.replace(rowwise_data=None)
            error = (alone.dequantize(torch.float64).reshape(x2d.shape) - x2d).abs()
            over = error > bound(scheme, params, x2d, columnwise)
            assert not bool(over.any()), (columnwise, dtype, x2d[over][:4].tolist(), error[over][:4].tolist())
