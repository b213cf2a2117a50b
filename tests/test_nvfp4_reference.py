"""NVFP4 reference (engine/ops/nvfp4.py) against the per-element brute force of tests/nvfp4_brute.py,
and the random Hadamard transform."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nvfp4_brute as brute
from engine.ops import nvfp4
from engine.ops import reference as ref

SHAPES = [(32, 48), (5, 37), (33, 16), (1, 7), (17, 33)]


def edge_tensor() -> torch.Tensor:
    """Rows of 16: zero block, ties at S_enc = 1, one outlier per block, subnormal and zero block scales, +-max."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -2.5, -5.0, 6.0, -6.0, 0.0, -0.0, 2688.0 / 448 * 0]
    rows = [
        [0.0] * 16,
        ties,
        [2688.0] + [0.0] * 15,  # amax 2688: S_enc = 1, so the ties row scales by exactly 1
        [0.01 * (i + 1) for i in range(15)] + [100.0],  # one outlier
        [0.03 * (-1) ** i for i in range(16)],  # s_b = 0.03 * 448/2688 * 6 / 6 -> subnormal E4M3
        [1e-4 * (i + 1) for i in range(16)],  # s_b rounds to 0: enc FLT_MAX, codes saturate, value 0
        [1e-30, -1e-30] * 8,
        [2688.0, -448.0] + [7.0] * 14,
    ]
    return torch.tensor(rows, dtype=torch.float32)


def mx_unpacked(data: torch.Tensor) -> torch.Tensor:
    return torch.stack((data & 15, data >> 4), -1).reshape(data.shape[0], -1)


def check(x: torch.Tensor, tile_rows: int = 1) -> None:
    x32 = x.float()
    a = ref.amax(x32)
    data, scales = nvfp4.quantize_2d(x32, a, tile_rows=tile_rows)
    xn = x32.numpy()
    want_data, want_scales = brute.quantize_rows(xn, brute.amax_of(xn), tile_rows)
    assert np.array_equal(scales.view(torch.uint8).numpy(), want_scales)
    assert np.array_equal(data.numpy(), want_data)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rowwise_columnwise_2d_match_brute_force(shape, dtype):
    g = torch.Generator().manual_seed(hash(shape) % 1000)
    x = (torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 3)).to(dtype)
    out = nvfp4.quantize(x, rowwise=True, columnwise=True)
    xn = x.float().numpy()
    for data, scales, view in ((out["rowwise_data"], out["rowwise_scale_inv"], xn),
                               (out["columnwise_data"], out["columnwise_scale_inv"], xn.T.copy())):
        want_data, want_scales = brute.quantize_rows(view, brute.amax_of(view))
        assert np.array_equal(scales.view(torch.uint8).numpy(), want_scales)
        assert np.array_equal(data.numpy(), want_data)
    two = nvfp4.quantize(x, rowwise=True, columnwise=True, two_d=True)
    want_data, want_scales = brute.quantize_rows(xn, brute.amax_of(xn), 16)
    assert np.array_equal(two["rowwise_scale_inv"].view(torch.uint8).numpy(), want_scales)
    assert np.array_equal(two["rowwise_data"].numpy(), want_data)
    # 16x16 tiles: the columnwise copy is the rowwise one transposed
    m, k = x.shape
    row_vals = nvfp4.dequantize_2d(two["rowwise_data"], two["rowwise_scale_inv"], two["amax_rowwise"], k)
    col_vals = nvfp4.dequantize_2d(two["columnwise_data"], two["columnwise_scale_inv"], two["amax_columnwise"], m)
    assert torch.equal(row_vals, col_vals.t())


@pytest.mark.parametrize("tile_rows", [1, 16])
def test_edge_cases_match_brute_force(tile_rows):
    x = edge_tensor()
    check(x, tile_rows)
    check(torch.cat([x, -x]), tile_rows)
    check(torch.cat([x, torch.full((1, 16), 3.4e38), torch.full((1, 16), -3.4e38)]), tile_rows)  # +-fp32 max
    check(x[:4, :7] * 1e-40, tile_rows)  # subnormal fp32 inputs
    codes = mx_unpacked(nvfp4.quantize_2d(x, ref.amax(x), tile_rows=tile_rows)[0])
    if tile_rows == 1:  # S_enc = 1 and s_b = 1: the ties row hits every midpoint; even codes win
        assert codes[1, :11].tolist() == [0, 2, 2, 4, 4, 6, 6, 8, 10, 12, 14]
    scales = nvfp4.quantize_2d(x, ref.amax(x))[1].view(torch.uint8)
    assert (scales[4] > 0).all() and (scales[4] < 8).all()  # subnormal E4M3 block scales occur
    assert (scales[5] == 0).all()  # and zero ones


def test_non_finite():
    x = edge_tensor()
    x[3, 2] = float("inf")
    check(x)
    d = nvfp4.quantize(x, columnwise=False)
    v = nvfp4.dequantize_2d(d["rowwise_data"], d["rowwise_scale_inv"], d["amax_rowwise"], 16)
    assert v[3, 2] == float("inf") and torch.isnan(v[0]).all()  # 0 * inf: as TE's dequantize
    x[1, 4] = float("nan")
    check(x)
    d = nvfp4.quantize(x, columnwise=False)
    assert d["rowwise_scale_inv"].view(torch.uint8)[1, 0] == 0x7F
    assert torch.isnan(nvfp4.dequantize_2d(d["rowwise_data"], d["rowwise_scale_inv"], d["amax_rowwise"], 16)).all()


