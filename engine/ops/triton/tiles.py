"""The tile a program of a 1D grid reads: a `BLOCK_M x BLOCK_K` window of a strided 2D tensor."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def to_fp32(x):
    """x (fp32, bf16 or fp16) as fp32, exactly. bf16 widens through its bits: Triton's interpreter
    casts bf16 subnormals wrongly (9.2e-41 -> 0), which the bits cannot get wrong on any target."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def load_tile(x_ptr, M, K, stride_xm, stride_xk, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """(x as fp32 with 0 outside the tensor, row offsets, column offsets, in-bounds mask).

    A 1D grid (no 65535 limit on the second grid dim) walks the tiles in row-major order.
    """
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K, BLOCK_K)
    offs_m = (pid // tiles_k).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = (pid % tiles_k).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=mask, other=0.0)
    return to_fp32(x), offs_m, offs_k, mask
