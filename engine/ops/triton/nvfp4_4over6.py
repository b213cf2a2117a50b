"""
NVFP4 "4over6" quantize (TE's ``nvfp4_4over6``): two candidates per block, the lower-error one kept
====================================================================================================

The bits of `engine.ops.nvfp4.quantize(four_over_six=True)` (read `engine.ops.nvfp4_4over6` for the
numerics), on CUDA tensors and, under ``TRITON_INTERPRET=1``, on CPU tensors. ``_nvfp4_4over6_kernel``
quantizes a strided 2D ``[R, C]`` view in 1x16 blocks along C (``TWO_D``: 16x16 tiles): the rowwise usage
is x ``[M, K]``, the columnwise one the view ``x.t()`` (no copy), so with 16x16 tiles each usage sums and
decides on its own rows. A program holds a ``[BLOCK_R, BLOCK_C]`` tile as ``[BLOCK_R, NB, 16]`` blocks: both
candidates' codes and error terms are computed for the whole tile, and each block row's 16 terms are added
to 0 in element order (taken apart by even / odd splits: `_sum_in_order`).
16x16 tiles add their 16 row errors by TE's tree (rows i and i + 8, then 4, 2, 1 apart: `_halves`).

Per block: ``base = div_rn(block_amax, 6) * S_enc``; ``s6 = e4m3(base)``, ``s4 = e4m3(base * 1.5)``
(integer RNE cast, `fp8_bits`); ``enc = div_rn(1, s * S_dec)``, above FLT_MAX -> FLT_MAX, a NaN kept;
``q = e2m1(x * enc)`` (`mx_small._mx_element_code`, then code 0 for a zero: TE's reference sign rule);
the error term of an element is taken on magnitudes, ``div_rn((|q| * s) * amax, 6E) - |x|`` (the same
bits as with signs: round to nearest is symmetric). The per-tensor values (S_enc from the amax by
`nvfp4_4over6.encode_scale`, S_dec, the amax, 6E) are computed on the device: no host sync.

Launched with ``enable_fp_fusion=False``: MSE's ``err + d * d`` would otherwise compile to an FMA (one
rounding fewer than TE's reference). Checked bit for bit under the interpreter and compiled for sm_80 /
sm_90 (tests/test_triton.py: no FMA, IEEE divisions only); never timed on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops import nvfp4_4over6 as ref46
from engine.ops.triton.fp8_bits import abs_bits, e4m3_scale_value, fp32_to_fp8_bits
from engine.ops.triton.mx_small import _mx_element_code, _store_data
from engine.ops.triton.tiles import load_tile

FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _code(y):
    """E2M1 code (int32) of fp32 y, RNE, saturating, with TE's reference sign rule: -0 and NaN give code 0."""
    return tl.where(y == 0.0, 0, _mx_element_code(y, 1, 1, 4))


@triton.jit
def _magnitude(code):
    """fp32 |value| of E2M1 codes (int32): c * 0.5 below code 2, else 2^((c >> 1) - 1) * (1 + (c & 1) / 2)."""
    c = code & 7
    normal = ((((c >> 1) + 126) << 23) | ((c & 1) << 22)).to(tl.float32, bitcast=True)
    return tl.where(c < 2, c.to(tl.float32) * 0.5, normal)


@triton.jit
def _encode_factor(sf, s_dec):
    """min(1 / (sf * S_dec), FLT_MAX), IEEE division, a NaN kept (torch.minimum)."""
    r = tl.math.div_rn(tl.full(sf.shape, 1.0, tl.float32), sf * s_dec)
    return tl.where(r > FLT_MAX, FLT_MAX, r)


