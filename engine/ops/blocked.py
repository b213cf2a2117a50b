"""quantize_blocked / dequantize_blocked: the reference of every scheme, generic over its data.

A scheme (`engine.schemes`) says which elements share a scale; these functions read that
and apply one rule: split the 2D view into blocks, take each block's amax, turn it into a
scale (a given per-tensor scale, the current-scaling rule, or an E8M0 exponent), multiply,
and cast with saturation. Every per-scheme function in `reference.py` is an instance.
"""

from __future__ import annotations

import torch

from engine.ops import reference as ref
from engine.schemes import ScaleEncoding, Scheme


def _blocks(x2d: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, int, int]:
    """x2d zero-padded and seen as [grid rows, rows, grid cols, cols] (0 = the whole dim)."""
    m, k = x2d.shape
    br, bc = rows or m, cols or k
    gr = 1 if rows == 0 else -(-m // br)
    gc = 1 if cols == 0 else -(-k // bc)
    return ref._pad_to(x2d, gr * br, gc * bc).reshape(gr, br, gc, bc), gr, gc


def quantize_blocked(
    x: torch.Tensor,
    scheme: Scheme,
    *,
    columnwise: bool = False,
    scale: torch.Tensor | None = None,
    amax_epsilon: float = 0.0,
    scale_mode: str = "rceil",
) -> tuple[torch.Tensor, torch.Tensor]:
    """x quantized by `scheme` for one usage: (data, scale_inv) as the scheme stores them.

    Scales: `scale` if given (one per tensor: delayed scaling); else from each block's amax,
    by the current-scaling rule (fp32 or power-of-2 scales; a scale that overflows becomes
    FLT_MAX for a whole tensor and the input dtype's max for a block, as TE does) or, for
    E8M0 scales, by `scale_mode` ("rceil" or "floor").
    """
    ref.check_input(x)
    x2d = ref.as_2d(x).float()
    transposed = columnwise and scheme.columnwise_transposed
    if transposed:
        x2d = x2d.t()
    block = scheme.stored_block(columnwise)
    tiles, gr, gc = _blocks(x2d, block.rows, block.cols)
    if scale is None:
        amax = tiles.abs().amax(dim=(1, 3)) if tiles.numel() else torch.zeros(gr, gc, device=x.device)
    if scheme.scale is ScaleEncoding.E8M0:
        if scale_mode not in ref.SCALE_MODES:
            raise ValueError(f"scale_mode: expected one of {sorted(ref.SCALE_MODES)}, got {scale_mode!r}")
        scale_inv = ref.SCALE_MODES[scale_mode](amax, scheme.element)
        multiplier = ref.e8m0_to_element_scale(scale_inv)
    else:
        if scale is None:
            value_for_inf = ref.FLT_MAX if block.is_tensor else torch.finfo(x.dtype).max
            scale = ref.compute_scale(amax, scheme.element, force_pow_2_scales=scheme.scale.is_pow2,
                                      amax_epsilon=amax_epsilon, value_for_inf=value_for_inf)
        multiplier = scale.float().reshape(gr, gc)
        scale_inv = ref.reciprocal(multiplier)
    q = ref.cast_to_fp8(tiles * multiplier[:, None, :, None], scheme.element)
    data = q.reshape(gr * tiles.shape[1], gc * tiles.shape[3])[: x2d.shape[0], : x2d.shape[1]].contiguous()
    if not transposed:
        data = data.reshape(x.shape)
    return data, scale_inv.reshape(scheme.scale_shape(x.shape, columnwise))


def dequantize_blocked(
    data: torch.Tensor, scale_inv: torch.Tensor, scheme: Scheme, *, shape: torch.Size, columnwise: bool = False,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The value of one usage's (data, scale_inv), with the tensor's `shape`: each block times its scale."""
    transposed = columnwise and scheme.columnwise_transposed
    d2 = data if transposed else ref.as_2d(data)
    block = scheme.stored_block(columnwise)
    factors = ref.e8m0_to_float(scale_inv) if scheme.scale is ScaleEncoding.E8M0 else scale_inv.float()
    rows, cols = d2.shape
    if block.is_tensor:
        factors = factors.reshape(())
    else:
        br, bc = block.rows or max(rows, 1), block.cols or max(cols, 1)  # 0: one block along that dim
        grid = factors.reshape(-(-rows // br) if block.rows else 1, -(-cols // bc) if block.cols else 1)
        factors = grid.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    value = (d2.float() * factors).to(dtype)
    if transposed:
        value = value.t().contiguous()
    return value.reshape(shape)
