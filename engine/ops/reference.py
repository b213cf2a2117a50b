"""Plain-PyTorch quantization for every scheme: the executable spec.

Every other backend (C++ for the CPU, Triton for CUDA) must give the same bits as these
functions. They favour being obviously right over being fast. Conventions:

* Inputs are fp32, bf16 or fp16 with any leading dims; they are read as 2D `[M, K]`,
  M = prod(leading dims), K = last dim. Math happens in fp32.
* "Rowwise" data is x quantized as it is laid out (per-tensor and MXFP8 functions keep
  x's shape; block functions return the 2D view `[M, K]`). "Columnwise" data is what the
  wgrad/dgrad GEMMs read: for per-tensor and block scaling it is the quantization of the
  transposed 2D tensor, `[K, M]`; for MXFP8 it keeps x's shape (32x1 blocks, not
  transposed), as on NVIDIA hardware.
* Casts saturate: values are clamped to the format's ±max before the round-to-nearest-even
  cast, so inf becomes ±max and only NaN stays NaN.
* amax propagates NaN (torch semantics). A NaN amax gives per-tensor and block scales of 1
  (the current-scaling rule) and the NaN E8M0 code 255 for an MX block.
* NaN has one bit pattern per format, whatever the sign and payload of the NaN that made
  it, in every backend: FP8 E4M3 and E5M2 `0x7F` (positive NaN, what NVIDIA's cvt
  instructions produce), E8M0 `0xFF`, an fp32 amax `0x7FC00000` (the default quiet NaN),
  bf16 from `fp8_to_bf16` `0x7FC0`. Only these functions fix it (torch's own casts keep
  the sign of a NaN, on some code paths only), so the tests compare NaN bits too.
"""

from __future__ import annotations

import math

import torch

from engine.formats import FloatFormat, element_format, fp8_max
from engine.ops import int_elements, mx_elements
from engine.schemes import BLOCK_128, MX_BLOCK, ScaleEncoding, Scheme, dims_2d, fp8_scheme  # noqa: F401 (re-exported)

FLT_MAX = torch.finfo(torch.float32).max
HIGH_PRECISION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
E8M0_NAN = 0xFF
E8M0_BIAS = 127
FP8_NAN = 0x7F  # the canonical FP8 NaN code (E4M3 and E5M2)
F32_NAN_BITS = 0x7FC00000  # the canonical fp32 NaN (of an amax)


# ----------------------------------------------------------------------------- helpers
#: delayed scaling: an amax slot with nothing recorded since the last scale update (below every amax,
#: which is >= 0 or NaN)
NOT_RECORDED = -1.0

def check_input(x: torch.Tensor, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"{name}: expected dtype float32, bfloat16 or float16, got {x.dtype}")


def as_2d(x: torch.Tensor) -> torch.Tensor:
    """View `x` as `[prod(leading dims), last dim]` (a scalar is `[1, 1]`)."""
    if x.dim() == 2:
        return x
    if x.dim() == 0:
        return x.reshape(1, 1)
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # explicit rows: a last dim of 0 is fine


def amax(x: torch.Tensor) -> torch.Tensor:
    """max(|x|) as a 1-element fp32 tensor; 0 for an empty tensor; the canonical NaN if x has NaN."""
    if x.numel() == 0:
        return torch.zeros(1, dtype=torch.float32, device=x.device)
    a = x.abs().amax().float().reshape(1)
    return a.view(torch.int32).masked_fill(torch.isnan(a), F32_NAN_BITS).view(torch.float32)


def cast_to_element(x: torch.Tensor, element: torch.dtype | FloatFormat) -> torch.Tensor:
    """The saturating RNE cast of an fp32 tensor to a scheme element: FP8 values, or unpacked uint8
    codes for an MX element without a torch dtype (`mx_elements.encode`)."""
    if isinstance(element, FloatFormat):
        return mx_elements.encode(x, element_format(element))
    return cast_to_fp8(x, element)


