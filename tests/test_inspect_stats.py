"""engine.inspect's statistics (engine/numerics/stats.py) against values computed by hand on small tensors."""

from __future__ import annotations

import math

import pytest
import torch

from engine.numerics.stats import relative_error, scale_shares, sqnr_db, stored_elements, usage_stats
from engine.quantizers import Float8Quantizer
from engine.recipes import BACKWARD_ROLES, FORWARD_ROLES, RECIPES
from engine.schemes import get_scheme
from engine.tensors import QuantizedTensorBase


def planted() -> tuple[torch.Tensor, dict[str, float]]:
    """A 4x32 tensor with known fates under E4M3 at scale 1 (max 448, smallest subnormal 2^-9): 112 ones (exact),
    3 x 1000 (clamped to 448), 5 x 1e-4 (below half the smallest subnormal: zero) and 8 zeros."""
    x = torch.ones(4, 32)
    flat = x.view(-1)
    flat[[0, 40, 127]] = 1000.0
    flat[[1, 2, 50, 90, 100]] = 1e-4
    flat[[3, 4, 5, 60, 61, 62, 63, 126]] = 0.0
    tiny = float(torch.tensor(1e-4))  # the fp32 value actually stored
    error_sq = 3 * 552.0**2 + 5 * tiny**2
    signal_sq = 3 * 1000.0**2 + 5 * tiny**2 + 112
    return x, {"underflow_pct": 100 * 5 / 120, "saturation_pct": 100 * 3 / 128, "mse": error_sq / 128,
               "sqnr_db": 10 * math.log10(signal_sq / error_sq), "amax": 1000.0}


@pytest.mark.parametrize("columnwise", [False, True])
def test_e4m3_per_tensor_counts_by_hand(columnwise: bool) -> None:
    x, expected = planted()
    q = Float8Quantizer(torch.ones(1), torch.zeros(1), torch.float8_e4m3fn)
    stats = usage_stats(q.quantize_storage(x), x, columnwise)
    for key, value in expected.items():
        assert stats[key] == pytest.approx(value, rel=1e-6), key
    assert stats["scale_min"] == stats["scale_max"] == 1.0
    assert (stats["zero_scale_pct"], stats["subnormal_scale_pct"], stats["saturated_scale_pct"]) == (0, 0, 0)


def test_e5m2_scale_4_saturates_what_exceeds_max_over_scale() -> None:
    # scale 4: scale_inv 1/4, E5M2 max 57344: |x| > 14336 clamps; 2^-16 * 1/4 = 2^-18 is E5M2's smallest subnormal
    x = torch.tensor([[20000.0, 14336.0, -30000.0, 2.0**-21, 2.0**-18, 1.0, 0.0, 3.0]])
    q = Float8Quantizer(torch.full((1,), 4.0), torch.zeros(1), torch.float8_e5m2)
    stats = usage_stats(q.quantize_storage(x), x, False)
    assert stats["saturation_pct"] == pytest.approx(100 * 2 / 8)  # 20000 and -30000, not 14336 (exactly the max)
    assert stats["underflow_pct"] == pytest.approx(100 * 1 / 7)  # 2^-21: x4 = 2^-19 < 2^-17, half the smallest subnormal
    assert stats["scale_min"] == stats["scale_max"] == 0.25


def _storage(scheme: str, data: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int], **extra: torch.Tensor
             ) -> QuantizedTensorBase:
    return QuantizedTensorBase(scheme=get_scheme(scheme), shape=torch.Size(shape), nominal_dtype=torch.float32,
                               rowwise_data=data, rowwise_scale_inv=scale, **extra)


def test_scale_shares_e8m0_codes_by_hand() -> None:
    # 4 rows of one 1x32 block: code 0 = 2^-127 (an fp32 subnormal), 1, 127 = 1.0, 254 = 2^127 (E8M0's max)
    data = torch.zeros(4, 32, dtype=torch.float8_e4m3fn)
    storage = _storage("mx_e4m3", data, torch.tensor([[0], [1], [127], [254]], dtype=torch.uint8), (4, 32))
    assert scale_shares(storage, False) == {"zero_scale_pct": 0.0, "subnormal_scale_pct": 25.0,
                                            "saturated_scale_pct": 25.0}


def test_scale_shares_e4m3_block_scales_by_hand() -> None:
    # NVFP4: one E4M3 scale per 16; 0, 2^-9 (subnormal: below 2^-6), 1 and 448 (E4M3's max)
    scales = torch.tensor([[0.0], [2.0**-9], [1.0], [448.0]]).to(torch.float8_e4m3fn)
    storage = _storage("nvfp4_e2m1", torch.zeros(4, 8, dtype=torch.uint8), scales, (4, 16),
                       amax_rowwise=torch.ones(1))
    assert scale_shares(storage, False) == {"zero_scale_pct": 25.0, "subnormal_scale_pct": 25.0,
                                            "saturated_scale_pct": 25.0}


def test_sqnr_and_relative_error_of_a_known_error() -> None:
    signal = torch.ones(100)
    assert sqnr_db(signal, torch.full((100,), 0.1)) == pytest.approx(20.0)  # 100 / 1 -> 20 dB
    assert sqnr_db(signal, torch.zeros(100)) == math.inf
    ref = torch.tensor([3.0, 4.0])  # norm 5
    assert relative_error(torch.tensor([3.0, 5.0]), ref) == pytest.approx(0.2)
    assert relative_error(torch.zeros(2), torch.zeros(2)) == 0.0


def _training_quantizers() -> dict[str, object]:
    """One quantizer per scheme any registered recipe's states use (a delayed one reads its state's scale)."""
    found = {}
    for cls in RECIPES.values():
        for forward in (True, False):
            state = cls().make_state(forward=forward)
            for role in FORWARD_ROLES if forward else BACKWARD_ROLES:
                for q in state.uses(role):
                    if q is not None:
                        found.setdefault(q.scheme.name, q)
    return found


@pytest.mark.parametrize("scheme", sorted(_training_quantizers()))
def test_stored_values_are_the_storages_dequantize(scheme: str) -> None:
    """The values the statistics read are the engine's own dequantized ones (in the stored orientation)."""
    q = _training_quantizers()[scheme]
    q.set_usage(rowwise=True, columnwise=True)
    x = torch.randn(32, 64) * torch.logspace(-3, 3, 64)
    storage = q.quantize_storage(x)
    for columnwise in (False, True):
        if columnwise and storage.scheme.transform(columnwise=True) is not None:
            continue  # the RHT domain: compared through its SQNR in test_inspect.py
        _, values, _ = stored_elements(storage, columnwise)
        expected = (storage.without_rowwise() if columnwise else storage).dequantize(torch.float32)
        if columnwise and storage.scheme.columnwise_transposed:
            expected = expected.t()
        assert torch.equal(values, expected)
