"""
FP8 to bf16
===========

Every E4M3 and E5M2 value is exactly a bf16 value (bf16 has 8 exponent bits and 7
mantissa bits, more than either FP8 format), so FP8 GEMM operands can be upcast to bf16
without any rounding. This kernel does the decode with integer ops only
(:func:`engine.ops.triton.fp8_bits.fp8_bits_to_bf16_bits`): FP8 subnormals become bf16
normals, ±0 stays ±0, E5M2 ±inf stays ±inf, and NaN codes become 0x7FC0, the NaN torch's
CPU conversion produces. The result does not depend on how the backend implements FP8
upcasts (the interpreter, old GPUs without FP8 support, ...).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.triton.fp8_bits import fp8_bits_to_bf16_bits, fp8_params


@triton.jit
def _fp8_to_bf16_kernel(in_ptr, out_ptr, n, MAN_BITS: tl.constexpr, EXP_BITS: tl.constexpr,
                        BIAS: tl.constexpr, IEEE_LIKE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    c = tl.load(in_ptr + offs, mask=mask, other=0).to(tl.int32)
    out = fp8_bits_to_bf16_bits(c, MAN_BITS, EXP_BITS, BIAS, IEEE_LIKE)
    tl.store(out_ptr + offs, out.to(tl.int16), mask=mask)  # int32 -> int16 keeps the low 16 bits


BLOCK = 4096
NUM_WARPS = 4


def fp8_to_bf16(data: torch.Tensor) -> torch.Tensor:
    """FP8 (torch.float8_e4m3fn / float8_e5m2) -> bf16 of the same shape, exactly."""
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"data: expected a torch.Tensor, got {type(data).__name__}")
    p = fp8_params(data.dtype)
    codes = data.contiguous().view(torch.uint8).reshape(-1)
    out = torch.empty(data.shape, dtype=torch.bfloat16, device=data.device)
    n = codes.numel()
    if n:
        _fp8_to_bf16_kernel[(triton.cdiv(n, BLOCK),)](
            codes, out.view(torch.int16), n, MAN_BITS=p.man_bits, EXP_BITS=p.exp_bits, BIAS=p.bias,
            IEEE_LIKE=p.ieee_like, BLOCK=BLOCK, num_warps=NUM_WARPS,
        )
    return out
