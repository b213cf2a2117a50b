"""The scale arithmetic of per-tensor GEMMs that never flushes: frexp mantissas and exact powers of two.

The fp32 product of two per-tensor scale_inv leaves fp32's normal range for tiny operands
(two ~1e-23 scales multiply to 0). Each scale is split into a mantissa in [0.5, 1) and a
power of two; the GEMM is scaled by the mantissas' product and the power of two is applied
to its fp32 result, rounding once. Everything is a tensor op: no host sync.
"""

from __future__ import annotations

import torch

from engine.gemm.operand import GemmOperand


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2.0**e as fp32, exact for int32 e in [-149, 127] (subnormal below -126), 0 below; built from bits."""
    e = e.clamp(-150, 127)
    normal = (e + 127).clamp(min=1) << 23
    subnormal = torch.ones_like(e) << (e + 149).clamp(0, 22)
    bits = torch.where(e >= -126, normal, torch.where(e >= -149, subnormal, torch.zeros_like(e)))
    return bits.view(torch.float32)


def times_pow2(y: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """y * 2**e rounded once to fp32, for the fp32 result y of an FP8 GEMM times a scale in [0.25, 1).

    FP8 products are multiples of 2^-32 below 2^32, so such a y is 0 or |y| is in [2^-34, 2^60)
    (for K < 2^28): y * 2^e1 with e1 = clamp(e, -90, 67) is then exact and normal, and the
    second factor 2^(e - e1) (normal or subnormal) rounds once. Beyond fp32's powers of two
    the true result is 0 or overflows anyway. `e` is an int32 tensor: no host sync.
    """
    e1 = e.clamp(-90, 67)
    return y * pow2(e1) * pow2(e - e1)


def split_scales(a: GemmOperand, b: GemmOperand) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ma, mb, e): scale_inv_a * scale_inv_b = ma * mb * 2**e, with frexp mantissas in [0.5, 1).

    The mantissas' fp32 product is in [0.25, 1), so it never flushes or overflows; e is int32.
    """
    ma, ea = torch.frexp(a.scale_inv.float().reshape(()))
    mb, eb = torch.frexp(b.scale_inv.float().reshape(()))
    return ma, mb, ea + eb


#: 1 / (6 * 448)^2 rounded to fp32: NVFP4's per-tensor factor is amax_a * amax_b * NVFP4_FACTOR (TE's GEMM alpha)
NVFP4_FACTOR = 1.0 / (2688.0 * 2688.0)


def times_nvfp4_factor(y: torch.Tensor, a: GemmOperand, b: GemmOperand) -> torch.Tensor:
    """y * amax_a * amax_b / (6 E_a * 6 E_b) for the fp32 result y of an NVFP4 GEMM on block-scaled values (E =
    448: 1 / 2688^2; 256 under 4over6: TE's alpha), without underflow.

    The three factors are split into frexp mantissas (their fp32 product is in [1/8, 1): exact enough and
    normal) and one power of two applied by `times_pow2`, so tiny amaxes do not flush the factor to zero.
    No host sync.
    """
    ma, ea = torch.frexp(a.amax.float().reshape(()))
    mb, eb = torch.frexp(b.amax.float().reshape(()))
    factor = 1.0 / (a.amax_divisor * b.amax_divisor)
    mc, ec = torch.frexp(torch.tensor(factor, dtype=torch.float32, device=y.device))
    return times_pow2(y * (ma * mb * mc), ea + eb + ec)