@triton.jit
def _candidate(xb, sf, s_dec, amax, denom, MSE: tl.constexpr):
    """One candidate of blocks xb `[BLOCK_R, NB, 16]` with scale values sf `[BLOCK_R, NB]`: (codes, per-row
    errors: the 16 terms added to 0 in element order)."""
    enc = _encode_factor(sf, s_dec)
    code = _code(xb * enc[:, :, None])
    value = tl.math.div_rn((_magnitude(code) * sf[:, :, None]) * amax, tl.full(xb.shape, denom, tl.float32))
    d = value - tl.abs(xb)
    if MSE:
        terms = d * d
    else:
        terms = tl.abs(d)
    return code, _sum_in_order(terms, xb.shape[0], xb.shape[1])


@triton.jit
def _parity(t, R: tl.constexpr, NB: tl.constexpr, N: tl.constexpr):
    """t `[R, NB, N]` -> (t[..., 0::2], t[..., 1::2])."""
    return tl.split(tl.reshape(t, [R, NB, N // 2, 2]))


@triton.jit
def _sum_in_order(t, R: tl.constexpr, NB: tl.constexpr):
    """(((0 + t_0) + t_1) + ...) + t_15 over the last axis of t `[R, NB, 16]`: its 16 terms taken apart by
    4 levels of even / odd splits (leaf names: the term's index), then added in order."""
    e, o = _parity(t, R, NB, 16)
    e0, e1 = _parity(e, R, NB, 8)
    o0, o1 = _parity(o, R, NB, 8)
    e00, e01 = _parity(e0, R, NB, 4)
    e10, e11 = _parity(e1, R, NB, 4)
    o00, o01 = _parity(o0, R, NB, 4)
    o10, o11 = _parity(o1, R, NB, 4)
    t0, t8 = _parity(e00, R, NB, 2)
    t4, t12 = _parity(e01, R, NB, 2)
    t2, t10 = _parity(e10, R, NB, 2)
    t6, t14 = _parity(e11, R, NB, 2)
    t1, t9 = _parity(o00, R, NB, 2)
    t5, t13 = _parity(o01, R, NB, 2)
    t3, t11 = _parity(o10, R, NB, 2)
    t7, t15 = _parity(o11, R, NB, 2)
    err = tl.zeros([R, NB, 1], tl.float32) + t0
    err = err + t1
    err = err + t2
    err = err + t3
    err = err + t4
    err = err + t5
    err = err + t6
    err = err + t7
    err = err + t8
    err = err + t9
    err = err + t10
    err = err + t11
    err = err + t12
    err = err + t13
    err = err + t14
    err = err + t15
    return tl.reshape(err, [R, NB])


@triton.jit
def _halves(e, G: tl.constexpr, H: tl.constexpr, NB: tl.constexpr):
    """One level of TE's warp tree on `[G, 2H, NB]`: rows i and i + H added -> `[G, H, NB]`."""
    a, b = tl.split(tl.permute(tl.reshape(e, [G, 2, H, NB]), (0, 2, 3, 1)))
    return a + b


@triton.jit
def _tile_errors(e, BLOCK_R: tl.constexpr, NB: tl.constexpr):
    """16x16 tiles: the 16 row errors of each tile `[BLOCK_R, NB]` -> `[BLOCK_R // 16, NB]` by the tree."""
    G: tl.constexpr = BLOCK_R // 16
    e = _halves(tl.reshape(e, [G, 16, NB]), G, 8, NB)
    e = _halves(e, G, 4, NB)
    e = _halves(e, G, 2, NB)
    return tl.reshape(_halves(e, G, 1, NB), [G, NB])


@triton.jit
def _rows_of_tiles(v, BLOCK_R: tl.constexpr, NB: tl.constexpr):
    """`[BLOCK_R // 16, NB]` -> `[BLOCK_R, NB]`, each tile's value on its 16 rows."""
    return tl.reshape(tl.broadcast_to(v[:, None, :], [BLOCK_R // 16, 16, NB]), [BLOCK_R, NB])


@triton.jit
def _nvfp4_4over6_kernel(
    x_ptr, data_ptr, scale_ptr, params_ptr, R, C, stride_xr, stride_xc,
    TWO_D: tl.constexpr, MSE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    x, offs_r, offs_c, mask = load_tile(x_ptr, R, C, stride_xr, stride_xc, BLOCK_R, BLOCK_C)
    pid_c = tl.program_id(0) % tl.cdiv(C, BLOCK_C)
    s_enc = tl.load(params_ptr)
    s_dec = tl.load(params_ptr + 1)
    amax = tl.load(params_ptr + 2)
    denom = tl.load(params_ptr + 3)  # 6 * E
    NB: tl.constexpr = BLOCK_C // 16
    xb = tl.reshape(x, [BLOCK_R, NB, 16])
    bits = tl.max(abs_bits(xb), axis=2)  # block amax: an integer max of |bits| (a NaN propagates)
    if TWO_D:
        bits = _rows_of_tiles(tl.max(tl.reshape(bits, [BLOCK_R // 16, 16, NB]), axis=1), BLOCK_R, NB)
    base = tl.math.div_rn(bits.to(tl.float32, bitcast=True), tl.full([BLOCK_R, NB], 6.0, tl.float32)) * s_enc
    s4 = fp32_to_fp8_bits(base * 1.5, 3, 7, 0x7E).to(tl.int32)
    s6 = fp32_to_fp8_bits(base, 3, 7, 0x7E).to(tl.int32)
    code4, err4 = _candidate(xb, e4m3_scale_value(s4), s_dec, amax, denom, MSE)
    code6, err6 = _candidate(xb, e4m3_scale_value(s6), s_dec, amax, denom, MSE)
    if TWO_D:
        pick4 = _rows_of_tiles(_tile_errors(err4, BLOCK_R, NB) < _tile_errors(err6, BLOCK_R, NB), BLOCK_R, NB)
    else:
        pick4 = err4 < err6  # ties and NaN keep map-to-6
    q = tl.reshape(tl.where(pick4[:, :, None], code4, code6), [BLOCK_R, BLOCK_C])
    _store_data(data_ptr, q, offs_r, offs_c, pid_c, R, C, BLOCK_R, BLOCK_C, True)
    n_scales = tl.cdiv(C, 16)
    cs = pid_c.to(tl.int64) * NB + tl.arange(0, NB)
    tl.store(scale_ptr + offs_r[:, None] * n_scales + cs[None, :], tl.where(pick4, s4, s6).to(tl.uint8),
             mask=(offs_r[:, None] < R) & (cs[None, :] < n_scales))


# %%
# Launcher
# --------

BLOCK_R = 64
BLOCK_C = 128
NUM_WARPS = 4


def quantize_2d(v: torch.Tensor, amax: torch.Tensor, *, two_d: bool, err_mode: str, e4m3_max: float,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes `[R, ceil(C/2)]`, E4M3 scales `[R, ceil(C/16)]`) of a strided 2D view, as
    `nvfp4_4over6.quantize_2d` (`two_d`: 16x16 tiles), from its fp32 amax."""
    e4m3_max = ref46.check_options(err_mode, e4m3_max)
    r, c = v.shape
    a = amax.float().reshape(())
    s_enc = ref46.encode_scale(a, e4m3_max)
    params = torch.stack([s_enc, 1.0 / s_enc, a,
                          torch.tensor(6.0 * e4m3_max, dtype=torch.float32, device=v.device)])
    data = torch.empty((r, -(-c // 2)), dtype=torch.uint8, device=v.device)
    scales = torch.empty((r, -(-c // 16)), dtype=torch.uint8, device=v.device)
    if r and c:
        grid = (triton.cdiv(r, BLOCK_R) * triton.cdiv(c, BLOCK_C),)
        _nvfp4_4over6_kernel[grid](v, data, scales, params, r, c, v.stride(0), v.stride(1), TWO_D=two_d,
                                   MSE=err_mode == "MSE", BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=NUM_WARPS,
                                   enable_fp_fusion=False)
    return data, scales.view(torch.float8_e4m3fn)
