"""Which kernel runs an op for a scheme layout on a device: one table, with a per-op reference fallback.

`KERNELS[(op, layout, device type)]` names a backend ("native": the C++ kernels of csrc/,
"triton": engine/ops/triton) and the function that makes the op's result from that
backend's kernels. An op without an entry - a new scheme that has only its reference - or
whose backend is unavailable (the C++ build failed) runs the plain-PyTorch reference, with
a one-time warning. `ENGINE_BACKEND=reference|native|triton` forces a backend for every op.
Each entry is enrolled in the bitwise tests (tests/test_registry.py) by iterating this table.

Kernel functions take and return plain tensors:
`elements_to_bf16(data, element, cols)` decodes MX E2M1/E2M3/E3M2 codes to bf16 (exact, unscaled).
`quantize(x, scheme, *, rowwise, columnwise, scale, amax_epsilon, scale_mode)` returns the
four buffers (None for a usage not asked for) and max|x| where the kernel measured it; the
per-tensor ones also take `record_amax` (a 1-element fp32 tensor that becomes
max(record_amax, max|x|) in place, delayed scaling's record). Schemes with a tensor-level scale (NVFP4:
`quantize_nvfp4_reference`) take given per-usage amaxes, a stochastic-rounding counter and their rule's options
instead, and add the usages' amaxes to the buffers. `delayed_update(amax_history,
scale, fp8_max, margin, algo, held)` is delayed scaling's update of its state, in place.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch

from engine.ops import backend, nvfp4, nvfp4_sr
from engine.ops import reference as ref
from engine.ops.exact_gemm import exact_gemm as exact_gemm_reference
from engine.ops.reference import quantize_blocked
from engine.schemes import BUFFER_FIELDS, SCHEMES, Scheme

Buffers = dict[str, "torch.Tensor | None"]
Result = tuple[Buffers, "torch.Tensor | None"]


# ------------------------------------------------------------------ kernels, generic over a backend module
def record_max(into: torch.Tensor, amax: torch.Tensor) -> None:
    """into = max(into, amax) in place (torch.maximum: NaN if either is NaN): delayed scaling's record."""
    into.copy_(torch.maximum(into, amax.to(into.device).reshape(into.shape)))


def quantize_reference(x: torch.Tensor, scheme: Scheme, *, rowwise: bool, columnwise: bool,
                       record_amax: torch.Tensor | None = None, **rule) -> Result:
    """Any scheme, one usage at a time, by the generic reference (a tensor-level scale: `quantize_nvfp4_reference`)."""
    if scheme.tensor_scale:
        return quantize_nvfp4_reference(x, scheme, rowwise=rowwise, columnwise=columnwise, **rule)
    out: Buffers = dict.fromkeys(BUFFER_FIELDS)
    for usage, wanted in (("rowwise", rowwise), ("columnwise", columnwise)):
        if wanted:
            out[f"{usage}_data"], out[f"{usage}_scale_inv"] = quantize_blocked(
                x, scheme, columnwise=usage == "columnwise", **rule)
    amax = ref.amax(x) if scheme.rowwise_block.is_tensor else None
    if record_amax is not None:
        record_max(record_amax, amax)
    return out, amax


def quantize_nvfp4_reference(x: torch.Tensor, scheme: Scheme, *, rowwise: bool, columnwise: bool,
                             rng_counter: torch.Tensor | None = None, amax_rowwise: torch.Tensor | None = None,
                             amax_columnwise: torch.Tensor | None = None, **options: object) -> Result:
    """NVFP4 by `engine.ops.nvfp4.quantize`: the buffers plus `amax_rowwise` / `amax_columnwise`, and x's amax.

    `rng_counter` (int64 (seed, offset)) selects stochastic rounding: the rowwise bits are drawn first,
    then the columnwise ones, the offset advanced in place past each (`nvfp4_sr.advance`).
    `amax_rowwise` / `amax_columnwise`: given per-tensor amaxes (all-reduced), else x's own. `options`: the
    rule's (`two_d`: 16x16 tiles).
    """
    m, k = ref.as_2d(x).shape
    rbits = rbits_t = None
    if rng_counter is not None and rowwise:
        rbits = nvfp4_sr.random_bits((m, k), rng_counter)
        nvfp4_sr.advance(rng_counter, m * k)
    if rng_counter is not None and columnwise:
        rbits_t = nvfp4_sr.random_bits((k, m), rng_counter)
        nvfp4_sr.advance(rng_counter, k * m)
    out = nvfp4.quantize(x, rowwise=rowwise, columnwise=columnwise, rht=scheme.columnwise_transform is not None,
                         rbits=rbits, rbits_t=rbits_t, amax=amax_rowwise, amax_t=amax_columnwise,
                         **_with_bound(scheme, options))
    return out, out["amax_rowwise"]


