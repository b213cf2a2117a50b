"""Quantized tensors: usages, saving for backward, dequantize, quantizer updates,
__torch_dispatch__ (quantized ops and the dequantizing fallback), serialization, repr, Parameter."""

from __future__ import annotations

import contextlib
import io
import math
import warnings

import pytest
import torch

import brute_force
from conftest import (
    DELAYED_SCALE, DTYPES, E4M3, E5M2, FIELDS, KIND_LAYOUT, KIND_RULE, MX, PER_TENSOR, USAGES, assert_buffers_equal,
    bits, brute_dequantize, expected_layout, kind_fp8_dtype, kind_shapes, make_input, make_quantizer,
    reference_buffers, special_input, storage_of,
)
from engine.ops.reference import dequantize_blocked, quantize_blocked
from engine.quantizers import Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer, MXFP8Quantizer
from engine.schemes import SCHEMES, ScaleEncoding
from engine.tensors import (
    Float8BlockwiseTensor, Float8Tensor, MXFP8Tensor, QuantizedFallbackWarning, QuantizedTensor,
    QuantizedTensorBase,
)
from engine.tensors import serialization

DERIVABLE = PER_TENSOR + ("block2d",)
NOT_DERIVABLE = ("block1d",) + MX
TENSOR_CLASS = {**dict.fromkeys(PER_TENSOR, Float8Tensor), "block1d": Float8BlockwiseTensor,
                "block2d": Float8BlockwiseTensor, **dict.fromkeys(MX, MXFP8Tensor)}


def ptrs(t) -> dict:
    return {n: (None if b is None else b.data_ptr()) for n, b in storage_of(t).buffers().items()}


def cloned_buffers(t) -> dict:
    return {n: (None if b is None else b.clone()) for n, b in storage_of(t).buffers().items()}


