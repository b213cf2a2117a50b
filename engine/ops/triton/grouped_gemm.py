"""
Grouped FP8 GEMM: every expert's out_g = A_g @ B_g^T in one launch
==================================================================

A mixture of experts' fprop (and dgrad) multiplies consecutive row groups of one activation
A [T, K] (the tokens of expert g: rows ``offsets[g]:offsets[g+1]``) by that expert's matrix
B_g [N, K] (a slice of B [E, N, K]). One program computes one ``BLOCK_M x BLOCK_N`` output
tile of one group; the host lists the groups' row tiles (``tile_group``, ``tile_row``) from
``m_splits``, which it knows anyway, so there is no device-side search and no host sync.
A group with zero rows has no tile.

Operands are FP8 codes (uint8) with either

* one scale per group and operand (per-tensor FP8: delayed or current scaling), applied to the
  fp32 sum as ``acc * m_g * p1_g * p2_g`` where ``m_g`` is the product of the two scales' frexp
  mantissas and ``p1_g * p2_g`` the power of two (``engine.gemm.scales.times_pow2``): the
  per-expert CPU emulation's alpha, rounded once while the result is a normal number; or
* power-of-two tile scales (MXFP8's 1x32 E8M0 codes, block scaling's 1x128 / 128x128
  power-of-two fp32 scales), applied to each element at the decode (exact: a power of two
  times an FP8 value, unless that underflows fp32's normal range).

Numerics: the contract of ``engine.ops.exact_gemm`` (and so of the per-expert path it is tested
against): exact decode, exact fp32 products, fp32 sum in an unspecified order (here: blocks of
``BLOCK_K``, ``tl.dot`` with IEEE fp32 inputs), then the scale product and the bias add (fp32).
The output is fp32; the caller rounds it once to its dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.triton.fp8_bits import fp8_bits_to_bf16_bits, fp8_params

BLOCK_M = 32
BLOCK_N = 32
BLOCK_K = 32  # divides every tile width along K the kernel is given (32 for MX, 128 for block scaling)
NUM_WARPS = 4
#: no fma for `acc * factor + bias`: the scale product and the bias add round once each, as the per-expert path's
#: (inside tl.dot fusing changes nothing: every product of two decoded FP8 values is exact in fp32)
LAUNCH_OPTIONS = {"enable_fp_fusion": False}


@triton.jit
def _decode(codes, MAN_BITS: tl.constexpr, EXP_BITS: tl.constexpr, BIAS: tl.constexpr, IEEE_LIKE: tl.constexpr):
    """FP8 codes (int32) -> their exact fp32 values (NaN codes: the quiet NaN 0x7FC00000)."""
    bits = fp8_bits_to_bf16_bits(codes, MAN_BITS, EXP_BITS, BIAS, IEEE_LIKE) & 0xFFFF
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def _tile_scale(scale_ptr, rows, cols, mask, E8M0: tl.constexpr):
    """The fp32 scale of each element from its tile's scale: fp32 values, or E8M0 codes decoded by bits
    (code 0: 2^-127, a subnormal; 255: NaN)."""
    if E8M0:
        code = tl.load(scale_ptr + rows + cols, mask=mask, other=127).to(tl.int32)
        bits = tl.where(code == 0, 0x00400000, code << 23)
        bits = tl.where(code == 255, 0x7FC00000, bits)
        scale = bits.to(tl.float32, bitcast=True)
    else:
        scale = tl.load(scale_ptr + rows + cols, mask=mask, other=1.0).to(tl.float32)
    return scale


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, out_ptr, tile_group_ptr, tile_row_ptr, group_end_ptr, factor_ptr, bias_ptr,
    a_scale_ptr, b_scale_ptr,
    N, K, stride_am, stride_bg, stride_bn, stride_om,
    stride_as_m, stride_bs_g, stride_bs_n,
    A_MAN: tl.constexpr, A_EXP: tl.constexpr, A_BIAS: tl.constexpr, A_IEEE: tl.constexpr,
    B_MAN: tl.constexpr, B_EXP: tl.constexpr, B_BIAS: tl.constexpr, B_IEEE: tl.constexpr,
    TILED: tl.constexpr, E8M0: tl.constexpr, A_TILE_ROWS: tl.constexpr, B_TILE_ROWS: tl.constexpr,
    TILE_COLS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    t = pid // tiles_n
    g = tl.load(tile_group_ptr + t).to(tl.int64)
    row0 = tl.load(tile_row_ptr + t).to(tl.int64)
    row_end = tl.load(group_end_ptr + g).to(tl.int64)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = (pid % tiles_n).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < row_end
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a_mask = mask_m[:, None] & mask_k[None, :]
        b_mask = mask_n[:, None] & mask_k[None, :]
        a_codes = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :], mask=a_mask, other=0)
        b_codes = tl.load(b_ptr + g * stride_bg + offs_n[:, None] * stride_bn + offs_k[None, :], mask=b_mask, other=0)
        a = _decode(a_codes.to(tl.int32), A_MAN, A_EXP, A_BIAS, A_IEEE)
        b = _decode(b_codes.to(tl.int32), B_MAN, B_EXP, B_BIAS, B_IEEE)
        if TILED:
            kt = (offs_k // TILE_COLS)[None, :]
            a = a * _tile_scale(a_scale_ptr, (offs_m // A_TILE_ROWS)[:, None] * stride_as_m, kt, a_mask, E8M0)
            b = b * _tile_scale(b_scale_ptr + g * stride_bs_g, (offs_n // B_TILE_ROWS)[:, None] * stride_bs_n, kt,
                                b_mask, E8M0)
        acc += tl.dot(a, tl.trans(b), input_precision="ieee")
    if not TILED:  # per-tensor scales: mantissa product, then the power of two in two exact steps
        acc = acc * tl.load(factor_ptr + 3 * g) * tl.load(factor_ptr + 3 * g + 1) * tl.load(factor_ptr + 3 * g + 2)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + g * N + offs_n, mask=mask_n, other=0.0)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc, mask=mask_m[:, None] & mask_n[None, :])


def _fp8_constants(dtype: torch.dtype) -> tuple[int, int, int, bool]:
    p = fp8_params(dtype)
    return p.man_bits, p.exp_bits, p.bias, p.ieee_like


def tile_schedule(m_splits: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tile_group, tile_row, group_end) int32: each BLOCK_M row tile of each non-empty group."""
    groups, rows, ends, start = [], [], [], 0
    for g, m in enumerate(m_splits):
        for r in range(start, start + m, BLOCK_M):
            groups.append(g)
            rows.append(r)
        start += m
        ends.append(start)

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

    return as_tensor(groups), as_tensor(rows), as_tensor(ends)


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, m_splits: list[int], *, factors: torch.Tensor | None = None,
                 a_scale: torch.Tensor | None = None, b_scale: torch.Tensor | None = None,
                 a_tile_rows: int = 1, b_tile_rows: int = 1, tile_cols: int = 0,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 out [T, N]: rows of group g = decode(a rows of g) @ decode(b[g])^T (* scales) (+ bias[g]).

    a: FP8 [T, K]; b: FP8 [E, N, K] (K contiguous); m_splits: E ints summing to T.
    Per-tensor: `factors` fp32 [E, 3] (mantissa product, 2^e1, 2^e2 per group). Tiled: `a_scale` [T', K'] and
    `b_scale` [E, N', K'] (fp32 powers of two, or uint8 E8M0 codes), tiles of (a_tile_rows | b_tile_rows) x
    tile_cols. bias: fp32 [E, N] or None.
    """
    t, k = a.shape
    e, n, _ = b.shape
    out = torch.empty(t, n, dtype=torch.float32, device=a.device)
    tile_group, tile_row, group_end = tile_schedule(m_splits, a.device)
    if tile_group.numel() == 0 or n == 0:
        return out.zero_()
    tiled = factors is None
    if tiled and (tile_cols % BLOCK_K or a_scale is None or b_scale is None):
        raise ValueError(f"grouped_gemm: tiled operands need a_scale, b_scale and tile_cols a multiple of {BLOCK_K}, "
                         f"got tile_cols={tile_cols}")
    dummy = out
    a_scale = a_scale.contiguous() if tiled else dummy
    b_scale = b_scale.contiguous() if tiled else dummy
    grid = (tile_group.numel() * triton.cdiv(n, BLOCK_N),)
    _grouped_gemm_kernel[grid](
        a.view(torch.uint8), b.view(torch.uint8), out, tile_group, tile_row, group_end,
        dummy if factors is None else factors.contiguous(), dummy if bias is None else bias.contiguous(),
        a_scale, b_scale,
        n, k, a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        a_scale.stride(0) if tiled else 0, b_scale.stride(0) if tiled else 0, b_scale.stride(1) if tiled else 0,
        *_fp8_constants(a.dtype), *_fp8_constants(b.dtype),
        TILED=tiled, E8M0=tiled and a_scale.dtype == torch.uint8, A_TILE_ROWS=a_tile_rows, B_TILE_ROWS=b_tile_rows,
        TILE_COLS=max(tile_cols, 1), HAS_BIAS=bias is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS, **LAUNCH_OPTIONS,
    )
    return out
