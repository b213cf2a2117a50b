"""NVFP4 (Transformer Engine's NVFP4BlockScaling), the executable spec in plain PyTorch.

E2M1 elements in blocks of 16 with an E4M3 block scale, and one fp32 per-tensor amax. Every
step is fp32 and in this order (TE's quantize kernel, `common/cast/nvfp4/core_nvfp4.cuh`):

1. `amax` = max|x| of the tensor (of the RHT output for RHT'd columnwise data).
2. `S_enc = fmin(448*6 / amax, FLT_MAX)`; `S_enc = 1` if amax is 0 or the quotient is 0
   (amax inf). `fmin` ignores a NaN (C's fminf): a NaN amax gives FLT_MAX. `S_dec = 1 / S_enc`.
3. Per block: `s_b = e4m3_rne_satfinite(block_amax * (S_enc * (1/6)))`. No lower clamp:
   subnormal and zero E4M3 scales occur. A NaN block gives the E4M3 NaN code 0x7F.
4. `enc_b = fmin(1 / (float(s_b) * S_dec), FLT_MAX)` (a zero scale gives FLT_MAX).
5. `q = e2m1_rne_satfinite(x * enc_b)` (`mx_elements.encode`: inf -> +-6, NaN -> code 0).
   Gradients may use stochastic rounding instead (`engine.ops.nvfp4_sr`).

Dequantize (TE's dequantize kernel): `q * ((float(s_b) * amax) * (1/2688))`, fp32, then the
output dtype. Consequences for non-finite input: a NaN anywhere makes amax NaN and the whole
tensor dequantizes to NaN; an inf makes amax inf, its element dequantizes to +-inf, other
nonzero elements of blocks with a nonzero scale to +-inf and zeros to NaN (0 * inf), as on TE.

Layouts (the 2D view `[M, K]` of x):
* rowwise: 1x16 blocks along K; data `[M, ceil(K/2)]` uint8, E2M1 packed along K (element 2i
  in the low nibble); scales `[M, ceil(K/16)]` E4M3.
* columnwise: 16x1 blocks of x along M, stored transposed as TE stores `data_t`: data
  `[K, ceil(M/2)]` (packed along M), scales `[K, ceil(M/16)]`. Its amax is its own (after RHT).
* 2D (weights): one scale per 16x16 tile, stored per row as TE stores it (each tile's scale
  repeated on its 16 rows), so rowwise and columnwise data are transposes of each other.
Scales are stored compactly (no 128x4 swizzle padding; that is a CUDA GEMM detail).

Partial blocks: zero padding changes no block amax, so a dim that is not a multiple of 16 ends
in a partial block (TE requires multiples of 16). The RHT mixes 16 tokens and so needs
M % 16 == 0; `rht=True` with another M is a ValueError naming that rule.

torchao's `NVFP4Tensor` (`prototype/mx_formats/nvfp4_tensor.py`, `nvfp4_quantize`) differs: it stores
`per_tensor_scale = amax / (6*448)` and computes `s_b = e4m3((block_amax / 6) / per_tensor_scale)`
(a division, not TE's folded `S_enc * (1/6)` product), clamps that scale to at least 2^-6 (the
smallest normal E4M3: no subnormal or zero scales), scales elements by `(1 / per_tensor_scale) / s_b`,
also has a single-level mode without a per-tensor scale, requires K % 16 == 0, and has no RHT / 2D /
stochastic-rounding paths. Its variant is not offered: TE is what trains in NVFP4 and bit-exactness
with it is the goal; torchao's form is for inference checkpoints.
"""

from __future__ import annotations

import torch

from engine.formats import E2M1
from engine.ops import mx_elements
from engine.ops import nvfp4_4over6 as four_over_six_ref
from engine.ops import reference as ref
from engine.ops.nvfp4_sr import encode_e2m1_stochastic
from engine.schemes import RHT_SIGNS, Scheme

NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
FLT_MAX = torch.finfo(torch.float32).max


def _f32(v: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32, device=like.device)


def encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc from a per-tensor fp32 amax (step 2 of the module doc), elementwise."""
    a = amax.float()
    s = torch.fmin(_f32(E4M3_MAX * E2M1_MAX, a) / a, _f32(FLT_MAX, a))
    return torch.where((a == 0) | (s == 0), _f32(1.0, a), s)


def block_scales(block_amax: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales s_b (step 3), as float8_e4m3fn."""
    multiplier = s_enc.float() * _f32(1.0 / E2M1_MAX, s_enc)  # S_enc * (1/6), one fp32 rounding
    return ref.cast_to_fp8(block_amax.float() * multiplier, torch.float8_e4m3fn)


def block_encode(s_b: torch.Tensor, s_dec: torch.Tensor) -> torch.Tensor:
    """enc_b = fmin(1 / (float(s_b) * S_dec), FLT_MAX) (step 4)."""
    return torch.fmin(1.0 / (s_b.float() * s_dec), _f32(FLT_MAX, s_dec))


def _pad(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))


def quantize_2d(
    x2d: torch.Tensor, amax: torch.Tensor, *, tile_rows: int = 1, rbits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 of a 2D tensor with 1x16 (`tile_rows=1`) or 16x16 (`tile_rows=16`) blocks along its last dim.

    `amax` is the fp32 per-tensor amax the scales derive from. `rbits` (uint8, x's shape) selects
    stochastic rounding with those random bits; None rounds to nearest even. Returns (packed E2M1
    codes `[M, ceil(K/2)]` uint8, E4M3 scales `[M, ceil(K/16)]`, per row as TE stores them).
    """
    if tile_rows not in (1, NVFP4_BLOCK):
        raise ValueError(f"tile_rows: expected 1 (1x16 blocks) or 16 (16x16 tiles), got {tile_rows}")
    m, k = x2d.shape
    gr, gc = -(-m // tile_rows), -(-k // NVFP4_BLOCK)
    xf = _pad(x2d.float(), gr * tile_rows, gc * NVFP4_BLOCK)
    tiles = xf.reshape(gr, tile_rows, gc, NVFP4_BLOCK)
    block_amax = tiles.abs().amax(dim=(1, 3)) if tiles.numel() else torch.zeros(gr, gc, device=x2d.device)
    s_enc = encode_scale(amax.reshape(()))
    s_dec = 1.0 / s_enc
    s_b = block_scales(block_amax, s_enc)  # [gr, gc]
    enc = block_encode(s_b, s_dec)
    scaled = (tiles * enc[:, None, :, None]).reshape(gr * tile_rows, gc * NVFP4_BLOCK)[:m, :k]
    if rbits is None:
        codes = mx_elements.encode(scaled, E2M1)
    else:
        codes = encode_e2m1_stochastic(scaled, rbits)
    scales = s_b.repeat_interleave(tile_rows, dim=0)[:m] if tile_rows > 1 else s_b
    return mx_elements.pack(codes, E2M1), scales.contiguous()


def dequantize_2d(
    data: torch.Tensor, scales: torch.Tensor, amax: torch.Tensor, cols: int, dtype: torch.dtype = torch.float32,
    *, e4m3_max: float = E4M3_MAX,
) -> torch.Tensor:
    """Values `[M, cols]` of packed codes and per-row E4M3 scales: `q * ((s_b * amax) * (1/2688))` in fp32.

    `e4m3_max`: the global E4M3 bound E the scales were made with (4over6 may use 256): the factor is then
    `fp32(1 / (6 * E))`, as TE's dequantize kernel.
    """
    q = mx_elements.decode(mx_elements.unpack(data, E2M1, cols), E2M1)
    e4m3_max = float(e4m3_max)
    if e4m3_max not in four_over_six_ref.E4M3_BOUNDS:
        raise ValueError(f"e4m3_max: expected 448 or 256, got {e4m3_max!r}")
    factor = (scales.float() * amax.float().reshape(())) * (_f32(1.0, q) / _f32(E2M1_MAX * e4m3_max, q))
    return (q * factor.repeat_interleave(NVFP4_BLOCK, dim=1)[:, :cols]).to(dtype)


def quantize(
    x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = True, two_d: bool = False, rht: bool = False,
    rbits: torch.Tensor | None = None, rbits_t: torch.Tensor | None = None,
    amax: torch.Tensor | None = None, amax_t: torch.Tensor | None = None,
    four_over_six: bool = False, four_over_six_err_mode: str = "MAE", four_over_six_e4m3_max: float = 448.0,
) -> dict[str, torch.Tensor | None]:
    """x quantized to NVFP4 for the asked usages, as TE does it.

    `two_d`: 16x16 tiles (weights), so both usages share their scales (transposed). `rht`: the
    columnwise copy is quantized from `rht_transform(x^T)` (inputs and output gradients). `rbits`
    / `rbits_t`: random bits for stochastic rounding of the rowwise (`[M, K]`) and columnwise
    (`[K, M]`) data. `amax` / `amax_t`: given per-tensor amaxes (all-reduced over a group) instead of
    this tensor's own. `four_over_six`: TE's "4over6" (`engine.ops.nvfp4_4over6`): each block keeps
    the nearer of its map-to-6 and map-to-4 candidates by `four_over_six_err_mode` ("MAE" or "MSE"),
    with the global E4M3 bound `four_over_six_e4m3_max` (448 or 256; ignored without 4over6, as TE
    does); not with the RHT nor stochastic rounding (TE refuses both). Returns rowwise_data /
    rowwise_scale_inv / amax_rowwise and the columnwise ones (None where not asked for).
    """
    ref.check_input(x)
    if two_d and rht:
        raise ValueError("two_d and rht: TE applies the RHT to inputs and gradients only, never with 16x16 tiles")
    check_four_over_six(four_over_six, four_over_six_err_mode, four_over_six_e4m3_max, rht=rht,
                        stochastic=rbits is not None or rbits_t is not None)
    x2d = ref.as_2d(x)
    tile_rows = NVFP4_BLOCK if two_d else 1

    def quantize_usage(v: torch.Tensor, a: torch.Tensor, bits: torch.Tensor | None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        if four_over_six:
            return four_over_six_ref.quantize_2d(v, a, tile_rows=tile_rows, err_mode=four_over_six_err_mode,
                                                 e4m3_max=four_over_six_e4m3_max)
        return quantize_2d(v, a, tile_rows=tile_rows, rbits=bits)

    out: dict[str, torch.Tensor | None] = dict.fromkeys(
        ("rowwise_data", "rowwise_scale_inv", "amax_rowwise", "columnwise_data", "columnwise_scale_inv",
         "amax_columnwise"))
    if rowwise:
        a = ref.amax(x2d) if amax is None else amax.float().reshape(1)
        out["rowwise_data"], out["rowwise_scale_inv"] = quantize_usage(x2d, a, rbits)
        out["amax_rowwise"] = a
    if columnwise:
        xt = columnwise_input(x2d, rht)
        a = ref.amax(xt) if amax_t is None else amax_t.float().reshape(1)
        out["columnwise_data"], out["columnwise_scale_inv"] = quantize_usage(xt, a, rbits_t)
        out["amax_columnwise"] = a
    return out


def check_four_over_six(four_over_six: object, err_mode: object, e4m3_max: object, *, rht: bool,
                        stochastic: bool) -> None:
    """The 4over6 options of `quantize` (and of the kernels' wrappers): types and values, and TE's refusals."""
    if not isinstance(four_over_six, bool):
        raise TypeError(f"four_over_six: expected a bool, got {type(four_over_six).__name__}")
    four_over_six_ref.check_options(err_mode, e4m3_max)
    if four_over_six and rht:
        raise ValueError("four_over_six and rht: TE has no 4over6 with the random Hadamard transform (it refuses "
                         "both on one tensor); quantize this tensor with rht=False or four_over_six=False")
    if four_over_six and stochastic:
        raise ValueError("four_over_six and stochastic rounding: TE refuses 4over6 with stochastic rounding "
                         "(gradients keep plain NVFP4); drop the random bits / counter or four_over_six")


def columnwise_input(x2d: torch.Tensor, rht: bool) -> torch.Tensor:
    """What the columnwise usage quantizes: x^T `[K, M]`, through the RHT when `rht`."""
    xt = x2d.t().contiguous()
    return rht_transform(xt) if rht else xt


# ------------------------------------------------------------------ random Hadamard transform
def hadamard_matrix(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """H = diag(s) * H16 / 4: Sylvester's H16 (entries +-1), rows signed by TE's `RHT_SIGNS`, orthonormal."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < NVFP4_BLOCK:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.tensor(RHT_SIGNS, dtype=torch.float64)
    return (signs[:, None] * h / 4).to(dtype=dtype, device=device)


def rht_transform(xt: torch.Tensor) -> torch.Tensor:
    """Each run of 16 along the last dim (the token axis of the transposed tensor) times H, rounded to bf16.

    `y[r, 16j + c] = sum_i xt[r, 16j + i] * H[i, c]` in fp32 by the fast Walsh-Hadamard transform: the run
    times the signed quarters `s_i / 4` (exact), then 4 butterfly stages, h = 1, 2, 4, 8, each replacing the
    pair (v_i, v_{i+h}) (i & h == 0) by (v_i + v_{i+h}, v_i - v_{i+h}); 64 fp32 sums in a fixed order that
    every backend follows (a plain sum over i would take 240), then one rounding to bf16 (TE's RHT output
    dtype). Sylvester's H16[i, c] = (-1)^popcount(i & c) is what the stages compute.
    """
    rows, cols = xt.shape
    if cols % NVFP4_BLOCK:
        raise ValueError(f"x: the random Hadamard transform mixes {NVFP4_BLOCK} tokens, so the token count "
                         f"(M, the product of the leading dims) must be a multiple of {NVFP4_BLOCK}, got {cols}")
    quarters = torch.tensor(RHT_SIGNS, dtype=torch.float32, device=xt.device) / 4
    v = xt.float().reshape(rows, cols // NVFP4_BLOCK, NVFP4_BLOCK) * quarters
    h = 1
    while h < NVFP4_BLOCK:
        pairs = v.reshape(rows, cols // NVFP4_BLOCK, NVFP4_BLOCK // (2 * h), 2, h)
        a, b = pairs[:, :, :, 0], pairs[:, :, :, 1]
        v = torch.stack([a + b, a - b], dim=3).reshape(rows, cols // NVFP4_BLOCK, NVFP4_BLOCK)
        h *= 2
    return v.reshape(rows, cols).to(torch.bfloat16)


# ------------------------------------------------------------------ reading a stored usage
def dequantize_usage(data: torch.Tensor, scales: torch.Tensor, amax: torch.Tensor, scheme: Scheme,
                     shape: torch.Size, columnwise: bool, dtype: torch.dtype) -> torch.Tensor:
    """The value (x's shape) of one stored usage of an NVFP4-like scheme: rowwise data `[..., ceil(K/2)]`, or
    columnwise data of the transpose `[K, ceil(M/2)]`, whose transform (the RHT: H is orthonormal) is undone
    in fp32."""
    m, k = ref.dims_2d(shape)
    if not columnwise:
        return dequantize_2d(ref.as_2d(data), scales, amax, k, e4m3_max=scheme.tensor_scale_max).to(dtype).reshape(
            shape)
    vt = dequantize_2d(data, scales, amax, m, e4m3_max=scheme.tensor_scale_max)
    transform = scheme.transform(columnwise=True)
    if transform is not None:  # y = xt @ blockdiag(H): xt = y @ blockdiag(H)^T
        h = hadamard_matrix(device=vt.device)
        vt = (vt.reshape(k, -1, transform.size) @ h.t()).reshape(k, m)
    return vt.t().to(dtype).reshape(shape)


def check_scales(scales: torch.Tensor, amax: object, usage: str) -> None:
    """ValueError naming the field unless a stored usage has what quantizing makes: an fp32 [1] amax >= 0 (or
    NaN), and E4M3 block scales >= 0 that hold the NaN code only when the amax is NaN (only a block with a NaN
    gets it, and that NaN is the tensor's amax too). Read at load (syncs)."""
    if not isinstance(amax, torch.Tensor) or amax.dtype != torch.float32 or tuple(amax.shape) != (1,):
        got = amax if not isinstance(amax, torch.Tensor) else f"{amax.dtype} {tuple(amax.shape)}"
        raise ValueError(f"amax_{usage}: expected a float32 tensor of shape (1,), got {got}")
    if bool((amax < 0).any()):
        raise ValueError(f"amax_{usage}: expected an amax >= 0, got {amax.tolist()}")
    values = scales.float()
    bad = values < 0
    if not bool(torch.isnan(amax).any()):
        bad |= torch.isnan(values)
    if bool(bad.any()):
        raise ValueError(f"{usage}_scale_inv: expected E4M3 block scales >= 0 (the NaN code only with a NaN "
                         f"amax, amax_{usage} = {amax.item()}), got {values[bad][:4].tolist()} "
                         f"({int(bad.sum())} of {values.numel()})")
