"""Quantizers: buffers equal engine.ops.reference bit for bit, state handling, in-place updates,
validation, autograd transparency and plain-data round trips."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import (
    DELAYED_SCALE, DTYPES, E4M3, E5M2, FIELDS, KINDS, MX, PER_TENSOR, USAGES, assert_buffers_equal, bits,
    expected_layout, kind_fp8_dtype, kind_shapes, make_input, make_quantizer, reference_buffers, storage_of,
)
from engine.ops import reference as ref
from engine.quantizers import (
    Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer, MXFP8Quantizer, Quantizer,
    quantizer_from_plain,
)
from engine.tensors import (
    Float8BlockwiseTensor, Float8BlockwiseTensorStorage, Float8Tensor, Float8TensorStorage, MXFP8Tensor,
    MXFP8TensorStorage, QuantizedFallbackWarning, QuantizedTensorBase,
)

TENSOR_CLASS = {"per_tensor": Float8Tensor, "block": Float8BlockwiseTensor, "mx": MXFP8Tensor}
STORAGE_CLASS = {"per_tensor": Float8TensorStorage, "block": Float8BlockwiseTensorStorage, "mx": MXFP8TensorStorage}


def fam(kind: str) -> str:
    if kind in PER_TENSOR:
        return "per_tensor"
    return "mx" if kind in MX else "block"


def buffers_of(t) -> dict:
    return storage_of(t).buffers()


# ----------------------------------------------------------------------------- buffers vs reference
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("usage", list(USAGES))
@pytest.mark.parametrize("kind", KINDS)
def test_buffers_match_reference_and_layout(kind, usage, dtype):
    rowwise, columnwise = USAGES[usage]
    for i, shape in enumerate(kind_shapes(kind)):
        x = make_input(shape, dtype, seed=i)
        q = make_quantizer(kind, rowwise=rowwise, columnwise=columnwise)
        t = q(x)
        assert type(t) is TENSOR_CLASS[fam(kind)]
        assert t.shape == torch.Size(shape) and t.dtype == dtype and t.fp8_dtype == kind_fp8_dtype(kind)
        assert t.quantizer is q
        st = t.qstorage
        assert st.has_rowwise == rowwise and st.has_columnwise == columnwise
        assert_buffers_equal(st.buffers(), reference_buffers(kind, x, rowwise=rowwise, columnwise=columnwise))
        layout = expected_layout(kind, shape, kind_fp8_dtype(kind), rowwise=rowwise, columnwise=columnwise)
        for name in FIELDS:
            buf = getattr(st, name)
            if layout[name] is None:
                assert buf is None
            else:
                assert (tuple(buf.shape), buf.dtype) == layout[name], name
        if kind in PER_TENSOR and usage == "both":
            # per-tensor schemes keep one scale_inv object for both usages
            assert st.rowwise_scale_inv is st.columnwise_scale_inv


# ----------------------------------------------------------------------------- delayed scaling
def test_float8_quantizer_uses_given_scale_hand_values():
    # scale 2: 1 -> 2, -2 -> -4, 100 -> 200 (tie between E4M3 192 = 1.100b*2^7 and 208 = 1.101b*2^7,
    # RNE picks the even mantissa 192), 1000 -> 2000 saturates to 448. scale_inv = 0.5, so the
    # dequantized values are 1, -2, 96, 224.
    x = torch.tensor([[1.0, -2.0, 100.0, 1000.0]])
    q = Float8Quantizer(torch.tensor([2.0]), torch.zeros(1), E4M3, columnwise=False)
    t = q(x)
    assert t.qstorage.rowwise_data.float().tolist() == [[2.0, -4.0, 192.0, 448.0]]
    assert t.qstorage.rowwise_scale_inv.tolist() == [0.5]
    assert t.dequantize().tolist() == [[1.0, -2.0, 96.0, 224.0]]
    assert q.amax.tolist() == [1000.0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_float8_quantizer_records_amax_into_history_view(dtype):
    hist = torch.zeros(4, 3)
    amax = hist[0, 1:2]
    q = Float8Quantizer(torch.tensor([1.0]), amax, E4M3)
    assert q.amax is amax
    x = torch.zeros(5, 8, dtype=dtype)
    for peak, expected in ((3.0, 3.0), (-2.0, 3.0), (-5.0, 5.0), (4.5, 5.0)):  # max(old amax, |peak|)
        x[2, 3] = peak
        q(x)
        want = torch.zeros(4, 3)
        want[0, 1] = expected
        assert torch.equal(hist, want), (peak, hist)
        assert amax.tolist() == [expected]


def test_float8_quantizer_amax_not_lowered_below_previous_value():
    amax = torch.tensor([7.0])
    q = Float8Quantizer(torch.tensor([1.0]), amax, E4M3)
    q(torch.full((2, 4), 0.5))
    assert amax.tolist() == [7.0]  # max(7, 0.5)


@pytest.mark.parametrize("scale, expected", [(4.0, 0.25), (0.25, 4.0), (DELAYED_SCALE, None)])
def test_float8_quantizer_scale_inv_is_reciprocal(scale, expected):
    if expected is None:  # 1/3 rounded to fp32 by an fp32 division
        expected = (torch.tensor([1.0]) / torch.tensor([scale])).item()
    q = Float8Quantizer(torch.tensor([scale]), torch.zeros(1), E4M3)
    st = q(make_input((8, 16))).qstorage
    assert st.rowwise_scale_inv.dtype == torch.float32
    assert st.rowwise_scale_inv.tolist() == [expected]
    assert st.columnwise_scale_inv.tolist() == [expected]


def test_float8_quantizer_later_scale_change_does_not_touch_existing_tensor():
    scale = torch.tensor([2.0])
    q = Float8Quantizer(scale, torch.zeros(1), E4M3)
    x = make_input((16, 32))
    t = q(x)
    before = t.dequantize().clone()
    scale.fill_(8.0)  # the recipe updates the scale in place
    assert t.qstorage.rowwise_scale_inv.tolist() == [0.5]
    assert t.qstorage.columnwise_scale_inv.tolist() == [0.5]
    assert torch.equal(t.dequantize(), before)
    t2 = q(x)  # the next quantization reads the new scale
    assert t2.qstorage.rowwise_scale_inv.tolist() == [0.125]
    assert torch.equal(bits(t2.qstorage.rowwise_data), bits(ref.quantize_per_tensor(x, torch.tensor([8.0]), E4M3)))


# ----------------------------------------------------------------------------- current scaling options
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=str)
def test_current_scaling_force_pow_2_scales(fp8_dtype):
    x = torch.zeros(4, 8)
    x[1, 2] = -3.0  # amax 3
    fmax = 448.0 if fp8_dtype == E4M3 else 57344.0
    # power of 2: 448/3 = 149.3 -> 128 (E4M3); 57344/3 = 19114.7 -> 16384 (E5M2); scale_inv is its inverse
    pow2 = 128.0 if fp8_dtype == E4M3 else 16384.0
    t = Float8CurrentScalingQuantizer(fp8_dtype, force_pow_2_scales=True)(x)
    assert t.qstorage.rowwise_scale_inv.tolist() == [1.0 / pow2]
    # -3 * 128 = -384 = -1.1b*2^8 (E4M3) and -3 * 16384 = -1.1b*2^15 (E5M2) are exact
    assert t.dequantize()[1, 2].item() == -3.0
    # without: scale = fmax / 3 in fp32, scale_inv = 1 / scale in fp32
    t = Float8CurrentScalingQuantizer(fp8_dtype, force_pow_2_scales=False)(x)
    want = (torch.tensor([1.0]) / (torch.tensor([fmax]) / torch.tensor([3.0]))).item()
    assert t.qstorage.rowwise_scale_inv.tolist() == [want]
    assert want != 1.0 / pow2


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=str)
def test_current_scaling_amax_epsilon(fp8_dtype):
    x = torch.full((4, 8), 1e-6)
    fmax = 448.0 if fp8_dtype == E4M3 else 57344.0
    # amax 1e-6 < eps 1.0, so the amax used is 1: scale = fmax, scale_inv = 1/fmax (fp32)
    t = Float8CurrentScalingQuantizer(fp8_dtype, amax_epsilon=1.0)(x)
    want = (torch.tensor([1.0]) / torch.tensor([fmax])).item()
    assert t.qstorage.rowwise_scale_inv.tolist() == [want]
    data, sinv, _ = ref.quantize_current_scaling(x, fp8_dtype, amax_epsilon=1.0)
    assert torch.equal(bits(t.qstorage.rowwise_data), bits(data))
    # epsilon below the amax changes nothing
    t0 = Float8CurrentScalingQuantizer(fp8_dtype, amax_epsilon=1e-9)(x)
    t1 = Float8CurrentScalingQuantizer(fp8_dtype)(x)
    assert torch.equal(bits(t0.qstorage.rowwise_scale_inv), bits(t1.qstorage.rowwise_scale_inv))


@pytest.mark.parametrize("dim", [1, 2])
def test_block_quantizer_options_reach_reference(dim):
    x = make_input((130, 257))
    fn = ref.quantize_block_1d if dim == 1 else ref.quantize_block_2d
    # make_input's values stay below 2^8 * 5, so an epsilon of 1e4 replaces every tile's amax
    for opts in ({"force_pow_2_scales": False}, {"amax_epsilon": 4.0}, {"amax_epsilon": 1e4},
                 {"force_pow_2_scales": False, "amax_epsilon": 1.0}):
        t = Float8BlockQuantizer(E4M3, block_scaling_dim=dim, **opts)(x)
        d, s = fn(x, E4M3, **opts)
        dc, sc = fn(x, E4M3, columnwise=True, **opts)
        assert_buffers_equal(t.qstorage.buffers(), {"rowwise_data": d.reshape(x.shape), "rowwise_scale_inv": s,
                                                    "columnwise_data": dc, "columnwise_scale_inv": sc})
    # the options change the result (so the comparison above is not vacuous)
    a = Float8BlockQuantizer(E4M3, block_scaling_dim=dim, force_pow_2_scales=False)(x).qstorage.rowwise_scale_inv
    b = Float8BlockQuantizer(E4M3, block_scaling_dim=dim)(x).qstorage.rowwise_scale_inv
    assert not torch.equal(a, b)
    # eps 1e4 > every tile amax: every tile's scale is 448 / 1e4 = 0.0448 rounded down to 2^-5 = 0.03125,
    # so every scale_inv is 32
    c = Float8BlockQuantizer(E4M3, block_scaling_dim=dim, amax_epsilon=1e4)(x).qstorage.rowwise_scale_inv
    assert torch.equal(c, torch.full_like(c, 32.0))


# ----------------------------------------------------------------------------- autograd
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quantize_is_autograd_transparent(kind, dtype):
    x = make_input(kind_shapes(kind)[0], dtype).requires_grad_(True)
    t = make_quantizer(kind)(x)
    assert t.requires_grad
    t.dequantize().sum().backward()
    assert x.grad.dtype == dtype
    assert torch.equal(x.grad, torch.ones_like(x))


def test_gradient_through_fallback_op(kind):
    x = make_input(kind_shapes(kind)[0]).requires_grad_(True)
    q = make_quantizer(kind)
    with pytest.warns(QuantizedFallbackWarning):
        loss = (q(x) * 2).sum()
    loss.backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))  # d(sum(2 x))/dx = 2


def test_quantize_without_grad_gives_no_grad(kind):
    t = make_quantizer(kind)(make_input(kind_shapes(kind)[0]))
    assert not t.requires_grad and t.grad_fn is None


# ----------------------------------------------------------------------------- internal
def test_internal_returns_storage(kind):
    shape = kind_shapes(kind)[1]
    x = make_input(shape)
    s = make_quantizer(kind, internal=True)(x)
    assert isinstance(s, QuantizedTensorBase) and not isinstance(s, torch.Tensor)
    assert type(s) is STORAGE_CLASS[fam(kind)]
    assert s.shape == torch.Size(shape) and s.dtype == torch.float32
    assert_buffers_equal(s.buffers(), reference_buffers(kind, x))
    e = make_quantizer(kind, internal=True).make_empty(shape)
    assert type(e) is STORAGE_CLASS[fam(kind)]


def test_internal_storage_even_when_input_requires_grad(kind):
    x = make_input(kind_shapes(kind)[0]).requires_grad_(True)
    s = make_quantizer(kind, internal=True)(x)
    assert isinstance(s, QuantizedTensorBase) and not isinstance(s, torch.Tensor)
    assert_buffers_equal(s.buffers(), reference_buffers(kind, x.detach()))


# ----------------------------------------------------------------------------- in-place updates
def _ptrs(t) -> dict:
    return {n: (None if b is None else b.data_ptr()) for n, b in buffers_of(t).items()}


@pytest.mark.parametrize("internal", [False, True])
@pytest.mark.parametrize("via", ["out", "update_quantized"])
def test_quantize_into_existing_buffers(kind, via, internal):
    shape = kind_shapes(kind)[1]
    q = make_quantizer(kind, internal=internal)
    x1, x2 = make_input(shape, seed=1), make_input(shape, seed=2) * 3
    t = q(x1)
    ptrs = _ptrs(t)
    ids = {n: id(b) for n, b in buffers_of(t).items()}
    r = q.quantize(x2, out=t) if via == "out" else q.update_quantized(x2, t)
    assert r is t
    assert _ptrs(t) == ptrs
    assert {n: id(b) for n, b in buffers_of(t).items()} == ids
    assert_buffers_equal(buffers_of(t), reference_buffers(kind, x2))
    assert not torch.equal(bits(buffers_of(t)["rowwise_data"]), bits(reference_buffers(kind, x1)["rowwise_data"]))


def test_update_quantized_noop_flag(kind):
    shape = kind_shapes(kind)[0]
    q = make_quantizer(kind)
    x1, x2 = make_input(shape, seed=1), make_input(shape, seed=2) * 5
    t = q(x1)
    before = {n: b.clone() for n, b in buffers_of(t).items()}
    assert q.update_quantized(x2, t, noop_flag=torch.tensor([1.0])) is t
    assert_buffers_equal(buffers_of(t), before)
    assert_buffers_equal(buffers_of(t), reference_buffers(kind, x1))
    assert q.update_quantized(x2, t, noop_flag=torch.tensor([0.0])) is t
    assert_buffers_equal(buffers_of(t), reference_buffers(kind, x2))


def test_update_quantized_noop_flag_leaves_delayed_amax_alone():
    amax = torch.zeros(1)
    q = Float8Quantizer(torch.tensor([1.0]), amax, E4M3)
    t = q(torch.ones(4, 4))
    q.update_quantized(torch.full((4, 4), 9.0), t, noop_flag=torch.tensor([1.0]))
    assert amax.tolist() == [1.0]
    q.update_quantized(torch.full((4, 4), 9.0), t, noop_flag=torch.tensor([0.0]))
    assert amax.tolist() == [9.0]


def test_update_quantized_shape_mismatch(kind):
    shape = kind_shapes(kind)[0]
    q = make_quantizer(kind)
    t = q(make_input(shape))
    wrong = make_input((shape[0] * 2,) + tuple(shape[1:]))
    with pytest.raises(ValueError, match="src"):
        q.update_quantized(wrong, t)
    with pytest.raises(ValueError, match="src"):
        q.quantize(wrong, out=t)


def test_update_quantized_wrong_destination_kind(kind):
    shape = (64, 128)
    q = make_quantizer(kind)
    x = make_input(shape)
    other_kind = "mx_rceil" if fam(kind) != "mx" else "current_e4m3"
    with pytest.raises(TypeError, match="dst"):
        q.update_quantized(x, make_quantizer(other_kind)(x))
    with pytest.raises(TypeError, match="dst"):
        q.update_quantized(x, torch.zeros(shape))


@pytest.mark.parametrize("src_kind, dst_kind", [("current_e5m2", "current_e4m3"), ("block2d", "block1d"),
                                                ("block1d", "block2d")])
def test_update_quantized_into_tensor_made_with_other_settings(src_kind, dst_kind):
    """The storage class accepts any quantizer of its scheme; the result must then read correctly.

    Expected: dst afterwards equals a fresh quantization by the quantizer used (values and fp8_dtype).
    """
    x = make_input((130, 257))
    dst = make_quantizer(dst_kind)(x)
    q = make_quantizer(src_kind)
    q.update_quantized(x, dst)
    fresh = q(x)
    assert dst.qstorage.rowwise_data.dtype == fresh.fp8_dtype
    assert dst.fp8_dtype == fresh.fp8_dtype
    assert torch.equal(dst.dequantize(), fresh.dequantize())


# ----------------------------------------------------------------------------- make_empty / usages / copy
@pytest.mark.parametrize("usage", list(USAGES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_make_empty(kind, usage, dtype):
    rowwise, columnwise = USAGES[usage]
    q = make_quantizer(kind, rowwise=rowwise, columnwise=columnwise)
    for shape in kind_shapes(kind):
        t = q.make_empty(shape, dtype=dtype, device="cpu")
        assert type(t) is TENSOR_CLASS[fam(kind)]
        assert t.shape == torch.Size(shape) and t.dtype == dtype and t.device == torch.device("cpu")
        assert t.quantizer is q and not t.requires_grad
        layout = expected_layout(kind, shape, kind_fp8_dtype(kind), rowwise=rowwise, columnwise=columnwise)
        for name, buf in t.qstorage.buffers().items():
            if layout[name] is None:
                assert buf is None, name
            else:
                assert (tuple(buf.shape), buf.dtype, buf.device) == (*layout[name], torch.device("cpu")), name
        if kind in PER_TENSOR and usage == "both":  # one scale_inv object for both usages
            assert t.qstorage.rowwise_scale_inv is t.qstorage.columnwise_scale_inv
    assert q.make_empty(kind_shapes(kind)[0], requires_grad=True).requires_grad


def test_make_empty_then_fill_matches_reference(kind):
    shape = kind_shapes(kind)[1]
    q = make_quantizer(kind)
    t = q.make_empty(shape)
    x = make_input(shape)
    q.quantize(x, out=t)
    assert_buffers_equal(t.qstorage.buffers(), reference_buffers(kind, x))


def test_make_empty_mx_partial_blocks_have_ceil_scale_shapes():
    t = MXFP8Quantizer(E4M3).make_empty((40, 48))
    assert t.qstorage.rowwise_scale_inv.shape == (40, 2) and t.qstorage.columnwise_scale_inv.shape == (2, 48)


def test_set_usage(kind):
    shape = kind_shapes(kind)[0]
    x = make_input(shape)
    q = make_quantizer(kind)
    q.set_usage(rowwise=False)
    assert (q.rowwise_usage, q.columnwise_usage) == (False, True)
    assert_buffers_equal(q(x).qstorage.buffers(), reference_buffers(kind, x, rowwise=False, columnwise=True))
    q.set_usage(rowwise=True, columnwise=False)
    assert (q.rowwise_usage, q.columnwise_usage) == (True, False)
    assert_buffers_equal(q(x).qstorage.buffers(), reference_buffers(kind, x, rowwise=True, columnwise=False))
    q.set_usage()  # None leaves both as they are
    assert (q.rowwise_usage, q.columnwise_usage) == (True, False)
    with pytest.raises(TypeError, match="columnwise"):
        q.set_usage(columnwise=1)


def test_copy_shares_delayed_state_but_not_usages():
    hist = torch.zeros(2, 2)
    scale = torch.tensor([2.0])
    q = Float8Quantizer(scale, hist[0, 0:1], E5M2)
    c = q.copy()
    assert type(c) is Float8Quantizer and c is not q
    assert c.scale is q.scale and c.amax is q.amax
    c.set_usage(rowwise=False)
    assert (q.rowwise_usage, q.columnwise_usage) == (True, True)
    assert (c.rowwise_usage, c.columnwise_usage) == (False, True)
    c(torch.full((4, 4), -6.0))
    assert hist[0, 0].item() == 6.0  # recorded through the shared amax view
    scale.fill_(4.0)
    assert c(torch.ones(4, 4)).qstorage.columnwise_scale_inv.tolist() == [0.25]


def test_copy_has_equal_config_and_own_usages(kind):
    q = make_quantizer(kind)
    c = q.copy()
    assert type(c) is type(q) and c.config() == q.config()
    c.set_usage(columnwise=False)
    assert q.columnwise_usage is True and c.columnwise_usage is False
    x = make_input(kind_shapes(kind)[0])
    assert_buffers_equal(c(x).qstorage.buffers(), reference_buffers(kind, x, columnwise=False))


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("ctor", [
    lambda dt: Float8Quantizer(torch.ones(1), torch.zeros(1), dt),
    lambda dt: Float8CurrentScalingQuantizer(dt),
    lambda dt: Float8BlockQuantizer(dt),
    lambda dt: MXFP8Quantizer(dt),
], ids=["delayed", "current", "block", "mx"])
@pytest.mark.parametrize("bad", [torch.float16, torch.float32, torch.float8_e8m0fnu, "float8_e4m3fn"], ids=str)
def test_wrong_fp8_dtype(ctor, bad):
    with pytest.raises(TypeError, match="fp8_dtype"):
        ctor(bad)


@pytest.mark.parametrize("cls", [Float8CurrentScalingQuantizer, Float8BlockQuantizer])
@pytest.mark.parametrize("eps", [-1.0, -1e-12, float("nan"), float("inf"), "0.1", None], ids=str)
def test_bad_amax_epsilon(cls, eps):
    with pytest.raises(ValueError, match="amax_epsilon"):
        cls(E4M3, amax_epsilon=eps)


@pytest.mark.parametrize("dim", [3, 0, True, "2"], ids=str)
def test_bad_block_scaling_dim(dim):
    with pytest.raises(ValueError, match="block_scaling_dim"):
        Float8BlockQuantizer(E4M3, block_scaling_dim=dim)


def test_bad_scale_mode():
    with pytest.raises(ValueError, match="scale_mode"):
        MXFP8Quantizer(E4M3, scale_mode="nearest")


@pytest.mark.parametrize("field", ["scale", "amax"])
@pytest.mark.parametrize("bad", [
    torch.ones(2), torch.ones(1, dtype=torch.float64), torch.ones(1, dtype=torch.bfloat16), 1.0, torch.ones(0),
], ids=["two_elements", "float64", "bf16", "python_float", "empty"])
def test_bad_scale_or_amax(field, bad):
    args = {"scale": torch.ones(1), "amax": torch.zeros(1), field: bad}
    with pytest.raises(TypeError, match=field):
        Float8Quantizer(args["scale"], args["amax"], E4M3)


@pytest.mark.parametrize("bad_dtype", [torch.int32, torch.float64, torch.int8, torch.float8_e4m3fn], ids=str)
def test_bad_input_dtype(kind, bad_dtype):
    x = torch.ones(64, 128).to(bad_dtype)
    with pytest.raises(TypeError, match="dtype"):
        make_quantizer(kind)(x)
    with pytest.raises(TypeError, match="dtype"):
        make_quantizer(kind, internal=True)(x)


@pytest.mark.parametrize("internal", [True, False])
def test_non_tensor_input(internal):
    # ref.check_input's contract: "x: expected a torch.Tensor, got list" as a TypeError
    with pytest.raises(TypeError, match="torch.Tensor"):
        Float8CurrentScalingQuantizer(E4M3, internal=internal)([[1.0, 2.0]])


@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("shape", [(64, 48), (48, 64), (3, 8, 40), (1, 5)])
def test_mx_partial_blocks_quantize_like_zero_padding(mode, shape):
    """A dim that is not a multiple of 32 ends in a partial block: the result is that of zero padding."""
    x = make_input(shape)
    t = MXFP8Quantizer(E4M3, scale_mode=mode)(x)
    m, k = math.prod(shape[:-1]), shape[-1]
    mp, kp = -(-m // 32) * 32, -(-k // 32) * 32
    padded = torch.zeros(mp, kp)
    padded[:m, :k] = x.reshape(m, k)
    row_data, row_codes = ref.quantize_mxfp8(padded, E4M3, scale_mode=mode)
    col_data, col_codes = ref.quantize_mxfp8(padded, E4M3, scale_mode=mode, columnwise=True)
    st = t.qstorage
    assert torch.equal(bits(st.rowwise_data.reshape(m, k)), bits(row_data[:m, :k]))
    assert torch.equal(st.rowwise_scale_inv, row_codes[:m])
    assert torch.equal(bits(st.columnwise_data.reshape(m, k)), bits(col_data[:m, :k]))
    assert torch.equal(st.columnwise_scale_inv, col_codes[:, :k])
    assert torch.equal(t.dequantize(), ref.dequantize_mxfp8(row_data, row_codes, dtype=torch.float32)[:m, :k]
                       .reshape(shape))


def test_both_usages_off(kind):
    x = make_input(kind_shapes(kind)[0])
    q = make_quantizer(kind, rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match="usage"):
        q(x)
    q = make_quantizer(kind)
    q.set_usage(rowwise=False, columnwise=False)
    with pytest.raises(ValueError, match="usage"):
        q(x)


@pytest.mark.parametrize("arg", ["rowwise", "columnwise", "internal"])
def test_usage_flags_must_be_bool(arg):
    with pytest.raises(TypeError, match=arg):
        Float8CurrentScalingQuantizer(E4M3, **{arg: 1})


def test_quantizer_is_abstract():
    with pytest.raises(TypeError):
        Quantizer()


# ----------------------------------------------------------------------------- plain data round trip
@pytest.mark.parametrize("usage", list(USAGES))
@pytest.mark.parametrize("internal", [False, True])
def test_quantizer_from_plain_round_trip(kind, usage, internal):
    rowwise, columnwise = USAGES[usage]
    q = make_quantizer(kind, rowwise=rowwise, columnwise=columnwise, internal=internal)
    if kind.startswith("delayed"):
        q.amax.fill_(5.0)
    plain = q.to_plain()
    for key, value in plain.items():  # plain data only: what torch.load(weights_only=True) accepts
        assert isinstance(value, (str, int, float, bool, torch.Tensor)), (key, type(value))
    r = quantizer_from_plain(plain)
    assert type(r) is type(q)
    assert r.config() == q.config()
    assert (r.rowwise_usage, r.columnwise_usage, r.internal) == (rowwise, columnwise, internal)
    assert r.fp8_dtype == q.fp8_dtype
    if kind.startswith("delayed"):
        assert r.scale.tolist() == [DELAYED_SCALE] and r.amax.tolist() == [5.0]
        assert r.scale.dtype == torch.float32 and r.amax.dtype == torch.float32
    x = make_input(kind_shapes(kind)[0])
    assert_buffers_equal(storage_of(r(x)).buffers(), storage_of(q(x)).buffers())


def test_quantizer_from_plain_keeps_non_default_options():
    for q in (Float8CurrentScalingQuantizer(E5M2, force_pow_2_scales=True, amax_epsilon=0.5),
              Float8BlockQuantizer(E4M3, block_scaling_dim=2, force_pow_2_scales=False, amax_epsilon=2.0),
              MXFP8Quantizer(E5M2, scale_mode="floor")):
        r = quantizer_from_plain(q.to_plain())
        assert r.config() == q.config()
        x = make_input((64, 256))
        assert_buffers_equal(r(x).qstorage.buffers(), q(x).qstorage.buffers())


def _valid_plain():
    return Float8CurrentScalingQuantizer(E4M3).to_plain()


@pytest.mark.parametrize("mutate", [
    lambda p: "not a dict",
    lambda p: None,
    lambda p: {k: v for k, v in p.items() if k != "quantizer_class"},
    lambda p: {**p, "quantizer_class": "NoSuchQuantizer"},
    lambda p: {**p, "quantizer_class": "Quantizer"},
    lambda p: {k: v for k, v in p.items() if k != "fp8_dtype"},
    lambda p: {**p, "unknown_option": 1},
    lambda p: {**p, "amax_epsilon": -1.0},
    lambda p: {**p, "fp8_dtype": "float16"},
    lambda p: {**p, "fp8_dtype": 7},
    lambda p: {**p, "rowwise": "yes"},
    lambda p: {**p, "fp8_dtype": "float8_no_such_dtype"},
    lambda p: {"quantizer_class": "Float8Quantizer", "fp8_dtype": "float8_e4m3fn", "scale": [1.0],
               "amax": torch.zeros(1)},
    lambda p: {"quantizer_class": "MXFP8Quantizer", "fp8_dtype": "float8_e4m3fn", "scale_mode": "nearest"},
    lambda p: {"quantizer_class": "Float8BlockQuantizer", "fp8_dtype": "float8_e4m3fn", "block_scaling_dim": 3},
], ids=["str", "none", "no_class", "unknown_class", "abstract_base", "no_fp8_dtype", "unknown_key",
        "negative_eps", "non_fp8_dtype", "dtype_not_str", "usage_not_bool", "unknown_dtype_name",
        "scale_not_tensor", "bad_scale_mode", "bad_block_dim"])
def test_quantizer_from_plain_malformed(mutate):
    with pytest.raises(ValueError):
        quantizer_from_plain(mutate(_valid_plain()))
