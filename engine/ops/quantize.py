"""quantize(x, scheme, ...): the four buffers of x under a scheme, from the fastest backend that has them.

`KERNELS[layout]` says which backend functions make a layout's buffers; a scheme whose
layout has no entry runs the generic reference (`quantize_blocked`), so a new scheme can
land with its reference alone. Every function here takes and returns plain tensors.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.ops import backend
from engine.ops import reference as ref
from engine.ops.blocked import quantize_blocked
from engine.schemes import Scheme

Buffers = dict[str, "torch.Tensor | None"]
BUFFER_FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def quantize(
    x: torch.Tensor,
    scheme: Scheme,
    *,
    rowwise: bool,
    columnwise: bool,
    scale: torch.Tensor | None = None,
    amax_epsilon: float = 0.0,
    scale_mode: str = "rceil",
) -> tuple[Buffers, torch.Tensor | None]:
    """(buffers for the asked usages, max|x| as fp32 [1] where the kernel measured it, else None).

    `scale`: a given per-tensor scale (delayed scaling); otherwise scales come from the data
    (the current-scaling rule with `amax_epsilon`, or E8M0 by `scale_mode`).
    """
    kernel = KERNELS.get(scheme.layout, _generic)
    return kernel(x, scheme, rowwise=rowwise, columnwise=columnwise, scale=scale, amax_epsilon=amax_epsilon,
                  scale_mode=scale_mode)


def _generic(x: torch.Tensor, scheme: Scheme, *, rowwise: bool, columnwise: bool, **rule) -> tuple[Buffers, None]:
    out: Buffers = dict.fromkeys(BUFFER_FIELDS)
    for usage, wanted in (("rowwise", rowwise), ("columnwise", columnwise)):
        if wanted:
            out[f"{usage}_data"], out[f"{usage}_scale_inv"] = quantize_blocked(
                x, scheme, columnwise=usage == "columnwise", **rule)
    return out, None


def _per_tensor(x: torch.Tensor, scheme: Scheme, *, rowwise: bool, columnwise: bool, scale: torch.Tensor | None,
                amax_epsilon: float, scale_mode: str) -> tuple[Buffers, torch.Tensor]:
    """One pass over x: rowwise data, its 2D transpose and amax (a first amax pass when no scale is given)."""
    if scale is None:
        scale = ref.compute_scale(backend.amax(x), scheme.element, force_pow_2_scales=scheme.scale.is_pow2,
                                  amax_epsilon=amax_epsilon)
    data, data_t, amax = backend.cast_transpose(ref.as_2d(x), scale, scheme.element, rowwise=rowwise,
                                                columnwise=columnwise)
    scale_inv = ref.reciprocal(scale).reshape(1).to(x.device)  # one tensor shared by both usages
    return {
        "rowwise_data": None if data is None else data.view(x.shape),
        "rowwise_scale_inv": scale_inv if rowwise else None,
        "columnwise_data": data_t,
        "columnwise_scale_inv": scale_inv if columnwise else None,
    }, amax


def _per_tile(x: torch.Tensor, scheme: Scheme, *, rowwise: bool, columnwise: bool, scale: torch.Tensor | None,
              amax_epsilon: float, scale_mode: str) -> tuple[Buffers, None]:
    """Float8 block scaling: one scale per tile (a 2D tile's columnwise form is the exact transpose)."""
    x2d = ref.as_2d(x)
    block = scheme.rowwise_block
    opts = {"tile_cols": block.cols, "force_pow_2_scales": scheme.scale.is_pow2, "amax_epsilon": amax_epsilon,
            "value_for_inf": ref.block_value_for_inf(x.dtype)}
    out: Buffers = dict.fromkeys(BUFFER_FIELDS)
    if scheme.derivable:
        data, scale_inv = backend.quantize_block(x2d, scheme.element, tile_rows=block.rows, **opts)
        if rowwise:
            out["rowwise_data"], out["rowwise_scale_inv"] = data.view(x.shape), scale_inv
        if columnwise:
            out["columnwise_data"], out["columnwise_scale_inv"] = data.t().contiguous(), scale_inv.t().contiguous()
        return out, None
    if rowwise:
        data, out["rowwise_scale_inv"] = backend.quantize_block(x2d, scheme.element, tile_rows=block.rows, **opts)
        out["rowwise_data"] = data.view(x.shape)
    if columnwise:  # the transposed tensor in the same 1 x cols tiles
        out["columnwise_data"], out["columnwise_scale_inv"] = backend.quantize_block(
            x2d.t(), scheme.element, tile_rows=block.rows, **opts)
    return out, None


def _mx(x: torch.Tensor, scheme: Scheme, *, rowwise: bool, columnwise: bool, scale: torch.Tensor | None,
        amax_epsilon: float, scale_mode: str) -> tuple[Buffers, None]:
    """MX: each usage quantized from x (1x32 and 32x1 blocks, both in x's shape)."""
    out: Buffers = dict.fromkeys(BUFFER_FIELDS)
    for usage, wanted in (("rowwise", rowwise), ("columnwise", columnwise)):
        if wanted:
            out[f"{usage}_data"], out[f"{usage}_scale_inv"] = backend.quantize_mxfp8(
                x, scheme.element, scale_mode=scale_mode, columnwise=usage == "columnwise")
    return out, None


Kernel = Callable[..., tuple[Buffers, "torch.Tensor | None"]]
#: layout -> the function that makes its buffers with the fast backends
KERNELS: dict[str, Kernel] = {"tensor": _per_tensor, "block1d": _per_tile, "block2d": _per_tile, "mx": _mx}


def amax(x: torch.Tensor) -> torch.Tensor:
    """max|x| as fp32 [1] (NaN if x has NaN, 0 for an empty tensor)."""
    return backend.amax(x)
