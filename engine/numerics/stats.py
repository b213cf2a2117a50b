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

Each is kept as sums (counts, sums of squares, maxima, minima: `usage_sums`, `gemm_sums`) until a step is
complete, so that ranks can add theirs (`reduce.py`); `operand_stats` / `error_of` make the statistics.
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


#: the parts of a record that add over ranks (and over shards of one tensor), that take the max, and the min
SUMS = ("numel", "nonzero", "underflow", "clamped", "finite", "signal_sq", "error_sq", "blocks", "zero_blocks",
        "subnormal_blocks", "saturated_blocks", "difference_sq", "reference_sq")
MAXES = ("amax", "scale_max")
MINS = ("scale_min",)


def scale_sums(storage: QuantizedTensorBase, columnwise: bool) -> dict[str, int]:
    """Counts of the usage's block scales (as stored): all, zero, subnormal in their encoding, at its max."""
    scheme = storage.scheme
    stored = getattr(storage, f"{'columnwise' if columnwise else 'rowwise'}_scale_inv")
    if scheme.scale is ScaleEncoding.E8M0:
        values, min_normal, top = ref.e8m0_to_float(stored), FP32.tiny, E8M0_MAX
    elif scheme.scale is ScaleEncoding.E4M3:
        values, min_normal, top = stored.float(), E4M3_MIN_NORMAL, E4M3_MAX
    else:
        values, min_normal, top = stored.float(), FP32.tiny, FP32.max
    values = values.abs()
    return {"blocks": values.numel(), "zero_blocks": int((values == 0).sum()),
            "subnormal_blocks": int(((values > 0) & (values < min_normal)).sum()),
            "saturated_blocks": int((values >= top).sum())}


def value_sums(x: torch.Tensor, elements: torch.Tensor, values: torch.Tensor, top: float) -> dict[str, float]:
    """The element-level sums of one usage: x its high-precision input, `elements` the element values and
    `values` the dequantized ones (all in the same orientation), `top` the element format's max."""
    finite = torch.isfinite(x) & torch.isfinite(values)
    nonzero = x != 0
    clamped = (elements.abs() == top) & (x.abs() > values.abs())
    return {
        "numel": x.numel(),
        "nonzero": int(nonzero.sum()),
        "underflow": int((nonzero & (elements == 0)).sum()),
        "clamped": int(clamped.sum()),
        "finite": int(finite.sum()),
        "signal_sq": float(torch.where(finite, x, 0.0).double().square().sum()),
        "error_sq": float(torch.where(finite, x - values, 0.0).double().square().sum()),
        "amax": float(x.abs().max()) if x.numel() else 0.0,
    }


def usage_sums(storage: QuantizedTensorBase, hp: torch.Tensor, columnwise: bool) -> dict[str, Any]:
    """The sums, maxima and minima of one usage of `storage`, the quantization of the high-precision `hp`."""
    if tuple(hp.shape) != tuple(storage.shape):
        raise ValueError(f"hp: expected the storage's shape {tuple(storage.shape)}, got {tuple(hp.shape)}")
    elements, values, factors = stored_elements(storage, columnwise)
    x = stored_reference(hp, storage.scheme, columnwise)
    finite = factors[torch.isfinite(factors)]
    return {
        **value_sums(x, elements, values, element_max(storage.scheme)),
        "scale_min": float(finite.min()) if finite.numel() else math.inf,
        "scale_max": float(finite.max()) if finite.numel() else -math.inf,
        **scale_sums(storage, columnwise),
    }


def gemm_sums(out: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """sum (out - reference)^2 and sum reference^2 in float64, over the finite pairs."""
    out, reference = out.detach().double(), reference.detach().double()
    finite = torch.isfinite(out) & torch.isfinite(reference)
    return {"difference_sq": float(torch.where(finite, out - reference, 0.0).square().sum()),
            "reference_sq": float(torch.where(finite, reference, 0.0).square().sum())}


def _ratio_db(signal_sq: float, error_sq: float) -> float:
    if error_sq == 0.0:
        return math.inf if signal_sq > 0 else math.nan
    return 10.0 * math.log10(signal_sq / error_sq) if signal_sq > 0 else -math.inf


def _percent(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole else 0.0


def operand_stats(sums: dict[str, Any]) -> dict[str, float]:
    """What a record of an operand usage says, from its sums (`usage_sums`, possibly added over ranks)."""
    return {
        "numel": int(sums["numel"]), "amax": sums["amax"],
        "scale_min": sums["scale_min"] if math.isfinite(sums["scale_min"]) else math.nan,
        "scale_max": sums["scale_max"] if math.isfinite(sums["scale_max"]) else math.nan,
        "underflow_pct": _percent(sums["underflow"], sums["nonzero"]),
        "saturation_pct": _percent(sums["clamped"], sums["numel"]),
        "sqnr_db": _ratio_db(sums["signal_sq"], sums["error_sq"]),
        "mse": sums["error_sq"] / max(sums["finite"], 1),
        "zero_scale_pct": _percent(sums["zero_blocks"], sums["blocks"]),
        "subnormal_scale_pct": _percent(sums["subnormal_blocks"], sums["blocks"]),
        "saturated_scale_pct": _percent(sums["saturated_blocks"], sums["blocks"]),
    }


def error_of(sums: dict[str, float]) -> float:
    """||out - reference|| / ||reference|| from `gemm_sums` (0 when both are 0)."""
    if sums["reference_sq"] == 0.0:
        return 0.0 if sums["difference_sq"] == 0.0 else math.inf
    return math.sqrt(sums["difference_sq"] / sums["reference_sq"])


# ------------------------------------------------------------------ one tensor at a time (tests, ad-hoc use)
def usage_stats(storage: QuantizedTensorBase, hp: torch.Tensor, columnwise: bool) -> dict[str, Any]:
    """Every statistic of one usage of `storage`, the quantization of the high-precision `hp` (same shape)."""
    return {"scheme": storage.scheme.name, **operand_stats(usage_sums(storage, hp, columnwise))}


def scale_shares(storage: QuantizedTensorBase, columnwise: bool) -> dict[str, float]:
    """Percent of the usage's block scales (as stored) that are zero, subnormal in their encoding, or at its max."""
    stats = operand_stats({**dict.fromkeys(SUMS, 0), "amax": 0.0, "scale_min": 0.0, "scale_max": 0.0,
                           **scale_sums(storage, columnwise)})
    return {k: stats[k] for k in ("zero_scale_pct", "subnormal_scale_pct", "saturated_scale_pct")}


def sqnr_db(signal: torch.Tensor, error: torch.Tensor) -> float:
    """10 log10(sum signal^2 / sum error^2) in float64: inf for no error, nan for no signal."""
    return _ratio_db(float(signal.double().square().sum()), float(error.double().square().sum()))


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    """||out - reference||_F / ||reference||_F in float64, over the finite pairs (0 when both are 0)."""
    return error_of(gemm_sums(out, reference))
