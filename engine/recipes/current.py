"""Current scaling: per-tensor scales from each tensor's own amax, no state between steps."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from engine.quantizers import Float8CurrentScalingQuantizer, Quantizer
from engine.recipes.base import PerRoleRecipe
from engine.recipes.roles import Role


class Float8CurrentScaling(PerRoleRecipe):
    """scale = fp8_max / max(amax, amax_epsilon), computed just before each cast.

    Unlike Transformer Engine, `amax_epsilon` reaches the quantizers of every role.
    """

    name: ClassVar[str] = "current"

    use_power_2_scales: bool = False
    amax_epsilon: float = Field(0.0, ge=0.0, allow_inf_nan=False)

    def make_quantizer(self, role: Role) -> Quantizer:
        return Float8CurrentScalingQuantizer(
            self.dtype_for(role), force_pow_2_scales=self.use_power_2_scales, amax_epsilon=self.amax_epsilon
        )
