"""The C++ weight-only GEMMs (engine.ops.native.int4_linear / int8_linear) against plain-PyTorch references,
and the int8 dynamic-activation glue (int8_quantize_rows, int8_rescale) bit for bit against the torch ops.

The reference dequantizes the weight with torch ops written out here ((q - 8) * scale + zero in fp32 for int4,
q for int8) and sums in float64. The kernels dequantize to the same fp32 values and sum in fp32 in their own
order, so each output is within one rounding to the output dtype plus fp32 accumulation in any order:
|y - ref| <= u_out * |ref| + (2K + 16) * 2^-24 * sum_k |x_k| |w_k| (int8: times the scale; plus half the output
dtype's subnormal spacing), at every instruction-set level the machine runs (baseline, avx2, avx512). int4 with bf16 x (AVX512-BF16) sums
scale * sum x * (q - 8) + zero * sum x per group: |w_k| becomes |q_k - 8| * scale + |zero| there. A row's result does not depend on M (the sums run in the same order). Odd shapes
(K not a multiple of 16, N odd, M = 1, 3, 16, 17), every group size, and bad arguments (errors naming them).
"""

from __future__ import annotations

import pytest
import torch

import avx2_emulation
import engine
from engine.formats import INT4
from engine.inference import int8_mm, int_formats, saving
from engine.ops import int_elements, native

FP32_U = 2.0 ** -24
UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
HALF_SUBNORMAL = {torch.float32: 2.0 ** -150, torch.bfloat16: 2.0 ** -134, torch.float16: 2.0 ** -25}  # absolute
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# every instruction-set level this machine runs (each kernel variant, tested where it runs)
ISAS = tuple(native.available_isas()) if native.available() else ("baseline",)


@pytest.fixture(params=ISAS)
def isa(request):
    assert native.available(), native.why_unavailable()
    with native.use_isa(request.param):
        yield request.param


def int4_weight(rows: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor]:
    """(data uint8 [rows, K/2], scale_and_zero bf16 [K/group, rows, 2], the fp32 weight they stand for,
    |q - 8| * scale + |zero|: the magnitudes the bf16 path's sums add up)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(rows, k // group, generator=gen) * 0.1 + 1e-3).bfloat16()
    zero = (torch.randn(rows, k // group, generator=gen) * 0.2).bfloat16()
    data = torch.empty(rows, k // 2, dtype=torch.uint8)
    for i in range(k // 2):  # byte i: element 2i in the low nibble, 2i + 1 in the high one
        data[:, i] = q[:, 2 * i] + 16 * q[:, 2 * i + 1]
    sz = torch.stack([scale.t(), zero.t()], dim=2).contiguous()
    s = scale.float().repeat_interleave(group, dim=1)
    z = zero.float().repeat_interleave(group, dim=1)
    return data, sz, (q.float() - 8.0) * s + z, (q.float() - 8.0).abs() * s + z.abs()


def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, factor: torch.Tensor | None = None,
          magnitudes: torch.Tensor | None = None) -> None:
    """y = x @ w^T (* factor per output column) within one rounding to y's dtype plus fp32 accumulation in any
    order and grouping of the terms whose `magnitudes` (default |w|) are given."""
    ref = x.double() @ w.double().t()
    absdot = x.double().abs() @ (w.abs() if magnitudes is None else magnitudes).double().t()
    if factor is not None:
        ref, absdot = ref * factor.double(), absdot * factor.double().abs()
    k = x.shape[1]
    bound = UNIT[y.dtype] * ref.abs() * 1.01 + (2 * k + 16) * FP32_U * absdot + HALF_SUBNORMAL[y.dtype]
    assert y.dtype == x.dtype and y.shape == ref.shape
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("group", [32, 64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_within_the_fp32_bound(isa: str, group: int, dtype: torch.dtype) -> None:
    for k, n, rows in ((group, 1, 16), (3 * group, 17, 32), (2 * group, 33, 48)):
        data, sz, w, mags = int4_weight(rows, k, group, seed=k + n)
        for m in (1, 3, 16, 17):
            x = torch.randn(m, k).to(dtype)
            y = native.int4_linear(x, data, sz, group, n)
            check(y, x, w[:n], magnitudes=mags[:n])


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_within_the_fp32_bound(isa: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    for k in (1, 15, 16, 17, 40, 100):
        for n in (1, 18):
            data = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
            for scale_dtype in (torch.float32, torch.bfloat16):
                scale = (torch.rand(n, generator=gen) * 0.01 + 1e-4).to(scale_dtype)
                for m in (1, 3, 16, 17):
                    x = torch.randn(m, k, generator=gen).to(dtype)
                    check(native.int8_linear(x, data, scale), x, data.float(), scale.float())


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_within_the_fp32_bound(isa: str, dtype: torch.dtype) -> None:
    """E4M3 bytes decoded in the kernel (every code: zero, subnormals, normals, +-448; the NaN codes give NaN
    outputs) against torch's own E4M3 cast, times the row scale, within the fp32 bound; the tail K % 16."""
    gen = torch.Generator().manual_seed(2)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]
    for k in (1, 15, 16, 17, 100, 254):
        for n in (1, 18):
            data = finite[torch.randint(0, finite.numel(), (n, k), generator=gen)]
            if k == 254:
                data[0] = finite[:k]  # every finite code, in a row
            values = data.view(torch.float8_e4m3fn).float()
            scale = torch.exp2(torch.randint(-12, 4, (n,), generator=gen).float())
            for m in (1, 3, 16, 17):
                x = torch.randn(m, k, generator=gen).to(dtype)
                check(native.fp8_linear(x, data, scale), x, values, scale)
    data = torch.full((3, 20), 0x38, dtype=torch.uint8)  # 1.0
    data[1, 4], data[2, 19] = 0x7F, 0xFF  # NaN codes (the second in the tail)
    y = native.fp8_linear(torch.ones(2, 20), data, torch.ones(3))
    assert torch.equal(y[:, 0], torch.full((2,), 20.0)) and bool(y[:, 1:].isnan().all())
    assert torch.equal(native.fp8_linear(torch.ones(1, 20), data.view(torch.float8_e4m3fn), torch.ones(3))[:, 0],
                       torch.tensor([20.0]))
    with pytest.raises(TypeError, match="data: expected float8_e4m3fn or its uint8 bytes"):
        native.fp8_linear(torch.ones(1, 20), data.view(torch.int8), torch.ones(3))


