"""
Per-tensor cast, transpose and amax
===================================

The per-tensor FP8 recipes (delayed and current scaling) quantize a 2D tensor ``x [M, K]``
with one fp32 ``scale``::

    q = saturate(RNE(float(x) * scale))

and the backward GEMMs want the same codes transposed (``q^T [K, M]``, contiguous), while
the recipe wants ``amax = max|x|`` of the *input*. This kernel does all three in one pass
over ``x``: every element is read once, and written once or twice.

In this file you will find:

* ``_amax_kernel`` and :func:`amax`: a NaN-propagating ``max|x|`` reduced across programs
  with an integer atomic max,
* ``_cast_transpose_kernel`` and :func:`cast_transpose`: the fused cast + transpose + amax.

Amax across programs
--------------------

Each program reduces its tile to one number, and the programs combine theirs with
``tl.atomic_max`` on an int32 buffer holding the fp32 bits of ``|x|``: non-negative
floats order like their bit patterns, and NaN's bits (sign cleared) are larger than
+inf's, so the integer max is the float max *and* propagates NaN, which a float
``atomic_max``/``tl.max`` (``maxnum`` semantics on GPUs) would not. Each program makes a
NaN amax the canonical ``0x7FC00000`` before the atomic max (which then stays canonical:
it is above every number), so the payload does not depend on the input. The buffer starts at 0
(the amax of an empty tile); max is associative and commutative, so the result does not
depend on the order the programs finish in.

The transpose
-------------

The program's ``[BLOCK_M, BLOCK_K]`` tile is quantized once; the rowwise codes are
stored as is and the columnwise ones as ``tl.trans(q)`` into ``[K, M]``. On a GPU,
Triton converts the transposed tile's layout (through shared memory) before storing,
so that the writes of both outputs run along contiguous memory. The input may be any strided 2D view (e.g. ``x.t()``); offsets are 64-bit.

NaN
---

A NaN input stays NaN: the integer cast maps every NaN to the canonical code ``0x7F``, so
it does not matter which NaN the multiply returns (a CPU returns the NaN operand, a GPU a
canonical positive NaN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops import reference
from engine.ops.triton.tiles import load_tile, to_fp32
from engine.ops.triton.fp8_bits import abs_bits, canonical_amax_bits, fp8_params, fp32_to_fp8_bits

# %%
# Kernels
# -------


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = to_fp32(tl.load(x_ptr + offs, mask=offs < n, other=0.0))
    tl.atomic_max(amax_ptr, canonical_amax_bits(tl.max(abs_bits(x), axis=0)))


@triton.jit
def _cast_transpose_kernel(
    x_ptr, scale_ptr, out_ptr, out_t_ptr, amax_ptr,
    M, K, stride_xm, stride_xk,
    MAN_BITS: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr,
    ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    x, offs_m, offs_k, mask = load_tile(x_ptr, M, K, stride_xm, stride_xk, BLOCK_M, BLOCK_K)
    scale = tl.load(scale_ptr)
    q = fp32_to_fp8_bits(x * scale, MAN_BITS, BIAS, MAX_CODE)

    if ROWWISE:
        tl.store(out_ptr + offs_m[:, None] * K + offs_k[None, :], q, mask=mask)
    if COLUMNWISE:
        tl.store(out_t_ptr + offs_k[:, None] * M + offs_m[None, :], tl.trans(q), mask=tl.trans(mask))

    # masked elements were loaded as 0.0, which cannot raise the max
    tile_amax = tl.max(tl.max(abs_bits(x), axis=1), axis=0)
    tl.atomic_max(amax_ptr, canonical_amax_bits(tile_amax))


# %%
# Launchers
# ---------

AMAX_BLOCK = 4096
BLOCK_M = 64
BLOCK_K = 64
NUM_WARPS = 4


def _amax_buffer(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=device)


def amax(x: torch.Tensor) -> torch.Tensor:
    """max|x| as fp32 ``[1]``; the canonical NaN if x has a NaN; 0 for an empty tensor.

    fp32/bf16/fp16 run the kernel; other dtypes (which the quantizers never pass) get the
    same definition with torch ops.
    """
    if x.dtype not in reference.HIGH_PRECISION_DTYPES:
        return reference.amax(x)
    buf = _amax_buffer(x.device)
    flat = x.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    n = flat.numel()
    if n:
        _amax_kernel[(triton.cdiv(n, AMAX_BLOCK),)](flat, buf, n, BLOCK=AMAX_BLOCK, num_warps=NUM_WARPS)
    return buf.view(torch.float32)


def cast_transpose(
    x2d: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, *, rowwise: bool = True, columnwise: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Per-tensor cast: (data ``[M, K]`` if rowwise, data^T ``[K, M]`` if columnwise, amax ``[1]``).

    ``scale`` is a 1-element tensor (read as fp32 on the device, not synchronised to the host).
    """
    reference.check_input(x2d, "x2d")
    if x2d.dim() != 2:
        raise ValueError(f"x2d: expected a 2D tensor, got shape {tuple(x2d.shape)}")
    p = fp8_params(fp8_dtype)
    m, k = x2d.shape
    dev = x2d.device
    scale32 = scale.detach().to(device=dev, dtype=torch.float32).reshape(-1)
    if scale32.numel() != 1:
        raise ValueError(f"scale: expected 1 element, got {scale32.numel()}")
    data = torch.empty((m, k), dtype=torch.uint8, device=dev) if rowwise else None
    data_t = torch.empty((k, m), dtype=torch.uint8, device=dev) if columnwise else None
    buf = _amax_buffer(dev)
    if m and k:
        grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(k, BLOCK_K),)
        dummy = buf  # an unused pointer argument when one output is not asked for
        _cast_transpose_kernel[grid](
            x2d, scale32, data if rowwise else dummy, data_t if columnwise else dummy, buf,
            m, k, x2d.stride(0), x2d.stride(1),
            MAN_BITS=p.man_bits, BIAS=p.bias, MAX_CODE=p.max_code,
            ROWWISE=rowwise, COLUMNWISE=columnwise,
            BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS,
        )
    return (
        data.view(fp8_dtype) if rowwise else None,
        data_t.view(fp8_dtype) if columnwise else None,
        buf.view(torch.float32),
    )