def test_scale_rule_values():
    amax = torch.tensor([0.0, float("inf"), float("nan"), 2688.0, 1e-45])
    s = nvfp4.encode_scale(amax)
    assert s.tolist() == [1.0, 1.0, torch.finfo(torch.float32).max, 1.0, torch.finfo(torch.float32).max]


def test_dequantize_error_bound():
    x = torch.randn(64, 64)
    d = nvfp4.quantize(x)
    v = nvfp4.dequantize_2d(d["rowwise_data"], d["rowwise_scale_inv"], d["amax_rowwise"], 64)
    blocks = x.reshape(64, 4, 16).abs().amax(-1, keepdim=True)
    # half an E2M1 step at the top (1 of 6) plus the E4M3 scale's rounding (1/16 relative)
    assert ((v - x).reshape(64, 4, 16).abs() <= blocks * (1 / 6 + 1 / 16) * 1.01).all()
    assert (v - x).abs().max() > 0


# ------------------------------------------------------------------------------------------ RHT
def test_hadamard_is_orthonormal_with_te_signs():
    h = nvfp4.hadamard_matrix(torch.float64)
    assert torch.equal(h @ h.t(), torch.eye(16, dtype=torch.float64))
    assert torch.equal(h.abs(), torch.full((16, 16), 0.25, dtype=torch.float64))
    assert h[:, 0].sign().tolist() == [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]
    sylvester = torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(16)] for i in range(16)],
                             dtype=torch.float64)
    signs = torch.tensor(nvfp4.RHT_SIGNS, dtype=torch.float64)
    assert torch.equal(h * 4, signs[:, None] * sylvester)


def test_rht_leaves_wgrad_unchanged_in_exact_arithmetic():
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(48, 24, generator=g, dtype=torch.float64), torch.randn(48, 40, generator=g,
                                                                               dtype=torch.float64)
    h = nvfp4.hadamard_matrix(torch.float64)
    blocks = torch.block_diag(*[h] * 3)
    xt, dyt = x.t() @ blocks, dy.t() @ blocks  # the transform along the token axis of both transposes
    assert torch.allclose(dyt @ xt.t(), dy.t() @ x, rtol=0, atol=1e-12)


def test_rht_transform_sums_in_the_butterfly_order():
    """Where fp32 sums round (exponents spread over 2^+-40), the bits are those of the documented butterflies,
    written out here per run in numpy float32, not those of the plain sum over i (which differ)."""
    g = torch.Generator().manual_seed(8)
    xt = (torch.randn(6, 64, generator=g) * torch.exp2(torch.randint(-40, 41, (6, 64), generator=g).float())).bfloat16()
    xt[0, :16] = 0.0
    xt[0, 1] = -0.0  # signed zeros keep the signs the butterflies give them
    xt[1, 16:32] = 1.0  # 2^40 at tokens 2 and 3 cancel in the first stage (s_2 = 1, s_3 = -1) for even outputs;
    xt[1, 18:20] = 2.0**40  # the plain sum meets them after token 0's 1/4 and loses it
    quarters = np.array(nvfp4.RHT_SIGNS, dtype=np.float32) / np.float32(4)
    want, plain = [], []
    for run in xt.float().numpy().reshape(-1, 16):
        v = [np.float32(x) * q for x, q in zip(run, quarters)]
        h = 1
        while h < 16:
            for i in range(16):
                if not i & h:
                    v[i], v[i + h] = v[i] + v[i + h], v[i] - v[i + h]
            h *= 2
        want.append(v)
        hm = nvfp4.hadamard_matrix(torch.float32).numpy()
        acc = [np.float32(run[0]) * hm[0, c] for c in range(16)]
        for i in range(1, 16):
            acc = [acc[c] + np.float32(run[i]) * hm[i, c] for c in range(16)]
        plain.append(acc)
    want_bits = torch.from_numpy(np.array(want, dtype=np.float32).reshape(6, 64)).bfloat16().view(torch.int16)
    plain_bits = torch.from_numpy(np.array(plain, dtype=np.float32).reshape(6, 64)).bfloat16().view(torch.int16)
    got = nvfp4.rht_transform(xt).view(torch.int16)
    assert torch.equal(got, want_bits)
    assert not torch.equal(got, plain_bits)  # the order matters for these inputs


def test_rht_transform_values_and_rule():
    g = torch.Generator().manual_seed(2)
    xt = torch.randn(5, 32, generator=g).to(torch.bfloat16)
    got = nvfp4.rht_transform(xt)
    want = (xt.double().reshape(5, 2, 16) @ nvfp4.hadamard_matrix(torch.float64)).reshape(5, 32)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))  # bf16 sums: exact in fp32
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize(torch.randn(20, 16), rht=True)
    x = torch.randn(32, 20, generator=g).to(torch.bfloat16)
    d = nvfp4.quantize(x, rht=True)
    y = want_rht = (x.t().double().reshape(20, 2, 16) @ nvfp4.hadamard_matrix(torch.float64)).reshape(20, 32)
    y = want_rht.to(torch.bfloat16).float().numpy()
    assert d["amax_columnwise"].item() == np.abs(y).max()  # the columnwise amax is taken after the transform
    want_data, want_scales = brute.quantize_rows(y, brute.amax_of(y))
    assert np.array_equal(d["columnwise_data"].numpy(), want_data)
    assert np.array_equal(d["columnwise_scale_inv"].view(torch.uint8).numpy(), want_scales)
    assert torch.equal(d["rowwise_data"], nvfp4.quantize(x, columnwise=False)["rowwise_data"])  # rowwise: no RHT