def _with_bound(scheme: Scheme, options: dict) -> dict:
    """The rule's options, plus the scheme's E4M3 bound E where 4over6 reads it (`four_over_six_e4m3_max`)."""
    if not options.get("four_over_six"):
        if scheme.tensor_scale_max != 448.0:
            raise ValueError(f"scheme: {scheme.name}'s bound E = {scheme.tensor_scale_max:g} is 4over6's; quantize "
                             "it with four_over_six=True")
        return options
    return {**options, "four_over_six_e4m3_max": scheme.tensor_scale_max}


def quantize_nvfp4(kernels: ModuleType, x: torch.Tensor, scheme: Scheme, *, rowwise: bool, columnwise: bool,
                   rng_counter: torch.Tensor | None = None, amax_rowwise: torch.Tensor | None = None,
                   amax_columnwise: torch.Tensor | None = None, **options: object) -> Result:
    """NVFP4 in one kernel call (`quantize_nvfp4_reference`'s arguments and result); the counter advanced as there."""
    out = kernels.quantize_nvfp4(x, rowwise=rowwise, columnwise=columnwise, rht=scheme.columnwise_transform is not None,
                                 amax=amax_rowwise, amax_t=amax_columnwise, counter=rng_counter,
                                 **_with_bound(scheme, options))
    if rng_counter is not None:
        m, k = ref.as_2d(x).shape
        for wanted in (rowwise, columnwise):
            if wanted:
                nvfp4_sr.advance(rng_counter, m * k)
    return out, out["amax_rowwise"]


def quantize_per_tensor(kernels: ModuleType, x: torch.Tensor, scheme: Scheme, *, rowwise: bool, columnwise: bool,
                        scale: torch.Tensor | None, amax_epsilon: float, scale_mode: str,
                        record_amax: torch.Tensor | None = None) -> Result:
    """One pass over x: rowwise data, its 2D transpose and amax (a first amax pass when no scale is given)."""
    if scale is None:
        scale = ref.compute_scale(kernels.amax(x), scheme.element, force_pow_2_scales=scheme.scale.is_pow2,
                                  amax_epsilon=amax_epsilon)
    data, data_t, amax = kernels.cast_transpose(ref.as_2d(x), scale, scheme.element, rowwise=rowwise,
                                                columnwise=columnwise)
    scale_inv = ref.reciprocal(scale).reshape(1).to(x.device)  # one tensor for both usages
    if record_amax is not None:
        record_max(record_amax, amax)
    return {
        "rowwise_data": data if data is None or x.dim() == 2 else data.view(x.shape),
        "rowwise_scale_inv": scale_inv if rowwise else None,
        "columnwise_data": data_t,
        "columnwise_scale_inv": scale_inv if columnwise else None,
    }, amax


def quantize_per_tensor_fused(kernels: ModuleType, x: torch.Tensor, scheme: Scheme, *, rowwise: bool,
                              columnwise: bool, scale: torch.Tensor | None, amax_epsilon: float, scale_mode: str,
                              record_amax: torch.Tensor | None = None) -> Result:
    """All of per-tensor quantization in one kernel call: amax, scale, cast(s), scale_inv, the record."""
    elsewhere = record_amax is not None and not record_amax.is_cpu  # state kept on another device than x
    data, data_t, scale_inv, amax = kernels.quantize_per_tensor(
        x, scheme.element, rowwise=rowwise, columnwise=columnwise, scale=scale,
        force_pow_2_scales=scheme.scale.is_pow2, amax_epsilon=amax_epsilon,
        record_amax=None if elsewhere else record_amax)
    if elsewhere:
        record_max(record_amax, amax)
    return {
        "rowwise_data": data,
        "rowwise_scale_inv": scale_inv if rowwise else None,
        "columnwise_data": data_t,
        "columnwise_scale_inv": scale_inv if columnwise else None,
    }, amax