def test_a_row_does_not_depend_on_m(isa: str) -> None:
    """The GEMV (M = 1) and every row block of the GEMM sum in the same order: the same bits."""
    data, sz, _, _ = int4_weight(32, 256, 64, seed=3)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(19, 256, dtype=dtype)
        y = native.int4_linear(x, data, sz, 64, 30)
        assert torch.equal(torch.cat([native.int4_linear(x[i:i + 1], data, sz, 64, 30) for i in range(19)]), y)
    q8 = torch.randint(-127, 128, (30, 70), dtype=torch.int8)
    s8 = torch.rand(30)
    x8 = torch.randn(19, 70, dtype=torch.bfloat16)
    y8 = native.int8_linear(x8, q8, s8)
    assert torch.equal(torch.cat([native.int8_linear(x8[i:i + 1], q8, s8) for i in range(19)]), y8)


def test_isas_agree_within_the_bound() -> None:
    """A bigger shape, split over threads (the row ranges a multiple of 4), at every level."""
    data, sz, w, mags = int4_weight(528, 1024, 128, seed=4)
    x = torch.randn(5, 1024, dtype=torch.bfloat16)
    for name in ISAS:
        with native.use_isa(name):
            check(native.int4_linear(x, data, sz, 128, 517), x, w[:517], magnitudes=mags[:517])


def test_empty_inputs(isa: str) -> None:
    data, sz, _, _ = int4_weight(16, 64, 32, seed=5)
    assert native.int4_linear(torch.randn(0, 64), data, sz, 32, 16).shape == (0, 16)
    assert native.int4_linear(torch.randn(2, 64), data, sz, 32, 0).shape == (2, 0)
    y = native.int8_linear(torch.randn(2, 0), torch.zeros(3, 0, dtype=torch.int8), torch.ones(3))
    assert torch.equal(y, torch.zeros(2, 3))