@contextlib.contextmanager
def no_warnings():
    """A context in which any warning (fallback or other) is an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# ============================================================================ update_usage
@pytest.mark.parametrize("drop", ["rowwise", "columnwise"])
def test_update_usage_drops_one(kind, drop):
    x = make_input(kind_shapes(kind)[1])
    t = make_quantizer(kind)(x)
    keep = "columnwise" if drop == "rowwise" else "rowwise"
    kept = {n: getattr(t.qstorage, n) for n in (f"{keep}_data", f"{keep}_scale_inv")}
    t.update_usage(**{f"{drop}_usage": False})
    st = t.qstorage
    assert getattr(st, f"{drop}_data") is None and getattr(st, f"{drop}_scale_inv") is None
    for n, b in kept.items():
        assert getattr(st, n) is b  # the kept buffers are untouched
    want = reference_buffers(kind, x, rowwise=keep == "rowwise", columnwise=keep == "columnwise")
    assert_buffers_equal(st.buffers(), want)
    t.update_usage()  # None, None: nothing changes
    assert_buffers_equal(st.buffers(), want)


@pytest.mark.parametrize("direction", ["row_to_col", "col_to_row"])
@pytest.mark.parametrize("kind", DERIVABLE)
def test_update_usage_derives_other_representation(kind, direction):
    for i, shape in enumerate(kind_shapes(kind)):
        x = make_input(shape, seed=i)
        start_row = direction == "row_to_col"
        t = make_quantizer(kind, rowwise=start_row, columnwise=not start_row)(x)
        if start_row:
            t.update_usage(columnwise_usage=True)
        else:
            t.update_usage(rowwise_usage=True)
        # equal, bit for bit, to a fresh quantization with both usages
        assert_buffers_equal(t.qstorage.buffers(), reference_buffers(kind, x))
        fresh = make_quantizer(kind)(x)
        assert_buffers_equal(t.qstorage.buffers(), fresh.qstorage.buffers())
        # create-and-drop in one call: switch to the other representation only
        t2 = make_quantizer(kind, rowwise=start_row, columnwise=not start_row)(x)
        t2.update_usage(rowwise_usage=not start_row, columnwise_usage=start_row)
        assert_buffers_equal(t2.qstorage.buffers(),
                             reference_buffers(kind, x, rowwise=not start_row, columnwise=start_row))


@pytest.mark.parametrize("direction", ["row_to_col", "col_to_row"])
@pytest.mark.parametrize("kind", NOT_DERIVABLE)
def test_update_usage_cannot_derive(kind, direction):
    x = make_input(kind_shapes(kind)[0])
    start_row = direction == "row_to_col"
    t = make_quantizer(kind, rowwise=start_row, columnwise=not start_row)(x)
    before = cloned_buffers(t)
    with pytest.raises(ValueError, match="cannot be derived"):
        if start_row:
            t.update_usage(columnwise_usage=True)
        else:
            t.update_usage(rowwise_usage=True)
    assert_buffers_equal(t.qstorage.buffers(), before)  # nothing changed
    assert (t.qstorage.has_rowwise, t.qstorage.has_columnwise) == (start_row, not start_row)


def test_update_usage_dropping_both_raises(kind):
    t = make_quantizer(kind)(make_input(kind_shapes(kind)[0]))
    before = cloned_buffers(t)
    with pytest.raises(ValueError, match="at least one"):
        t.update_usage(rowwise_usage=False, columnwise_usage=False)
    assert_buffers_equal(t.qstorage.buffers(), before)
    t = make_quantizer(kind, columnwise=False)(make_input(kind_shapes(kind)[0]))
    with pytest.raises(ValueError, match="at least one"):
        t.update_usage(rowwise_usage=False)


# ============================================================================ saving for backward
@pytest.mark.parametrize("internal", [False, True])
def test_prepare_for_saving_and_restore(kind, internal):
    x = make_input(kind_shapes(kind)[1])
    t = make_quantizer(kind, internal=internal)(x)
    value = t.dequantize().clone()
    bufs = [getattr(storage_of(t), n) for n in FIELDS]
    tensors, obj = t.prepare_for_saving()
    assert obj is t
    assert isinstance(tensors, list) and len(tensors) == 4
    assert all(a is b for a, b in zip(tensors, bufs))
    assert all(getattr(storage_of(t), n) is None for n in FIELDS)
    with pytest.raises(ValueError):
        t.dequantize()
    with pytest.raises(ValueError):
        t.update_usage(rowwise_usage=True)
    extra = [torch.ones(3), None, torch.zeros(2)]
    rest = t.restore_from_saved(tensors + extra)
    assert len(rest) == 3 and all(a is b for a, b in zip(rest, extra))
    assert all(getattr(storage_of(t), n) is b for n, b in zip(FIELDS, bufs))
    assert torch.equal(t.dequantize(), value)
    assert_buffers_equal(storage_of(t).buffers(), reference_buffers(kind, x))


def test_restore_from_saved_too_few_tensors():
    t = make_quantizer("current_e4m3")(make_input((8, 16)))
    tensors, _ = t.prepare_for_saving()
    with pytest.raises(ValueError, match="at least 4"):
        t.restore_from_saved(tensors[:3])


@pytest.mark.parametrize("internal", [False, True])
def test_saving_inside_autograd_function(kind, internal):
    shape = kind_shapes(kind)[0]
    quantizer = make_quantizer(kind, internal=internal)
    seen = {}

    class QuantizeAndSave(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            qx = quantizer(x)
            tensors, ctx.qx = qx.prepare_for_saving()
            ctx.save_for_backward(w, *tensors)
            seen["emptied"] = all(getattr(storage_of(qx), n) is None for n in FIELDS)
            return x * w

        @staticmethod
        def backward(ctx, grad):
            w, *rest = ctx.saved_tensors
            seen["rest"] = ctx.qx.restore_from_saved(rest + [w])
            seen["buffers"] = {n: getattr(storage_of(ctx.qx), n) for n in FIELDS}
            return grad * ctx.qx.dequantize(), grad * 2

    x = make_input(shape).requires_grad_(True)
    w = torch.full(shape, 3.0, requires_grad=True)
    QuantizeAndSave.apply(x, w).sum().backward()
    want = reference_buffers(kind, x.detach())
    assert seen["emptied"]
    assert len(seen["rest"]) == 1 and seen["rest"][0] is not None and torch.equal(seen["rest"][0], w)
    assert_buffers_equal(seen["buffers"], want)
    # dL/dx = grad * dequantize(q(x)) with grad = 1
    assert torch.equal(x.grad, brute_dequantize(kind, want, shape, torch.float32))
    assert torch.equal(w.grad, torch.full(shape, 2.0))


# ============================================================================ dequantize
# partial 128-tiles and 32-blocks along both dims, 2D and 3D (one full-size case per kind below)
SMALL, THREE_D, BIG = (33, 130), (3, 70, 130), (256, 256)


def edge_inputs(shape, dtype, *, all_kinds: bool = True) -> list[torch.Tensor]:
    """Edge values (zeros, subnormals, +-max, saturating) with +-inf and NaN; with `all_kinds` also ordinary
    values, the edge values without inf/NaN, and only zeros and subnormals (scales that overflow fp32)."""
    inputs = [special_input(shape, dtype, seed=3, nonfinite=True)]
    if all_kinds:
        tiny = torch.zeros(shape, dtype=dtype)
        sub = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
        tiny.view(-1)[::7] = sub
        tiny.view(-1)[3::11] = -sub * 5
        inputs += [make_input(shape, dtype, seed=1), special_input(shape, dtype, seed=2), tiny]
    return inputs


def brute_cases(dtype, *, big: bool = False):
    """(shape, input) pairs: every kind of input on the small shape, edge values on the 3D one."""
    cases = [(SMALL, x) for x in edge_inputs(SMALL, dtype)]
    cases += [(THREE_D, x) for x in edge_inputs(THREE_D, dtype, all_kinds=False)]
    return cases + ([(BIG, make_input(BIG, dtype, seed=4))] if big else [])


def one_usage(st, columnwise: bool):
    """The storage with only one usage's buffers (what dequantize reads then)."""
    drop = "rowwise" if columnwise else "columnwise"
    return st.replace(**{f"{drop}_data": None, f"{drop}_scale_inv": None})


def test_brute_force_decodes_and_rounds_like_the_format_definitions():
    """tests/brute_force.py itself: its decoding against torch's FP8/E8M0 dtypes and known values,
    and its nearest-code search against torch's saturated RNE cast on midpoints and neighbours."""
    for element, dtype, top, top_code, tiny in (("e4m3", E4M3, 448.0, 0x7E, 2.0**-9),
                                                ("e5m2", E5M2, 57344.0, 0x7B, 2.0**-16)):
        table = brute_force.fp8_table(element)
        by_torch = torch.arange(256, dtype=torch.uint8).view(dtype).double()
        brute_force.assert_same_values(table, by_torch, element)
        assert table[top_code] == top and table[0x80 | top_code] == -top and table[1] == tiny
        assert brute_force.fp8_max(element) == top
        finite = table[:128][torch.isfinite(table[:128])]
        mids = (finite[1:] + finite[:-1]) / 2  # ties: RNE picks the even code
        probes = torch.cat([finite, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1),
                            torch.tensor([top * 1.04, top * 1.1, 1e30, math.inf])])
        probes = torch.cat([probes, -probes, torch.tensor([math.nan])]).float().double()  # fp32 values
        want = probes.float().clamp(-top, top).to(dtype).view(torch.uint8).long()
        got = brute_force.nearest_codes(probes, element)
        nan = torch.isnan(probes)
        assert torch.equal(got[~nan], want[~nan]) and bool((got[nan] == 255).all())
        assert brute_force.fp8_emax(element) == {"e4m3": 8, "e5m2": 15}[element]
    e8m0 = brute_force.e8m0_table()
    brute_force.assert_same_values(e8m0, torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu).double(),
                                   "e8m0")
    assert e8m0[127] == 1.0 and e8m0[0] == 2.0**-127 and e8m0[254] == 2.0**127 and math.isnan(e8m0[255])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("usage", ["row", "col", "both"])
