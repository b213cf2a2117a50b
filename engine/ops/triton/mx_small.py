"""
MXFP4 / MXFP6: E2M1, E2M3 and E3M2 elements with E8M0 scales per 32
====================================================================

The MX blocks and scale rules of mxfp8.py (1x32 rowwise, 32x1 columnwise, RCEIL or FLOOR;
`_e8m0_code`, `_element_scale`) with the elements of `engine.ops.mx_elements`: formats
without a torch dtype, stored as uint8 codes. One program reads a ``[BLOCK_M, BLOCK_K]`` tile
of x once and writes both usages (as the C++ kernel does):

* rowwise: codes ``[M, ceil(K/32)]``, data ``[M, packed K]``;
* columnwise: codes ``[ceil(M/32), K]``, data ``[M, packed K]`` (x's layout, not transposed);

where E2M1 packs two codes per byte along K, element 2i in the low nibble (an odd K ends in
a byte whose high nibble is 0: the masked load reads +0 there), and E2M3 / E3M2 take one
byte each.

The element cast (:func:`_mx_element_code`) is integer arithmetic on the fp32 bits of
``y = x * 2^(127 - code)``, as fp8_bits.py does for FP8: round to nearest even at the
element's mantissa width (subnormals by a right shift with RNE), saturate at ``±max``
(the formats have no inf: ``±inf`` gives ``±max``), keep the sign bit (``-0`` has a code),
and NaN gives code 0 whatever its sign (a NaN sits in a block of scale code 255, whose
multiplier is NaN, so the whole block is code 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.formats import MX_ELEMENTS, FloatFormat, element_format
from engine.ops import reference
from engine.ops.triton.fp8_bits import abs_bits, f32_bits
from engine.ops.triton.mxfp8 import MX_BLOCK, _e8m0_code, _element_scale
from engine.ops.triton.tiles import load_tile


@triton.jit
def _mx_element_code(y, MAN_BITS: tl.constexpr, BIAS: tl.constexpr, CODE_BITS: tl.constexpr):
    """Saturating RNE code (int32) of fp32 `y` in the element format (see the module doc)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = ((bits >> 31) & 1) << (CODE_BITS - 1)
    u = bits & 0x7FFFFFFF
    is_nan = u > 0x7F800000
    # normal result: re-bias the exponent, RNE on the low (23 - MAN_BITS) bits (a carry moves up a binade)
    SHIFT: tl.constexpr = 23 - MAN_BITS
    r = u + ((BIAS - 127) << 23)
    r = r + ((1 << (SHIFT - 1)) - 1) + ((r >> SHIFT) & 1)
    normal_code = r >> SHIFT
    # subnormal result: the significand (with its implicit 1) shifted right with RNE; shifts kept in [1, 25]
    e32 = u >> 23
    sig = tl.where(e32 == 0, u & 0x7FFFFF, (u & 0x7FFFFF) | 0x800000)
    e_elem = tl.maximum(e32, 1) + (BIAS - 127)  # the element's biased exponent (<= 0: subnormal)
    shift = tl.minimum(tl.maximum((24 - MAN_BITS) - e_elem, 1), 25)
    q = sig >> shift
    rem = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    round_up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    sub_code = q + round_up.to(tl.int32)
    code = tl.where(e_elem <= 0, sub_code, normal_code)
    code = tl.minimum(code, (1 << (CODE_BITS - 1)) - 1)  # saturation (+-inf too)
    return tl.where(is_nan, 0, code | sign)