def test_bad_arguments_are_named() -> None:
    data, sz, _, _ = int4_weight(16, 64, 32, seed=6)
    x = torch.randn(2, 64)
    cases = [
        (TypeError, "x: expected float32", lambda: native.int4_linear(x.double(), data, sz, 32, 16)),
        (ValueError, "x: expected a 2D", lambda: native.int4_linear(x[0], data, sz, 32, 16)),
        (TypeError, "x:", lambda: native.int4_linear(x.to("meta"), data, sz, 32, 16)),
        (TypeError, "data: expected uint8", lambda: native.int4_linear(x, data.to(torch.int8), sz, 32, 16)),
        (ValueError, "data: expected shape", lambda: native.int4_linear(x, data[:, :16], sz, 32, 16)),
        (ValueError, "data: expected shape", lambda: native.int4_linear(x, data, sz, 32, 17)),
        (ValueError, "data: expected a contiguous", lambda: native.int4_linear(x, data.t().contiguous().t(), sz, 32, 16)),
        (TypeError, "scale_and_zero: expected bfloat16", lambda: native.int4_linear(x, data, sz.float(), 32, 16)),
        (ValueError, "scale_and_zero: expected shape", lambda: native.int4_linear(x, data, sz[:1], 32, 16)),
        (ValueError, "group_size: expected a positive multiple of 32", lambda: native.int4_linear(x, data, sz, 48, 16)),
        (ValueError, "x: K = 64 is not a multiple of group_size 128", lambda: native.int4_linear(x, data, sz, 128, 16)),
        (TypeError, "group_size: expected an int", lambda: native.int4_linear(x, data, sz, 32.0, 16)),
        (TypeError, "data:", lambda: native.int8_linear(x, data, torch.ones(16))),
        (ValueError, "data: expected shape", lambda: native.int8_linear(x, torch.zeros(4, 63, dtype=torch.int8),
                                                                          torch.ones(4))),
        (TypeError, "scale: expected float32 or bfloat16", lambda: native.int8_linear(
            x, torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, dtype=torch.float16))),
        (ValueError, "scale: expected shape", lambda: native.int8_linear(x, torch.zeros(4, 64, dtype=torch.int8),
                                                                          torch.ones(5))),
    ]
    for error, match, call in cases:
        with pytest.raises(error, match=match):
            call()


# ------------------------------------------------------------------------------ the int4 format's layout
def test_int4_format_packs_two_codes_a_byte() -> None:
    """Int4WeightOnly's data: codes c in [-8, 7] as q = c + 8, byte [n, i] = q[n, 2i] | q[n, 2i+1] << 4 (an odd
    last dim: a high nibble of 0); the int4 element's store / load undo each other."""
    q = torch.randint(0, 16, (5, 9), dtype=torch.uint8)
    packed = int_elements.store(q.float() - 8, INT4)
    padded = torch.nn.functional.pad(q, (0, 1))
    assert torch.equal(packed, (padded[:, 0::2] + 16 * padded[:, 1::2]).to(torch.uint8))
    assert torch.equal(int_elements.load(packed, INT4, 9), q.float() - 8)


