"""The native exact GEMM against an independent fp64 reference (tests/exact_gemm_bound.py), on every ISA.

Its contract (engine/ops/exact_gemm.py): the decode is exact, each product is exact, the fp32 accumulation order is
unspecified but fixed by K alone. So: shapes with M, N and K tails and empty ones within the fp32 reassociation
bound; subnormal products kept (vdpbf16ps would flush them); inf and NaN as IEEE says; and, for the AVX-512 kernel,
a GEMM on a slice of B's (or A's) rows, on the other storage order or on more threads gives the same bits as the
matching slice of the whole GEMM (tensor-parallel shards are compared bit for bit with one process).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import avx2_emulation
from engine.ops import native
from engine.ops.exact_gemm import native_bf16_gemm
from exact_gemm_bound import check, decode64

pytestmark = pytest.mark.skipif(not native.available(), reason="the C++ kernels did not build here (native.why_unavailable() says why); these tests are of them")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
OUTS = (torch.bfloat16, torch.float32, torch.float16)


def isas() -> list[str]:
    return native.available_isas() if native.available() else []


#: the levels at which exact_gemm runs the small kernel (csrc/gemm/exact_gemm_glue.cpp); baseline runs addmm
KERNEL_ISAS = ("avx2", "avx512")


def fp8(rows: int, k: int, g: torch.Generator, element=E4M3, scale: float = 8.0) -> torch.Tensor:
    return (torch.randn(rows, k, generator=g) * scale).to(element)


def gemm(a, sa, b, sb, bias=None, out_dtype=torch.bfloat16, a_tile=(0, 0), b_tile=(0, 0)):
    return native.exact_gemm(a, sa, a_tile, b, sb, b_tile, bias, out_dtype)


def column_major(x: torch.Tensor) -> torch.Tensor:
    """The same values stored transposed (a column-major view, as a columnwise FP8 copy arrives)."""
    return x.t().contiguous().t()


@pytest.mark.parametrize("isa", isas())
def test_tails_and_layouts_within_the_fp32_bound(isa):
    g, bad = torch.Generator().manual_seed(1), []
    sa, sb = torch.tensor([0.37]), torch.tensor([1.9])
    with native.use_isa(isa):
        for m, n, k in ((1, 1, 1), (7, 15, 15), (16, 16, 17), (17, 33, 129), (3, 40, 16), (40, 3, 33), (16, 256, 64),
                        (64, 48, 16)):
            a, b = fp8(m, k, g), fp8(n, k, g, E5M2, 1000.0)
            for a_view, b_view in ((a, b), (column_major(a), b), (a, column_major(b)), (column_major(a),
                                                                                      column_major(b))):
                for out_dtype in OUTS:
                    for bias in (None, torch.randn(n, generator=g).mul(100).to(out_dtype)):
                        args = (a_view, sa, (0, 0), b_view, sb, (0, 0), bias, out_dtype)
                        why = check(native.exact_gemm(*args), *args)
                        if why:
                            bad.append(f"{m}x{n}x{k} {out_dtype} bias={bias is not None} "
                                       f"a_col={a_view is not a} b_col={b_view is not b}: {why}")
    assert not bad, bad[:5]


@pytest.mark.parametrize("isa", isas())
def test_empty_shapes(isa):
    g = torch.Generator().manual_seed(2)
    with native.use_isa(isa):
        for m, n, k in ((0, 5, 16), (5, 0, 16), (0, 0, 0)):
            out = gemm(fp8(m, k, g), torch.ones(1), fp8(n, k, g), torch.ones(1))
            assert out.shape == (m, n) and out.dtype == torch.bfloat16
        bias = torch.randn(6, generator=g)
        out = gemm(fp8(4, 0, g), torch.ones(1), fp8(6, 0, g), torch.ones(1), bias, torch.float32)  # K = 0: the bias
        assert torch.equal(out, bias.expand(4, 6))


@pytest.mark.parametrize("isa", isas())
def test_subnormal_products_are_kept(isa):
    """A decodes to 2^-127 (a bf16 subnormal), B to 2^-10: each product 2^-137 and the sum 2^-131 are fp32
    subnormals (and bf16 ones), exact; flushing inputs or outputs (vdpbf16ps, FTZ/DAZ) would give 0. The caller's
    flush-to-zero state does not reach the kernels. A native bf16 GEMM (addmm with bf16 hardware: below avx512,
    large problems) flushes them whatever the state: there only the fp32 output is promised; without bf16 hardware
    a bf16 output comes from the fp32 GEMM and keeps them."""
    a = torch.ones(3, 64).to(E4M3)
    b = torch.ones(5, 64).to(E4M3)
    sa = torch.zeros(3, 2, dtype=torch.uint8)  # E8M0 code 0: 2^-127
    sb = torch.full((5, 2), 117, dtype=torch.uint8)  # 2^-10
    both = isa in KERNEL_ISAS or not native_bf16_gemm()
    for out_dtype in (torch.float32, torch.bfloat16) if both else (torch.float32,):
        with native.use_isa(isa), torch.no_grad():
            torch.set_flush_denormal(True)
            try:
                out = gemm(a, sa, b, sb, None, out_dtype, (1, 32), (1, 32))
            finally:
                torch.set_flush_denormal(False)
        assert torch.equal(out, torch.full((3, 5), 2.0**-131, dtype=out_dtype)), (out_dtype, out)


# (format, its largest and smallest nonzero magnitudes, the largest and smallest shifts that keep both normal)
EDGES = {E4M3: (448.0, 2.0**-9, 119, -117), E5M2: (57344.0, 2.0**-16, 112, -110)}


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("fmt", list(EDGES), ids=str)
@pytest.mark.parametrize("stored", ["rowwise", "columnwise"])
@pytest.mark.parametrize("scales", ["all_in_range", "some_out_of_range", "and_a_nan_scale"])
def test_decode_at_the_edges_of_bf16s_normal_range(isa, fmt, stored, scales):
    """A power-of-2 tile scale moves each value's exponent (the AVX-512 decode does exactly that) only while the
    result stays normal: A @ I (fp32, so A's decoded values) against the fp64 decode where whole tiles land on
    the largest and smallest exponents, one step past them (inf; bf16 subnormals, rounded), and a NaN code.
    Stored columnwise (a transposed view, as MXFP8's columnwise data reaches wgrad) each element of a storage row
    has its own scale: all of them in range take the per-element exponent adds, a NaN element kept as it is."""
    top, tiny, up, down = EDGES[fmt]
    values = torch.tensor([top] + [1.5, -tiny, 2**-6, 0.0, -0.0, 3.5, -1.0] * 4 + [2.0, -3.0, 0.25]).to(fmt)
    # E4M3: 448 * 2^119 = 1.75 * 2^127 (largest exponent), 448 * 2^120 overflows, 2^-9 * 2^-117 = 2^-126
    # (smallest normal), 2^-9 * 2^-118 and 1.5 * 2^-119 are bf16 subnormals; E5M2 likewise
    in_range = scales == "all_in_range"
    codes = [127 + up, 127 + down, 127, 128 + down] if in_range else \
        [127 + up, 128 + up, 126 + down, 127 + down, 125 + down, 127 + down] + [255] * (scales == "and_a_nan_scale")
    codes = torch.tensor(codes, dtype=torch.uint8).reshape(-1, 1)
    a = values.repeat(codes.shape[0], 1)
    if in_range:
        a[2, 5] = torch.tensor(float("nan")).to(fmt)
    if stored == "columnwise":
        a = column_major(a)
    eye, ones = torch.eye(32).to(fmt), torch.full((32, 1), 127, dtype=torch.uint8)
    with native.use_isa(isa):
        got = gemm(a, codes, eye, ones, None, torch.float32, (1, 32), (1, 32)).double()
    want = decode64(a, codes, (1, 32))
    want = torch.where(want.isnan().any(1, keepdim=True), torch.nan, want)  # NaN * 0 elsewhere
    want = torch.where(want.isinf().any(1, keepdim=True) & ~want.isinf(), torch.nan, want)  # inf * 0 elsewhere
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), (got, want)
    if in_range:
        assert want[2].isnan().all() and (want[1].abs() == 2.0**-126).any() and want[0].abs().max() == top * 2.0**up
    else:
        assert want[1].isinf().any() and (want[3].abs() == 2.0**-126).any() and (want[4].abs() < 2.0**-126).any()


@pytest.mark.parametrize("isa", isas())
def test_inf_and_nan_propagate(isa):
    g = torch.Generator().manual_seed(3)
    a = torch.randn(4, 40, generator=g).abs() * 100
    b = torch.randn(6, 40, generator=g).abs() * 100 + 1  # positive: every product > 0
    a[0, 5] = float("inf")
    a[1, 39] = float("nan")  # the K tail
    a[2, 3] = float("inf")
    b[4, 3] = 0.0  # inf * 0 = NaN at [2, 4]
    a, b = a.to(E5M2), b.to(E5M2)
    with native.use_isa(isa):
        out = gemm(a, torch.ones(1), b, torch.ones(1), None, torch.float32)
        want = check(out, a, torch.ones(1), (0, 0), b, torch.ones(1), (0, 0), None, torch.float32)
    assert want is None, want
    assert out[0].eq(float("inf")).all() and out[1].isnan().all() and out[2, 4].isnan()
    assert out[2, :4].eq(float("inf")).all() and out[3].isfinite().all()


@contextlib.contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("isa", [isa for isa in isas() if isa in KERNEL_ISAS])
@pytest.mark.parametrize("out_dtype", OUTS)
def test_each_output_depends_on_k_only(isa, out_dtype):
    """Row slices of B (A) give column (row) slices of the whole GEMM bit for bit, whatever the storage order and
    the thread count: tensor-parallel shards match one process."""
    g = torch.Generator().manual_seed(4)
    m, n = (40, 80) if out_dtype == torch.bfloat16 else (96, 256)  # bf16: within the kernel's 2^20 MACs (avx2)
    a, b = fp8(m, 300, g), fp8(n, 300, g, E5M2, 100.0)
    sa, sb = torch.tensor([0.7]), torch.tensor([3.1])
    bias = torch.randn(n, generator=g).to(out_dtype)
    with native.use_isa(isa), threads(1):
        whole = gemm(a, sa, b, sb, bias, out_dtype)
        for i, j in ((0, 16), (16, 50), (50, 73), (73, n), (7, 8)):
            part = gemm(a, sa, b[i:j], sb, bias[i:j], out_dtype)
            assert torch.equal(part.view(torch.uint8), whole[:, i:j].contiguous().view(torch.uint8)), (i, j)
        for i, j in ((0, 5), (5, 21), (21, m)):
            part = gemm(a[i:j], sa, b, sb, bias, out_dtype)
            assert torch.equal(part.view(torch.uint8), whole[i:j].contiguous().view(torch.uint8)), (i, j)
        for a_view, b_view in ((column_major(a), b), (a, column_major(b)), (column_major(a), column_major(b))):
            other = gemm(a_view, sa, b_view, sb, bias, out_dtype)
            assert torch.equal(other.view(torch.uint8), whole.view(torch.uint8))
    with native.use_isa(isa), threads(2):  # fp32/fp16: 7.4M MACs, split over 2 threads
        assert torch.equal(gemm(a, sa, b, sb, bias, out_dtype).view(torch.uint8), whole.view(torch.uint8))


@pytest.mark.skipif(bool(os.environ.get("ONEDNN_MAX_CPU_ISA")), reason="oneDNN capped by ONEDNN_MAX_CPU_ISA: the "
                    "flags do not say what runs (test_a_bf16_output_is_the_fp32_gemm_without_bf16_hardware does)")
def test_the_bf16_gemm_is_native_where_the_cpu_has_bf16_dot_products():
    assert native_bf16_gemm() == bool({"avx512_bf16", "amx_bf16"} & avx2_emulation.cpu_flags())


# Run under the AVX2 emulation (tests/avx2_emulation.py): each case's bf16 output, native and reference, against the
# fp32 output of the same call (the bias rounded to bf16 first, as a bf16 output's is) rounded to bf16. At K = 4096
# torch's own bf16 matmul (fp32 sums in another order) gives other bits for ~1 output in 1000.
BF16_AS_FP32 = """
    import json
    import torch
    import test_registry
    from engine.ops import exact_gemm, native, registry

    g, bad = torch.Generator().manual_seed(5), []
    for m, n, k, tile in ((64, 256, 4096, (0, 0)), (40, 96, 4096, (1, 32)), (9, 21, 70, (1, 32)),
                          (130, 40, 520, (1, 128))):
        a = (torch.randn(m, k, generator=g) * 8).to(torch.float8_e4m3fn)
        b = (torch.randn(n, k, generator=g) * 100).to(torch.float8_e5m2)
        if tile == (0, 0):
            sa, sb = torch.tensor([0.37]), torch.tensor([1.9])
        else:
            sa = torch.randint(110, 140, (m, -(-k // tile[1])), generator=g, dtype=torch.uint8)
            sb = torch.randint(110, 140, (n, -(-k // tile[1])), generator=g, dtype=torch.uint8)
        bias = torch.randn(n, generator=g) * 100
        for name, fn in (("native", native.exact_gemm), ("reference", registry.REFERENCE["exact_gemm"])):
            low = fn(a, sa, tile, b, sb, tile, bias, torch.bfloat16)
            high = fn(a, sa, tile, b, sb, tile, bias.bfloat16(), torch.float32).bfloat16()
            differ = int((low.view(torch.int16) != high.view(torch.int16)).sum())
            if differ:
                bad.append(f"{name} {m}x{n}x{k} {tile}: {differ} outputs")
    contract = test_registry.compare_exact_gemm(native.exact_gemm, native.isa() == "baseline")
    print(json.dumps({"isa": native.isa(), "native_bf16": getattr(exact_gemm, "native_bf16_gemm", lambda: None)(),
                      "bad": bad, "contract": contract[:5]}))
"""


def test_a_bf16_output_is_the_fp32_gemm_without_bf16_hardware():
    """On a CPU without bf16 dot products (an AVX2 Zen 3, emulated) the exact GEMM's bf16 output, native and
    reference, has the bits of the fp32 GEMM's output rounded to bf16, and meets the contract with subnormals
    kept (tests/test_registry.py's cases): torch's bf16 matmul there converts to fp32 inside, 3-6x slower."""
    got = avx2_emulation.run(BF16_AS_FP32)
    assert got["isa"] == "avx2" and got["native_bf16"] is False
    assert not got["bad"], got["bad"]
    assert not got["contract"], got["contract"]