def test_dequantize_matches_brute_force(kind, usage, dtype):
    """dequantize() is each element's code times its block's scale, read by the README's layout rules."""
    rowwise, columnwise = USAGES[usage]
    for shape, x in brute_cases(dtype, big=dtype == torch.bfloat16):
        t = make_quantizer(kind, rowwise=rowwise, columnwise=columnwise)(x)
        st = t.qstorage
        exact = {col: brute_force.dequantize(getattr(st, f"{u}_data"), getattr(st, f"{u}_scale_inv"),
                                             layout=KIND_LAYOUT[kind], shape=shape, columnwise=col)
                 for u, col, on in (("rowwise", False, rowwise), ("columnwise", True, columnwise)) if on}
        got = t.dequantize()
        assert type(got) is torch.Tensor and got.dtype == dtype and got.shape == torch.Size(shape)
        first = exact[not rowwise]  # rowwise data when present
        brute_force.assert_same_values(got, brute_force.as_dtype(first, dtype), f"{kind} {usage} {dtype} {shape}")
        for out in (torch.float32, torch.float64):
            brute_force.assert_same_values(st.dequantize(out), brute_force.as_dtype(first, out), f"{kind} {out}")
        if usage == "both":  # the columnwise buffers alone
            brute_force.assert_same_values(one_usage(st, True).dequantize(torch.float32),
                                           brute_force.as_dtype(exact[True], torch.float32), f"{kind} columnwise")


# quantizers beyond conftest.KINDS whose scale rules differ: (quantizer, layout, rule)
RULE_CASES = {
    "current_e4m3_pow2": (lambda: Float8CurrentScalingQuantizer(E4M3, force_pow_2_scales=True), "tensor",
                          "current_pow2"),
    "block1d_e5m2_f32": (lambda: Float8BlockQuantizer(E5M2, force_pow_2_scales=False), "block1d", "current"),
    "block2d_f32": (lambda: Float8BlockQuantizer(E4M3, block_scaling_dim=2, force_pow_2_scales=False), "block2d",
                    "current"),
    "mx_rceil_e5m2": (lambda: MXFP8Quantizer(E5M2), "mx", "rceil"),
    "mx_floor_e5m2": (lambda: MXFP8Quantizer(E5M2, scale_mode="floor"), "mx", "floor"),
    **{k: (lambda k=k: make_quantizer(k), KIND_LAYOUT[k], KIND_RULE[k]) for k in KIND_RULE},
}


@pytest.mark.parametrize("case, dtype", [pytest.param(case, dtype, id=f"{case}-{str(dtype)[6:]}")
                                         for case in RULE_CASES for dtype in DTYPES
                                         if case in KIND_RULE or dtype != torch.float16])  # time: extras skip fp16
def test_quantized_codes_are_nearest_and_scales_follow_the_rule(case, dtype):
    """Each block's scale_inv is the documented rule's (current scaling, power-of-2, E8M0 RCEIL/FLOOR, or
    the delayed scale); each code is the round-to-nearest-even, saturating code of x times that scale."""
    make, layout, rule = RULE_CASES[case]
    for shape, x in brute_cases(dtype, big=dtype == torch.bfloat16 and case in KIND_RULE):
        st = make()(x).qstorage
        for columnwise in (False, True):
            usage = "columnwise" if columnwise else "rowwise"
            brute_force.check_quantized(x, getattr(st, f"{usage}_data"), getattr(st, f"{usage}_scale_inv"),
                                        layout=layout, rule=rule, columnwise=columnwise, scale=DELAYED_SCALE)


# FP8 elements (brute_force.py decodes FP8 bytes); MX E2M1/E2M3/E3M2 schemes: tests/test_mx_small.py's brute force;
# integer schemes: tests/test_int_schemes.py
GENERIC_CASES = [(name, mode) for name, scheme in SCHEMES.items() if not scheme.coded and not scheme.integer
                 for mode in (("rceil", "floor") if scheme.scale is ScaleEncoding.E8M0 else ("",))]
GENERIC_CASES += [(name, "delayed") for name, scheme in SCHEMES.items() if scheme.layout == "tensor"]


@pytest.mark.parametrize("name, mode", GENERIC_CASES, ids=[f"{n}-{m}" if m else n for n, m in GENERIC_CASES])
def test_generic_reference_of_every_scheme_follows_the_rules(name, mode):
    """quantize_blocked / dequantize_blocked (the reference every scheme's storage dequantizes with) against
    the brute-force rules: README buffer shapes, scale rules, nearest codes, and exact values."""
    scheme = SCHEMES[name]
    if mode in ("rceil", "floor", "delayed"):
        rule = mode
    else:
        rule = "current_pow2" if scheme.scale is ScaleEncoding.FP32_POW2 else "current"
    extra = {"scale_mode": mode} if mode in ("rceil", "floor") else {}
    if mode == "delayed":
        extra = {"scale": torch.tensor([DELAYED_SCALE])}
    for shape, dtype in ((SMALL, torch.float32), (THREE_D, torch.bfloat16)):
        x = special_input(shape, dtype, seed=5, nonfinite=True)
        for columnwise in (False, True):
            data, scale_inv = quantize_blocked(x, scheme, columnwise=columnwise, **extra)
            brute_force.check_quantized(x, data, scale_inv, layout=scheme.layout, rule=rule, columnwise=columnwise,
                                        scale=DELAYED_SCALE)
            exact = brute_force.dequantize(data, scale_inv, layout=scheme.layout, shape=shape, columnwise=columnwise)
            got = dequantize_blocked(data, scale_inv, scheme, shape=torch.Size(shape), columnwise=columnwise,
                                     dtype=dtype)
            brute_force.assert_same_values(got, brute_force.as_dtype(exact, dtype), f"{name} {shape}")


