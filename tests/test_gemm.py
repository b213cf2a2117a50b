"""general_gemm on every pairing the recipes produce, against an fp64 GEMM of the operands' exact values.

The expected values never go through general_gemm or engine's dequantize: each operand's buffers
are dequantized element by element by tests/brute_force.py (from the README's layout rules),
multiplied in fp64, and compared with a bound on fp32 accumulation error derived from K.
"""

import pytest
import torch

import brute_force
from engine import gemm
from engine.gemm import cuda
from engine.gemm import general_gemm, gemm_operand
from engine.quantizers import (
    Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8RowwiseQuantizer, MXFP8Quantizer,
)

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


def layout_of(quantizer) -> str:
    """The README layout a quantizer's tensors have (from the quantizer's type and settings)."""
    if isinstance(quantizer, Float8CurrentScalingQuantizer):
        return "tensor"
    if isinstance(quantizer, Float8BlockQuantizer):
        return f"block{quantizer.block_scaling_dim}d"
    assert isinstance(quantizer, MXFP8Quantizer)
    return "mx"


def value(t, *, transposed):
    """Exact fp64 value of op(t) as the GEMM reads it: rowwise data, or the columnwise data transposed."""
    st = t.qstorage
    usage = "columnwise" if transposed else "rowwise"
    exact = brute_force.dequantize(getattr(st, f"{usage}_data"), getattr(st, f"{usage}_scale_inv"),
                                   layout=layout_of(t.quantizer), shape=tuple(st.shape), columnwise=transposed)
    exact = exact.reshape(-1, st.shape[-1])
    return exact.t() if transposed else exact


