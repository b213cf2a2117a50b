"""NVFP4 "4over6" (TE 2.x `nvfp4_4over6`, arXiv 2512.02010), the executable spec in plain PyTorch.

Each block is quantized twice, with its maximum mapped to E2M1's 6 ("map-to-6", plain NVFP4's scale) and to
4 ("map-to-4", the block scale x1.5), and the candidate whose dequantized values are nearer x is kept. Bit
for bit Transformer Engine's reference (`custom_recipes/reference_nvfp4.py`,
`_quantize_blockwise_4over6_reference`; the CUDA kernel is `common/cast/nvfp4/quantize_4over6_nvfp4.cuh`).
Every step is fp32, in this order; E, the global E4M3 bound, is 448 or 256 (TE's default for 4over6 tensors):

1. `amax` = max|x| of the usage's tensor, as plain NVFP4 (no RHT: TE refuses 4over6 with it).
2. `S_enc = min((E * 6) / amax, FLT_MAX)`, a NaN staying NaN (torch.min); 1 if that is 0 (amax inf).
   `S_dec = 1 / S_enc`.
3. Per block (1x16, or 16x16 tile): `base = (block_amax / 6) * S_enc`, a division then a product (plain
   NVFP4 rounds `S_enc * (1/6)` first). `s6 = e4m3(base)`, `s4 = e4m3(base * 1.5)`: round to nearest even,
   saturating at 448 (not E); NaN -> 0x7F. No lower clamp.
4. Per candidate k: `enc_k = min(1 / (float(s_k) * S_dec), FLT_MAX)` (a NaN staying NaN), and the codes
   `q = e2m1(clamp(x * enc_k, -6, 6))` rounded to nearest even, the sign code set iff the value is < 0:
   -0 and NaN give code 0 (plain NVFP4 keeps -0's sign, code 8, as the GPU's cvt does).
5. The error of each candidate, per row of the block, summed element by element in order (a partial
   block's zero padding included): `d_i = ((e2m1_value(q_i) * float(s_k)) * amax) / (6 * E) - x_i`,
   `err = (((0 + t_0) + t_1) + ...) + t_15` with `t_i = |d_i|` (MAE) or `d_i * d_i` (MSE). 16x16 tiles:
   the 16 row errors r_0..r_15 are then summed by TE's warp tree: `a_i = r_i + r_(i+8)` (i < 8),
   `b_i = a_i + a_(i+4)`, `c_i = b_i + b_(i+2)`, `err = c_0 + c_1`.
6. Map-to-4 is kept iff `err_4 < err_6`: ties and NaN errors keep map-to-6. The block's scale is the kept
   candidate's.

The columnwise usage is the same on x^T, so with 16x16 tiles its rows are x's columns: each usage sums its
own errors and decides for itself, and the two usages' tile scales need not be transposes of each other.
Dequantization is plain NVFP4's with E in place of 448: `q * ((s * amax) * (1 / (6 * E)))`
(`nvfp4.dequantize_2d(..., e4m3_max=E)`); the GEMM's alpha is `amax_a * amax_b / (36 * E_a * E_b)`.
TE refuses 4over6 with the RHT and with stochastic rounding, and applies it only to non-gradient tensors.
"""

from __future__ import annotations

import torch

from engine.formats import E2M1
from engine.ops import mx_elements
from engine.ops import reference as ref

BLOCK = 16
E2M1_MAX = 6.0
MAP4_EXPAND = 1.5
FLT_MAX = torch.finfo(torch.float32).max
ERR_MODES = ("MAE", "MSE")
E4M3_BOUNDS = (448.0, 256.0)


def check_options(err_mode: object, e4m3_max: object) -> float:
    """The E4M3 bound as a float, after checking both options (a ValueError / TypeError naming the bad one)."""
    if err_mode not in ERR_MODES:
        raise ValueError(f"four_over_six_err_mode: expected 'MAE' or 'MSE', got {err_mode!r}")
    if isinstance(e4m3_max, bool) or not isinstance(e4m3_max, (int, float)):
        raise TypeError(f"four_over_six_e4m3_max: expected a number (448 or 256), got {type(e4m3_max).__name__}")
    if float(e4m3_max) not in E4M3_BOUNDS:
        raise ValueError(f"four_over_six_e4m3_max: expected 448 or 256 (TE's global E4M3 bounds), got {e4m3_max!r}")
    return float(e4m3_max)


def _f32(v: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32, device=like.device)


def encode_scale(amax: torch.Tensor, e4m3_max: float) -> torch.Tensor:
    """S_enc (step 2) of a per-tensor fp32 amax."""
    s = torch.minimum(_f32(e4m3_max * E2M1_MAX, amax) / amax.float(), _f32(FLT_MAX, amax))
    return torch.where(s == 0, _f32(1.0, amax), s)


