"""The numbers `engine.inspect` records, computed from a quantizer's own output (no second cast).

A usage (rowwise or columnwise) of a quantized storage is read in its stored orientation - the
transposed `[K, M]` columnwise copy as it is, NVFP4's columnwise data still in the random Hadamard
domain - and compared with what the quantizer was given, brought to that orientation (and transform):
the values a GEMM multiplies against the values it would have multiplied in high precision.

    underflow %   non-zero inputs whose element code is zero, of the non-zero inputs
    saturation %  inputs beyond the largest value their block can hold (element code at the format's
                  max, input magnitude above the dequantized one), of all inputs
    SQNR, MSE     10 log10(sum x^2 / sum (x - dq)^2) and mean (x - dq)^2 over the finite pairs
    scales        the decode factor per block (element -> value): min / max; the share of block
                  scales that are zero, subnormal in their encoding, or at their encoding's max
"""

from __future__ import annotations

import math
from typing import Any

import torch

from engine.ops import mx_elements, nvfp4
from engine.ops import reference as ref
from engine.schemes import ScaleEncoding, Scheme, dims_2d
from engine.tensors import QuantizedTensorBase

#: the largest value and the smallest normal of each block-scale encoding (as fp32 factors)
E4M3_MAX, E4M3_MIN_NORMAL = 448.0, 2.0**-6
E8M0_MAX = 2.0**127
FP32 = torch.finfo(torch.float32)


def element_max(scheme: Scheme) -> float:
    """The largest finite magnitude of the scheme's element."""
    element = scheme.element
    return float(torch.finfo(element).max) if isinstance(element, torch.dtype) else float(element.max)


def stored_reference(hp: torch.Tensor, scheme: Scheme, columnwise: bool) -> torch.Tensor:
    """What the quantizer turned into the usage's data, as fp32 in the stored orientation: x `[M, K]`, its
    transpose for a transposed columnwise copy, through the scheme's transform (NVFP4's RHT) if it has one."""
    x2d = ref.as_2d(hp.detach())
    if not columnwise:
        return x2d.float()
    if scheme.transform(columnwise=True) is not None:
        return nvfp4.columnwise_input(x2d, rht=True).float()
    return (x2d.t() if scheme.columnwise_transposed else x2d).float()


