"""general_gemm on every pairing the recipes produce, against an fp64 GEMM of the dequantized operands."""

import pytest
import torch

from engine import gemm
from engine.gemm import cuda
from engine.gemm import general_gemm, gemm_operand
from engine.quantizers import Float8BlockQuantizer, Float8CurrentScalingQuantizer, MXFP8Quantizer

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def pairing(name):
    """(x quantizer, w quantizer, dy quantizer) as each recipe makes them."""
    if name == "tensor":
        return (Float8CurrentScalingQuantizer(E4M3), Float8CurrentScalingQuantizer(E4M3),
                Float8CurrentScalingQuantizer(E5M2))
    if name == "tensor-e4m3-grad":
        return tuple(Float8CurrentScalingQuantizer(E4M3) for _ in range(3))
    if name.startswith("block"):
        pow2 = name != "block-f32"
        w_dim = 1 if name == "block-1dx1d" else 2
        return (Float8BlockQuantizer(E4M3, force_pow_2_scales=pow2),
                Float8BlockQuantizer(E4M3, block_scaling_dim=w_dim, force_pow_2_scales=pow2),
                Float8BlockQuantizer(E4M3, force_pow_2_scales=pow2))
    if name == "mx":
        return MXFP8Quantizer(E4M3), MXFP8Quantizer(E4M3), MXFP8Quantizer(E5M2)
    raise KeyError(name)


PAIRINGS = ["tensor", "tensor-e4m3-grad", "block-pow2", "block-f32", "block-1dx1d", "mx"]


def value(t, *, transposed):
    """fp64 value of op(t) as the GEMM reads it: from rowwise data, or the columnwise data transposed."""
    st = t.qstorage
    if transposed:
        st = st.replace(rowwise_data=None, rowwise_scale_inv=None)
        return st.dequantize(torch.float64).reshape(-1, st.shape[-1]).t()
    st = st.replace(columnwise_data=None, columnwise_scale_inv=None)
    return st.dequantize(torch.float64).reshape(-1, st.shape[-1])


def fp32_bound(lhs, rhs):
    """|error| of an fp32-accumulated dot product: K * 2^-24 * sum|a*b| (plus the output rounding)."""
    k = lhs.shape[1]
    return (k + 2) * 2.0**-24 * (lhs.abs() @ rhs.abs().t())


@pytest.mark.parametrize("name", PAIRINGS)
@pytest.mark.parametrize("m, n, k", [(96, 160, 384), (64, 32, 256), (160, 96, 160)])
def test_the_three_linear_gemms_match_fp64(name, m, n, k):
    torch.manual_seed(m + n + k)
    qx, qw, qdy = pairing(name)
    x, w, dy = qx(torch.randn(m, k)), qw(torch.randn(n, k)), qdy(torch.randn(m, n))
    cases = [
        (general_gemm(x, w, out_dtype=torch.float32), value(x, transposed=False), value(w, transposed=False)),
        (general_gemm(dy, w, b_transposed=True, out_dtype=torch.float32), value(dy, transposed=False),
         value(w, transposed=True)),
        (general_gemm(dy, x, a_transposed=True, b_transposed=True, out_dtype=torch.float32),
         value(dy, transposed=True), value(x, transposed=True)),
    ]
    for got, lhs, rhs in cases:
        want = lhs @ rhs.t()
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert ((got.double() - want).abs() <= fp32_bound(lhs, rhs)).all()