def cast_to_fp8(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Saturating round-to-nearest-even cast of an fp32 tensor to an FP8 dtype; NaN -> 0x7F."""
    limit = fp8_max(fp8_dtype)
    xf = x.float()
    q = xf.clamp(-limit, limit).to(fp8_dtype)
    return q.view(torch.uint8).masked_fill(torch.isnan(xf), FP8_NAN).view(fp8_dtype)


_SIGN_AND_EXPONENT = -0x800000  # 0xFF800000 as int32: clearing the mantissa rounds down to a power of 2


def compute_scale(
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    force_pow_2_scales: bool = False,
    amax_epsilon: float = 0.0,
    value_for_inf: float = FLT_MAX,
) -> torch.Tensor:
    """Current-scaling rule: scale = fp8_max / max(amax, eps), elementwise over `amax`.

    amax of 0, inf or NaN gives scale 1; a scale that overflows fp32 becomes
    `value_for_inf`; power-of-2 scales clear the mantissa (round down).
    """
    a = amax.float()
    if amax_epsilon > 0:
        a = a.clamp_min(amax_epsilon)  # NaN stays NaN
    scale = torch.full_like(a, fp8_max(fp8_dtype)).div_(a)  # a true division (not times 1/a)
    scale = torch.where(scale == float("inf"), value_for_inf, scale)  # scale > 0: only +inf occurs
    scale = torch.where(torch.isfinite(a) & (a != 0), scale, 1.0)  # amax 0, inf or NaN: scale 1
    if force_pow_2_scales:
        scale = (scale.view(torch.int32) & _SIGN_AND_EXPONENT).view(torch.float32)
    return scale


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(scale, dtype=torch.float32) / scale.float()


def usable_scales(scale: torch.Tensor) -> torch.Tensor:
    """Where a given per-tensor scale can quantize: finite, > 0 and with a finite fp32 reciprocal (the
    scale_inv the data is saved with; a subnormal scale below 2^-128 has none, and dequantizes to inf/NaN)."""
    return torch.isfinite(scale) & (scale > 0) & torch.isfinite(reciprocal(scale))


# ------------------------------------------------------------------------ the one blocked rule
def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def quantize_tiles(
    x2d: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    tile_rows: int,
    tile_cols: int,
    encoding: ScaleEncoding = ScaleEncoding.FP32,
    scale: torch.Tensor | None = None,
    amax_epsilon: float = 0.0,
    value_for_inf: float = FLT_MAX,
    scale_mode: str = "rceil",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2D tensor in tiles of `tile_rows x tile_cols` (0 = the whole dim), one scale per tile.

    `fp8_dtype` is the scheme's element: an FP8 dtype, or an MX element format (E8M0 scales only),
    whose data comes back as unpacked uint8 codes.
    Each tile's scale is the given `scale` (one per tensor), or comes from the tile's amax:
    E8M0 codes by `scale_mode`, otherwise the current-scaling rule (`compute_scale`, power of
    2 for a power-of-2 encoding). Then q = sat_rne(x * scale). Edge tiles are partial (the
    tensor is zero-padded for the amax, which zeros cannot change). Returns (data `[M, K]`,
    scale_inv `[ceil(M/tile_rows), ceil(K/tile_cols)]`: fp32, or uint8 E8M0 codes).
    """
    m, k = x2d.shape
    tr, tc = tile_rows or m, tile_cols or k
    gr, gc = (_ceil_div(m, tr) if tile_rows else 1), (_ceil_div(k, tc) if tile_cols else 1)
    tiles = _pad_to(x2d.float(), gr * tr, gc * tc).reshape(gr, tr, gc, tc)
    if scale is None:
        tile_amax = tiles.abs().amax(dim=(1, 3)) if tiles.numel() else torch.zeros(gr, gc, device=x2d.device)
    if encoding is ScaleEncoding.E8M0:
        if scale_mode not in SCALE_MODES:
            raise ValueError(f"scale_mode: expected one of {sorted(SCALE_MODES)}, got {scale_mode!r}")
        scale_inv = SCALE_MODES[scale_mode](tile_amax, fp8_dtype)
        multiplier = e8m0_to_element_scale(scale_inv)
    else:
        if scale is None:
            scale = compute_scale(tile_amax, fp8_dtype, force_pow_2_scales=encoding.is_pow2,
                                  amax_epsilon=amax_epsilon, value_for_inf=value_for_inf)
        multiplier = scale.float().reshape(gr, gc)
        scale_inv = reciprocal(multiplier)
    q = cast_to_element(tiles * multiplier[:, None, :, None], fp8_dtype)
    return q.reshape(gr * tr, gc * tc)[:m, :k].contiguous(), scale_inv


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

    The usage's blocks come from the scheme (transposed data for a transposed columnwise
    layout); scales are a given per-tensor `scale` (delayed scaling) or come from each block
    (`quantize_tiles`; a scale that overflows becomes FLT_MAX for a whole tensor and the input
    dtype's max for a block, as TE does).
    """
    check_input(x)
    if scheme.integer:  # scales from each block, as `int_elements` says
        if scale is not None or amax_epsilon:
            raise ValueError(f"scale / amax_epsilon: {scheme.name} takes its scales from each block (amax / max, or "
                             f"min and max with a zero point); got scale={scale!r}, amax_epsilon={amax_epsilon!r}")
        return int_elements.quantize(x, scheme, columnwise=columnwise)
    x2d = as_2d(x)
    transposed = columnwise and scheme.columnwise_transposed
    block = scheme.stored_block(columnwise)
    data, scale_inv = quantize_tiles(
        x2d.t() if transposed else x2d, scheme.element, tile_rows=block.rows, tile_cols=block.cols,
        encoding=scheme.scale, scale=scale, amax_epsilon=amax_epsilon, scale_mode=scale_mode,
        value_for_inf=FLT_MAX if block.is_tensor else block_value_for_inf(x.dtype))
    if scheme.coded:  # uint8 codes, packed along the last dim of the stored data
        data = mx_elements.pack(data, scheme.element).reshape(scheme.data_shape(x.shape, columnwise))
        return data, scale_inv.reshape(scheme.scale_shape(x.shape, columnwise))
    return (data if transposed else data.reshape(x.shape)), scale_inv.reshape(scheme.scale_shape(x.shape, columnwise))


def dequantize_block(
    data: torch.Tensor, scale_inv: torch.Tensor, *, tile_rows: int, tile_cols: int, dtype: torch.dtype,
    zero: torch.Tensor | None = None,
) -> torch.Tensor:
    """2D data times its fp32 scale_inv per `tile_rows x tile_cols` tile (0 = the whole dim), plus the tile's
    `zero` point where given."""
    m, k = data.shape
    tr, tc = tile_rows or max(m, 1), tile_cols or max(k, 1)
    shape = (_ceil_div(m, tr) if tile_rows else 1, _ceil_div(k, tc) if tile_cols else 1)

    def expand(grid: torch.Tensor) -> torch.Tensor:
        return grid.float().reshape(shape).repeat_interleave(tr, 0)[:m].repeat_interleave(tc, 1)[:, :k]

    value = data.float() * expand(scale_inv)
    return (value if zero is None else value + expand(zero)).to(dtype)


def dequantize_blocked(
    data: torch.Tensor, scale_inv: torch.Tensor, scheme: Scheme, *, shape: torch.Size, columnwise: bool = False,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The value of one usage's (data, scale_inv), with the tensor's `shape`: each block times its scale."""
    transposed = columnwise and scheme.columnwise_transposed
    block = scheme.stored_block(columnwise)
    data = data if transposed else as_2d(data)
    m, k = dims_2d(shape)
    if scheme.coded:  # element codes -> their fp32 values, in the stored orientation
        data = mx_elements.decode(mx_elements.unpack(data, scheme.element, m if transposed else k), scheme.element)
    elif scheme.integer:
        data = int_elements.load(data, scheme.element, m if transposed else k)
    factors = e8m0_to_float(scale_inv) if scheme.scale is ScaleEncoding.E8M0 else scale_inv
    zero = None
    if scheme.zero_point:  # (scale, zero) pairs
        factors, zero = scale_inv[..., 0], scale_inv[..., 1]
    value = dequantize_block(data, factors, tile_rows=block.rows, tile_cols=block.cols, dtype=dtype, zero=zero)
    return (value.t().contiguous() if transposed else value).reshape(shape)


def block_value_for_inf(dtype: torch.dtype) -> float:
    """A tile scale that overflows fp32 becomes the input dtype's max (as TE does)."""
    return torch.finfo(dtype).max


# ------------------------------------------------------ today's schemes, as instances of the rule
def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """q = sat_rne(x * scale), same shape as x. `scale` is a 1-element fp32 tensor."""
    return quantize_blocked(x, fp8_scheme("tensor", fp8_dtype), scale=scale)[0]


def transpose_2d(data: torch.Tensor) -> torch.Tensor:
    """Columnwise layout of per-tensor data: the 2D view transposed, `[K, M]`, contiguous."""
    return as_2d(data).t().contiguous()


def cast_transpose(
    x2d: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, *, rowwise: bool = True, columnwise: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Per-tensor cast of a 2D tensor: (data [M, K] if rowwise, data^T [K, M] if columnwise, amax [1])."""
    check_input(x2d, "x2d")
    data = quantize_per_tensor(x2d, scale, fp8_dtype)
    return (data if rowwise else None), (transpose_2d(data) if columnwise else None), amax(x2d)


def dequantize_per_tensor(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (data.float() * scale_inv.float().reshape(())).to(dtype)


def quantize_current_scaling(
    x: torch.Tensor, fp8_dtype: torch.dtype, *, force_pow_2_scales: bool = False, amax_epsilon: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-tensor scale from this tensor's own amax. Returns (data, scale_inv, amax)."""
    scheme = fp8_scheme("tensor", fp8_dtype, pow2=force_pow_2_scales)
    data, scale_inv = quantize_blocked(x, scheme, amax_epsilon=amax_epsilon)
    return data, scale_inv, amax(x)


def quantize_block(
    x2d: torch.Tensor, fp8_dtype: torch.dtype, *, tile_rows: int, tile_cols: int, force_pow_2_scales: bool = True,
    amax_epsilon: float = 0.0, value_for_inf: float = FLT_MAX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float8 block scaling of a 2D tensor in `tile_rows x tile_cols` tiles: (data [M, K], fp32 scale_inv)."""
    encoding = ScaleEncoding.FP32_POW2 if force_pow_2_scales else ScaleEncoding.FP32
    return quantize_tiles(x2d, fp8_dtype, tile_rows=tile_rows, tile_cols=tile_cols, encoding=encoding,
                          amax_epsilon=amax_epsilon, value_for_inf=value_for_inf)


def quantize_block_1d(
    x: torch.Tensor, fp8_dtype: torch.dtype, *, force_pow_2_scales: bool = True, amax_epsilon: float = 0.0,
    columnwise: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 tiles along the last dim of the 2D view (rowwise): data `[M, K]`, scale_inv `[M, ceil(K/128)]`.

    Columnwise: the same rule on the transposed tensor, i.e. 128x1 tiles of x running
    along M: data `[K, M]`, scale_inv `[K, ceil(M/128)]`.
    """
    data, scale_inv = quantize_blocked(x, fp8_scheme("block1d", fp8_dtype, pow2=force_pow_2_scales),
                                       columnwise=columnwise, amax_epsilon=amax_epsilon)
    return as_2d(data), scale_inv


def quantize_block_2d(
    x: torch.Tensor, fp8_dtype: torch.dtype, *, force_pow_2_scales: bool = True, amax_epsilon: float = 0.0,
    columnwise: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 tiles: data `[M, K]`, scale_inv `[ceil(M/128), ceil(K/128)]`.

    Square tiles map onto themselves under transposition, so the columnwise form is
    exactly the transpose of the rowwise data and scales (`[K, M]`, `[ceil(K/128), ceil(M/128)]`).
    """
    data, scale_inv = quantize_blocked(x, fp8_scheme("block2d", fp8_dtype, pow2=force_pow_2_scales),
                                       columnwise=columnwise, amax_epsilon=amax_epsilon)
    return as_2d(data), scale_inv


# ----------------------------------------------------------------------------------- MXFP8
def mx_blocks(count: int) -> int:
    """Number of 32-element blocks along a dim of `count` elements (the last one may be partial)."""
    return -(-count // MX_BLOCK)


def e8m0_rceil(block_amax: torch.Tensor, fp8_dtype: torch.dtype | FloatFormat) -> torch.Tensor:
    """Shared exponent, hardware/TE rule: round d = amax * (1/max_elem) up to a power of two.

    `fp8_dtype` is the block's element (an FP8 dtype or an MX element format; max_elem is its
    largest normal: 448, 57344, 6, 7.5, 28).
    Like TE, d is the fp32 product with the fp32 reciprocal of max_elem (not a division).
    The e8m0 code is d's biased exponent, plus one if d's mantissa is non-zero; a
    subnormal d up to 2^-127 gives code 0; the largest code is 254; inf gives 254 and
    NaN gives 255.
    """
    rcp = torch.tensor(1.0 / element_format(fp8_dtype, "fp8_dtype").max, dtype=torch.float32, device=block_amax.device)
    d = block_amax.float() * rcp
    bits = d.view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    exponent = bits >> 23
    mantissa = bits & 0x7FFFFF
    round_up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    code = exponent + round_up.to(torch.int64)
    code = torch.where(torch.isinf(d), torch.full_like(code, 0xFE), code)
    code = torch.where(torch.isnan(d), torch.full_like(code, E8M0_NAN), code)
    return code.to(torch.uint8)


def e8m0_floor(block_amax: torch.Tensor, fp8_dtype: torch.dtype | FloatFormat) -> torch.Tensor:
    """Shared exponent, OCP MX v1.0 rule: floor(log2(amax)) - emax_elem, clamped to [-127, 127].

    emax_elem is the unbiased exponent of the element's max normal (E4M3 8, E5M2 15, E2M1 and
    E2M3 2, E3M2 4; `fp8_dtype` is the block's element: an FP8 dtype or an MX element format).
    floor(log2(amax)) is read from amax's fp32 exponent bits (a zero or subnormal amax
    counts as 2^-127, which the clamp makes code 0). inf or NaN amax gives NaN (255).
    Elements that then exceed the format's max saturate.
    """
    fmt = element_format(fp8_dtype, "fp8_dtype")  # a TypeError for anything but an FP8 dtype or an MX element
    a = block_amax.float()
    biased = (a.view(torch.int32).to(torch.int64) >> 23) & 0xFF
    shared = (biased - E8M0_BIAS) - fmt.max_exponent
    code = (shared.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS)
    code = torch.where(torch.isfinite(a), code, torch.full_like(code, E8M0_NAN))
    return code.to(torch.uint8)


def e8m0_to_float(code: torch.Tensor) -> torch.Tensor:
    """2^(code - 127) exactly as fp32 (code 0 is the subnormal 2^-127), NaN for 255."""
    c = code.to(torch.int32)
    normal = (c << 23).view(torch.float32)
    value = torch.where(c == 0, torch.full_like(normal, 2.0**-127), normal)
    return torch.where(c == E8M0_NAN, torch.full_like(value, float("nan")), value)


def e8m0_to_element_scale(code: torch.Tensor) -> torch.Tensor:
    """The multiplier applied to elements before the cast: 2^(127 - code) exactly, NaN for 255."""
    c = code.to(torch.int32)
    value = e8m0_to_float((254 - c).clamp(0, 254))
    return torch.where(c == E8M0_NAN, torch.full_like(value, float("nan")), value)


SCALE_MODES = {"rceil": e8m0_rceil, "floor": e8m0_floor}


def quantize_mxfp8(
    x: torch.Tensor, fp8_dtype: torch.dtype, *, scale_mode: str = "rceil", columnwise: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 with E8M0 shared scales, blocks of 32.

    Rowwise: 1x32 blocks along the last dim; data has x's shape, scales (uint8 E8M0 codes)
    are `[M, ceil(K/32)]`. Columnwise: 32x1 blocks along M, data still has x's shape (not
    transposed), scales are `[ceil(M/32), K]`. A dim that is not a multiple of 32 ends in
    a partial block, whose scale comes from the elements it has (the same as zero padding).
    """
    return quantize_blocked(x, fp8_scheme("mx", fp8_dtype), columnwise=columnwise, scale_mode=scale_mode)


def dequantize_mxfp8(
    data: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype, columnwise: bool = False
) -> torch.Tensor:
    """data * 2^(code - 127) per block; `columnwise` selects 32x1 blocks."""
    scheme = fp8_scheme("mx", data.dtype)
    return dequantize_blocked(data, scale, scheme, shape=data.shape, columnwise=columnwise, dtype=dtype)


def fp8_to_bf16(data: torch.Tensor) -> torch.Tensor:
    """FP8 values as bf16 (exact: every E4M3 and E5M2 value is a bf16 value)."""
    return data.to(torch.bfloat16)


def elements_to_bf16(data: torch.Tensor, element: FloatFormat, cols: int | None = None) -> torch.Tensor:
    """Stored MX element codes (E2M1 packed, E2M3 / E3M2 one per byte) -> their values as bf16, unscaled and
    exact, [..., cols] (`cols`: the unpacked last dim; default every element the bytes hold)."""
    return mx_elements.elements_to_bf16(data, element_format(element), cols)
