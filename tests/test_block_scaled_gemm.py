"""CUDA block-scaled GEMMs (MXFP8, MXFP4, NVFP4 through `torch._scaled_mm`), driven on CPU tensors.

* The 128x4 scale swizzle against a brute-force loop placing each (row, col) at the offset the
  documented formula gives (and against torch's own test helper).
* The CUDA GEMM functions with `torch._scaled_mm` replaced by `blockscaled_mm`, an independent stand-in:
  it enforces torch's checks (layouts, multiples of 16, scale dtypes and blocked sizes), un-swizzles
  the scales by the formula, decodes FP8 / packed FP4 itself and multiplies in fp64. Their results
  are compared with the CPU emulation (`engine.gemm.cpu`) within fp32 reassociation: both sum the same
  exact products, so |cuda - cpu| <= (K + 4) * 2^-24 * sum|a*b| (+ one output rounding for bf16).
* The dispatch rule: which pairs and devices take the block-scaled path, the one-time warning otherwise.
"""

import warnings

import pytest
import torch

from engine.gemm import PAIRINGS, block_scaled, cpu, gemm_operand, general_gemm
from engine.gemm.swizzle import blocked_numel, to_blocked
from engine.quantizers import Float8BlockQuantizer, MXQuantizer, NVFP4Quantizer

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# ------------------------------------------------------------------------------------------------ swizzle
def brute_force_blocked(s: torch.Tensor) -> torch.Tensor:
    """The blocked layout, one (row, col) at a time from the documented offset formula (padding stays 0)."""
    rows, cols = s.shape
    rows_p, cols_p = -(-rows // 128) * 128, -(-cols // 4) * 4
    out = torch.zeros(rows_p * cols_p, dtype=torch.uint8)
    codes = s.view(torch.uint8) if s.is_contiguous() else s.contiguous().view(torch.uint8)
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * (cols_p // 4) + c // 4
            offset = 512 * tile + 16 * (r % 32) + 4 * ((r % 128) // 32) + c % 4
            out[offset] = codes[r, c]
    return out


@pytest.mark.parametrize("shape", [(1, 1), (128, 4), (5, 3), (130, 5), (256, 8), (127, 9), (300, 2)])
@pytest.mark.parametrize("dtype", [torch.uint8, E4M3, torch.float8_e8m0fnu])
def test_swizzle_places_every_scale_where_the_formula_says(shape, dtype):
    gen = torch.Generator().manual_seed(shape[0] * 31 + shape[1])
    codes = torch.randint(1, 255, shape, dtype=torch.uint8, generator=gen)  # nonzero: padding is visible
    got = to_blocked(codes.view(dtype))
    assert got.dtype == dtype and got.dim() == 1 and got.is_contiguous()
    rows_p, cols_p = -(-shape[0] // 128) * 128, -(-shape[1] // 4) * 4
    assert got.numel() == blocked_numel(*shape) == rows_p * cols_p
    want = brute_force_blocked(codes)
    assert torch.equal(got.view(torch.uint8), want)
    assert int((got.view(torch.uint8) == 0).sum()) == rows_p * cols_p - codes.numel()  # padding is zeros


def test_swizzle_of_a_transposed_view():
    codes = torch.randint(0, 256, (7, 150), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)).t()
    assert not codes.is_contiguous()
    assert torch.equal(to_blocked(codes), brute_force_blocked(codes.contiguous()))


def test_swizzle_agrees_with_torchs_test_helper():
    pytest.importorskip("expecttest")  # torch.testing._internal needs it
    from torch.testing._internal.common_quantized import to_blocked as torch_to_blocked
    codes = torch.randint(0, 256, (200, 7), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    assert torch.equal(to_blocked(codes), torch_to_blocked(codes))


def test_swizzle_rejects_bad_input():
    with pytest.raises(TypeError, match="scales: expected a 2D"):
        to_blocked(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(TypeError, match="scales: expected one of"):
        to_blocked(torch.zeros(4, 4))


# ----------------------------------------------------------------------------- the _scaled_mm stand-in
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def unswizzle(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """S[r, c] = blocked[offset(r, c)] for the unpadded (rows, cols), gathered by the formula."""
    cols_p = -(-cols // 4) * 4
    r = torch.arange(rows).unsqueeze(1)
    c = torch.arange(cols).unsqueeze(0)
    offset = 512 * ((r // 128) * (cols_p // 4) + c // 4) + 16 * (r % 32) + 4 * ((r % 128) // 32) + c % 4
    return blocked.view(torch.uint8).reshape(-1)[offset]


def decode(mat: torch.Tensor) -> torch.Tensor:
    """fp64 values of a K-major [rows, K] FP8 or packed-FP4 matrix (FP4: low nibble first)."""
    if mat.dtype != torch.float4_e2m1fn_x2:
        return mat.double()
    b = mat.view(torch.uint8)
    nibbles = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(b.shape[0], -1).long()
    sign = torch.where(nibbles >= 8, -1.0, 1.0).double()
    return sign * E2M1_VALUES[nibbles & 7]


def scale_values(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    codes = unswizzle(blocked, rows, cols)
    if blocked.dtype == torch.float8_e8m0fnu:
        v = torch.pow(2.0, codes.double() - 127)
        return torch.where(codes == 255, float("nan"), v)
    return codes.view(E4M3).double()


@pytest.fixture
def blockscaled_mm(monkeypatch):
    """torch._scaled_mm replaced by an fp64 emulator with torch's CUDA checks; returns the list of calls."""
    calls = []

    def emulator(mat1, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
        assert mat1.stride(1) == 1 and mat2.stride(0) == 1, "mat1 row-major, mat2 column-major"
        assert mat1.shape[1] % 16 == 0 and mat2.shape[0] % 16 == 0 and mat2.shape[1] % 16 == 0
        assert mat1.shape[1] == mat2.shape[0]
        assert bias is None or out_dtype != torch.float32
        fp4 = mat1.dtype == torch.float4_e2m1fn_x2
        assert fp4 == (mat2.dtype == torch.float4_e2m1fn_x2)
        a, b = decode(mat1), decode(mat2.t())  # [M, K], [N, K]
        k = a.shape[1]
        block = 16 if scale_a.dtype == E4M3 else 32
        assert scale_a.dtype == scale_b.dtype and scale_a.dtype in (E4M3, torch.float8_e8m0fnu)
        assert fp4 or scale_a.dtype == torch.float8_e8m0fnu  # FP8 data: MX only
        for s, rows in ((scale_a, a.shape[0]), (scale_b, b.shape[0])):
            assert s.is_contiguous() and s.numel() == -(-rows // 128) * 128 * (-(-(k // block) // 4) * 4)
        sa = scale_values(scale_a, a.shape[0], k // block).repeat_interleave(block, 1)
        sb = scale_values(scale_b, b.shape[0], k // block).repeat_interleave(block, 1)
        calls.append((mat1.dtype, scale_a.dtype, tuple(a.shape), tuple(b.shape)))
        out = (a * sa) @ (b * sb).t()
        return out.to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", emulator)
    return calls


@pytest.fixture
def blackwell(monkeypatch):
    """Every device reports compute capability 10.0; clears the one-time warnings."""
    monkeypatch.setattr(block_scaled, "device_capability", lambda device: (10, 0))
    block_scaled._warn_emulation_once.cache_clear()
    yield
    block_scaled._warn_emulation_once.cache_clear()


def close(got, want, lhs, rhs, k, out_dtype):
    """Both results sum the same exact products in fp32 (in different orders): within (K + 4) * 2^-24 * sum|a*b|."""
    exact = lhs.double() @ rhs.double().t()
    tol = (k + 4) * 2.0**-24 * (lhs.double().abs() @ rhs.double().abs().t()) + 2.0**-140
    if out_dtype != torch.float32:
        tol = tol + 2 * torch.finfo(out_dtype).eps * exact.abs()
    err = (got.double() - want.double()).abs()
    assert got.dtype == want.dtype == out_dtype and got.shape == want.shape
    assert bool((err <= tol).all()), f"max error {err.max().item()}"


def three_gemms(qx, qw, qdy):
    """(a, b, a_transposed, b_transposed) of fprop, dgrad and wgrad."""
    return [(qx, qw, False, False), (qdy, qw, False, True), (qdy, qx, True, True)]


def operands(quantizers, m, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, k)
    w, dy = torch.randn(n, k, generator=gen), torch.randn(m, n, generator=gen) * 1e-3
    return quantizers[0](x), quantizers[1](w), quantizers[2](dy)


MX_CASES = {
    "mxfp8": (MXQuantizer("e4m3"), MXQuantizer("e4m3"), MXQuantizer("e5m2")),
    "mxfp4": (MXQuantizer("e2m1"), MXQuantizer("e2m1"), MXQuantizer("e2m1", scale_mode="floor")),
}
SHAPES = [(32, 48, 64), (37, 20, 70), (130, 33, 100), (16, 16, 16), (24, 20, 45)]  # M, N, K: partial blocks, odd



@pytest.mark.parametrize("case", sorted(MX_CASES))
@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_mx_gemms_on_blockscaled_mm_match_the_emulation(blockscaled_mm, blackwell, case, m, n, k, out_dtype):
    qx, qw, qdy = operands(MX_CASES[case], m, n, k, seed=m * n + k)
    fp4 = torch.float4_e2m1fn_x2
    for a, b, at, bt in three_gemms(qx, qw, qdy):
        lhs, rhs = gemm_operand(a, transposed=at), gemm_operand(b, transposed=bt)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = PAIRINGS[("pow2", "pow2", "cuda")](lhs, rhs, out_dtype, None)
        want = cpu.pow2_tiles(lhs, rhs, out_dtype, None)
        close(got, want, lhs.dequantize(torch.float64), rhs.dequantize(torch.float64), lhs.k, out_dtype)
        dtype, scale_dtype, _, _ = blockscaled_mm[-1]
        assert scale_dtype == torch.float8_e8m0fnu and (dtype == fp4) == (case == "mxfp4")
    assert len(blockscaled_mm) == 3


NVFP4_SETS = {
    "1d": (NVFP4Quantizer(), NVFP4Quantizer(), NVFP4Quantizer()),
    "te_recipe": (NVFP4Quantizer(with_rht=True), NVFP4Quantizer(with_2d_quantization=True),
                  NVFP4Quantizer(with_rht=True, stochastic_rounding=True, rng_counter=torch.tensor([3, 0]))),
}


@pytest.mark.parametrize("recipe", sorted(NVFP4_SETS))
@pytest.mark.parametrize("m, n, k", [(32, 48, 64), (48, 20, 72), (144, 33, 100)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_gemms_on_blockscaled_mm_match_the_emulation(blockscaled_mm, blackwell, recipe, m, n, k, out_dtype):
    qx, qw, qdy = operands(NVFP4_SETS[recipe], m, n, k, seed=m + n * k)
    for a, b, at, bt in three_gemms(qx, qw, qdy):
        lhs, rhs = gemm_operand(a, transposed=at), gemm_operand(b, transposed=bt)
        got = PAIRINGS[("nvfp4", "nvfp4", "cuda")](lhs, rhs, out_dtype, None)
        want = cpu.nvfp4(lhs, rhs, out_dtype, None)
        close(got, want, lhs.dequantize(torch.float64), rhs.dequantize(torch.float64), lhs.k, out_dtype)
    assert [c[:2] for c in blockscaled_mm] == [(torch.float4_e2m1fn_x2, E4M3)] * 3


def test_nvfp4_odd_dims(blockscaled_mm, blackwell):
    # odd K and M: a half-filled last byte on both sides of fprop, dgrad and wgrad
    qx, qw, qdy = operands(NVFP4_SETS["1d"], 33, 21, 45, seed=15)
    for a, b, at, bt in three_gemms(qx, qw, qdy):
        lhs, rhs = gemm_operand(a, transposed=at), gemm_operand(b, transposed=bt)
        close(block_scaled.nvfp4(lhs, rhs, torch.float32, None), cpu.nvfp4(lhs, rhs, torch.float32, None),
              lhs.dequantize(torch.float64), rhs.dequantize(torch.float64), lhs.k, torch.float32)
    assert len(blockscaled_mm) == 3


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_bias_is_added_after_the_factor(blockscaled_mm, blackwell, out_dtype):
    qx, qw, _ = operands(NVFP4_SETS["1d"], 16, 24, 48, seed=9)
    bias = torch.randn(24).to(out_dtype)
    lhs, rhs = gemm_operand(qx, transposed=False), gemm_operand(qw, transposed=False)
    got = block_scaled.nvfp4(lhs, rhs, out_dtype, bias)
    want = cpu.nvfp4(lhs, rhs, out_dtype, bias)
    close(got - bias, want - bias, lhs.dequantize(torch.float64), rhs.dequantize(torch.float64), lhs.k + 1, out_dtype)
    mx_x, mx_w, _ = operands(MX_CASES["mxfp8"], 16, 24, 48, seed=10)
    lhs, rhs = gemm_operand(mx_x, transposed=False), gemm_operand(mx_w, transposed=False)
    got, want = block_scaled.pow2_tiles(lhs, rhs, out_dtype, bias), cpu.pow2_tiles(lhs, rhs, out_dtype, bias)
    close(got - bias, want - bias, lhs.dequantize(torch.float64), rhs.dequantize(torch.float64), lhs.k + 1, out_dtype)


def test_tiny_nvfp4_amaxes_do_not_flush_the_factor(blockscaled_mm, blackwell):
    # amaxes ~2^-58 each: the fp32 factor amax_a * amax_b / 2688^2 (~2^-139) flushes, the results (~2^-116) do not
    gen = torch.Generator().manual_seed(11)
    q = NVFP4Quantizer()
    x, w = q(torch.randn(16, 64, generator=gen) * 2.0**-60), q(torch.randn(32, 64, generator=gen) * 2.0**-60)
    lhs, rhs = gemm_operand(x, transposed=False), gemm_operand(w, transposed=False)
    factor32 = lhs.amax.float() * rhs.amax.float() * torch.tensor(1 / 2688**2, dtype=torch.float32)
    assert factor32.item() < torch.finfo(torch.float32).tiny
    got = block_scaled.nvfp4(lhs, rhs, torch.float32, None)
    assert (got != 0).float().mean() > 0.9
    close(got, cpu.nvfp4(lhs, rhs, torch.float32, None), lhs.dequantize(torch.float64),
          rhs.dequantize(torch.float64), 64, torch.float32)


@pytest.mark.parametrize("quantizer", [NVFP4Quantizer(), MXQuantizer("e2m1"), MXQuantizer("e4m3")])
def test_3d_operands(blockscaled_mm, blackwell, quantizer):
    gen = torch.Generator().manual_seed(14)
    x, w = quantizer(torch.randn(2, 24, 48, generator=gen)), quantizer(torch.randn(40, 48, generator=gen))
    dy = quantizer(torch.randn(2, 24, 40, generator=gen))
    kind = "nvfp4" if isinstance(quantizer, NVFP4Quantizer) else "pow2"
    impl = PAIRINGS[(kind, kind, "cuda")]
    emulation = cpu.nvfp4 if isinstance(quantizer, NVFP4Quantizer) else cpu.pow2_tiles
    for a, b, at, bt in three_gemms(x, w, dy):
        lhs, rhs = gemm_operand(a, transposed=at), gemm_operand(b, transposed=bt)
        close(impl(lhs, rhs, torch.float32, None), emulation(lhs, rhs, torch.float32, None),
              lhs.dequantize(torch.float64), rhs.dequantize(torch.float64), lhs.k, torch.float32)
    assert len(blockscaled_mm) == 3


def test_general_gemm_on_cpu_never_calls_scaled_mm(blockscaled_mm, blackwell):
    qx, qw, _ = operands(NVFP4_SETS["1d"], 16, 16, 32, seed=12)
    general_gemm(qx, qw)
    assert blockscaled_mm == []


# ------------------------------------------------------------------------------------------ dispatch
def test_cuda_pairings_are_the_block_scaled_dispatchers():
    assert PAIRINGS[("pow2", "pow2", "cuda")] is block_scaled.pow2_tiles
    assert PAIRINGS[("nvfp4", "nvfp4", "cuda")] is block_scaled.nvfp4
    assert block_scaled.device_capability(torch.device("cpu")) == (0, 0)
    assert block_scaled.torch_has_block_scaled()


def pair(qa, qb, shape=(16, 64)):
    gen = torch.Generator().manual_seed(13)
    a, b = qa(torch.randn(*shape, generator=gen)), qb(torch.randn(*shape, generator=gen))
    return gemm_operand(a, transposed=False), gemm_operand(b, transposed=False)


@pytest.mark.parametrize("elements, kind", [
    (("e4m3", "e4m3"), "mxfp8"), (("e4m3", "e5m2"), "mxfp8"), (("e5m2", "e4m3"), "mxfp8"),
    (("e5m2", "e5m2"), None), (("e2m1", "e2m1"), "mxfp4"), (("e2m3", "e2m3"), None), (("e3m2", "e2m1"), None),
    (("e2m1", "e4m3"), None),
])
def test_which_mx_pairs_have_a_kernel(elements, kind):
    lhs, rhs = pair(MXQuantizer(elements[0]), MXQuantizer(elements[1]))
    assert block_scaled.mx_kind(lhs, rhs) == kind


def test_block_1x128_pow2_pairs_are_not_mx():
    q = Float8BlockQuantizer(E4M3)
    lhs, rhs = pair(q, q, (16, 256))
    assert lhs.kind == rhs.kind == "pow2" and block_scaled.mx_kind(lhs, rhs) is None


@pytest.mark.parametrize("capability", [(9, 0), (12, 0), (8, 9)])
def test_other_devices_emulate_with_one_warning(blockscaled_mm, monkeypatch, capability):
    monkeypatch.setattr(block_scaled, "device_capability", lambda device: capability)
    block_scaled._warn_emulation_once.cache_clear()
    for qa, impl, emulation in ((MXQuantizer("e4m3"), block_scaled.pow2_tiles, cpu.pow2_tiles),
                                (MXQuantizer("e2m1"), block_scaled.pow2_tiles, cpu.pow2_tiles),
                                (NVFP4Quantizer(), block_scaled.nvfp4, cpu.nvfp4)):
        lhs, rhs = pair(qa, qa)
        with pytest.warns(RuntimeWarning, match=f"emulation path .*compute capability {capability[0]}"):
            first = impl(lhs, rhs, torch.float32, None)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the second call is silent
            again = impl(lhs, rhs, torch.float32, None)
        assert torch.equal(first, emulation(lhs, rhs, torch.float32, None)) and torch.equal(first, again)
    assert blockscaled_mm == []
    block_scaled._warn_emulation_once.cache_clear()


def test_pairs_without_a_kernel_emulate_on_blackwell_with_one_warning(blockscaled_mm, blackwell):
    for i, (qa, qb) in enumerate(((MXQuantizer("e2m3"), MXQuantizer("e2m3")),
                                  (MXQuantizer("e5m2"), MXQuantizer("e5m2")),
                                  (Float8BlockQuantizer(E4M3), Float8BlockQuantizer(E4M3)))):
        lhs, rhs = pair(qa, qb, (16, 256))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = block_scaled.pow2_tiles(lhs, rhs, torch.bfloat16, None)
        # one warning for all of them (one per pair name, device type and reason)
        assert [str(w.message) for w in caught] == ([
            "general_gemm: pow2 x pow2 GEMMs on cpu run through the emulation path (no cuBLAS kernel for this "
            "pair; slow)"] if i == 0 else [])
        assert torch.equal(got, cpu.pow2_tiles(lhs, rhs, torch.bfloat16, None))
    assert blockscaled_mm == []


def test_a_torch_without_the_dtypes_emulates(blockscaled_mm, blackwell, monkeypatch):
    monkeypatch.setattr(block_scaled, "torch_has_block_scaled", lambda: False)
    lhs, rhs = pair(NVFP4Quantizer(), NVFP4Quantizer())
    with pytest.warns(RuntimeWarning, match="has no float8_e8m0fnu"):
        got = block_scaled.nvfp4(lhs, rhs, torch.float32, None)
    assert torch.equal(got, cpu.nvfp4(lhs, rhs, torch.float32, None)) and blockscaled_mm == []


def test_the_gemm_functions_reject_other_pairs():
    lhs, rhs = pair(MXQuantizer("e2m3"), MXQuantizer("e2m3"))
    with pytest.raises(TypeError, match="mx_gemm: expected an MXFP8 or MXFP4 pair"):
        block_scaled.mx_gemm(lhs, rhs, torch.float32, None)
    with pytest.raises(TypeError, match="nvfp4_gemm: expected two NVFP4 operands"):
        block_scaled.nvfp4_gemm(lhs, rhs, torch.float32, None)