@pytest.mark.parametrize("name", PAIRINGS)
def test_bf16_output_is_the_fp64_result_rounded_once(name):
    torch.manual_seed(1)
    qx, qw, _ = pairing(name)
    x, w = qx(torch.randn(64, 256)), qw(torch.randn(96, 256))
    want = value(x, transposed=False) @ value(w, transposed=False).t()
    got = general_gemm(x, w, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    # one bf16 rounding (2^-8 relative) on top of the fp32 accumulation error
    bound = want.abs() * 2.0**-8 + fp32_bound(value(x, transposed=False), value(w, transposed=False))
    assert ((got.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("name", PAIRINGS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bias_and_out_dtype_against_the_reference_sum(name, out_dtype):
    torch.manual_seed(2)
    qx, qw, _ = pairing(name)
    x, w = qx(torch.randn(32, 128)), qw(torch.randn(64, 128))
    bias = torch.randn(64).to(out_dtype)
    got = general_gemm(x, w, out_dtype=out_dtype, bias=bias)
    lhs, rhs = value(x, transposed=False), value(w, transposed=False)
    want = lhs @ rhs.t() + bias.double()
    rounding = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[out_dtype]
    bound = want.abs() * rounding + fp32_bound(lhs, rhs) + bias.double().abs() * 2.0**-23
    assert got.dtype == out_dtype and ((got.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("name", PAIRINGS)
def test_accumulate_adds_into_an_fp32_main_grad(name):
    torch.manual_seed(3)
    _, qw, qdy = pairing(name)
    qx = pairing(name)[0]
    dy, x = qdy(torch.randn(64, 96)), qx(torch.randn(64, 128))
    main_grad = torch.randn(96, 128)
    before = main_grad.clone()
    result = general_gemm(dy, x, a_transposed=True, b_transposed=True, out=main_grad, accumulate=True)
    assert result is main_grad
    lhs, rhs = value(dy, transposed=True), value(x, transposed=True)
    want = before.double() + lhs @ rhs.t()
    bound = fp32_bound(lhs, rhs) + want.abs() * 2.0**-23
    assert ((main_grad.double() - want).abs() <= bound).all()


def test_out_without_accumulate_is_overwritten():
    qx, qw, _ = pairing("tensor")
    x, w = qx(torch.randn(16, 64)), qw(torch.randn(32, 64))
    out = torch.full((16, 32), 7.0)
    general_gemm(x, w, out=out, out_dtype=torch.float32)
    assert torch.equal(out, general_gemm(x, w, out_dtype=torch.float32))


def test_fp32_block_scales_are_applied_per_k_block():
    # one operand with a different (non power of 2) scale in each K block: a single dequantized GEMM
    # and the per-K-block path agree to fp32 accuracy, and the per-K-block path is the one taken
    torch.manual_seed(4)
    q = Float8BlockQuantizer(E4M3, force_pow_2_scales=False)
    a = torch.cat([torch.randn(8, 128) * 3, torch.randn(8, 128) * 0.01], dim=1)
    x, w = q(a), q(torch.randn(8, 256))
    lhs, rhs = gemm_operand(x, transposed=False), gemm_operand(w, transposed=False)
    assert lhs.kind == "block" and gemm.pairing(lhs, rhs) is gemm.cpu.fp32_tiles  # known from the scheme
    got = general_gemm(x, w, out_dtype=torch.float32)
    want = value(x, transposed=False) @ value(w, transposed=False).t()
    assert ((got.double() - want).abs() <= fp32_bound(value(x, transposed=False), value(w, transposed=False))).all()


def test_scaled_mm_call_of_the_cuda_path_runs_on_cpu_and_agrees():
    torch.manual_seed(5)
    qx, qw, _ = pairing("tensor")
    x, w = qx(torch.randn(32, 64) * 5), qw(torch.randn(48, 64))
    bias = torch.randn(48)
    lhs, rhs = gemm_operand(x, transposed=False), gemm_operand(w, transposed=False)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = cuda.scaled_mm(lhs, rhs, out_dtype, bias.to(out_dtype))
        want = general_gemm(x, w, out_dtype=out_dtype, bias=bias.to(out_dtype))
        tol = 0 if out_dtype == torch.float32 else 2.0**-7
        assert got.dtype == out_dtype
        assert torch.allclose(got.float(), want.float(), rtol=tol + 1e-6, atol=1e-5)


@pytest.mark.parametrize("name", PAIRINGS)
def test_a_high_precision_operand_pairs_with_a_quantized_one(name):
    """Weight-only and unquantized operands: the quantized side's exact value times the plain one (fp64 check)."""
    torch.manual_seed(3)
    qx, qw, _ = pairing(name)
    x_plain, w = torch.randn(48, 256), qw(torch.randn(80, 256))
    want = x_plain.double() @ value(w, transposed=False).t()
    got = general_gemm(x_plain, w, out_dtype=torch.float32)
    assert ((got.double() - want).abs() <= fp32_bound(x_plain.double(), value(w, transposed=False))).all()
    dy = torch.randn(48, 80)  # dgrad with a plain gradient: dy @ W
    got = general_gemm(dy, w, b_transposed=True, out_dtype=torch.float32)
    want = dy.double() @ value(w, transposed=True).t()
    assert ((got.double() - want).abs() <= fp32_bound(dy.double(), value(w, transposed=True))).all()


def test_errors_name_the_problem():
    qx, qw, _ = pairing("tensor")
    x, w = qx(torch.randn(16, 64)), qw(torch.randn(32, 64))
    with pytest.raises(TypeError, match="a: expected a quantized tensor"):
        general_gemm([[1.0] * 64] * 16, w)
    with pytest.raises(TypeError, match="cannot pair"):
        general_gemm(x, MXFP8Quantizer(E4M3)(torch.randn(32, 64)))
    with pytest.raises(ValueError, match="inner dims"):
        general_gemm(x, qw(torch.randn(32, 96)))
    with pytest.raises(ValueError, match="bias"):
        general_gemm(x, w, bias=torch.zeros(31))
    with pytest.raises(ValueError, match="accumulate"):
        general_gemm(x, w, accumulate=True)
    with pytest.raises(TypeError, match="out_dtype"):
        general_gemm(x, w, out_dtype=torch.int32)
    rowwise_only = Float8BlockQuantizer(E4M3, columnwise=False)(torch.randn(16, 64))
    with pytest.raises(ValueError, match="columnwise"):
        general_gemm(rowwise_only, rowwise_only, a_transposed=True, b_transposed=True)
    two_d = Float8BlockQuantizer(E4M3, block_scaling_dim=2)
    with pytest.raises(ValueError, match="2D x 2D"):
        general_gemm(two_d(torch.randn(16, 64)), two_d(torch.randn(32, 64)))
