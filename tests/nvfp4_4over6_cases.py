"""Inputs and options of the 4over6 kernel tests (tests/test_nvfp4_4over6_native.py and
tests/test_triton_nvfp4_4over6.py).

The oracle is engine's reference (`engine.ops.nvfp4.quantize(four_over_six=True)`), itself checked against TE's
(tests/test_nvfp4_4over6.py). Inputs: every input of TE's fixture with its options (random, heavy-tailed, the edge
values, and the near ties that pin the order of the fp32 operations), and edge cases in each dtype (zeros, -0,
all-zero blocks, subnormal and zero block scales, +-max and saturation, inf, NaN of both signs, odd, 1-row,
empty, 1D and 3D shapes), under options that reach every value of every option (both usages or one, 1x16 or
16x16, MAE or MSE, 448 or 256, given amaxes: ordinary, 0, inf, NaN).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "nvfp4_4over6" / "te_reference.safetensors"
FIELDS = ("rowwise_data", "rowwise_scale_inv", "amax_rowwise", "columnwise_data", "columnwise_scale_inv",
          "amax_columnwise")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# (rowwise, columnwise, two_d, err_mode, e4m3_max, given (amax, amax_t) or None)
OPTIONS = (
    (True, True, False, "MAE", 448, None),
    (True, True, True, "MSE", 256, None),
    (True, True, False, "MSE", 256, (3.5, 0.25)),
    (True, True, True, "MAE", 448, (0.0, float("inf"))),
    (True, False, True, "MSE", 448, (float("nan"), 1e-30)),
    (False, True, False, "MAE", 256, None),
    (False, True, True, "MAE", 256, (1e30, 7.0)),
    (True, False, False, "MSE", 448, None),
)


def quantize_kwargs(option: tuple) -> dict:
    rowwise, columnwise, two_d, mode, e4m3_max, given = option
    kw = dict(rowwise=rowwise, columnwise=columnwise, two_d=two_d, four_over_six=True, four_over_six_err_mode=mode,
              four_over_six_e4m3_max=e4m3_max)
    if given is not None:
        kw.update(amax=torch.tensor([given[0]]), amax_t=torch.tensor([given[1]]))
    return kw


def fixture_cases() -> list[tuple[str, torch.Tensor, dict]]:
    """(case, input, quantize kwargs) of every case of TE's fixture."""
    with safe_open(str(FIXTURE), "pt") as f:
        cases = json.loads(f.metadata()["cases"])
        inputs = {c["input"]: f.get_tensor(f"{c['input']}.x") for c in cases.values()}
    return [(name, inputs[c["input"]], dict(rowwise=c["rowwise"], columnwise=c["columnwise"], two_d=c["two_d"],
                                            four_over_six=True, four_over_six_err_mode=c["err_mode"],
                                            four_over_six_e4m3_max=c["e4m3_max"]))
            for name, c in cases.items()]


def edge_inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Edge-case inputs in `dtype`."""
    g = torch.Generator().manual_seed(11)
    big = torch.finfo(dtype).max
    out = {}
    x = torch.randn(48, 70, generator=g) * torch.exp2(torch.randint(-8, 9, (48, 70), generator=g).float())
    x.view(-1, 10)[:, 3] *= 300  # outliers
    out["random+outliers"] = x.to(dtype)
    out["zeros"] = torch.zeros(32, 48, dtype=dtype)
    z = torch.randn(48, 64, generator=g)
    z[:, 16:32] = 0.0  # all-zero rowwise blocks
    z[16:32] = -0.0  # all-zero columnwise blocks and 16x16 tiles, of -0
    z[40, 3] = -0.0
    out["zero-blocks"] = z.to(dtype)
    span = -torch.arange(32, dtype=torch.float32)[:, None].expand(32, 32) * (2.0 if dtype != torch.float16 else 0.6)
    tiny = torch.rand(32, 32, generator=g) * torch.exp2(span) * (big / 4)
    tiny[0, 0] = big / 2
    out["tiny-next-to-huge"] = tiny.to(dtype)  # subnormal and zero E4M3 block scales
    sub = (torch.rand(32, 48, generator=g) - 0.5) * torch.finfo(dtype).smallest_normal * 4
    out["subnormal"] = sub.to(dtype)
    pm = torch.randn(32, 32, generator=g)
    pm[::3, ::5] = big
    pm[1::4, 2::7] = -big
    out["+-max"] = pm.to(dtype)
    inf = torch.randn(32, 40, generator=g)
    inf[3, 7], inf[20, 33] = float("inf"), float("-inf")
    out["inf"] = inf.to(dtype)
    nan = torch.randn(32, 40, generator=g).to(dtype)
    nan[5, 9] = float("nan")
    nan.view(-1)[100] = torch.tensor(float("-nan")).to(dtype)
    out["nan"] = nan
    for shape in ((17, 33), (1, 70), (16, 7), (33, 17), (0, 64), (32, 0), (0, 0)):
        out[f"shape {shape}"] = (torch.randn(*shape, generator=g) * 10).to(dtype)
    out["3d"] = (torch.randn(2, 24, 35, generator=g) * 3).to(dtype)
    out["1d"] = torch.randn(40, generator=g).to(dtype)
    return out


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def mismatches(got: dict, want: dict) -> list[str]:
    """What differs between two quantize dicts, by the bits (NaN payloads included)."""
    bad = []
    for field in FIELDS:
        g, w = got[field], want[field]
        if g is None or w is None:
            if (g is None) != (w is None):
                bad.append(f"{field}: {g is None} vs {w is None}")
        elif g.shape != w.shape or g.dtype != w.dtype:
            bad.append(f"{field}: {g.dtype} {tuple(g.shape)} vs {w.dtype} {tuple(w.shape)}")
        elif not torch.equal(raw(g), raw(w)):
            bad.append(f"{field}: {int((raw(g) != raw(w)).sum())} of {g.numel()} differ")
    return bad
