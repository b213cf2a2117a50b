"""The CPU grouped GEMM (engine.gemm.grouped.cpu_grouped_gemm: every group's exact GEMM in one native call, fprop
and dgrad written into one output) against one general_gemm per group, bit for bit.

tests/test_grouped_linear.py checks GroupedLinear against per-expert engine.Linear modules at small fp32 shapes
(the small GEMM kernel's sizes); here the bf16 shapes where the native exact GEMM runs oneDNN's addmm, which the
grouped call runs into a row slice of the output, under every recipe class (its default build), and the
per-tensor pair whose scale product is not a normal number (computed outside the native call, as general_gemm does).
"""

from __future__ import annotations

import pytest
import torch

import engine
from conformance.recipes import DEFAULTS, Case
from engine.gemm import general_gemm
from engine.gemm.grouped import cpu_grouped_gemm
from engine.ops import native
from test_grouped_linear import assert_bits, reference_grads, share_streams


@pytest.fixture(autouse=True)
def native_built():
    """These tests are of the native grouped call: `make test` builds it, so a missing build fails, not skips."""
    assert native.available(), native.why_unavailable()


E, K, N = 3, 256, 128
SPLITS = [0, 70, 130]  # an empty expert; 130 x 128 x 256 = 4.3M multiply-adds: addmm, not the small GEMM kernel


def bf16_linears(module: engine.GroupedLinear) -> list[engine.Linear]:
    refs = []
    for e in range(E):
        ref = engine.Linear(K, N, bias=True, params_dtype=torch.bfloat16)
        with torch.no_grad():
            ref.weight.copy_(getattr(module, f"weight{e}"))
            ref.bias.copy_(getattr(module, f"bias{e}"))
        refs.append(ref)
    return refs


@pytest.mark.parametrize("case", DEFAULTS, ids=str)
def test_bf16_addmm_sizes_bit_exact_to_per_expert_linears(case: Case, monkeypatch):
    calls = []
    grouped = native.grouped_exact_gemm
    monkeypatch.setattr(native, "grouped_exact_gemm", lambda *a, **k: calls.append(1) or grouped(*a, **k))
    recipe = case.recipe()
    torch.manual_seed(0)
    module = engine.GroupedLinear(E, K, N, params_dtype=torch.bfloat16)
    refs = bf16_linears(module)
    share_streams(module, refs, recipe)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(SPLITS), K, generator=g).bfloat16()
    dy = torch.randn(sum(SPLITS), N, generator=g).bfloat16()
    xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    with engine.fp8_autocast(recipe=recipe):
        y = module(xg, SPLITS)
        y_ref = torch.cat([ref(xe) for ref, xe in zip(refs, torch.split(xr, SPLITS))])
    y.backward(dy)
    y_ref.backward(dy)
    assert_bits(y, y_ref, "out")
    assert_bits(xg.grad, xr.grad, "dx")
    grads = [getattr(module, f"weight{e}").grad for e in range(E)] + \
        [getattr(module, f"bias{e}").grad for e in range(E)]
    for e, (got, want) in enumerate(zip(grads, reference_grads(refs))):
        assert_bits(got, want, f"grad {e} (weights then biases)")
    if case.class_name in ("DelayedScaling", "MXFP8BlockScaling"):  # per-tensor FP8, E8M0 tiles: the native call's
        assert calls, "the native grouped GEMM did not run"


def per_tensor(x: torch.Tensor, scale_inv: float) -> engine.Float8Tensor:
    """x as E4M3 data with the given per-tensor scale_inv (the data: x / scale_inv, rounded)."""
    q = engine.Float8Quantizer(torch.tensor(1.0 / scale_inv), torch.zeros(1), torch.float8_e4m3fn,
                               rowwise=True, columnwise=False)
    return q(x)


def test_per_tensor_scale_product_below_fp32_normals_matches_general_gemm():
    g = torch.Generator().manual_seed(2)
    a = [per_tensor(torch.randn(m, 64, generator=g), s) for m, s in ((5, 2.0**-70), (0, 1.0), (9, 1.0))]
    b = [per_tensor(torch.randn(16, 64, generator=g), s) for s in (2.0**-70, 1.0, 0.5)]  # group 0: 2^-140
    out = cpu_grouped_gemm(a, b, out_dtype=torch.float32)
    want = torch.cat([general_gemm(x, w, out_dtype=torch.float32) for x, w in zip(a, b)])
    assert out is not None and out[:5].abs().max() > 0
    assert_bits(out, want, "out")
    listed = cpu_grouped_gemm(a, b, out_dtype=torch.float32, concat=False)
    for got, x, w in zip(listed, a, b):
        assert_bits(got, general_gemm(x, w, out_dtype=torch.float32), "group")