def spread(m, k, seed):
    """N(0, 1) values times a power of two per row and per column in [2^-4, 2^4]: every row, 1x128 tile,
    32-block and 128x128 tile gets its own scale, so a scale applied to the wrong block shows."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.exp2(torch.randint(-4, 5, (m, 1), generator=g).float())
    cols = torch.exp2(torch.randint(-4, 5, (1, k), generator=g).float())
    return torch.randn(m, k, generator=g) * rows * cols


def fp32_bound(lhs, rhs):
    """|error| of an fp32-accumulated dot product: K * 2^-24 * sum|a*b| (plus the output rounding)."""
    k = lhs.shape[1]
    return (k + 2) * 2.0**-24 * (lhs.abs() @ rhs.abs().t())


def assert_within(got, want, bound, what=""):
    err = (got.double() - want).abs()
    bad = ~(err <= bound)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} outside the bound, worst excess "
                           f"{(err - bound)[bad].max().item():.3g} (got {got.double()[bad][:3].tolist()}, "
                           f"want {want[bad][:3].tolist()})")


@pytest.mark.parametrize("name", PAIRINGS)
@pytest.mark.parametrize("m, n, k", [(96, 160, 384), (64, 32, 256), (160, 96, 160), (33, 70, 130)])
def test_the_three_linear_gemms_match_fp64(name, m, n, k):
    qx, qw, qdy = pairing(name)
    x, w, dy = qx(spread(m, k, 1)), qw(spread(n, k, 2)), qdy(spread(m, n, 3))
    cases = [
        ("fprop", general_gemm(x, w, out_dtype=torch.float32), value(x, transposed=False), value(w, transposed=False)),
        ("dgrad", general_gemm(dy, w, b_transposed=True, out_dtype=torch.float32), value(dy, transposed=False),
         value(w, transposed=True)),
        ("wgrad", general_gemm(dy, x, a_transposed=True, b_transposed=True, out_dtype=torch.float32),
         value(dy, transposed=True), value(x, transposed=True)),
    ]
    for what, got, lhs, rhs in cases:
        want = lhs @ rhs.t()
        assert got.dtype == torch.float32 and got.shape == want.shape, what
        assert_within(got, want, fp32_bound(lhs, rhs), what)


@pytest.mark.parametrize("name", PAIRINGS)
def test_bf16_output_is_the_fp64_result_rounded_once(name):
    qx, qw, _ = pairing(name)
    x, w = qx(spread(64, 256, 4)), qw(spread(96, 256, 5))
    lhs, rhs = value(x, transposed=False), value(w, transposed=False)
    want = lhs @ rhs.t()
    got = general_gemm(x, w, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    # one bf16 rounding (2^-8 relative) on top of the fp32 accumulation error
    assert_within(got, want, want.abs() * 2.0**-8 + fp32_bound(lhs, rhs))


@pytest.mark.parametrize("name", PAIRINGS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_bias_and_out_dtype_against_the_reference_sum(name, out_dtype):
    qx, qw, _ = pairing(name)
    x, w = qx(spread(32, 128, 6)), qw(spread(64, 128, 7) / 64)  # within fp16's range
    bias = (torch.randn(64, generator=torch.Generator().manual_seed(7)) * 4).to(out_dtype)
    got = general_gemm(x, w, out_dtype=out_dtype, bias=bias)
    lhs, rhs = value(x, transposed=False), value(w, transposed=False)
    want = lhs @ rhs.t() + bias.double()
    rounding = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[out_dtype]
    bound = want.abs() * rounding + fp32_bound(lhs, rhs) + bias.double().abs() * 2.0**-23
    assert got.dtype == out_dtype
    assert_within(got, want, bound)


@pytest.mark.parametrize("name", PAIRINGS)
def test_accumulate_adds_into_an_fp32_main_grad(name):
    qx, _, qdy = pairing(name)
    dy, x = qdy(spread(64, 96, 8)), qx(spread(64, 128, 9))
    main_grad = torch.randn(96, 128)
    before = main_grad.clone()
    result = general_gemm(dy, x, a_transposed=True, b_transposed=True, out=main_grad, accumulate=True)
    assert result is main_grad
    lhs, rhs = value(dy, transposed=True), value(x, transposed=True)
    want = before.double() + lhs @ rhs.t()
    assert_within(main_grad, want, fp32_bound(lhs, rhs) + want.abs() * 2.0**-23)


@pytest.mark.parametrize("name", PAIRINGS)
def test_out_without_accumulate_is_overwritten_in_place(name):
    qx, qw, _ = pairing(name)
    x, w = qx(spread(16, 128, 10)), qw(spread(32, 128, 11))
    out = torch.full((16, 32), 7.0)
    ptr = out.data_ptr()
    result = general_gemm(x, w, out=out, out_dtype=torch.float32)
    assert result is out and out.data_ptr() == ptr
    lhs, rhs = value(x, transposed=False), value(w, transposed=False)
    assert_within(out, lhs @ rhs.t(), fp32_bound(lhs, rhs))


def test_fp32_block_scales_are_applied_per_k_block():
    # one operand with a different (non power of 2) scale in each K block: the per-K-block path is the one
    # taken (known from the scheme), and it matches the fp64 product of the exact values
    q = Float8BlockQuantizer(E4M3, force_pow_2_scales=False)
    g = torch.Generator().manual_seed(4)
    a = torch.cat([torch.randn(8, 128, generator=g) * 3, torch.randn(8, 128, generator=g) * 0.01], dim=1)
    x, w = q(a), q(spread(8, 256, 12))
    lhs, rhs = gemm_operand(x, transposed=False), gemm_operand(w, transposed=False)
    assert lhs.kind == "block" and gemm.pairing(lhs, rhs) is gemm.cpu.fp32_tiles
    got = general_gemm(x, w, out_dtype=torch.float32)
    vx, vw = value(x, transposed=False), value(w, transposed=False)
    assert_within(got, vx @ vw.t(), fp32_bound(vx, vw))


def test_scaled_mm_call_of_the_cuda_path_runs_on_cpu_and_matches_fp64():
    qx, qw, _ = pairing("tensor")
    x, w = qx(spread(32, 64, 13) * 5), qw(spread(48, 64, 14))
    bias = torch.randn(48)
    lhs, rhs = gemm_operand(x, transposed=False), gemm_operand(w, transposed=False)
    vx, vw = value(x, transposed=False), value(w, transposed=False)
    for out_dtype, rounding in ((torch.float32, 0.0), (torch.bfloat16, 2.0**-8)):
        b = bias.to(out_dtype)
        got = cuda.scaled_mm(lhs, rhs, out_dtype, b)
        want = vx @ vw.t() + b.double()
        assert got.dtype == out_dtype
        assert_within(got, want, want.abs() * rounding + fp32_bound(vx, vw) + b.double().abs() * 2.0**-23)


@pytest.mark.parametrize("name", PAIRINGS)
def test_a_high_precision_operand_pairs_with_a_quantized_one(name):
    """Weight-only and unquantized operands: the quantized side's exact value times the plain one (fp64 check)."""
    _, qw, _ = pairing(name)
    g = torch.Generator().manual_seed(15)
    x_plain, w = torch.randn(48, 256, generator=g), qw(spread(80, 256, 16))
    vw = value(w, transposed=False)
    got = general_gemm(x_plain, w, out_dtype=torch.float32)
    assert_within(got, x_plain.double() @ vw.t(), fp32_bound(x_plain.double(), vw))
    dy = torch.randn(48, 80, generator=g)  # dgrad with a plain gradient: dy @ W
    vwt = value(w, transposed=True)
    got = general_gemm(dy, w, b_transposed=True, out_dtype=torch.float32)
    assert_within(got, dy.double() @ vwt.t(), fp32_bound(dy.double(), vwt))


def test_errors_name_the_problem():
    qx, qw, _ = pairing("tensor")
    x, w = qx(torch.randn(16, 64)), qw(torch.randn(32, 64))
    with pytest.raises(TypeError, match="a: expected a quantized tensor"):
        general_gemm([[1.0] * 64] * 16, w)
    with pytest.raises(TypeError, match="cannot pair"):  # 1x32 blocks against one scale per 64-wide row
        general_gemm(MXFP8Quantizer(E4M3)(torch.randn(16, 64)), Float8RowwiseQuantizer(E4M3)(torch.randn(32, 64)))
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
