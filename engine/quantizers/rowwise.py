"""Float8RowwiseQuantizer: torchao's axiswise ("rowwise") float8, one scale per row of the 2D view.

Rowwise data has one scale per row over the whole last dim K (per token of an input, per
output channel of a weight); the columnwise copy is quantized from x on its own, one scale
per column over all of M, and stored transposed `[K, M]` (per K of a weight in dgrad, per K
and per N of wgrad's operands). The scale is the current-scaling rule on each row,
`fp8_max / max(amax, amax_epsilon)`, by default with torchao's eps (1e-12) and rounded down
to a power of two (`round_scales_to_power_of_2=True` in torchao's rowwise recipes), which
makes every FP8 value times its scale exact in bf16.

Where torchao differs (documented, not copied): its power-of-2 rounding is
`exp2(floor(log2(s)))` in fp32, and `log2` rounds up for the few fp32 scales just below a
power of two (up to ~20 ulps below 2^k for large |k|), which it then doubles; here every
scale is rounded down exactly (its mantissa cleared). A row whose amax is inf or NaN gets
scale 1 here (inf saturates to +-max, NaN stays NaN, as for every engine scheme), where
torchao's scale becomes 0 or NaN and the whole row dequantizes to NaN.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.checks import check_bool
from engine.quantizers.base import dtype_name
from engine.quantizers.named import _FromTheData, fp8_schemes
from engine.quantizers.registry import name_quantizer
from engine.quantizers.rules import CurrentRule
from engine.schemes import fp8_scheme

#: torchao's float8 EPS: amax is clamped to at least this before 448 / amax
TORCHAO_EPS = 1e-12


class Float8RowwiseQuantizer(_FromTheData):
    """One scale per row of x's 2D view (rowwise usage) and per column (columnwise usage, stored `[K, M]`)."""

    def __init__(
        self, fp8_dtype: torch.dtype, *, force_pow_2_scales: bool = True, amax_epsilon: float = TORCHAO_EPS,
        rowwise: bool = True, columnwise: bool = True, internal: bool = False,
    ) -> None:
        pow2 = check_bool(force_pow_2_scales, "force_pow_2_scales")
        super().__init__(fp8_scheme("axiswise", fp8_dtype, pow2=pow2), CurrentRule(amax_epsilon),
                         rowwise=rowwise, columnwise=columnwise, internal=internal)

    def config(self) -> dict[str, Any]:
        return {"fp8_dtype": dtype_name(self.fp8_dtype), "force_pow_2_scales": self.force_pow_2_scales,
                "amax_epsilon": self.amax_epsilon}


name_quantizer(Float8RowwiseQuantizer, "current", fp8_schemes("axiswise"))
