"""
NVFP4 quantize (Transformer Engine's recipe): E2M1 per 16 with an E4M3 scale and an fp32 amax
==============================================================================================

The bits of `engine.ops.nvfp4.quantize` (read its docstring for the numerics), on CUDA tensors
(and on CPU tensors under ``TRITON_INTERPRET=1``, how the tests check it). Two kernels:

* ``_nvfp4_kernel`` quantizes a strided 2D ``[R, C]`` view in 1x16 blocks along C (``TWO_D``:
  16x16 tiles, each tile's scale written on its 16 rows): rowwise usage = x ``[M, K]``, columnwise
  = the view ``x.t()`` ``[K, M]`` (no copy) or the RHT output. Per block: the block amax (an integer
  max of |bits|, so a NaN propagates), ``s_b = e4m3_satfinite(block_amax * (S_enc * (1/6)))``
  (integer RNE cast, `fp8_bits`), ``enc_b = fmin(1 / (s_b * S_dec), FLT_MAX)`` with an IEEE division
  (``div_rn``; a NaN or zero scale gives FLT_MAX as C's ``fminf`` does), ``q = e2m1(x * enc_b)``:
  round to nearest even by integer arithmetic (`mx_small._mx_element_code`), or stochastic rounding
  with the counter-based bits of `engine.ops.nvfp4_sr` (the same hash, on int64 lanes masked to 32
  bits, of the element's row-major index in ``[R, C]`` plus the counter's offset).
* ``_rht_kernel``: the columnwise input of the RHT layout, ``y[k, 16j + c] = sum_i x[16j + i, k] * H[i, c]``
  by the reference's butterflies (`rht_transform`: 4 stages of (a + b, a - b) over the 16 tokens, as
  reshape / split / join of a ``[J, 16, K]`` block), rounded to bf16 by integer RNE, stored ``[K, M]``.
  H's entries are +-1/4: each term is x / 4 rounded to fp32 (exact unless it is subnormal), made by
  integer ops and a sign flip, so no multiply can fuse with the adds (an FMA would skip that rounding).

No fp32 multiply feeds an add anywhere (the GPU compile check in tests/test_triton.py finds no FMA), and
the one division is ``div_rn``.

The per-tensor values (``S_enc`` from the amax, ``S_enc * (1/6)``, ``S_dec = 1 / S_enc``) are a few fp32
scalar ops, computed on the device by the reference's own functions (`nvfp4.encode_scale`): no host
sync. The amaxes come from the Triton amax kernel (of x, or of the RHT output) unless given.

Not fused as the C++ kernel is: the RHT output is a bf16 ``[K, M]`` buffer that the amax and quantize
kernels read back, and each usage is its own launch. Checked bit for bit under the interpreter and
compiled for sm_80 / sm_90; never timed on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops import nvfp4 as ref_nvfp4
from engine.ops import reference
from engine.ops.triton.cast_transpose import amax as amax_of
from engine.ops.triton.fp8_bits import abs_bits, e4m3_scale_value, fp32_to_fp8_bits
from engine.ops.triton import nvfp4_4over6
from engine.ops.triton.mx_small import _mx_element_code, _store_data
from engine.ops.triton.tiles import load_tile, to_fp32

NVFP4_BLOCK = 16
FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _hash32(v):
    """`nvfp4_sr._hash32` ("lowbias32") on int64 lanes: the input masked to 32 bits, every product too."""
    v = v & 0xFFFFFFFF
    v = v ^ (v >> 16)
    v = (v * 0x7FEB352D) & 0xFFFFFFFF
    v = v ^ (v >> 15)
    v = (v * 0x846CA68B) & 0xFFFFFFFF
    return v ^ (v >> 16)


@triton.jit
def _random_bits(index, seed):
    """uint8-valued int32 random bits of int64 element indices (offset included), as `nvfp4_sr.random_bits`."""
    word = (index >> 2) & 0x3FFFFFFFFFFFFFFF  # index mod 2^64, shifted logically: one mix per 4 elements
    key = _hash32(seed & 0xFFFFFFFF) ^ ((seed >> 32) & 0xFFFFFFFF)
    mixed = _hash32(_hash32(word & 0xFFFFFFFF) ^ key ^ ((word >> 32) * 0x9E3779B9))
    return ((mixed >> ((index & 3) * 8)) & 0xFF).to(tl.int32)


@triton.jit
def _e2m1_stochastic(y, rbits):
    """`nvfp4_sr.encode_e2m1_stochastic` of fp32 y with int32 random bits in [0, 255], as int32 codes.

    With `a = min(|y|, 6)` and the grid step at a (0.5, 1, 2), `T = floor(a / step * 256)` is exact (a scaling
    by a power of two, then floor): `n = T >> 8` steps lie below a and the reference's
    `frac256 >= 256 - rbits` is `(T & 255) >= 256 - rbits` (an integer bound). The code is `n + up` plus
    the grid's offset of the step's binade (0, 2, 4). No float add follows a multiply: nothing fuses.
    """
    a = tl.minimum(tl.abs(y), 6.0)
    a = tl.where(a != a, 0.0, a)  # NaN: code 0 at the end
    region = tl.where(a < 2.0, 0, tl.where(a < 4.0, 1, 2))
    t = tl.floor(a * tl.where(region == 0, 512.0, tl.where(region == 1, 256.0, 128.0))).to(tl.int32)
    n = t >> 8
    up = ((t & 255) >= 256 - rbits) & ((region != 2) | (n != 3))  # never above 6
    code = n + up.to(tl.int32) + 2 * region
    negative = (y.to(tl.int32, bitcast=True) >> 31) != 0
    return tl.where(y != y, 0, tl.where(negative, code | 8, code))


@triton.jit
def _nvfp4_kernel(
    x_ptr, data_ptr, scale_ptr, amax_params_ptr, counter_ptr, R, C, stride_xr, stride_xc, index_base,
    TWO_D: tl.constexpr, STOCHASTIC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    x, offs_r, offs_c, mask = load_tile(x_ptr, R, C, stride_xr, stride_xc, BLOCK_R, BLOCK_C)
    tiles_c = tl.cdiv(C, BLOCK_C)
    pid_c = tl.program_id(0) % tiles_c
    multiplier = tl.load(amax_params_ptr)  # S_enc * (1/6)
    s_dec = tl.load(amax_params_ptr + 1)
    NB: tl.constexpr = BLOCK_C // 16
    if TWO_D:  # 16x16 tiles: [BLOCK_R/16, 16, NB, 16], reduce over the two 16-axes
        xb = tl.reshape(x, [BLOCK_R // 16, 16, NB, 16])
        amax_bits = tl.max(tl.max(abs_bits(xb), axis=3), axis=1)  # [BLOCK_R/16, NB]
        amax_bits = tl.reshape(tl.broadcast_to(amax_bits[:, None, :], [BLOCK_R // 16, 16, NB]), [BLOCK_R, NB])
    else:
        xb = tl.reshape(x, [BLOCK_R, NB, 16])
        amax_bits = tl.max(abs_bits(xb), axis=2)  # [BLOCK_R, NB]
    block_amax = amax_bits.to(tl.float32, bitcast=True)
    s_b = fp32_to_fp8_bits(block_amax * multiplier, 3, 7, 0x7E)  # E4M3 satfinite, NaN -> 0x7F
    s_b_f32 = e4m3_scale_value(s_b.to(tl.int32))
    r = tl.math.div_rn(tl.full([BLOCK_R, NB], 1.0, tl.float32), s_b_f32 * s_dec)
    enc = tl.where(r != r, FLT_MAX, tl.minimum(r, FLT_MAX))
    y = tl.reshape(tl.reshape(x, [BLOCK_R, NB, 16]) * enc[:, :, None], [BLOCK_R, BLOCK_C])
    if STOCHASTIC:
        seed = tl.load(counter_ptr)
        index = tl.load(counter_ptr + 1) + index_base + offs_r[:, None] * C + offs_c[None, :]
        q = _e2m1_stochastic(y, _random_bits(index, seed))
    else:
        q = _mx_element_code(y, 1, 1, 4)
    _store_data(data_ptr, q, offs_r, offs_c, pid_c, R, C, BLOCK_R, BLOCK_C, True)
    n_scales = tl.cdiv(C, 16)
    cs = pid_c.to(tl.int64) * NB + tl.arange(0, NB)
    smask = (offs_r[:, None] < R) & (cs[None, :] < n_scales)
    tl.store(scale_ptr + offs_r[:, None] * n_scales + cs[None, :], s_b, mask=smask)


@triton.jit
def _quarter(x):
    """x / 4 rounded to fp32 (RNE) by integer ops: the exponent lowered by 2, or a subnormal result shifted
    right with RNE; inf and NaN unchanged. (A float multiply here could fuse with the RHT's sums.)"""
    bits = x.to(tl.int32, bitcast=True)
    sign = bits & -0x80000000
    u = bits & 0x7FFFFFFF
    e = u >> 23
    sig = tl.where(e == 0, u & 0x7FFFFF, (u & 0x7FFFFF) | 0x800000)
    shift = tl.where(e == 2, 1, 2)  # subnormal result in units of 2^-149: sig * 2^(max(e, 1) - 3)
    q = sig >> shift
    rem = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    out = tl.where(e >= 255, u, tl.where(e > 2, u - (2 << 23), q))
    return (out | sign).to(tl.float32, bitcast=True)


@triton.jit
def _butterfly(v, H: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr):
    """One butterfly stage of `rht_transform` on v [J, 16 tokens, K]: tokens i and i + H (i & H == 0) become
    their sum and difference."""
    pairs = tl.permute(tl.reshape(v, [BLOCK_J, 8 // H, 2, H, BLOCK_K]), (0, 1, 3, 4, 2))
    a, b = tl.split(pairs)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 4, 2, 3)), [BLOCK_J, 16, BLOCK_K])


@triton.jit
def _rht_kernel(x_ptr, h_ptr, y_ptr, M, K, stride_xm, stride_xk, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr):
    """y [K, M] (bf16 bits as int16) = the 16-point RHT of x^T along M (module doc); M % 16 == 0."""
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K, BLOCK_K)
    offs_j = (pid // tiles_k).to(tl.int64) * BLOCK_J + tl.arange(0, BLOCK_J)  # groups of 16 tokens
    offs_k = (pid % tiles_k).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.arange(0, 16)
    mask = (offs_j[:, None, None] < M // 16) & (offs_k[None, None, :] < K)
    x = to_fp32(tl.load(x_ptr + (offs_j[:, None, None] * 16 + cols[None, :, None]) * stride_xm
                        + offs_k[None, None, :] * stride_xk, mask=mask, other=0.0))  # [J, 16 tokens, K]
    negative = tl.load(h_ptr + cols * 16) < 0  # H[i, 0] = s_i / 4
    q = _quarter(x)  # x / 4 by integer ops: no float multiply to fuse with the sums below
    v = tl.where(negative[None, :, None], -q, q)
    v = _butterfly(v, 1, BLOCK_J, BLOCK_K)  # the stages of rht_transform, h = 1, 2, 4, 8
    v = _butterfly(v, 2, BLOCK_J, BLOCK_K)
    v = _butterfly(v, 4, BLOCK_J, BLOCK_K)
    v = _butterfly(v, 8, BLOCK_J, BLOCK_K)
    bits = v.to(tl.int32, bitcast=True)
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    bf16 = tl.where(is_nan, 0x7FC0, rounded)
    out = offs_k[None, None, :] * M + offs_j[:, None, None] * 16 + cols[None, :, None]
    omask = (offs_j[:, None, None] < M // 16) & (offs_k[None, None, :] < K)
    tl.store(y_ptr + out, bf16.to(tl.int16), mask=omask)


# %%
# Launcher
# --------

BLOCK_R = 64
BLOCK_C = 128
RHT_BLOCK_J = 8
RHT_BLOCK_K = 64
NUM_WARPS = 4


def rht_transform(x2d: torch.Tensor) -> torch.Tensor:
    """`engine.ops.nvfp4.rht_transform(x2d.t())`: bf16 `[K, M]`; M must be a multiple of 16."""
    m, k = x2d.shape
    if m % NVFP4_BLOCK:
        raise ValueError(f"x: the random Hadamard transform mixes {NVFP4_BLOCK} tokens, so the token count "
                         f"(M, the product of the leading dims) must be a multiple of {NVFP4_BLOCK}, got {m}")
    y = torch.empty((k, m), dtype=torch.int16, device=x2d.device)
    if m and k:
        h = ref_nvfp4.hadamard_matrix(torch.float32, x2d.device).contiguous()
        grid = (triton.cdiv(m // NVFP4_BLOCK, RHT_BLOCK_J) * triton.cdiv(k, RHT_BLOCK_K),)
        _rht_kernel[grid](x2d, h, y, m, k, x2d.stride(0), x2d.stride(1), BLOCK_J=RHT_BLOCK_J,
                          BLOCK_K=RHT_BLOCK_K, num_warps=NUM_WARPS)
    return y.view(torch.bfloat16)


def _given(t: torch.Tensor | None, name: str, device: torch.device) -> torch.Tensor | None:
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() != 1:
        raise TypeError(f"{name}: expected a 1-element floating-point tensor, got {t!r}")
    return t.float().reshape(1).to(device)


def _quantize_2d(v: torch.Tensor, amax: torch.Tensor, two_d: bool, counter: torch.Tensor | None,
                 index_base: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes [R, ceil(C/2)], E4M3 scales [R, ceil(C/16)]) of a strided 2D view, from its amax."""
    r, c = v.shape
    s_enc = ref_nvfp4.encode_scale(amax.reshape(()))
    params = torch.stack([s_enc * torch.tensor(1.0 / 6.0, dtype=torch.float32, device=v.device), 1.0 / s_enc])
    data = torch.empty((r, -(-c // 2)), dtype=torch.uint8, device=v.device)
    scales = torch.empty((r, -(-c // NVFP4_BLOCK)), dtype=torch.uint8, device=v.device)
    if r and c:
        grid = (triton.cdiv(r, BLOCK_R) * triton.cdiv(c, BLOCK_C),)
        _nvfp4_kernel[grid](v, data, scales, params, params if counter is None else counter, r, c,
                            v.stride(0), v.stride(1), index_base, TWO_D=two_d, STOCHASTIC=counter is not None,
                            BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=NUM_WARPS)
    return data, scales.view(torch.float8_e4m3fn)


def quantize_nvfp4(
    x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = True, two_d: bool = False, rht: bool = False,
    amax: torch.Tensor | None = None, amax_t: torch.Tensor | None = None, counter: torch.Tensor | None = None,
    four_over_six: bool = False, four_over_six_err_mode: str = "MAE", four_over_six_e4m3_max: float = 448.0,
) -> dict[str, torch.Tensor | None]:
    """NVFP4 of x for the asked usages: `engine.ops.native.quantize_nvfp4`'s arguments and dict, bit for bit.

    `counter` (int64 `[2]` (seed, offset)) selects stochastic rounding: the rowwise bits start at the
    offset, the columnwise ones after the rowwise M*K; it is read on the device, not advanced.
    `four_over_six` / `four_over_six_err_mode` / `four_over_six_e4m3_max`: TE's 4over6 (`nvfp4_4over6.py`
    here, `engine.ops.nvfp4_4over6` the spec); not with `rht` nor `counter`.
    """
    reference.check_input(x)
    if two_d and rht:
        raise ValueError("two_d and rht: TE applies the RHT to inputs and gradients only, never with 16x16 tiles")
    ref_nvfp4.check_four_over_six(four_over_six, four_over_six_err_mode, four_over_six_e4m3_max, rht=rht,
                                  stochastic=counter is not None)
    if counter is not None and (not isinstance(counter, torch.Tensor) or counter.dtype != torch.int64
                                or tuple(counter.shape) != (2,)):
        raise TypeError(f"counter: expected an int64 tensor of shape (2,) holding (seed, offset), got {counter!r}")
    x2d = reference.as_2d(x)
    m, k = x2d.shape
    out: dict[str, torch.Tensor | None] = dict.fromkeys(
        ("rowwise_data", "rowwise_scale_inv", "amax_rowwise", "columnwise_data", "columnwise_scale_inv",
         "amax_columnwise"))

    def quantize_usage(v: torch.Tensor, a: torch.Tensor, index_base: int) -> tuple[torch.Tensor, torch.Tensor]:
        if four_over_six:
            return nvfp4_4over6.quantize_2d(v, a, two_d=two_d, err_mode=four_over_six_err_mode,
                                            e4m3_max=four_over_six_e4m3_max)
        return _quantize_2d(v, a, two_d, counter, index_base)

    if rowwise:
        a = _given(amax, "amax", x.device)
        a = amax_of(x2d) if a is None else a
        out["rowwise_data"], out["rowwise_scale_inv"] = quantize_usage(x2d, a, 0)
        out["amax_rowwise"] = a
    if columnwise:
        xt = rht_transform(x2d) if rht else x2d.t()
        a = _given(amax_t, "amax_t", x.device)
        if a is None:  # x^T's amax is x's: measured once when the rowwise usage measured it
            a = out["amax_rowwise"] if rowwise and amax is None and not rht else amax_of(xt)
        out["columnwise_data"], out["columnwise_scale_inv"] = quantize_usage(xt, a, m * k if rowwise else 0)
        out["amax_columnwise"] = a
    return out