def usage_buffers(row_data: torch.Tensor | None, row_scale: torch.Tensor | None, col_data: torch.Tensor | None,
                  col_scale: torch.Tensor | None) -> Buffers:
    """The buffers of a kernel that returns both usages at once (None for a usage not asked for)."""
    return {"rowwise_data": row_data, "rowwise_scale_inv": row_scale, "columnwise_data": col_data,
            "columnwise_scale_inv": col_scale}


def quantize_per_tile(kernels: ModuleType, x: torch.Tensor, scheme: Scheme, *, rowwise: bool, columnwise: bool,
                      scale: torch.Tensor | None, amax_epsilon: float, scale_mode: str) -> Result:
    """Float8 block scaling: a scale per tile, each usage quantized from x (rowwise) or its transposed view:
    in one call where the backend has `quantize_block_usages` (the C++ kernels), else one call per usage."""
    x2d, block = ref.as_2d(x), scheme.rowwise_block
    opts = {"tile_rows": block.rows, "tile_cols": block.cols, "force_pow_2_scales": scheme.scale.is_pow2,
            "amax_epsilon": amax_epsilon, "value_for_inf": ref.block_value_for_inf(x.dtype)}
    both = getattr(kernels, "quantize_block_usages", None)
    if both is not None:
        row, row_scale, col, col_scale = both(x2d, scheme.element, rowwise=rowwise, columnwise=columnwise, **opts)
        return usage_buffers(row if row is None or x.dim() == 2 else row.view(x.shape), row_scale, col,
                             col_scale), None
    out: Buffers = dict.fromkeys(BUFFER_FIELDS)
    if rowwise:
        data, out["rowwise_scale_inv"] = kernels.quantize_block(x2d, scheme.element, **opts)
        out["rowwise_data"] = data if x.dim() == 2 else data.view(x.shape)  # a view costs ~2 us
    if columnwise:  # the transposed tensor in the same tiles (square tiles: the rowwise data's exact transpose,
        # from a second pass over the transposed view: cheaper than a byte transpose's copy)
        out["columnwise_data"], out["columnwise_scale_inv"] = kernels.quantize_block(x2d.t(), scheme.element, **opts)
    return out, None


def quantize_per_row(kernels: ModuleType, x: torch.Tensor, scheme: Scheme, *, rowwise: bool, columnwise: bool,
                     scale: torch.Tensor | None, amax_epsilon: float, scale_mode: str) -> Result:
    """Axiswise: the block kernel with 1 x whole-row tiles, on x (rowwise) and on x^T as a view (columnwise).

    An empty x still has a scale per row of the other dim (that of an all-zero row): the reference makes those.
    """
    x2d = ref.as_2d(x)
    if x2d.numel() == 0:
        return quantize_reference(x, scheme, rowwise=rowwise, columnwise=columnwise, scale=scale,
                                  amax_epsilon=amax_epsilon, scale_mode=scale_mode)
    opts = {"force_pow_2_scales": scheme.scale.is_pow2, "amax_epsilon": amax_epsilon,
            "value_for_inf": ref.block_value_for_inf(x.dtype)}
    out: Buffers = dict.fromkeys(BUFFER_FIELDS)
    if rowwise:
        data, out["rowwise_scale_inv"] = kernels.quantize_block(x2d, scheme.element, tile_rows=1,
                                                                tile_cols=x2d.shape[1], **opts)
        out["rowwise_data"] = data if x.dim() == 2 else data.view(x.shape)  # a view costs ~2 us
    if columnwise:
        out["columnwise_data"], out["columnwise_scale_inv"] = kernels.quantize_block(
            x2d.t(), scheme.element, tile_rows=1, tile_cols=x2d.shape[0], **opts)
    return out, None


