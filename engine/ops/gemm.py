"""general_gemm: out = op(A) @ op(B)^T on quantized operands, with fp32 accumulation.

`op(t)` is the 2D value of t (its rowwise data) or, with `*_transposed=True`, its
transpose (its columnwise data). The three GEMMs of a linear layer are then:

    fprop  y  = x  @ W^T   general_gemm(x, W)
    dgrad  dx = dy @ W     general_gemm(dy, W, b_transposed=True)
    wgrad  dW = dy^T @ x   general_gemm(dy, x, a_transposed=True, b_transposed=True)

CPU (exact emulation, fast): every FP8 value is exact in bf16, and so is an FP8 value
times a power of two. So per-tensor operands are upcast to bf16 and run as one GEMM
with the product of the two scales folded into `addmm`'s alpha; MXFP8 and power-of-2
block-scaled operands are dequantized to bf16 exactly and run as one GEMM; fp32 block
scales are applied per 128-wide K block to fp32 partial sums (as DeepSeek-V3 does).
bf16 GEMMs accumulate in fp32 and round once; an fp32 (or fp16) output uses an fp32 GEMM.

Per-tensor scale products that leave fp32's normal range (tiny operands: two scale_inv of
~1e-23 multiply to 0 in fp32) never flush the result: each scale_inv is split into a
mantissa in [0.5, 1) and a power of two (frexp), the GEMM is scaled by the mantissas'
product and the power of two is applied to its fp32 result (see `_times_pow2`).

CUDA: per-tensor pairs go to `torch._scaled_mm` (fp32 output, mantissa scales, K and N
zero-padded to multiples of 16, bias added after); block and MX pairs run the emulation
(with a one-time warning) until the installed torch's block-scaled GEMMs are wired in.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.ops import backend as ops
from engine.ops import reference as ref
from engine.schemes import ScaleEncoding
from engine.tensors.quantized import QuantizedTensor, storage_of
from engine.tensors.storage import QuantizedTensorBase

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# 2^(code - 127) for every E8M0 code, as bf16 (exact: bf16 has fp32's exponent range; 255 is NaN)
E8M0_TO_BF16 = ref.e8m0_to_float(torch.arange(256, dtype=torch.uint8)).to(torch.bfloat16)
FP32 = torch.finfo(torch.float32)
# torch._scaled_mm on CUDA (cuBLASLt FP8) wants K and N multiples of 16 (M is free)
CUBLAS_FP8_MULTIPLE = 16


@dataclass(frozen=True)
class GemmOperand:
    """One side of out = A @ B^T, K-major: `data` is [rows, K] FP8 with scales along K.

    `scale_inv` is [1] (per tensor), or one scale per tile of `tile_rows x tile_cols`
    (block: fp32, MX: uint8 E8M0 codes), shaped [ceil(rows/tile_rows), ceil(K/tile_cols)].
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    kind: str  # "tensor" | "block" | "mx"
    tile_rows: int = 1
    tile_cols: int = 1
    pow2_scales: bool = False  # known from the scheme
    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def k(self) -> int:
        return self.data.shape[1]

    def tile_scales(self) -> torch.Tensor:
        """fp32 scale_inv per tile (E8M0 codes decoded)."""
        return ref.e8m0_to_float(self.scale_inv) if self.kind == "mx" else self.scale_inv.float()

    def has_pow2_scales(self) -> bool:
        return self.pow2_scales

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if self.kind == "tensor":
            return (self.data.float() * self.scale_inv.float()).to(dtype)
        return ref.dequantize_block(self.data, self.tile_scales(), tile_rows=self.tile_rows,
                                    tile_cols=self.tile_cols, dtype=dtype)

    def dequantize_pow2_bf16(self) -> torch.Tensor:
        """bf16 value of an operand with power-of-2 tile scales: exact, as a broadcast multiply.

        An FP8 value times a power of two is a bf16 value (bf16 has fp32's exponent range),
        so upcasting the data and multiplying by bf16 scales rounds nothing.
        """
        rows, k = self.data.shape
        tr, tc = self.tile_rows, self.tile_cols
        if rows % tr or k % tc:  # partial edge tiles: the general (slower) path, still exact
            return self.dequantize(torch.bfloat16)
        values = ops.fp8_to_bf16(self.data).view(rows // tr, tr, k // tc, tc)
        if self.kind == "mx":
            scales = E8M0_TO_BF16.to(self.data.device)[self.scale_inv.long()]
        else:
            scales = self.scale_inv.to(torch.bfloat16)
        return (values * scales[:, None, :, None]).view(rows, k)


def gemm_operand(t: QuantizedTensor | QuantizedTensorBase, *, transposed: bool, name: str = "a") -> GemmOperand:
    """The K-major operand for op(t): rowwise data, or columnwise data when `transposed`."""
    st = storage_of(t, name)
    usage = "columnwise" if transposed else "rowwise"
    data = st.columnwise_data if transposed else st.rowwise_data
    scale_inv = st.columnwise_scale_inv if transposed else st.rowwise_scale_inv
    if data is None:
        raise ValueError(f"{name}: the GEMM needs its {usage} data, but this {type(st).__name__} has only "
                         f"{'rowwise' if transposed else 'columnwise'} data; quantize with {usage} usage")
    scheme = st.scheme
    block = scheme.stored_block(transposed)
    data2d = data if transposed and scheme.columnwise_transposed else ref.as_2d(data)
    if transposed and not scheme.columnwise_transposed:  # stored in x's shape: read it as [K, M]
        data2d, scale_inv, block = data2d.t(), scale_inv.t(), block.transposed()
    if block.is_tensor:
        return GemmOperand(data2d, scale_inv, "tensor", pow2_scales=scheme.scale.is_pow2)
    kind = "mx" if scheme.scale is ScaleEncoding.E8M0 else "block"
    return GemmOperand(data2d, scale_inv, kind, block.rows, block.cols, scheme.scale.is_pow2)


def _check_pair(a: GemmOperand, b: GemmOperand) -> None:
    if a.kind != b.kind:
        raise TypeError(f"general_gemm: cannot pair a {a.kind}-scaled operand with a {b.kind}-scaled one")
    if a.k != b.k:
        raise ValueError(f"general_gemm: inner dims differ: A is [{a.rows}, {a.k}], B is [{b.rows}, {b.k}]")
    if a.kind == "block" and a.tile_rows > 1 and b.tile_rows > 1:
        raise ValueError("general_gemm: 2D x 2D block-scaled GEMMs are not supported (one operand must be 1x128)")


def _per_k_block(a: GemmOperand, b: GemmOperand) -> torch.Tensor:
    """fp32 out with block scales applied to each 128-wide K block's fp32 partial product."""
    sa = a.tile_scales().repeat_interleave(a.tile_rows, 0)[: a.rows]  # [rows_a, kb]
    sb = b.tile_scales().repeat_interleave(b.tile_rows, 0)[: b.rows]
    out = torch.zeros(a.rows, b.rows, dtype=torch.float32, device=a.data.device)
    for kb, start in enumerate(range(0, a.k, a.tile_cols)):
        stop = min(start + a.tile_cols, a.k)
        partial = a.data[:, start:stop].float() @ b.data[:, start:stop].float().t()
        out.addcmul_(partial, sa[:, kb : kb + 1] * sb[:, kb].unsqueeze(0))
    return out


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2.0**e as fp32, exact for int32 e in [-149, 127] (subnormal below -126), 0 below; built from bits."""
    e = e.clamp(-150, 127)
    normal = (e + 127).clamp(min=1) << 23
    subnormal = torch.ones_like(e) << (e + 149).clamp(0, 22)
    bits = torch.where(e >= -126, normal, torch.where(e >= -149, subnormal, torch.zeros_like(e)))
    return bits.view(torch.float32)


def _times_pow2(y: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """y * 2**e rounded once to fp32, for the fp32 result y of an FP8 GEMM times a scale in [0.25, 1).

    FP8 products are multiples of 2^-32 below 2^32, so such a y is 0 or |y| is in [2^-34, 2^60)
    (for K < 2^28): y * 2^e1 with e1 = clamp(e, -90, 67) is then exact and normal, and the
    second factor 2^(e - e1) (normal or subnormal) rounds once. Beyond fp32's powers of two
    the true result is 0 or overflows anyway. `e` is an int32 tensor: no host sync.
    """
    e1 = e.clamp(-90, 67)
    return y * _pow2(e1) * _pow2(e - e1)


def _split_scales(a: GemmOperand, b: GemmOperand) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ma, mb, e): scale_inv_a * scale_inv_b = ma * mb * 2**e, with frexp mantissas in [0.5, 1).

    The mantissas' fp32 product is in [0.25, 1), so it never flushes or overflows; e is int32.
    """
    ma, ea = torch.frexp(a.scale_inv.float().reshape(()))
    mb, eb = torch.frexp(b.scale_inv.float().reshape(()))
    return ma, mb, ea + eb


def _per_tensor_rescaled(a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """A per-tensor GEMM whose fp32 scale product is not a normal number: fp32 GEMM * ma * mb, then * 2**e."""
    ma, mb, e = _split_scales(a, b)
    lhs, rhs = ops.fp8_to_bf16(a.data).float(), ops.fp8_to_bf16(b.data).float()
    out = _times_pow2(torch.mm(lhs, rhs.t()).mul_(ma * mb), e)
    if bias is not None:
        out += bias.float()
    return out.to(out_dtype)


def _emulated(a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    gemm_dtype = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
    if a.kind == "tensor":
        # the one sync: addmm takes alpha as a host number (an mm then a multiply by a tensor changes the bits)
        alpha = (a.scale_inv.float() * b.scale_inv.float()).item()  # rounds the exact product once
        if not FP32.tiny <= abs(alpha) <= FP32.max:  # subnormal/0 (tiny operands), inf, NaN: rescale, no sync
            return _per_tensor_rescaled(a, b, out_dtype, bias)
        lhs, rhs = ops.fp8_to_bf16(a.data).to(gemm_dtype), ops.fp8_to_bf16(b.data).to(gemm_dtype)
    elif a.has_pow2_scales() and b.has_pow2_scales():
        alpha = 1.0
        lhs, rhs = a.dequantize_pow2_bf16().to(gemm_dtype), b.dequantize_pow2_bf16().to(gemm_dtype)
    else:
        out = _per_k_block(a, b)
        if bias is not None:
            out += bias.float()
        return out.to(out_dtype)
    if bias is None:
        out = torch.empty(a.rows, b.rows, dtype=gemm_dtype, device=a.data.device)
        out = torch.addmm(out, lhs, rhs.t(), beta=0, alpha=alpha)
    else:
        out = torch.addmm(bias.to(gemm_dtype).expand(a.rows, b.rows), lhs, rhs.t(), alpha=alpha)
    return out.to(out_dtype)


def _padded(data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Contiguous FP8 `data` with zero rows and columns appended up to [rows, cols] (FP8 zero is byte 0)."""
    r, c = data.shape
    if (r, c) == (rows, cols):
        return data.contiguous()
    return F.pad(data.view(torch.uint8), (0, cols - c, 0, rows - r)).view(data.dtype)


def _scaled_mm(a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """Per-tensor FP8 GEMM on the GPU through torch._scaled_mm, in the form every torch version accepts.

    * Scales: cuBLASLt multiplies the two scales in fp32, which flushes tiny pairs to 0. So it gets
      their frexp mantissas (product in [0.25, 1)) and 2**(ea + eb) is applied to its fp32 output,
      as tensors: no host sync.
    * Output fp32, bias added after: torch rejects a bias with an fp32 out_dtype, and the power of
      two must be applied before the bias. One rounding to out_dtype at the end, as the emulation.
    * K and N zero-padded to multiples of 16 (cuBLASLt FP8; zeros add nothing); B passed column-major.
    """
    ma, mb, e = _split_scales(a, b)
    k = -(-a.k // CUBLAS_FP8_MULTIPLE) * CUBLAS_FP8_MULTIPLE
    n = -(-b.rows // CUBLAS_FP8_MULTIPLE) * CUBLAS_FP8_MULTIPLE
    lhs, rhs = _padded(a.data, a.rows, k), _padded(b.data, n, k)
    out = torch._scaled_mm(lhs, rhs.t(), scale_a=ma, scale_b=mb, out_dtype=torch.float32)[:, : b.rows]
    out = _times_pow2(out, e)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _warn_emulating_on_gpu(kind: str) -> None:
    warnings.warn(f"general_gemm: {kind}-scaled GEMMs run through the emulation path on CUDA (slow)",
                  RuntimeWarning, stacklevel=3)


def _as_matrix(t: QuantizedTensor | QuantizedTensorBase | torch.Tensor, transposed: bool, dtype: torch.dtype,
               name: str) -> torch.Tensor:
    """op(t) in `dtype`: a high-precision tensor as it is, a quantized one dequantized from the usage op reads."""
    if isinstance(t, torch.Tensor) and not isinstance(t, QuantizedTensor):
        t2d = ref.as_2d(t)
        return (t2d.t() if transposed else t2d).to(dtype)  # op(t): t [M, K], or t^T for a [K, M] tensor
    op = gemm_operand(t, transposed=transposed, name=name)
    return op.dequantize(dtype)


def _with_high_precision(a, b, a_transposed, b_transposed, out_dtype, bias, out, accumulate) -> torch.Tensor:
    """A pairing with a high-precision operand (weight-only, or an operand the recipe keeps unquantized):
    the quantized side is dequantized exactly to fp32 and the GEMM runs in fp32."""
    lhs = _as_matrix(a, a_transposed, torch.float32, "a")
    rhs = _as_matrix(b, b_transposed, torch.float32, "b")
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"general_gemm: inner dims differ: A is {list(lhs.shape)}, B is {list(rhs.shape)}")
    result = lhs @ rhs.t()
    if bias is not None:
        result = result + bias.float()
    if accumulate:
        return out.add_(result)
    return result.to(out_dtype) if out is None else out.copy_(result)


def general_gemm(
    a: QuantizedTensor | QuantizedTensorBase,
    b: QuantizedTensor | QuantizedTensorBase,
    *,
    a_transposed: bool = False,
    b_transposed: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """out[M, N] = op(a)[M, K] @ op(b)[N, K]^T (+ bias[N]); with `accumulate`, added into `out` (fp32)."""
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype: expected float32, bfloat16 or float16, got {out_dtype}")
    if isinstance(a, torch.Tensor) and not isinstance(a, QuantizedTensor) or (
            isinstance(b, torch.Tensor) and not isinstance(b, QuantizedTensor)):
        return _with_high_precision(a, b, a_transposed, b_transposed, out_dtype, bias, out, accumulate)
    lhs = gemm_operand(a, transposed=a_transposed, name="a")
    rhs = gemm_operand(b, transposed=b_transposed, name="b")
    _check_pair(lhs, rhs)
    if bias is not None and tuple(bias.shape) != (rhs.rows,):
        raise ValueError(f"bias: expected shape ({rhs.rows},), got {tuple(bias.shape)}")
    if accumulate:
        if out is None or out.dtype != torch.float32 or tuple(out.shape) != (lhs.rows, rhs.rows):
            got = None if out is None else f"{out.dtype} {tuple(out.shape)}"
            raise ValueError(f"out: accumulate=True needs an fp32 out of shape ({lhs.rows}, {rhs.rows}), got {got}")
        out_dtype = torch.float32
    if lhs.data.is_cuda and lhs.kind == "tensor":
        result = _scaled_mm(lhs, rhs, out_dtype, bias)
    else:
        if lhs.data.is_cuda:
            _warn_emulating_on_gpu(lhs.kind)
        result = _emulated(lhs, rhs, out_dtype, bias)
    if out is None:
        return result
    if accumulate:
        return out.add_(result)
    return out.copy_(result)
