"""FP8 GEMMs on NVIDIA GPUs: per-tensor pairs through torch._scaled_mm.

Tested on CPU tensors through the same call (see tests/test_hardening_gemm.py), not on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.gemm.operand import GemmOperand
from engine.gemm.scales import split_scales, times_pow2

# torch._scaled_mm on CUDA (cuBLASLt FP8) wants K and N multiples of 16 (M is free)
CUBLAS_FP8_MULTIPLE = 16


def padded(data: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Contiguous FP8 `data` with zero rows and columns appended up to [rows, cols] (FP8 zero is byte 0)."""
    r, c = data.shape
    if (r, c) == (rows, cols):
        return data.contiguous()
    return F.pad(data.view(torch.uint8), (0, cols - c, 0, rows - r)).view(data.dtype)


def scaled_mm(a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """Per-tensor FP8 GEMM on the GPU through torch._scaled_mm, in the form every torch version accepts.

    * Scales: cuBLASLt multiplies the two scales in fp32, which flushes tiny pairs to 0. So it gets
      their frexp mantissas (product in [0.25, 1)) and 2**(ea + eb) is applied to its fp32 output,
      as tensors: no host sync.
    * Output fp32, bias added after: torch rejects a bias with an fp32 out_dtype, and the power of
      two must be applied before the bias. One rounding to out_dtype at the end, as the emulation.
    * K and N zero-padded to multiples of 16 (cuBLASLt FP8; zeros add nothing); B passed column-major.
    """
    ma, mb, e = split_scales(a, b)
    k = -(-a.k // CUBLAS_FP8_MULTIPLE) * CUBLAS_FP8_MULTIPLE
    n = -(-b.rows // CUBLAS_FP8_MULTIPLE) * CUBLAS_FP8_MULTIPLE
    lhs, rhs = padded(a.data, a.rows, k), padded(b.data, n, k)
    out = torch._scaled_mm(lhs, rhs.t(), scale_a=ma, scale_b=mb, out_dtype=torch.float32)[:, : b.rows]
    out = times_pow2(out, e)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


