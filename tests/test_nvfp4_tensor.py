"""NVFP4Quantizer / NVFP4Tensor: schemes, buffers against the brute force, usages, saving, checkpoints and the GEMM
against an fp64 reference."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

import nvfp4_brute as brute
from engine.gemm import general_gemm
from engine.quantizers import NVFP4Quantizer, quantizer_from_plain
from engine.schemes import SCHEMES, ScaleEncoding
from engine.tensors import NVFP4Tensor, NVFP4TensorStorage

E2M1 = np.array(brute.E2M1_GRID + [-v for v in brute.E2M1_GRID])


def values64(data: torch.Tensor, scales: torch.Tensor, amax: torch.Tensor, cols: int) -> np.ndarray:
    """fp64 values of packed codes [rows, ceil(cols/2)], per-row E4M3 scales and an amax (independent decode)."""
    d = data.numpy()
    codes = np.stack([d & 15, d >> 4], -1).reshape(d.shape[0], -1)[:, :cols]
    s = np.repeat(scales.float().double().numpy(), 16, axis=1)[:, :cols]
    return E2M1[codes] * s * float(amax) / 2688.0


def test_schemes():
    s = SCHEMES["nvfp4_e2m1"]
    assert s.scale is ScaleEncoding.E4M3 and s.scale.dtype == torch.float8_e4m3fn and not s.scale.is_pow2
    assert s.data_shape((3, 40, 33), False) == (3, 40, 17) and s.data_shape((3, 40, 33), True) == (33, 60)
    assert s.scale_shape((3, 40, 33), False) == (120, 3) and s.scale_shape((3, 40, 33), True) == (33, 8)
    assert not s.derivable and SCHEMES["nvfp4_rht_e2m1"].layout == "nvfp4_rht"


@pytest.mark.parametrize("shape", [(2, 24, 40), (17, 33)])
def test_quantizer_buffers_and_dequantize(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    t = NVFP4Quantizer()(x)
    assert isinstance(t, NVFP4Tensor) and isinstance(t.qstorage, NVFP4TensorStorage) and t.dtype == torch.bfloat16
    st = t.qstorage
    x2 = x.float().reshape(-1, shape[-1]).numpy()
    for data, scales, view in ((st.rowwise_data, st.rowwise_scale_inv, x2), (st.columnwise_data,
                                                                            st.columnwise_scale_inv, x2.T.copy())):
        want_data, want_scales = brute.quantize_rows(view, brute.amax_of(view))
        assert np.array_equal(data.reshape(view.shape[0], -1).numpy(), want_data)
        assert np.array_equal(scales.view(torch.uint8).numpy(), want_scales)
    assert st.amax_rowwise.item() == np.abs(x2).max() == st.amax_columnwise.item()
    want = values64(st.rowwise_data.reshape(x2.shape[0], -1), st.rowwise_scale_inv, st.amax_rowwise, shape[-1])
    got = t.dequantize(dtype=torch.float32).reshape(x2.shape).numpy()
    assert np.allclose(got, want, rtol=2**-23, atol=0)
    assert t.dequantize().dtype == torch.bfloat16 and t.dequantize(dtype=torch.float16).dtype == torch.float16
    st.update_usage(rowwise_usage=False)  # from the columnwise copy alone
    assert st.amax_rowwise is None and np.allclose(t.dequantize(dtype=torch.float32).reshape(x2.shape).numpy(),
                                                  values64(st.columnwise_data, st.columnwise_scale_inv,
                                                           st.amax_columnwise, x2.shape[0]).T, rtol=2**-23, atol=0)
    with pytest.raises(ValueError, match="cannot be derived"):
        st.update_usage(rowwise_usage=True)


def test_rht_tensor_dequantizes_to_x_up_to_quantization():
    x = torch.randn(32, 48, generator=torch.Generator().manual_seed(1))
    t = NVFP4Quantizer(with_rht=True, rowwise=False)(x)
    assert t.scheme.name == "nvfp4_rht_e2m1"
    err = (t.dequantize(dtype=torch.float32) - x).abs()
    assert err.max() < 0.35 * x.abs().max()  # RHT undone: x, not its transform (that differs by O(|x|))
    with pytest.raises(ValueError, match="multiple of 16"):
        NVFP4Quantizer(with_rht=True)(torch.randn(20, 16))
    with pytest.raises(ValueError, match="never both"):
        NVFP4Quantizer(with_rht=True, with_2d_quantization=True)


def test_save_restore_and_checkpoint():
    q = NVFP4Quantizer(stochastic_rounding=True, rng_counter=torch.tensor([5, 0]))
    x = torch.randn(16, 32)
    t = q(x)
    assert q.rule.rng_counter.tolist() == [5, 2 * 16 * 32]  # both usages drew their bits
    want = t.dequantize(dtype=torch.float32)
    st = t.qstorage
    tensors, _ = st.prepare_for_saving()
    assert len(tensors) == 6 and st.amax_rowwise is None
    assert st.restore_from_saved(tensors + ["extra"]) == ["extra"]
    assert torch.equal(t.dequantize(dtype=torch.float32), want)
    buf = io.BytesIO()
    torch.save({"w": t}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["w"]
    assert isinstance(loaded, NVFP4Tensor) and torch.equal(loaded.dequantize(dtype=torch.float32), want)
    assert torch.equal(loaded.qstorage.amax_columnwise, st.amax_columnwise)
    assert loaded.qstorage.quantizer.config() == q.config()
    plain = st.to_plain()
    plain["amax_rowwise"] = torch.tensor([-1.0])
    from engine.tensors import rebuild_storage
    with pytest.raises(ValueError, match="amax_rowwise"):
        rebuild_storage(plain)
    plain["amax_rowwise"] = torch.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match="amax_rowwise"):
        rebuild_storage(plain)
    again = quantizer_from_plain(q.to_plain())
    assert isinstance(again, NVFP4Quantizer) and again.config() == q.config()


def test_copy_carries_the_amax():
    a, b = NVFP4Quantizer()(torch.randn(16, 16)), NVFP4Quantizer()(torch.randn(16, 16) * 100)
    a.copy_(b)
    assert torch.equal(a.dequantize(), b.dequantize())


def fp64_gemm_bound(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    # fp32 accumulation of exact products (K terms) and two roundings of the scale
    return (np.abs(a) @ np.abs(b).T) * (a.shape[1] * 2.0**-24 + 4 * 2.0**-24)


@pytest.mark.parametrize("scale", [1.0, 1e-18, 3e15])
def test_gemm_fprop_and_wgrad_against_fp64(scale):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(48, 64, generator=g) * scale
    w = torch.randn(40, 64, generator=g) * scale
    dy = torch.randn(48, 40, generator=g)
    qx, qw = NVFP4Quantizer(with_rht=True)(x), NVFP4Quantizer(with_2d_quantization=True)(w)
    qdy = NVFP4Quantizer(with_rht=True, stochastic_rounding=True)(dy)
    for lhs, rhs, lt, rt, m, n, k in ((qx, qw, False, False, 48, 40, 64),  # fprop: x @ w^T
                                      (qdy, qx, True, True, 40, 64, 48)):  # wgrad: dy^T @ x (RHT'd columnwise)
        a_st, b_st = lhs.qstorage, rhs.qstorage
        if lt:
            a = values64(a_st.columnwise_data, a_st.columnwise_scale_inv, a_st.amax_columnwise, k)
            b = values64(b_st.columnwise_data, b_st.columnwise_scale_inv, b_st.amax_columnwise, k)
        else:
            a = values64(a_st.rowwise_data, a_st.rowwise_scale_inv, a_st.amax_rowwise, k)
            b = values64(b_st.rowwise_data, b_st.rowwise_scale_inv, b_st.amax_rowwise, k)
        want = a @ b.T
        got = general_gemm(lhs, rhs, a_transposed=lt, b_transposed=rt, out_dtype=torch.float32)
        assert got.shape == (m, n)
        err = np.abs(got.double().numpy() - want)
        assert (err <= fp64_gemm_bound(a, b) + 1e-300).all(), err.max()
        assert np.abs(want).max() > 0
        bf = general_gemm(lhs, rhs, a_transposed=lt, b_transposed=rt, out_dtype=torch.bfloat16)
        assert torch.equal(bf, got.to(torch.bfloat16))
    # the RHT leaves the wgrad unchanged up to quantization: close to the plain product
    wgrad = general_gemm(qdy, qx, a_transposed=True, b_transposed=True, out_dtype=torch.float32)
    exact = dy.t().double() @ x.double()
    assert (wgrad.double() - exact).norm() < 0.25 * exact.norm()