def candidate_scales(block_amax: torch.Tensor, s_enc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(s4, s6) as float8_e4m3fn (step 3)."""
    base = (block_amax.float() / _f32(E2M1_MAX, s_enc)) * s_enc
    s4 = ref.cast_to_fp8(base * _f32(MAP4_EXPAND, base), torch.float8_e4m3fn)
    return s4, ref.cast_to_fp8(base, torch.float8_e4m3fn)


def encode_elements(v: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of fp32 v (step 4): RNE, saturating, the sign code iff v < 0 (-0 and NaN: code 0)."""
    return mx_elements.encode(v, E2M1).masked_fill(v == 0, 0)


def row_errors(codes: torch.Tensor, s: torch.Tensor, amax: torch.Tensor, x: torch.Tensor, err_mode: str,
               e4m3_max: float) -> torch.Tensor:
    """Step 5 per row of each block: x and codes `[..., 16]`, the blocks' scales s `[...]`; errors `[...]`."""
    deq = mx_elements.decode(codes, E2M1)
    val = ((deq * s.float()[..., None]) * amax) / _f32(E2M1_MAX * e4m3_max, x)
    d = val - x
    terms = d.abs() if err_mode == "MAE" else d * d
    err = torch.zeros(terms.shape[:-1], dtype=torch.float32, device=x.device)
    for i in range(BLOCK):  # in order: the sum's rounding is part of the spec
        err = err + terms[..., i]
    return err


def tree_sum_rows(err: torch.Tensor) -> torch.Tensor:
    """TE's warp reduction of 16 row errors (dim 1 of `[tiles, 16, ...]`): halves added pairwise, 8, 4, 2, 1."""
    while err.shape[1] > 1:
        half = err.shape[1] // 2
        err = err[:, :half] + err[:, half:]
    return err[:, 0]


def quantize_2d(x2d: torch.Tensor, amax: torch.Tensor, *, tile_rows: int = 1, err_mode: str = "MAE",
                e4m3_max: float = 448.0) -> tuple[torch.Tensor, torch.Tensor]:
    """4over6 NVFP4 of a 2D tensor with 1x16 (`tile_rows=1`) or 16x16 (`tile_rows=16`) blocks along its last dim.

    `amax`: the fp32 per-tensor amax. Returns (packed E2M1 codes `[M, ceil(K/2)]` uint8, E4M3 scales
    `[M, ceil(K/16)]`, a 16x16 tile's scale on each of its rows), as `nvfp4.quantize_2d`.
    """
    if tile_rows not in (1, BLOCK):
        raise ValueError(f"tile_rows: expected 1 (1x16 blocks) or 16 (16x16 tiles), got {tile_rows}")
    e4m3_max = check_options(err_mode, e4m3_max)
    m, k = x2d.shape
    gr, gc = -(-m // tile_rows), -(-k // BLOCK)
    xf = torch.nn.functional.pad(x2d.float(), (0, gc * BLOCK - k, 0, gr * tile_rows - m))
    tiles = xf.reshape(gr, tile_rows, gc, BLOCK).transpose(1, 2)  # [gr, gc, tile_rows, 16]
    block_amax = tiles.abs().amax(dim=(2, 3)) if tiles.numel() else torch.zeros(gr, gc, device=x2d.device)
    a = amax.float().reshape(())
    s_enc = encode_scale(a, e4m3_max)
    s_dec = 1.0 / s_enc
    codes, scales, errors = [], [], []
    for s in candidate_scales(block_amax, s_enc):  # map-to-4, map-to-6
        enc = torch.minimum(1.0 / (s.float() * s_dec), _f32(FLT_MAX, s_dec))
        q = encode_elements(tiles * enc[:, :, None, None])
        err = row_errors(q, s[:, :, None].expand(gr, gc, tile_rows), a, tiles, err_mode, e4m3_max)
        codes.append(q)
        scales.append(s)
        errors.append(err[:, :, 0] if tile_rows == 1 else tree_sum_rows(err.permute(0, 2, 1)))
    pick4 = errors[0] < errors[1]
    q = torch.where(pick4[:, :, None, None], codes[0], codes[1])
    s_b = torch.where(pick4, scales[0].view(torch.uint8), scales[1].view(torch.uint8)).view(torch.float8_e4m3fn)
    q = q.transpose(1, 2).reshape(gr * tile_rows, gc * BLOCK)[:m, :k]
    out_scales = s_b.repeat_interleave(tile_rows, dim=0)[:m] if tile_rows > 1 else s_b
    return mx_elements.pack(q.contiguous(), E2M1), out_scales.contiguous()