def quantize_mx(kernels: ModuleType, x: torch.Tensor, scheme: Scheme, *, rowwise: bool, columnwise: bool,
                scale: torch.Tensor | None, amax_epsilon: float, scale_mode: str) -> Result:
    """MX: each usage quantized from x (1x32 and 32x1 blocks, both in x's shape).

    Elements without a torch dtype (E2M1, E2M3, E3M2: `scheme.coded`) go to the backend's
    `quantize_mx_coded` (both usages in one pass over x: the C++ and the Triton kernels); a backend
    without one runs the reference's torch ops on x's device, with a one-time warning.
    """
    if scheme.coded:
        fn = getattr(kernels, "quantize_mx_coded", None)
        if fn is None:
            _warn_reference_once(scheme.name, x.device.type)
            return quantize_reference(x, scheme, rowwise=rowwise, columnwise=columnwise, scale_mode=scale_mode)
        return usage_buffers(*fn(x, scheme.element, scale_mode=scale_mode, rowwise=rowwise,
                                 columnwise=columnwise)), None
    both = getattr(kernels, "quantize_mxfp8_usages", None)  # the C++ kernels: both usages in one call
    if both is not None:
        return usage_buffers(*both(x, scheme.element, scale_mode=scale_mode, rowwise=rowwise,
                                   columnwise=columnwise)), None
    out: Buffers = dict.fromkeys(BUFFER_FIELDS)
    for usage, wanted in (("rowwise", rowwise), ("columnwise", columnwise)):
        if wanted:
            out[f"{usage}_data"], out[f"{usage}_scale_inv"] = kernels.quantize_mxfp8(
                x, scheme.element, scale_mode=scale_mode, columnwise=usage == "columnwise")
    return out, None


@functools.lru_cache(maxsize=None)
def _warn_reference_once(scheme_name: str, device_type: str) -> None:
    """One warning per scheme and device for a backend that has the layout's kernel but not this element's."""
    warnings.warn(f"engine: no {scheme_name} quantize kernel on {device_type}; the reference runs (slow)",
                  RuntimeWarning, stacklevel=6)


def amax_kernel(kernels: ModuleType, x: torch.Tensor) -> torch.Tensor:
    return kernels.amax(x)


def fp8_to_bf16_kernel(kernels: ModuleType, data: torch.Tensor) -> torch.Tensor:
    return kernels.fp8_to_bf16(data)