@triton.jit
def _store_data(out_ptr, q, offs_m, offs_k, pid_k, M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                PACKED: tl.constexpr):
    """Codes q [BLOCK_M, BLOCK_K] (int32) to the data [M, packed K] at the tile's place."""
    if PACKED:
        kp = (K + 1) // 2
        pairs = tl.reshape(q, [BLOCK_M, BLOCK_K // 2, 2])
        nibble = (tl.arange(0, 2) * 15 + 1)[None, None, :]  # element 2i * 1 + element 2i + 1 * 16
        packed = tl.sum(pairs * nibble, axis=2)
        offs_p = pid_k.to(tl.int64) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        mask = (offs_m[:, None] < M) & (offs_p[None, :] < kp)
        tl.store(out_ptr + offs_m[:, None] * kp + offs_p[None, :], packed.to(tl.uint8), mask=mask)
    else:
        mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
        tl.store(out_ptr + offs_m[:, None] * K + offs_k[None, :], q.to(tl.uint8), mask=mask)


@triton.jit
def _mx_small_kernel(
    x_ptr, row_ptr, row_code_ptr, col_ptr, col_code_ptr,
    M, K, stride_xm, stride_xk, rcp_bits,
    MAN_BITS: tl.constexpr, BIAS: tl.constexpr, CODE_BITS: tl.constexpr, EMAX: tl.constexpr,
    FLOOR: tl.constexpr, ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    x, offs_m, offs_k, mask = load_tile(x_ptr, M, K, stride_xm, stride_xk, BLOCK_M, BLOCK_K)
    tiles_k = tl.cdiv(K, BLOCK_K)
    pid_m, pid_k = tl.program_id(0) // tiles_k, tl.program_id(0) % tiles_k
    PACKED: tl.constexpr = CODE_BITS == 4
    if ROWWISE:  # 1x32 blocks: [BLOCK_M, BLOCK_K/32, 32], reduce over the last axis
        xb = tl.reshape(x, [BLOCK_M, BLOCK_K // MX_BLOCK, MX_BLOCK])
        code = _e8m0_code(tl.max(abs_bits(xb), axis=2), rcp_bits, FLOOR, EMAX)
        q = _mx_element_code(xb * _element_scale(code)[:, :, None], MAN_BITS, BIAS, CODE_BITS)
        ck = pid_k.to(tl.int64) * (BLOCK_K // MX_BLOCK) + tl.arange(0, BLOCK_K // MX_BLOCK)
        n_codes = tl.cdiv(K, MX_BLOCK)
        cmask = (offs_m[:, None] < M) & (ck[None, :] < n_codes)
        tl.store(row_code_ptr + offs_m[:, None] * n_codes + ck[None, :], code.to(tl.uint8), mask=cmask)
        _store_data(row_ptr, tl.reshape(q, [BLOCK_M, BLOCK_K]), offs_m, offs_k, pid_k, M, K, BLOCK_M, BLOCK_K, PACKED)
    if COLUMNWISE:  # 32x1 blocks: [BLOCK_M/32, 32, BLOCK_K], reduce over the middle axis
        xb = tl.reshape(x, [BLOCK_M // MX_BLOCK, MX_BLOCK, BLOCK_K])
        code = _e8m0_code(tl.max(abs_bits(xb), axis=1), rcp_bits, FLOOR, EMAX)
        q = _mx_element_code(xb * _element_scale(code)[:, None, :], MAN_BITS, BIAS, CODE_BITS)
        cm = pid_m.to(tl.int64) * (BLOCK_M // MX_BLOCK) + tl.arange(0, BLOCK_M // MX_BLOCK)
        cmask = (cm[:, None] < tl.cdiv(M, MX_BLOCK)) & (offs_k[None, :] < K)
        tl.store(col_code_ptr + cm[:, None] * K + offs_k[None, :], code.to(tl.uint8), mask=cmask)
        _store_data(col_ptr, tl.reshape(q, [BLOCK_M, BLOCK_K]), offs_m, offs_k, pid_k, M, K, BLOCK_M, BLOCK_K, PACKED)


# %%
# Launcher
# --------

BLOCK_M = 64
BLOCK_K = 128
NUM_WARPS = 4


def _element(element: object) -> FloatFormat:
    fmt = element_format(element)
    if fmt not in MX_ELEMENTS.values():
        raise TypeError(f"element: expected an MX element without a torch dtype (E2M1, E2M3, E3M2), got {fmt.name}")
    return fmt


def quantize_mx_coded(
    x: torch.Tensor, element: object, *, scale_mode: str = "rceil", rowwise: bool = True, columnwise: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """MXFP4 / MXFP6 of x (any shape, read as [M, K]), both usages from one read of x: (rowwise data, rowwise
    E8M0 codes [M, ceil(K/32)], columnwise data, columnwise codes [ceil(M/32), K]), None for a usage not
    asked for; data has x's shape with the last dim packed (E2M1: ceil(K/2) bytes). As engine.ops.native."""
    reference.check_input(x)
    fmt = _element(element)
    if scale_mode not in reference.SCALE_MODES:
        raise ValueError(f"scale_mode: expected one of {sorted(reference.SCALE_MODES)}, got {scale_mode!r}")
    x2d = reference.as_2d(x)
    m, k = x2d.shape
    kp = -(-k // 2) if fmt.bits == 4 else k
    dev = x.device
    empty = torch.empty(0, dtype=torch.uint8, device=dev)
    row = torch.empty((m, kp), dtype=torch.uint8, device=dev) if rowwise else empty
    row_codes = torch.empty((m, reference.mx_blocks(k)), dtype=torch.uint8, device=dev) if rowwise else empty
    col = torch.empty((m, kp), dtype=torch.uint8, device=dev) if columnwise else empty
    col_codes = torch.empty((reference.mx_blocks(m), k), dtype=torch.uint8, device=dev) if columnwise else empty
    if m and k and (rowwise or columnwise):
        grid = (triton.cdiv(m, BLOCK_M) * triton.cdiv(k, BLOCK_K),)
        _mx_small_kernel[grid](
            x2d, row, row_codes, col, col_codes, m, k, x2d.stride(0), x2d.stride(1), f32_bits(1.0 / fmt.max),
            MAN_BITS=fmt.mantissa_bits, BIAS=fmt.bias, CODE_BITS=fmt.bits, EMAX=fmt.max_exponent,
            FLOOR=scale_mode == "floor", ROWWISE=bool(rowwise), COLUMNWISE=bool(columnwise),
            BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS,
        )
    shape = (*x.shape[:-1], kp) if x.dim() else ()
    return ((row.view(shape) if rowwise else None), (row_codes if rowwise else None),
            (col.view(shape) if columnwise else None), (col_codes if columnwise else None))