def stored_elements(storage: QuantizedTensorBase, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(element values, dequantized values, decode factor per block) of one usage, fp32, stored orientation.

    The dequantized values are the engine's own (`ops.reference.dequantize_block`, `ops.nvfp4.dequantize_2d`)."""
    scheme = storage.scheme
    usage = "columnwise" if columnwise else "rowwise"
    data, scale_inv = getattr(storage, f"{usage}_data"), getattr(storage, f"{usage}_scale_inv")
    if data is None:
        raise ValueError(f"storage: expected {usage} data in the {scheme.name} storage, it holds none")
    if scheme.integer or scheme.zero_point:
        raise ValueError(f"storage: {scheme.name} has integer elements; the inspector reads float elements only")
    transposed = columnwise and scheme.columnwise_transposed
    data = data if transposed else ref.as_2d(data)
    m, k = dims_2d(storage.shape)
    cols = m if transposed else k
    if scheme.coded:
        elements = mx_elements.decode(mx_elements.unpack(data, scheme.element, cols), scheme.element)
    else:
        elements = data.float()
    if scheme.tensor_scale:  # NVFP4: an E4M3 scale per 16 along the stored rows, times amax / (6 E)
        amax = getattr(storage, f"amax_{usage}")
        values = nvfp4.dequantize_2d(data, scale_inv, amax, cols, e4m3_max=scheme.tensor_scale_max)
        factors = scale_inv.float() * amax.float().reshape(()) * (1.0 / (6.0 * scheme.tensor_scale_max))
        return elements, values, factors
    factors = ref.e8m0_to_float(scale_inv) if scheme.scale is ScaleEncoding.E8M0 else scale_inv.float()
    block = scheme.stored_block(columnwise)
    values = ref.dequantize_block(elements, factors, tile_rows=block.rows, tile_cols=block.cols, dtype=torch.float32)
    return elements, values, factors


def scale_shares(storage: QuantizedTensorBase, columnwise: bool) -> dict[str, float]:
    """Percent of the usage's block scales (as stored) that are zero, subnormal in their encoding, or at its max."""
    scheme = storage.scheme
    stored = getattr(storage, f"{'columnwise' if columnwise else 'rowwise'}_scale_inv")
    if scheme.scale is ScaleEncoding.E8M0:
        values, min_normal, top = ref.e8m0_to_float(stored), FP32.tiny, E8M0_MAX
    elif scheme.scale is ScaleEncoding.E4M3:
        values, min_normal, top = stored.float(), E4M3_MIN_NORMAL, E4M3_MAX
    else:
        values, min_normal, top = stored.float(), FP32.tiny, FP32.max
    values = values.abs()
    n = max(values.numel(), 1)
    return {
        "zero_scale_pct": 100.0 * int((values == 0).sum()) / n,
        "subnormal_scale_pct": 100.0 * int(((values > 0) & (values < min_normal)).sum()) / n,
        "saturated_scale_pct": 100.0 * int((values >= top).sum()) / n,
    }


def sqnr_db(signal: torch.Tensor, error: torch.Tensor) -> float:
    """10 log10(sum signal^2 / sum error^2) in float64: inf for no error, nan for no signal."""
    s, e = float(signal.double().square().sum()), float(error.double().square().sum())
    if e == 0.0:
        return math.inf if s > 0 else math.nan
    return 10.0 * math.log10(s / e) if s > 0 else -math.inf


def value_stats(x: torch.Tensor, elements: torch.Tensor, values: torch.Tensor, top: float) -> dict[str, float]:
    """The element-level statistics of one usage: x its high-precision input, `elements` the element values and
    `values` the dequantized ones (all in the same orientation), `top` the element format's max."""
    finite = torch.isfinite(x) & torch.isfinite(values)
    nonzero = x != 0
    clamped = (elements.abs() == top) & (x.abs() > values.abs())
    error = torch.where(finite, x - values, 0.0)
    signal = torch.where(finite, x, 0.0)
    n_finite = int(finite.sum())
    return {
        "numel": x.numel(),
        "amax": float(x.abs().max()) if x.numel() else 0.0,
        "underflow_pct": 100.0 * int((nonzero & (elements == 0)).sum()) / max(int(nonzero.sum()), 1),
        "saturation_pct": 100.0 * int(clamped.sum()) / max(x.numel(), 1),
        "sqnr_db": sqnr_db(signal, error),
        "mse": float(error.double().square().sum()) / max(n_finite, 1),
    }


def usage_stats(storage: QuantizedTensorBase, hp: torch.Tensor, columnwise: bool) -> dict[str, Any]:
    """Every statistic of one usage of `storage`, the quantization of the high-precision `hp` (same shape)."""
    if tuple(hp.shape) != tuple(storage.shape):
        raise ValueError(f"hp: expected the storage's shape {tuple(storage.shape)}, got {tuple(hp.shape)}")
    elements, values, factors = stored_elements(storage, columnwise)
    x = stored_reference(hp, storage.scheme, columnwise)
    finite = factors[torch.isfinite(factors)]
    return {
        "scheme": storage.scheme.name,
        **value_stats(x, elements, values, element_max(storage.scheme)),
        "scale_min": float(finite.min()) if finite.numel() else math.nan,
        "scale_max": float(finite.max()) if finite.numel() else math.nan,
        **scale_shares(storage, columnwise),
    }


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    """||out - reference||_F / ||reference||_F in float64, over the finite pairs (0 when both are 0)."""
    out, reference = out.detach().double(), reference.detach().double()
    finite = torch.isfinite(out) & torch.isfinite(reference)
    diff = float(torch.where(finite, out - reference, 0.0).square().sum().sqrt())
    norm = float(torch.where(finite, reference, 0.0).square().sum().sqrt())
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm
