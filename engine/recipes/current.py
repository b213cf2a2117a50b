"""Current scaling: per-tensor scales from each tensor's own amax, no state between steps."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from engine.recipes.base import Recipe
from engine.recipes.operands import OPERANDS, Operand, QuantizerSpec
from engine.schemes import fp8_scheme


class Float8CurrentScaling(Recipe):
    """scale = fp8_max / max(amax, amax_epsilon), computed just before each cast.

    Unlike Transformer Engine, `amax_epsilon` reaches the quantizers of every operand.
    """

    name: ClassVar[str] = "current"

    use_power_2_scales: bool = False
    amax_epsilon: float = Field(0.0, ge=0.0, allow_inf_nan=False)

    def operands(self) -> dict[Operand, QuantizerSpec | None]:
        return {op: QuantizerSpec(scheme=fp8_scheme("tensor", self.dtype_for(op[1]), pow2=self.use_power_2_scales).name,
                                  rule="current", params={"amax_epsilon": self.amax_epsilon}) for op in OPERANDS}
