"""Per-tensor GEMMs whose fp32 scale product underflows, and the CUDA `_scaled_mm` call driven on CPU tensors.

The CUDA branch (`engine.gemm.cuda.scaled_mm`) is run on CPU tensors through `cublas_like`, a stand-in for
`torch._scaled_mm` that enforces what torch's CUDA path checks (K and N multiples of 16, no bias with
an fp32 output, B column-major) and multiplies the two scales in fp32 before the GEMM (cuBLASLt's
order is not documented; this is the order that flushes tiny pairs). The GEMM itself is the real CPU
`torch._scaled_mm`, given that one combined scale.
"""

import pytest
import torch

import exact_gemm_bound

from engine.gemm import cpu, cuda, scales
from engine.gemm import gemm_operand, general_gemm
from engine.quantizers import Float8CurrentScalingQuantizer

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP32_TINY = torch.finfo(torch.float32).tiny


@pytest.fixture
def strict_scaled_mm(monkeypatch):
    """Patches torch._scaled_mm with the cuBLAS-like stand-in; returns the list of (scale_a, scale_b) it got."""
    real, scales = torch._scaled_mm, []

    def cublas_like(mat1, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
                    use_fast_accum=False):
        k, n = mat2.shape
        if mat1.shape[1] % 16 or k % 16 or n % 16:
            raise RuntimeError(f"cuBLAS FP8: K and N must be multiples of 16, got mat1 {tuple(mat1.shape)}, "
                               f"mat2 {tuple(mat2.shape)}")
        if bias is not None and out_dtype == torch.float32:
            raise RuntimeError("Bias is not supported when out_dtype is set to Float32")
        assert mat2.stride(0) == 1, "mat2 must be column-major"
        assert scale_a.dtype == scale_b.dtype == torch.float32 and scale_a.numel() == scale_b.numel() == 1
        scales.append((scale_a.item(), scale_b.item()))
        alpha = scale_a * scale_b  # in fp32: 0 when the product is below fp32's range
        return real(mat1, mat2, scale_a=alpha, scale_b=torch.ones((), dtype=torch.float32), bias=bias,
                    out_dtype=out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", cublas_like)
    return scales


def f64(t, *, transposed):
    """fp64 op(t) straight from the FP8 data and its fp32 scale_inv (no fp32 rounding on the way).

    The columnwise data of a 2D [m, n] tensor is stored as its transpose [n, m], which is op(t).
    """
    st = t.qstorage
    if transposed:
        return st.columnwise_data.double() * st.columnwise_scale_inv.double()
    return st.rowwise_data.double() * st.rowwise_scale_inv.double()


def bound(lhs, rhs, out_dtype, bias=None):
    """fp32 accumulation error, one rounding to out_dtype (relative, or one subnormal step), and the bias's."""
    want = lhs @ rhs.t() + (0 if bias is None else bias.double())
    k = lhs.shape[1]
    fp32_acc = (k + 4) * 2.0**-24 * (lhs.abs() @ rhs.abs().t())
    finfo = torch.finfo(out_dtype)
    rounding = want.abs() * finfo.eps + finfo.smallest_normal * finfo.eps  # relative or one subnormal step
    if bias is not None:
        rounding = rounding + bias.double().abs() * 2.0**-24
    return want, fp32_acc + rounding


def tiny_wgrad_operands(m=64, n=48, k=96, seed=0):
    torch.manual_seed(seed)
    x = Float8CurrentScalingQuantizer(E4M3)(torch.randn(m, k) * 1e-20)
    dy = Float8CurrentScalingQuantizer(E5M2)(torch.randn(m, n) * 1e-20)
    return x, dy


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_wgrad_of_tiny_operands_is_not_flushed_to_zero(out_dtype):
    x, dy = tiny_wgrad_operands()
    sa, sb = dy.qstorage.columnwise_scale_inv, x.qstorage.columnwise_scale_inv
    assert (sa * sb).item() == 0.0  # the case: the fp32 product of the two scales underflows
    lhs, rhs = f64(dy, transposed=True), f64(x, transposed=True)
    want, tol = bound(lhs, rhs, out_dtype)
    assert want.abs().max() > 1e-39  # an fp32 (subnormal) result, not zero
    got = general_gemm(dy, x, a_transposed=True, b_transposed=True, out_dtype=out_dtype)
    assert got.dtype == out_dtype
    assert ((got.double() - want).abs() <= tol).all()


def test_accumulating_tiny_wgrad_into_main_grad():
    x, dy = tiny_wgrad_operands(seed=1)
    main_grad = torch.full((48, 96), 2.0**-130)
    want, tol = bound(f64(dy, transposed=True), f64(x, transposed=True), torch.float32)
    general_gemm(dy, x, a_transposed=True, b_transposed=True, out=main_grad, accumulate=True)
    assert ((main_grad.double() - (want + 2.0**-130)).abs() <= tol + 2.0**-149).all()


def test_scale_product_underflow_with_a_bias_and_a_normal_result():
    # scales 2^-70 * 2^-70 = 2^-140 (subnormal product, rounded to 2^-149 steps) on values whose GEMM is ~1e-20:
    # the flushed alpha would lose most bits, the exact one keeps them
    torch.manual_seed(2)
    q = Float8CurrentScalingQuantizer(E4M3)
    x, w = q(torch.randn(32, 64) * 2.0**-63), q(torch.randn(40, 64) * 2.0**-63)
    bias = torch.randn(40) * 1e-37
    lhs, rhs = f64(x, transposed=False), f64(w, transposed=False)
    want, tol = bound(lhs, rhs, torch.float32, bias)
    got = general_gemm(x, w, out_dtype=torch.float32, bias=bias)
    assert ((got.double() - want).abs() <= tol).all()


def one_call(x, w, out_dtype, bias):
    """The per-tensor CPU GEMM as it was before the rescaling: one exact GEMM call with alpha = the fp32 scale
    product (native: addmm or its small kernel, whose fp32 summation orders differ: engine/ops/exact_gemm.py)."""
    xs, ws = x.qstorage, w.qstorage
    return cpu.exact_gemm_fn()(xs.rowwise_data, xs.rowwise_scale_inv, (0, 0), ws.rowwise_data, ws.rowwise_scale_inv,
                               (0, 0), bias, out_dtype)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m, n, k", [(8, 16, 24), (96, 160, 384), (257, 130, 515)])
def test_normal_scale_products_keep_todays_bits(out_dtype, with_bias, m, n, k):
    """Normal scale products take the one-call path (its bits exactly), which meets the GEMM's fp32 bound."""
    torch.manual_seed(m + n + k)
    qx, qw = Float8CurrentScalingQuantizer(E4M3), Float8CurrentScalingQuantizer(E4M3)
    for magnitude in (1e-3, 1.0, 3e4):
        x, w = qx(torch.randn(m, k) * magnitude), qw(torch.randn(n, k))
        bias = torch.randn(n).to(out_dtype) if with_bias else None
        assert (x.qstorage.rowwise_scale_inv * w.qstorage.rowwise_scale_inv).abs().item() >= FP32_TINY
        got, want = general_gemm(x, w, out_dtype=out_dtype, bias=bias), one_call(x, w, out_dtype, bias)
        bits = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
        assert torch.equal(got.view(bits), want.view(bits))
        xs, ws = x.qstorage, w.qstorage
        why = exact_gemm_bound.check(got, xs.rowwise_data, xs.rowwise_scale_inv, (0, 0), ws.rowwise_data,
                                     ws.rowwise_scale_inv, (0, 0), bias, out_dtype)
        assert why is None, why


# --- the CUDA branch, run on CPU tensors through `cublas_like`


def cuda_branch(a, b, out_dtype, bias=None, *, a_transposed=False, b_transposed=False):
    lhs, rhs = gemm_operand(a, transposed=a_transposed), gemm_operand(b, transposed=b_transposed)
    return cuda.scaled_mm(lhs, rhs, out_dtype, bias)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_branch_adds_the_bias_outside_the_gemm(strict_scaled_mm, out_dtype):
    # the Linear module's default: fp32 params, so an fp32 output with a bias (rejected inside _scaled_mm)
    torch.manual_seed(3)
    q = Float8CurrentScalingQuantizer(E4M3)
    x, w = q(torch.randn(32, 64) * 5), q(torch.randn(48, 64))
    bias = torch.randn(48).to(out_dtype)
    got = cuda_branch(x, w, out_dtype, bias)
    want, tol = bound(f64(x, transposed=False), f64(w, transposed=False), out_dtype, bias)
    assert got.dtype == out_dtype and got.shape == (32, 48)
    assert ((got.double() - want).abs() <= tol).all()


@pytest.mark.parametrize("m, n, k", [(33, 17, 70), (16, 48, 40), (5, 20, 16)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_cuda_branch_pads_k_and_n_to_multiples_of_16(strict_scaled_mm, m, n, k, out_dtype):
    torch.manual_seed(m * n * k)
    qx, qdy = Float8CurrentScalingQuantizer(E4M3), Float8CurrentScalingQuantizer(E5M2)
    x, w, dy = qx(torch.randn(m, k)), qx(torch.randn(n, k)), qdy(torch.randn(m, n))
    bias = torch.randn(n).to(out_dtype)
    cases = [  # fprop with a bias, dgrad, wgrad: every dim of the three GEMMs takes the K or N place once
        (cuda_branch(x, w, out_dtype, bias), f64(x, transposed=False), f64(w, transposed=False), bias),
        (cuda_branch(dy, w, out_dtype, b_transposed=True), f64(dy, transposed=False), f64(w, transposed=True), None),
        (cuda_branch(dy, x, out_dtype, a_transposed=True, b_transposed=True), f64(dy, transposed=True),
         f64(x, transposed=True), None),
    ]
    for got, lhs, rhs, b in cases:
        want, tol = bound(lhs, rhs, out_dtype, b)
        assert got.dtype == out_dtype and got.shape == want.shape
        assert ((got.double() - want).abs() <= tol).all()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_cuda_branch_tiny_operands_pass_scales_that_do_not_flush(strict_scaled_mm, out_dtype):
    x, dy = tiny_wgrad_operands(seed=4)
    got = cuda_branch(dy, x, out_dtype, a_transposed=True, b_transposed=True)
    want, tol = bound(f64(dy, transposed=True), f64(x, transposed=True), out_dtype)
    assert ((got.double() - want).abs() <= tol).all()
    (scale_a, scale_b), = strict_scaled_mm
    assert abs(torch.tensor(scale_a) * torch.tensor(scale_b)).item() >= FP32_TINY


def test_huge_scale_product_does_not_overflow(strict_scaled_mm):
    # amax 2^73 on both sides: each scale_inv is 2^73/448, their fp32 product (2^128.4) is inf, but the two
    # amax elements never meet in a dot product, so every result is ~2^120, a finite fp32 number
    torch.manual_seed(5)
    q = Float8CurrentScalingQuantizer(E4M3)
    a, b = torch.randn(16, 32) * 2.0**58, torch.randn(32, 32) * 2.0**58
    a[:, 0], a[:, 1], b[:, 0], b[:, 1] = 2.0**73, 0.0, 0.0, 2.0**73
    x, w = q(a), q(b)
    assert (x.qstorage.rowwise_scale_inv * w.qstorage.rowwise_scale_inv).isinf().all()
    want, tol = bound(f64(x, transposed=False), f64(w, transposed=False), torch.float32)
    assert want.abs().max() < 2.0**127
    for got in (cuda_branch(x, w, torch.float32), general_gemm(x, w, out_dtype=torch.float32)):
        assert ((got.double() - want).abs() <= tol).all()


def test_pow2_is_exact_over_fp32s_range():
    e = torch.arange(-160, 128, dtype=torch.int32)
    want = torch.tensor([2.0**int(i) for i in e], dtype=torch.float64).float()  # 2^-150 and below round to 0
    assert torch.equal(scales.pow2(e).view(torch.int32), want.view(torch.int32))


def test_times_pow2_rounds_once():
    # y as an FP8 GEMM times a scale in [0.25, 1) can be: 0 or |y| in [2^-34, 2^60), any sign
    torch.manual_seed(6)
    y = (torch.rand(4000, dtype=torch.float64) * 94 - 34).exp2().float() * torch.randn(4000).sign()
    y[:3] = torch.tensor([0.0, 2.0**-34, 2.0**60 * (1 - 2.0**-24)])
    for e in range(-300, 261, 7):
        want = (y.double() * 2.0**e).float()  # exact in fp64, then one rounding (to 0 or inf past fp32's range)
        got = scales.times_pow2(y, torch.tensor(e, dtype=torch.int32))
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), e
