"""The CPU grouped GEMM (engine.gemm.grouped.cpu_grouped_gemm: every group's CPU GEMM in one native call, fprop
and dgrad written into one output) against per-expert engine.Linear modules and general_gemm per group, bit for bit.

tests/test_grouped_linear.py checks GroupedLinear against per-expert engine.Linear modules at small fp32 shapes
(the small GEMM kernel's sizes); here the bf16 shapes where the native exact GEMM runs oneDNN's addmm, which the
grouped call runs into a row slice of the output, under every recipe and option variant (the native call must run
every pass whose operands are quantized: per-tensor FP8, power-of-2 tiles, NVFP4, fp32 tiles, per-tensor by
tiles), the per-tensor pair whose scale product is not a normal number (computed outside the native call, as
general_gemm does), and NVFP4 amaxes whose factor leaves fp32's normal range.
"""

from __future__ import annotations

import pytest
import torch

import engine
from conformance.recipes import CASES, Case
from engine.gemm import general_gemm
from engine.gemm.grouped import cpu_grouped_gemm
from engine.ops import native
from engine.recipes import Gemm, NVFP4BlockScaling, Role
from engine.tensors.quantized import storage_of
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


def quantized_passes(module: engine.GroupedLinear) -> int:
    """How many of fprop, dgrad, wgrad have both operands quantized for every expert (read from the recipe's
    states): the passes the native grouped call must run."""
    passes = 0
    for gemm, roles in ((Gemm.FPROP, (Role.INPUT, Role.WEIGHT)), (Gemm.DGRAD, (Role.GRAD_OUTPUT, Role.WEIGHT)),
                        (Gemm.WGRAD, (Role.GRAD_OUTPUT, Role.INPUT))):
        states = [module._bwd_state if role is Role.GRAD_OUTPUT else module._fwd_state for role in roles]
        passes += all(state.operand((gemm, role), e) is not None
                      for state, role in zip(states, roles) for e in range(E))
    return passes


@pytest.mark.parametrize("case", CASES, ids=str)
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
    assert len(calls) == quantized_passes(module), "the native grouped GEMM did not run every quantized pass"


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


def test_fp32_output_beyond_the_small_gemm_matches_general_gemm():
    """fp32 output with K above the small GEMM kernel's limit (512): an fp32 addmm into each group's rows."""
    g = torch.Generator().manual_seed(4)
    a = [per_tensor(torch.randn(m, 640, generator=g), 0.5) for m in (7, 0, 12)]
    b = [per_tensor(torch.randn(24, 640, generator=g), 0.25) for _ in range(3)]
    out = cpu_grouped_gemm(a, b, out_dtype=torch.float32)
    assert out is not None
    assert_bits(out, torch.cat([general_gemm(x, w, out_dtype=torch.float32) for x, w in zip(a, b)]), "out")

@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_nvfp4_factor_outside_fp32_normals_matches_general_gemm(out_dtype: torch.dtype):
    """amax_a * amax_b / 2688^2 below fp32's normals (applied as mantissas and powers of two), and a bias."""
    recipe = NVFP4BlockScaling()
    state = recipe.make_state(forward=True, num_gemms=3)
    quantizers = [state.operand((Gemm.FPROP, role), 0) for role in (Role.INPUT, Role.WEIGHT)]
    for q in quantizers:
        q.set_usage(rowwise=True, columnwise=False)
    g = torch.Generator().manual_seed(3)
    a = [quantizers[0](torch.randn(m, 64, generator=g) * s) for m, s in ((5, 2.0**-60), (0, 1.0), (9, 1.0))]
    b = [quantizers[1](torch.randn(16, 64, generator=g) * s) for s in (2.0**-60, 2.0**60, 1.0)]
    biases = [torch.randn(16, generator=g).to(out_dtype) for _ in range(3)]
    out = cpu_grouped_gemm(a, b, out_dtype=out_dtype, biases=biases)
    want = torch.cat([general_gemm(x, w, out_dtype=out_dtype, bias=c) for x, w, c in zip(a, b, biases)])
    assert out is not None
    assert_bits(out, want, "out")
    listed = cpu_grouped_gemm(a, b, out_dtype=out_dtype, concat=False)
    for got, x, w in zip(listed, a, b):
        assert_bits(got, general_gemm(x, w, out_dtype=out_dtype), "group")
    factor = storage_of(a[0], "a").amax_rowwise * storage_of(b[0], "b").amax_rowwise / 2688.0**2
    assert factor < torch.finfo(torch.float32).tiny and listed[0].abs().max() > 0  # a factor fp32 would flush