def exact_gemm_kernel(kernels: ModuleType, a: torch.Tensor, a_scale_inv: torch.Tensor, a_tile: tuple[int, int],
                      b: torch.Tensor, b_scale_inv: torch.Tensor, b_tile: tuple[int, int],
                      bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor | None:
    return kernels.exact_gemm(a, a_scale_inv, a_tile, b, b_scale_inv, b_tile, bias, out_dtype)


def elements_to_bf16_kernel(kernels: ModuleType, data: torch.Tensor, element: object, cols: int) -> torch.Tensor:
    return kernels.elements_to_bf16(data, element, cols)


def delayed_update_kernel(kernels: ModuleType, amax_history: torch.Tensor, scale: torch.Tensor, fp8_max: float,
                          margin: int, algo: str, held: Iterable[int] = ()) -> None:
    kernels.delayed_update(amax_history, scale, fp8_max, margin, algo, held)


def delayed_update_reference(amax_history: torch.Tensor, scale: torch.Tensor, fp8_max: float, margin: int,
                             algo: str, held: Iterable[int] = ()) -> None:
    """Delayed scaling's update for the built-in algos ("max" | "most_recent"), in place, in torch ops.

    The steps of `DelayedScalingState.update` (engine/recipes/delayed.py) with its default
    scale rule: row 0's NaN/inf -> 0; amax over the rows (or row 0); scale = (fp8_max / amax)
    * 2**-margin as a true fp32 division where amax is finite and > 0, else the old scale,
    at most FLT_MAX; the history rolled up one row with row 0 = NOT_RECORDED; `held` slots and
    slots whose row 0 is NOT_RECORDED (nothing recorded since the last update) keep their
    history and scale.
    """
    history = amax_history
    keep = history[0] < 0  # NOT_RECORDED: nothing recorded since the last update (NaN compares False)
    torch.nan_to_num_(history.data[0], nan=0.0, posinf=0.0, neginf=0.0)
    amax = history.max(dim=0).values if algo == "max" else history[0].clone()
    new_scale = torch.full_like(amax, fp8_max).div_(amax)
    if margin:
        new_scale.mul_(math.ldexp(1.0, -margin))
    new_scale = torch.where(torch.isfinite(amax) & (amax > 0), new_scale, scale).clamp_max_(ref.FLT_MAX)
    rolled = torch.roll(history, -1, dims=0)
    rolled[0].fill_(ref.NOT_RECORDED)
    held = sorted(set(held))
    if held:
        keep[held] = True
    # through .data, as DelayedScalingState.update writes (a compiled backward may hold these tensors)
    history.data.copy_(torch.where(keep, history, rolled))
    scale.data.copy_(torch.where(keep, scale, new_scale))


# ------------------------------------------------------------------------------------------ the table
@dataclass(frozen=True)
class Kernel:
    backend: str  # "native" | "triton"
    fn: Callable


ANY = "*"  # an op that does not depend on the scheme
#: families with a tensor-level scale (NVFP4 and NVFP4 with the RHT): one kernel reads the transform from the scheme
_TWO_LEVEL = sorted({s.layout for s in SCHEMES.values() if s.tensor_scale})
_CODED = sorted({s.layout for s in SCHEMES.values() if s.coded})
_LAYOUT_KERNELS = {"block1d": quantize_per_tile, "block2d": quantize_per_tile, "mx": quantize_mx}
KERNELS: dict[tuple[str, str, str], Kernel] = {
    ("quantize", "tensor", "cpu"): Kernel("native", quantize_per_tensor_fused),
    ("quantize", "tensor", "cuda"): Kernel("triton", quantize_per_tensor),
    **{("quantize", layout, device): Kernel(name, fn) for layout, fn in _LAYOUT_KERNELS.items()
       for device, name in (("cpu", "native"), ("cuda", "triton"))},
    **{(op, ANY, device): Kernel(name, fn) for op, fn in (("amax", amax_kernel), ("fp8_to_bf16", fp8_to_bf16_kernel))
       for device, name in (("cpu", "native"), ("cuda", "triton"))},
    **{("elements_to_bf16", layout, "cpu"): Kernel("native", elements_to_bf16_kernel)  # MXFP4/MXFP6/NVFP4 codes
       for layout in _CODED},
    ("delayed_update", ANY, "cpu"): Kernel("native", delayed_update_kernel),  # no Triton kernel: see quantize.py
    ("exact_gemm", ANY, "cpu"): Kernel("native", exact_gemm_kernel),  # CUDA runs torch._scaled_mm
    # no Triton entry: its 1-row kernel holds a whole tile (here a whole row) in registers
    ("quantize", "axiswise", "cpu"): Kernel("native", quantize_per_row),
    # NVFP4 (the RHT layout's columnwise usage fused in on the CPU; a separate RHT kernel in Triton)
    **{("quantize", layout, device): Kernel(name, quantize_nvfp4) for layout in _TWO_LEVEL
       for device, name in (("cpu", "native"), ("cuda", "triton"))},
}
REFERENCE: dict[str, Callable] = {
    "quantize": quantize_reference,
    "amax": ref.amax,
    "fp8_to_bf16": ref.fp8_to_bf16,
    "elements_to_bf16": ref.elements_to_bf16,
    "delayed_update": delayed_update_reference,
    "exact_gemm": exact_gemm_reference,
}


def kernel(op: str, layout: str, device_type: str) -> Callable:
    """The function that runs `op` for `layout` on `device_type` (see the module docstring)."""
    return _resolve(op, layout, device_type, backend.forced_backend())


def kernel_for(op: str, layout: str, device_type: str, forced: str | None) -> Callable:
    """`kernel` for a forced backend the caller has read already (`backend.forced_backend()`)."""
    return _resolve(op, layout, device_type, forced)


@functools.lru_cache(maxsize=None)
def _resolve(op: str, layout: str, device_type: str, forced: str | None) -> Callable:
    """Decided once per (op, layout, device, forced backend), so each fallback warning is shown once."""
    if forced == "reference":
        return REFERENCE[op]
    if forced is None:
        entry = KERNELS.get((op, layout, device_type)) or KERNELS.get((op, ANY, device_type))
    else:  # the forced backend's kernel for this op and layout, whatever device it is registered for
        entry = next((k for (o, lay, _), k in KERNELS.items() if o == op and lay in (layout, ANY)
                      and k.backend == forced), None)
        if entry is None:
            raise RuntimeError(f"ENGINE_BACKEND={forced}: there is no {forced} kernel for {op} ({layout})")
    if entry is None:
        warnings.warn(f"engine: no {op} kernel for the {layout} layout on {device_type}; the reference runs (slow)",
                      RuntimeWarning, stacklevel=4)
        return REFERENCE[op]
    module, why = backend.module(entry.backend)
    if module is None:
        if forced:
            raise RuntimeError(f"ENGINE_BACKEND={forced}, but those kernels are unavailable: {why}")
        warnings.warn(f"engine: the {entry.backend} kernels are unavailable ({why}); {op} runs the slow reference "
                      "path", RuntimeWarning, stacklevel=4)
        return REFERENCE[op]
    return functools.partial(entry.fn, module)