def test_int4_layer_runs_the_kernel_by_shape() -> None:
    """M up to native_max_m: the kernel's bits; above: the fp32 formula; both within the bound of the reference."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 40, bias=False).bfloat16()
    engine.quantize_(lin, engine.Int4WeightOnly(group_size=64))
    parts, fmt = lin.weight.operands, lin.weight.fmt
    w = lin.weight.dequantize(torch.float32)
    codes = int_elements.load(parts["data"][:40], INT4, 256)
    sz = parts["scale_and_zero"][:, :40].float().repeat_interleave(64, dim=0)
    mags = codes.abs() * sz[:, :, 0].t() + sz[:, :, 1].t().abs()
    for dtype, limit in ((torch.bfloat16, fmt.native_max_m_bf16), (torch.float32, fmt.native_max_m)):
        for m in (1, limit, limit + 1):
            x = torch.randn(m, 256, dtype=dtype)
            y = lin(x)
            check(y, x, w, magnitudes=mags)
            if m <= limit:
                assert torch.equal(y, native.int4_linear(x, parts["data"], parts["scale_and_zero"], 64, 40))
            else:
                assert torch.equal(y, (x.float() @ w.t()).to(dtype))


def test_version_1_int4_records_are_refused() -> None:
    lin = torch.nn.Sequential(torch.nn.Linear(64, 16, bias=False))
    engine.quantize_(lin, engine.Int4WeightOnly(group_size=32))
    state = lin.state_dict()
    header = {"config": lin[0].weight.config.to_plain(), "shape": [16, 64], "dtype": "float32",
              "parts": ["data", "scale_and_zero"]}
    from engine.tensors.records import encode_record

    state["0.weight_qformat"] = encode_record(saving.MAGIC, 1, header, {})
    with pytest.raises(ValueError, match="0.weight_qformat: an Int4WeightOnly weight saved in torch's packed"):
        lin.load_state_dict(state)


# ------------------------------------------------------------------------------ int8 dynamic activations
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_dynamic_glue_is_bit_exact(dtype: torch.dtype) -> None:
    """The one-pass quantize of x and rescale of the int32 sums give the bits of the torch ops they replace:
    ties of the rounding, an all-zero row (the tiny scale), a NaN row, fp32 subnormals, clamping at 127."""
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(9, 77, generator=gen) * 3).to(dtype)
    x[1] = 0.0
    x[2, :4] = torch.tensor([127.0, 63.5, -0.5, 1.5]).to(dtype)  # ties: 63.5 -> 64, -0.5 -> -0, 1.5 -> 2
    x[3, 5] = float("nan")
    if dtype == torch.float32:
        x[4] = torch.tensor(1e-40) * torch.arange(77)
    q, sx = native.int8_quantize_rows(x)
    q_ref, sx_ref = int_formats.rowwise_int8(x)
    keep = torch.ones(9, dtype=torch.bool)
    keep[3] = False  # NaN -> int8 is undefined for torch; the kernel writes 0
    assert torch.equal(q[keep], q_ref[keep]) and torch.equal(sx.isnan(), sx_ref.isnan())
    assert torch.equal(sx[keep], sx_ref[keep]) and bool((q[3] == 0).all())
    qb, sxb = native.int8_quantize_rows(x, biased=True)  # oneDNN's u8 codes: q + 128
    assert qb.dtype == torch.uint8 and torch.equal(qb.long() - 128, q.long())
    torch.testing.assert_close(sxb, sx, rtol=0, atol=0, equal_nan=True)
    assert int(qb.min()) >= 1 and torch.equal(qb[3][~x[3].isnan()].long() - 128, q_ref[3][~x[3].isnan()].long())
    acc = torch.randint(-2 ** 26, 2 ** 26, (9, 33), generator=gen, dtype=torch.int32)
    sw = torch.rand(33, generator=gen) * 0.01
    ref = (acc.float() * sx_ref.unsqueeze(1) * sw.unsqueeze(0)).to(dtype)
    for sums in (acc, acc.float()):  # torch._int_mm's int32, or oneDNN's fp32 of the same sums
        y = native.int8_rescale(sums, sx_ref, sw, dtype)
        assert torch.equal(y[keep], ref[keep]) and bool(y[3].isnan().all())


def test_int8_dynamic_glue_bad_arguments() -> None:
    with pytest.raises(TypeError, match="x: expected float32"):
        native.int8_quantize_rows(torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="x: expected a 2D"):
        native.int8_quantize_rows(torch.zeros(3))
    acc = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(TypeError, match="acc: expected int32 or float32"):
        native.int8_rescale(acc.double(), torch.ones(2), torch.ones(3), torch.float32)
    with pytest.raises(TypeError, match="biased: expected a bool"):
        native.int8_quantize_rows(torch.zeros(2, 3), biased=1)
    with pytest.raises(ValueError, match="sx: expected shape"):
        native.int8_rescale(acc, torch.ones(3), torch.ones(3), torch.float32)
    with pytest.raises(ValueError, match="sw: expected shape"):
        native.int8_rescale(acc, torch.ones(2), torch.ones(2), torch.float32)
    with pytest.raises(TypeError, match="sw: expected float32"):
        native.int8_rescale(acc, torch.ones(2), torch.ones(3, dtype=torch.float64), torch.float32)
    with pytest.raises(TypeError, match="dtype: expected"):
        native.int8_rescale(acc, torch.ones(2), torch.ones(3), torch.int8)


def crafted_int8_layer(n: int = 37, k: int = 3000, seed: int = 3) -> torch.nn.Linear:
    """A Linear whose int8 sums with the positive x of `crafted_x` reach ~127 * 120 * K (past 2^24, where fp32
    values of the sums round) in its first n // 2 rows, with odd N, and pair sums past 16 bits everywhere."""
    gen = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        signs = torch.randn(n, k, generator=gen).sign()
        signs[: n // 2] = 1.0
        lin.weight.copy_(signs * (1 + 0.05 * torch.rand(n, k, generator=gen)))
    return lin


def crafted_x(m: int, k: int, dtype: torch.dtype, seed: int = 4) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (1 + 0.05 * torch.rand(m, k, generator=gen)).to(dtype)


def int32_formula(x: torch.Tensor, q: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """The layer's formula with its int sums from an fp64 matmul of the int8 values (exact below 2^53), not from
    any int8 GEMM: (sums as fp32 * sx * sw) rounded once to x's dtype."""
    xq, sx = int_formats.rowwise_int8(x)
    sums = (xq.double() @ q.double().t()).float()  # exact integers, rounded once to fp32 as an int32's .float()
    return (sums * sx.unsqueeze(1) * sw.unsqueeze(0)).to(x.dtype)


@pytest.mark.parametrize("prepack_from", [1, 1 << 40], ids=["prepacked_where_exact", "plain"])
@pytest.mark.parametrize("m", [0, 1, 5, 17, 64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_dynamic_on_onednn_is_the_int32_formula(prepack_from: int, m: int, dtype: torch.dtype,
                                                     monkeypatch) -> None:
    """The layer's bits are those of the formula on exact int sums, with sums past 2^24 (their fp32 values round)
    and odd N and K, whichever GEMM runs: oneDNN's prepacked one (where it is exact: VNNI), torch._int_mm, or
    its sign-split form (without VNNI). Under the AVX2 emulation nothing is prepacked."""
    monkeypatch.setattr(int_formats.Int8DynamicFormat, "onednn_min_elements", prepack_from)
    lin = crafted_int8_layer()
    n, k = lin.weight.shape
    x = crafted_x(m, k, dtype)
    engine.quantize_(lin, engine.Int8DynamicActivationInt8Weight())
    plain = lin.weight.plain_parts()
    q_ref, sw_ref = int_formats.rowwise_int8(lin.weight.dequantize(torch.float32))  # re-derived from the values
    assert torch.equal(plain["data"], q_ref) and plain["data"].is_contiguous()
    prepacked = lin.weight.operands["data"].is_mkldnn
    assert not (prepacked and (prepack_from > n * k or avx2_emulation.emulated()))
    xq, _ = int_formats.rowwise_int8(x)
    assert m == 0 or float((xq.double() @ q_ref.double().t()).abs().max()) > 2 ** 24
    with torch.no_grad():
        assert torch.equal(lin(x), int32_formula(x, plain["data"], plain["scale"]))


# Under the AVX2 emulation (tests/avx2_emulation.py): the crafted layer, prepacked where exact and plain, against the
# formula on fp64 sums; oneDNN's int8 GEMMs there saturate their 16-bit pair sums.
WITHOUT_VNNI = """
    import json
    import torch
    import engine
    from engine.inference import int_formats
    from test_inference_kernels import crafted_int8_layer, crafted_x, int32_formula

    bad, prepacked = [], []
    for prepack_from in (1, 1 << 40):
        int_formats.Int8DynamicFormat.onednn_min_elements = prepack_from
        lin = crafted_int8_layer()
        engine.quantize_(lin, engine.Int8DynamicActivationInt8Weight())
        prepacked.append(lin.weight.operands["data"].is_mkldnn)
        plain = lin.weight.plain_parts()
        for m in (1, 5, 17, 64):
            for dtype in (torch.float32, torch.bfloat16):
                x = crafted_x(m, lin.weight.shape[1], dtype)
                with torch.no_grad():
                    got, want = lin(x), int32_formula(x, plain["data"], plain["scale"])
                if not torch.equal(got, want):
                    err = float(((got.double() - want.double()).abs() / want.double().abs()).max())
                    bad.append(f"prepack_from={prepack_from} M={m} {dtype}: relative error up to {err:.3g}")
    from engine.inference import int8_mm

    print(json.dumps({"bad": bad, "prepacked": prepacked, "method": int8_mm.method()}))
"""


def test_int8_dynamic_is_the_int32_formula_without_vnni() -> None:
    """On a CPU without VNNI (an AVX2 Zen 3, emulated) the layer still gives the formula's bits on exact int sums,
    and keeps its weights plain (oneDNN's prepacked GEMM saturates there); its sums come from torch._int_mm on
    sign-split operands, not the slow fp64 fallback."""
    got = avx2_emulation.run(WITHOUT_VNNI)
    assert not got["bad"], got["bad"]
    assert got["prepacked"] == [False, False] and got["method"] == "int_mm_sign_split"



def prepacks() -> bool:
    """Whether large int8 dynamic weights are held prepacked for oneDNN here."""
    return int_formats.onednn_available() and int8_mm.prepacked_exact()


@pytest.mark.skipif(not prepacks(), reason="needs an x86 torch build with oneDNN's int8 linear (torch.ops.onednn.qlinear_prepack) giving exact sums (VNNI); other machines run int8_mm.int32_mm (tests/test_inference.py, test_int8_dynamic_is_the_int32_formula_without_vnni)")
def test_onednn_weights_copy_clone_and_load(monkeypatch) -> None:
    """copy_ of a plain or quantized weight, clone, deepcopy and an assigning load keep the prepacked layout and
    the values."""
    import copy

    monkeypatch.setattr(int_formats.Int8DynamicFormat, "onednn_min_elements", 1)
    gen = torch.Generator().manual_seed(4)
    a, b = torch.nn.Linear(64, 24), torch.nn.Linear(64, 24)
    source_weight = a.weight.detach().clone()
    for lin in (a, b):
        engine.quantize_(lin, engine.Int8DynamicActivationInt8Weight())
    x = torch.randn(3, 64, generator=gen)
    with torch.no_grad():
        b.load_state_dict(a.state_dict())
        assert torch.equal(b(x), a(x)) and b.weight.operands["data"].is_mkldnn
        c = torch.nn.Linear(64, 24)
        engine.quantize_(c, engine.Int8DynamicActivationInt8Weight())
        c.weight.copy_(source_weight)  # a plain tensor: quantized as it is copied in
        c.bias.copy_(a.bias)
        assert torch.equal(c(x), a(x))
        assert torch.equal(copy.deepcopy(a)(x), a(x))
        assert torch.equal(a.weight.clone().plain_parts()["data"], a.weight.plain_parts()["data"])
        d = torch.nn.Linear(64, 24)
        engine.quantize_(d, engine.Int8DynamicActivationInt8Weight())
        d.load_state_dict(a.state_dict(), assign=True)
        assert torch.equal(d(x), a(x)) and d.weight.operands["data"].is_mkldnn


def test_int8_dynamic_layout_follows_the_weight_size() -> None:
    """Small weights stay plain (torch._int_mm); from onednn_min_elements on they are prepacked where oneDNN is
    and gives exact sums (never under the AVX2 emulation: no VNNI)."""
    small, large = torch.nn.Linear(64, 32), torch.nn.Linear(2048, 1024)
    for lin in (small, large):
        engine.quantize_(lin, engine.Int8DynamicActivationInt8Weight())
    assert not small.weight.operands["data"].is_mkldnn
    assert large.weight.operands["data"].is_mkldnn == prepacks()
    assert not (avx2_emulation.emulated() and prepacks())
    # the weight holds its int8 values once (prepacked: no plain copy beside it) and its fp32 row scales
    assert large.weight.nbytes_quantized() == 1024 * 2048 + 1024 * 4
    plain = large.weight.storage  # read back from the prepacked copy when asked
    assert plain.rowwise_data.dtype == torch.int8 and plain.rowwise_data.shape == (1024, 2048)


@pytest.mark.parametrize("width", [64, 2048])  # plain, and prepacked where oneDNN is
def test_a_compiled_quantized_model_gives_eager_bits(width: int) -> None:
    """torch.compile takes the weight's GEMM as one custom op (engine::weight_linear), oneDNN's prepacked layout
    included; tests/test_compile_every_format.py compiles every config."""
    lin = torch.nn.Linear(width, 1024)
    engine.quantize_(lin, engine.Int8DynamicActivationInt8Weight())
    x = torch.randn(2, width)
    with torch.no_grad():
        assert torch.equal(torch.compile(lin, backend="aot_eager", fullgraph=True)(x), lin(x))


def test_the_benchmark_runs(capsys) -> None:
    """benchmarks/bench_inference.py on a tiny shape: every int config and torch's kernels, a row each."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_inference

    threads = torch.get_num_threads()
    rows = bench_inference.main(["--shapes", "128x48", "--ms", "1,3", "--blocks", "1",
                                 "--configs", "int8wo,int4wo-g32,int8dq,torch-int8pack,torch-int4pack-g128"])
    out = capsys.readouterr().out
    assert len(rows) == 2 * 7 and "speed-up vs bf16" in out and "vs the faster" in out
    assert f"engine kernels: {native.isa()}" in out
    for row in rows:  # against the faster baseline (the shorter time): the smaller of the two speed-ups
        assert float(row[5]) == min(float(row[3]), float(row[4]))
    assert torch.get_num_threads() == threads  # measured on one thread, this process's setting given back
