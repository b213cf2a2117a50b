"""The small exact GEMM (csrc/gemm/small_gemm_kernels.cpp, one source per instruction set) bit for bit against its
contract (csrc/gemm/small_gemm.h), computed here independently, at every level where exact_gemm runs it.

The contract: acc = +0, then acc = fma(a_k, b_k, acc) in fp32 for k = 0..K-1; y = fp32(alpha * acc), + bias in
fp32; one rounding to the output dtype (bf16 NaN 0x7FC0). Here the fma is fp64 arithmetic rounded once to fp32: a
product of two bf16 values is exact in fp64, and the fp64 sum of it and an fp32 value, rounded to fp32, is the fp32
fma (a double rounding through 53 bits is harmless for a sum of two 24-bit values; no product here underflows).
"""

from __future__ import annotations

import pytest
import torch

from engine.ops import native
from engine.ops import reference as ref

# a failed build is a failure in tests/test_native.py; these tests are of the kernels themselves
pytestmark = pytest.mark.skipif(not native.available(),
                                reason=f"the C++ kernels did not build here: {native.why_unavailable()}")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
#: the levels at which exact_gemm runs the kernel (fp32 and fp16 outputs up to K = 512; csrc/gemm/exact_gemm_glue.cpp)
KERNEL_ISAS = ("avx2", "avx512")


def kernel_isas() -> list[str]:
    return [isa for isa in KERNEL_ISAS if native.available() and isa in native.available_isas()]


def fma_chain(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The contract's sums of a [M, K] and b [N, K] (fp32 values): one fp32 fma chain over k per output."""
    a64, b64 = a.double(), b.double()
    acc = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32)
    for k in range(a.shape[1]):
        acc = (a64[:, k, None] * b64[None, :, k] + acc.double()).float()
    return acc


def expected(a, sa, b, sb, bias, out_dtype):
    """The contract's output for per-tensor FP8 operands: alpha = fp32(sa * sb), bias rounded to the output dtype."""
    acc = fma_chain(ref.fp8_to_bf16(a).float(), ref.fp8_to_bf16(b).float())
    alpha = (sa.double() * sb.double()).float()
    y = acc * alpha
    if bias is not None:
        y = y + bias.to(torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32).float()
    return y.to(out_dtype)


def fp8(rows, k, g, dtype=E4M3, scale=8.0):
    return (torch.randn(rows, k, generator=g) * scale).to(dtype)


def column_major(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous().t()


# (M, N, K): both orientations (s = A for tall A, s = B for wide B), every tail of the tiles (6, 8, 16 rows; 16-wide
# panels), K below and above a 16-wide block
SHAPES = ((1, 1, 1), (5, 37, 19), (16, 256, 64), (64, 7, 33), (40, 160, 300), (23, 70, 512), (130, 17, 45))


@pytest.mark.parametrize("isa", kernel_isas())
@pytest.mark.parametrize("out_dtype", (torch.float32, torch.float16))
@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_is_its_fma_chain(isa, out_dtype, shape):
    m, n, k = shape
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    a, b = fp8(m, k, g), fp8(n, k, g, E5M2, 100.0)
    sa, sb = torch.tensor([0.37]), torch.tensor([1.9])
    bias = torch.randn(n, generator=g).to(out_dtype)
    want = expected(a, sa, b, sb, bias, out_dtype)
    with native.use_isa(isa):
        for a_view, b_view in ((a, b), (column_major(a), b), (a, column_major(b))):
            got = native.exact_gemm(a_view, sa, (0, 0), b_view, sb, (0, 0), bias, out_dtype)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (isa, shape)
        got = native.exact_gemm(a, sa, (0, 0), b, sb, (0, 0), None, out_dtype)
        assert torch.equal(got.view(torch.uint8), expected(a, sa, b, sb, None, out_dtype).view(torch.uint8))


@pytest.mark.parametrize("isa", kernel_isas())
def test_fp16_rounding_at_its_edges(isa):
    """Outputs from fp16's subnormals (2^-24 steps, ties to even) to past its largest value (65520 and up: inf),
    both signs: the kernel's own fp32 -> fp16 conversion against torch's."""
    g = torch.Generator().manual_seed(3)
    m, n, k = 24, 48, 8
    a, b = fp8(m, k, g), fp8(n, k, g)
    for alpha in (2.0**-30, 2.0**-24, 2.0**-12, 1.0, 2.0**8, 2.0**10):
        sa, sb = torch.tensor([alpha]), torch.tensor([1.0])
        want = expected(a, sa, b, sb, None, torch.float16)
        with native.use_isa(isa):
            got = native.exact_gemm(a, sa, (0, 0), b, sb, (0, 0), None, torch.float16)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), alpha
    with native.use_isa(isa):  # exactly 65520 rounds to inf, 65504 stays; 2^-25 (a tie) to 0, 3 * 2^-25 to 2^-23
        ones, minus = torch.ones(1, 1, dtype=E4M3), (-torch.ones(1, 1)).to(E4M3)
        for value, bits in ((65520.0, 0x7C00), (65504.0, 0x7BFF), (2.0**-25, 0), (3 * 2.0**-25, 2)):
            got = native.exact_gemm(ones, torch.tensor([value]), (0, 0), ones, torch.tensor([1.0]), (0, 0), None,
                                    torch.float16)
            assert got.view(torch.int16).item() == bits, value
            got = native.exact_gemm(minus, torch.tensor([value]), (0, 0), ones, torch.tensor([1.0]), (0, 0), None,
                                    torch.float16)
            assert got.view(torch.int16).item() & 0xFFFF == bits | 0x8000, -value

def test_every_level_gives_the_same_bits():
    """The kernel's sums depend on K alone, not on the level's vector width or tiles."""
    isas = kernel_isas()
    if len(isas) < 2:
        pytest.skip("one level with the kernel here")
    g = torch.Generator().manual_seed(9)
    a, b = fp8(70, 200, g), fp8(90, 200, g, E5M2, 100.0)
    sa, sb, bias = torch.tensor([0.7]), torch.tensor([3.1]), torch.randn(90, generator=g)
    outs = []
    for isa in isas:
        with native.use_isa(isa):
            outs.append(native.exact_gemm(a, sa, (0, 0), b, sb, (0, 0), bias, torch.float32))
    assert all(torch.equal(o.view(torch.int32), outs[0].view(torch.int32)) for o in outs[1:])