@pytest.mark.parametrize("kind", DERIVABLE)
def test_rowwise_and_columnwise_dequantize_agree(kind):
    # per-tensor and 128x128 scaling: the columnwise data is the exact transpose of the rowwise data
    x = make_input(kind_shapes(kind)[1])
    row = make_quantizer(kind, columnwise=False)(x).dequantize()
    col = make_quantizer(kind, rowwise=False)(x).dequantize()
    assert torch.equal(row, col)


# ============================================================================ update_quantizer
def test_update_quantizer_same_config_no_warning(kind):
    t = make_quantizer(kind)(make_input(kind_shapes(kind)[0]))
    q2 = make_quantizer(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t.update_quantizer(q2)
    assert t.quantizer is q2 and t.qstorage.quantizer is q2


@pytest.mark.parametrize("old_kind, new_kind", [
    ("current_e4m3", "current_e5m2"), ("delayed_e4m3", "current_e4m3"), ("block1d", "block2d"),
    ("mx_rceil", "mx_floor"),
])
def test_update_quantizer_different_config_warns(old_kind, new_kind):
    old, new = make_quantizer(old_kind), make_quantizer(new_kind)
    t = old(make_input((64, 128)))
    with pytest.warns(UserWarning) as record:
        t.update_quantizer(new)
    msg = " ".join(str(r.message) for r in record)
    assert repr(old) in msg and repr(new) in msg
    assert t.quantizer is new


@pytest.mark.parametrize("kind, other", [("current_e4m3", "mx_rceil"), ("block1d", "delayed_e4m3"),
                                         ("mx_floor", "block2d")])
def test_update_quantizer_other_scheme_raises(kind, other):
    q = make_quantizer(kind)
    t = q(make_input((64, 128)))
    with pytest.raises(TypeError, match="quantizer"):
        t.update_quantizer(make_quantizer(other))
    assert t.quantizer is q


def test_update_quantizer_none_then_quantize_raises():
    t = make_quantizer("current_e4m3")(make_input((8, 16)))
    t.update_quantizer(None)
    assert t.quantizer is None
    with pytest.raises(ValueError, match="no quantizer"):
        t.quantize_(make_input((8, 16)))


@pytest.mark.parametrize("old_kind, new_kind", [
    ("delayed_e4m3", "current_e4m3"), ("mx_rceil", "mx_floor"),
    ("current_e4m3", "current_e5m2"), ("block1d", "block2d"), ("block2d", "block1d"),
])
def test_quantize_after_update_quantizer_uses_new_quantizer(old_kind, new_kind):
    """update_quantizer's contract: the new quantizer is used the next time the tensor is quantized into."""
    x = make_input((160, 288))  # partial 128-tiles both ways, multiples of 32 for MX
    t = make_quantizer(old_kind)(x)
    new = make_quantizer(new_kind)
    with pytest.warns(UserWarning):
        t.update_quantizer(new)
    t.quantize_(x)
    fresh = make_quantizer(new_kind)(x)
    assert t.fp8_dtype == fresh.fp8_dtype
    assert torch.equal(t.dequantize(), fresh.dequantize())
    assert_buffers_equal(t.qstorage.buffers(), fresh.qstorage.buffers())


# ============================================================================ dispatch: quantized ops
def test_detach(kind):
    x = make_input(kind_shapes(kind)[0]).requires_grad_(True)
    t = make_quantizer(kind)(x)
    assert t.requires_grad
    with no_warnings():
        d = t.detach()
    assert type(d) is type(t) and not d.requires_grad and d.grad_fn is None
    assert d.shape == t.shape and d.dtype == t.dtype and d.quantizer is t.quantizer
    for n in FIELDS:
        assert getattr(d.qstorage, n) is getattr(t.qstorage, n)  # the buffers are shared
    # but it is a new tensor: changing its usages leaves the original alone
    d.update_usage(rowwise_usage=False)
    assert t.qstorage.has_rowwise


def test_clone(kind):
    x = make_input(kind_shapes(kind)[1])
    t = make_quantizer(kind)(x)
    with no_warnings():
        c = t.clone()
    assert type(c) is type(t) and c.shape == t.shape and c.dtype == t.dtype
    assert_buffers_equal(c.qstorage.buffers(), reference_buffers(kind, x))
    for n in FIELDS:
        assert getattr(c.qstorage, n).data_ptr() != getattr(t.qstorage, n).data_ptr()
    if kind in PER_TENSOR:
        assert c.qstorage.rowwise_scale_inv is c.qstorage.columnwise_scale_inv
    # independent: overwriting the clone's data leaves the original intact
    c.qstorage.rowwise_data.view(torch.uint8).zero_()
    assert_buffers_equal(t.qstorage.buffers(), reference_buffers(kind, x))


def test_copy_from_high_precision(kind):
    shape = kind_shapes(kind)[1]
    t = make_quantizer(kind)(make_input(shape, seed=1))
    before = ptrs(t)
    x2 = make_input(shape, seed=2) * 4
    with no_warnings():
        r = t.copy_(x2)
    assert r is t and type(t) is TENSOR_CLASS[kind]
    assert ptrs(t) == before
    assert_buffers_equal(t.qstorage.buffers(), reference_buffers(kind, x2))


def test_copy_from_same_kind(kind):
    shape = kind_shapes(kind)[1]
    q = make_quantizer(kind)
    dst, src = q(make_input(shape, seed=1)), q(make_input(shape, seed=2) * 4)
    before = ptrs(dst)
    with no_warnings():
        dst.copy_(src)
    assert ptrs(dst) == before  # copied into the existing buffers
    assert_buffers_equal(dst.qstorage.buffers(), src.qstorage.buffers())
    assert all(p != s for p, s in zip(ptrs(dst).values(), ptrs(src).values()))


@pytest.mark.parametrize("src_kind, dst_kind", [
    ("current_e5m2", "current_e4m3"), ("block1d", "block2d"), ("block2d", "block1d"),
    ("delayed_e4m3", "current_e4m3"), ("current_e4m3", "delayed_e4m3"), ("current_e4m3", "mx_rceil"),
    ("mx_floor", "block2d"), ("block1d", "delayed_e5m2"),
])
def test_copy_from_other_kind_or_settings_requantizes(src_kind, dst_kind):
    """Another layout or quantizer: dst keeps its own kind and settings and holds its quantization of src's value."""
    shape = (160, 256)
    x = make_input(shape)
    src, dst = make_quantizer(src_kind)(x), make_quantizer(dst_kind)(make_input(shape, seed=3))
    before = ptrs(dst)
    with no_warnings():
        assert dst.copy_(src) is dst
    src_value = brute_dequantize(src_kind, reference_buffers(src_kind, x), shape, torch.float32)
    assert type(dst) is TENSOR_CLASS[dst_kind] and dst.fp8_dtype == kind_fp8_dtype(dst_kind)
    assert_buffers_equal(dst.qstorage.buffers(), reference_buffers(dst_kind, src_value))
    assert ptrs(dst) == before  # into the existing buffers


def test_copy_of_other_shape_or_into_tensor_without_quantizer_raises():
    x = make_input((64, 128))
    t = make_quantizer("current_e4m3")(x)
    with pytest.raises(ValueError, match="copy_.*shape"):
        t.copy_(make_quantizer("current_e4m3")(make_input((32, 128))))
    t.update_quantizer(None)
    with pytest.raises(ValueError, match="copy_: dst.*quantizer"):
        t.copy_(make_quantizer("mx_rceil")(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_copy_into_plain_tensor_dequantizes(kind, dtype):
    x = make_input(kind_shapes(kind)[0], dtype)
    t = make_quantizer(kind)(x)
    plain = torch.zeros(x.shape, dtype=torch.float32)
    with no_warnings():
        plain.copy_(t)
    assert type(plain) is torch.Tensor
    want = brute_dequantize(kind, reference_buffers(kind, x), x.shape, dtype).float()
    assert torch.equal(plain, want)


@pytest.mark.parametrize("nominal, target", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                             (torch.float32, torch.bfloat16)], ids=str)
def test_to_dtype_dequantizes(kind, nominal, target):
    x = make_input(kind_shapes(kind)[0], nominal)
    t = make_quantizer(kind)(x)
    with no_warnings():
        out = t.to(target)
    assert type(out) is torch.Tensor and out.dtype == target
    assert torch.equal(out, brute_dequantize(kind, reference_buffers(kind, x), x.shape, target))


def test_to_device_copy(kind):
    x = make_input(kind_shapes(kind)[1])
    t = make_quantizer(kind)(x)
    with no_warnings():
        c = t.to("cpu", copy=True)
    assert type(c) is type(t) and c.dtype == t.dtype and c.device == torch.device("cpu")
    assert_buffers_equal(c.qstorage.buffers(), reference_buffers(kind, x))
    assert all(a != b for a, b in zip(ptrs(c).values(), ptrs(t).values()))


VIEWS = {  # shape -> (a view keeping the last dim, a reshape keeping the last dim)
    (3, 70, 130): ((210, 130), (7, 30, 130)),
    (2, 32, 64): ((64, 64), (4, 16, 64)),
}


@pytest.mark.parametrize("usage", ["row", "col", "both"])
def test_view_and_reshape_keeping_last_dim(kind, usage):
    rowwise, columnwise = USAGES[usage]
    shape = kind_shapes(kind)[1]
    x = make_input(shape)
    t = make_quantizer(kind, rowwise=rowwise, columnwise=columnwise)(x)
    value = t.dequantize()
    for new_shape in VIEWS[shape]:
        for op in (lambda a: a.view(new_shape), lambda a: a.reshape(new_shape), lambda a: a.view(-1, shape[-1])):
            with no_warnings():
                v = op(t)
            assert type(v) is type(t)
            assert (v.qstorage.has_rowwise, v.qstorage.has_columnwise) == (rowwise, columnwise)
            assert torch.equal(v.dequantize(), value.reshape(v.shape))
            if rowwise:  # a view: the data is shared
                assert v.qstorage.rowwise_data.data_ptr() == t.qstorage.rowwise_data.data_ptr()
            if columnwise:
                assert v.qstorage.columnwise_data.data_ptr() == t.qstorage.columnwise_data.data_ptr()


@pytest.mark.parametrize("kind", PER_TENSOR)
def test_per_tensor_view_changing_last_dim_stays_quantized(kind):
    x = make_input((3, 70, 130))
    t = make_quantizer(kind)(x)
    value = t.dequantize()
    for new_shape in ((3, 130, 70), (27300,), (70, 390)):
        with no_warnings():
            v = t.view(new_shape)
        assert type(v) is Float8Tensor and v.shape == torch.Size(new_shape)
        assert v.qstorage.has_rowwise and not v.qstorage.has_columnwise  # the [K, M] copy no longer fits
        assert v.qstorage.rowwise_data.data_ptr() == t.qstorage.rowwise_data.data_ptr()
        assert torch.equal(v.dequantize(), value.reshape(new_shape))


@pytest.mark.parametrize("kind", ("block1d", "block2d") + MX)
def test_view_changing_last_dim_falls_back(kind):
    shape = kind_shapes(kind)[1]
    x = make_input(shape)
    t = make_quantizer(kind)(x)
    new_shape = (shape[0], shape[2], shape[1])
    with pytest.warns(QuantizedFallbackWarning):
        v = t.view(new_shape)
    assert type(v) is torch.Tensor
    assert torch.equal(v, brute_dequantize(kind, reference_buffers(kind, x), shape, torch.float32).view(new_shape))


@pytest.mark.parametrize("kind", ["current_e4m3", "delayed_e5m2", "block1d", "block2d"])
def test_reshape_changing_last_dim_of_columnwise_only_tensor(kind):
    """Without rowwise data the last dim cannot change quantized, so the op falls back; it must still work."""
    shape = (3, 70, 130)
    x = make_input(shape)
    t = make_quantizer(kind, rowwise=False)(x)
    want = brute_dequantize(kind, reference_buffers(kind, x), shape, torch.float32, from_columnwise=True)
    with pytest.warns(QuantizedFallbackWarning):
        v = t.reshape(3, 130, 70)
    assert torch.equal(v, want.reshape(3, 130, 70))


@pytest.mark.parametrize("usage", ["row", "col", "both"])
@pytest.mark.parametrize("kind", PER_TENSOR + ("block2d",))
def test_t_of_a_derivable_scheme_stays_quantized(kind, usage):
    """Per-tensor and 128x128 tiles map onto themselves under transposition: t() is exact."""
    rowwise, columnwise = USAGES[usage]
    x = make_input((17, 33) if kind != "block2d" else (130, 257))
    t = make_quantizer(kind, rowwise=rowwise, columnwise=columnwise)(x)
    value = t.dequantize()
    with no_warnings():
        tt = t.t()
    assert type(tt) is TENSOR_CLASS[kind] and tt.shape == torch.Size(x.shape[::-1]) and tt.dtype == t.dtype
    assert torch.equal(tt.dequantize(), value.t())
    ref_bufs = reference_buffers(kind, x)
    # rowwise data of the transpose is the original's columnwise ([K, M]) data
    assert torch.equal(bits(tt.qstorage.rowwise_data), bits(ref_bufs["columnwise_data"]))
    if columnwise:
        assert tt.qstorage.rowwise_data.data_ptr() == t.qstorage.columnwise_data.data_ptr()
    if rowwise:  # and its columnwise data is the original's rowwise data
        assert tt.qstorage.columnwise_data.data_ptr() == t.qstorage.rowwise_data.data_ptr()
    assert torch.equal(tt.t().dequantize(), value)


@pytest.mark.parametrize("kind", ("block1d",) + MX)
def test_t_on_other_schemes_falls_back(kind):
    x = make_input((64, 256))
    t = make_quantizer(kind)(x)
    with pytest.warns(QuantizedFallbackWarning):
        tt = t.t()
    assert torch.equal(tt, brute_dequantize(kind, reference_buffers(kind, x), x.shape, torch.float32).t())


@pytest.mark.parametrize("usage", ["row", "col", "both"])
def test_empty_like_and_new_empty(kind, usage):
    rowwise, columnwise = USAGES[usage]
    shape = kind_shapes(kind)[0]
    t = make_quantizer(kind, rowwise=rowwise, columnwise=columnwise)(make_input(shape, torch.bfloat16))
    fp8 = kind_fp8_dtype(kind)
    with no_warnings():
        e = torch.empty_like(t)
        n = t.new_empty((2, 64, 96))
    for out, out_shape in ((e, shape), (n, (2, 64, 96))):
        assert type(out) is type(t) and out.shape == torch.Size(out_shape) and out.dtype == torch.bfloat16
        assert out.quantizer is t.quantizer
        layout = expected_layout(kind, out_shape, fp8, rowwise=rowwise, columnwise=columnwise)
        for name, buf in out.qstorage.buffers().items():
            assert (None if buf is None else (tuple(buf.shape), buf.dtype)) == layout[name], name
    with no_warnings():
        plain = torch.empty_like(t, dtype=torch.float32)
    assert type(plain) is torch.Tensor and plain.shape == t.shape and plain.dtype == torch.float32


# ============================================================================ dispatch: fallback
def test_fallback_add(kind):
    x = make_input(kind_shapes(kind)[0])
    t = make_quantizer(kind)(x)
    deq = brute_dequantize(kind, reference_buffers(kind, x), x.shape, torch.float32)
    with pytest.warns(QuantizedFallbackWarning, match="add"):
        out = torch.add(t, 1.5)
    assert type(out) is torch.Tensor and torch.equal(out, deq + 1.5)
    with pytest.warns(QuantizedFallbackWarning):
        out = t + x
    assert type(out) is torch.Tensor and torch.equal(out, deq + x)


def test_fallback_matmul(kind):
    shape = kind_shapes(kind)[0]  # 2D
    x = make_input(shape)
    t = make_quantizer(kind)(x)
    deq = brute_dequantize(kind, reference_buffers(kind, x), shape, torch.float32)
    w = make_input((shape[1], 8), seed=5)
    with pytest.warns(QuantizedFallbackWarning):
        out = t @ w
    assert type(out) is torch.Tensor and torch.equal(out, deq @ w)
    v = make_input((8, shape[0]), seed=6)
    with pytest.warns(QuantizedFallbackWarning):
        out = torch.matmul(v, t)
    assert torch.equal(out, v @ deq)


def test_fallback_reduction_and_indexing(kind):
    x = make_input(kind_shapes(kind)[1])
    t = make_quantizer(kind)(x)
    deq = brute_dequantize(kind, reference_buffers(kind, x), x.shape, torch.float32)
    with pytest.warns(QuantizedFallbackWarning):
        s = t.abs().amax()
    assert s.item() == deq.abs().amax().item()
    with pytest.warns(QuantizedFallbackWarning):
        row = t[1]
    assert torch.equal(row, deq[1])


def test_inplace_update_writes_back_quantized_without_warning(kind):
    """An optimizer-style in-place update (mul_, add_, lerp_, ...) has no faster path: it is quiet."""
    x = make_input(kind_shapes(kind)[1])
    t = make_quantizer(kind)(x)
    old = t.dequantize()
    r = t.mul_(2)  # pyproject turns a QuantizedFallbackWarning into an error
    assert r is t and type(t) is TENSOR_CLASS[kind]
    # stored as the quantization of 2 * old (2 * old is exact in fp32)
    assert_buffers_equal(t.qstorage.buffers(), reference_buffers(kind, old * 2))
    assert torch.equal(t.dequantize(), brute_dequantize(kind, reference_buffers(kind, old * 2), x.shape,
                                                            torch.float32))


def test_other_inplace_fallback_warns_and_writes_back_quantized(kind):
    x = make_input(kind_shapes(kind)[1])
    t = make_quantizer(kind)(x)
    old = t.dequantize()
    with pytest.warns(QuantizedFallbackWarning, match="abs_"):
        r = t.abs_()
    assert r is t and type(t) is TENSOR_CLASS[kind]
    assert_buffers_equal(t.qstorage.buffers(), reference_buffers(kind, old.abs()))


@pytest.mark.parametrize("kind", ["current_e4m3", "block2d", "mx_rceil"])
def test_out_argument_fallback_writes_back_quantized(kind):
    """`torch.add(a, b, out=t)` mutates t just like an in-place op: the result must land in t."""
    shape = kind_shapes(kind)[0]
    a, b = make_input(shape, seed=1), make_input(shape, seed=2)
    t = make_quantizer(kind)(make_input(shape, seed=3))
    with pytest.warns(QuantizedFallbackWarning):
        torch.add(a, b, out=t)
    assert type(t) is TENSOR_CLASS[kind]
    assert_buffers_equal(t.qstorage.buffers(), reference_buffers(kind, a + b))


# ============================================================================ serialization
def save_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def assert_same_quantizer(got, want):
    assert type(got) is type(want)
    assert got.config() == want.config()
    assert (got.rowwise_usage, got.columnwise_usage, got.internal) == (
        want.rowwise_usage, want.columnwise_usage, want.internal)
    if isinstance(want, Float8Quantizer):
        assert torch.equal(got.scale, want.scale) and torch.equal(got.amax, want.amax)


@pytest.mark.parametrize("container", ["tensor", "storage", "dict"])
@pytest.mark.parametrize("usage", ["row", "col", "both"])
def test_save_load_round_trip(kind, usage, container):
    rowwise, columnwise = USAGES[usage]
    shape = kind_shapes(kind)[1]
    x = make_input(shape, torch.bfloat16)
    q = make_quantizer(kind, rowwise=rowwise, columnwise=columnwise, internal=container == "storage")
    t = q(x)
    if kind.startswith("delayed"):
        assert q.amax.item() > 0  # recorded, so the saved state is not all defaults
    extra = torch.arange(5.0)
    obj = {"q": t, "other": extra, "n": 3} if container == "dict" else t
    loaded = save_load(obj)
    if container == "dict":
        assert loaded["n"] == 3 and torch.equal(loaded["other"], extra)
        loaded = loaded["q"]
    assert type(loaded) is type(t)
    assert loaded.shape == t.shape and loaded.dtype == torch.bfloat16 and loaded.fp8_dtype == t.fp8_dtype
    assert_buffers_equal(storage_of(loaded).buffers(), reference_buffers(kind, x, rowwise=rowwise,
                                                                         columnwise=columnwise))
    assert_same_quantizer(loaded.quantizer, q)
    if kind in ("block1d", "block2d"):
        assert storage_of(loaded).block_scaling_dim == storage_of(t).block_scaling_dim
    if kind in PER_TENSOR and usage == "both":
        st = storage_of(loaded)
        assert st.rowwise_scale_inv is st.columnwise_scale_inv
    assert torch.equal(loaded.dequantize(), t.dequantize())


def test_save_load_keeps_requires_grad_and_detached_quantizer_state():
    amax = torch.zeros(1)
    q = Float8Quantizer(torch.tensor([DELAYED_SCALE]), amax, E4M3)
    p = torch.nn.Parameter(q(make_input((17, 33))))
    loaded = save_load(p)
    assert loaded.requires_grad and type(loaded) is Float8Tensor
    # the loaded quantizer's state is a copy: recording into it leaves the original alone
    before = amax.clone()
    loaded.quantizer(torch.full((2, 2), 1e4))
    assert torch.equal(amax, before) and loaded.quantizer.amax.item() == 1e4


def test_save_load_without_quantizer():
    t = make_quantizer("mx_rceil")(make_input((64, 96)))
    t.update_quantizer(None)
    loaded = save_load(t)
    assert loaded.quantizer is None
    assert_buffers_equal(loaded.qstorage.buffers(), t.qstorage.buffers())


def _plain_state():
    return make_quantizer("block2d")(make_input((130, 257))).qstorage.to_plain()


def _legacy(p):
    """The same state as a checkpoint from before schemes wrote it: storage class, fp8 dtype, block dim."""
    old = {k: v for k, v in p.items() if k != "scheme"}
    return {**old, "storage_class": "Float8BlockwiseTensorStorage", "fp8_dtype": "float8_e4m3fn", "block_scaling_dim": 2}


def test_a_checkpoint_from_before_schemes_loads_with_the_same_value():
    t = make_quantizer("block2d")(make_input((130, 257)))
    loaded = serialization.rebuild_storage(_legacy(t.qstorage.to_plain()))
    assert loaded.scheme == t.qstorage.scheme and isinstance(loaded, type(t.qstorage))
    assert torch.equal(loaded.dequantize(), t.dequantize())


@pytest.mark.parametrize("mutate", [
    lambda p: [p],
    lambda p: {k: v for k, v in p.items() if k != "shape"},
    lambda p: {k: v for k, v in p.items() if k != "scheme"},
    lambda p: {k: v for k, v in p.items() if k != "quantizer"},
    lambda p: {k: v for k, v in p.items() if k != "rowwise_data"},
    lambda p: {k: v for k, v in p.items() if k != "columnwise_scale_inv"},
    lambda p: {**p, "scheme": "NoSuchScheme"},
    lambda p: {**p, "rowwise_data": [1, 2, 3]},
    lambda p: {**p, "columnwise_scale_inv": "abc"},
    lambda p: {**p, "nominal_dtype": "float99"},
    lambda p: {**_legacy(p), "fp8_dtype": 5},
    lambda p: {**p, "nominal_dtype": "Tensor"},
    lambda p: {**p, "shape": "abc"},
    lambda p: {**_legacy(p), "block_scaling_dim": 3},
    lambda p: {**_legacy(p), "storage_class": "NoSuchStorage"},
    lambda p: {**p, "quantizer": {"quantizer_class": "Nope"}},
    lambda p: {**p, "unexpected_key": 1},
    lambda p: {**p, "quantizer": {**p["quantizer"], "fp8_dtype": "float8_no_such_dtype"}},
], ids=["not_dict", "no_shape", "no_scheme", "no_quantizer", "no_rowwise_data", "no_col_scale",
        "unknown_class", "buffer_is_list", "buffer_is_str", "bad_dtype_name", "dtype_not_str",
        "dtype_name_not_dtype", "bad_shape", "bad_block_dim", "unknown_legacy_class", "bad_quantizer", "unexpected_key",
        "quantizer_bad_dtype_name"])
def test_rebuild_storage_malformed(mutate):
    state = mutate(_plain_state())
    with pytest.raises(ValueError):
        serialization.rebuild_storage(state)


class _Malformed:
    """Pickles as a call to rebuild_storage with the given state (what a tampered file holds)."""

    def __init__(self, state):
        self.state = state

    def __reduce__(self):
        return serialization.rebuild_storage, (self.state,)


@pytest.mark.parametrize("drop", ["shape", "scheme", "rowwise_scale_inv", "fp8_dtype"])
def test_load_file_with_malformed_state(drop):
    state = _legacy(_plain_state()) if drop == "fp8_dtype" else _plain_state()
    state = {k: v for k, v in state.items() if k != drop}
    buf = io.BytesIO()
    torch.save({"bad": _Malformed(state)}, buf)
    buf.seek(0)
    with pytest.raises(ValueError, match=drop):
        torch.load(buf, weights_only=True)
    # the well-formed state loads through the same path
    buf = io.BytesIO()
    torch.save({"ok": _Malformed(_plain_state())}, buf)
    buf.seek(0)
    ok = torch.load(buf, weights_only=True)["ok"]
    assert_buffers_equal(ok.buffers(), reference_buffers("block2d", make_input((130, 257))))


# ============================================================================ repr, Parameter
def test_repr(kind):
    t = make_quantizer(kind)(make_input(kind_shapes(kind)[0]))
    cls = TENSOR_CLASS[kind].__name__
    r = repr(t)
    assert r.startswith(cls + "(") and str(kind_fp8_dtype(kind)).removeprefix("torch.float8_").removesuffix("fn") in r
    assert "rowwise" in r
    s = repr(t.qstorage)
    assert type(t.qstorage).__name__ in s and str(tuple(t.shape)) in s
    t.prepare_for_saving()
    assert cls in repr(t) and "emptied" in repr(t)
    st = make_quantizer(kind, internal=True)(make_input(kind_shapes(kind)[0]))
    assert repr(st).startswith(type(st).__name__ + "(")
    assert type(make_quantizer(kind)).__name__ in repr(make_quantizer(kind))


def test_parameter_keeps_class(kind):
    x = make_input(kind_shapes(kind)[0])
    t = make_quantizer(kind)(x)
    with no_warnings():
        p = torch.nn.Parameter(t)
    assert type(p) is TENSOR_CLASS[kind]
    assert isinstance(p, torch.nn.Parameter) and isinstance(p, QuantizedTensor)
    assert p.requires_grad and p.is_leaf
    assert all(getattr(p.qstorage, n) is getattr(t.qstorage, n) for n in FIELDS)
    m = torch.nn.Module()
    m.w = p
    assert [id(a) for a in m.parameters()] == [id(p)]
    p.dequantize().sum().backward()
    assert torch.equal(p.grad, torch.ones(x.shape))
    assert torch.equal(p.dequantize(), brute_dequantize(kind, reference_buffers(kind, x), x.shape,
                                                            torch.float32))


def test_storage_is_not_a_tensor_and_has_nbytes():
    st = make_quantizer("current_e4m3", internal=True)(make_input((16, 32)))
    assert isinstance(st, QuantizedTensorBase) and not isinstance(st, torch.Tensor)
    # 16*32 rowwise bytes + 32*16 columnwise bytes + one shared fp32 scale_inv (counted once)
    assert st.nbytes() == 16 * 32 + 32 * 16 + 4
    mx = make_quantizer("mx_rceil", internal=True)(make_input((64, 96)))
    # 2 * 64*96 data bytes + 64*3 + 2*96 E8M0 scale bytes
    assert mx.nbytes() == 2 * 64 * 96 + 64 * 3 + 2 * 96
