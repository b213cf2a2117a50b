"""MXFP8 block scaling: E8M0 scales per 32 elements for every operand."""

from __future__ import annotations

from typing import ClassVar, Literal

from engine.quantizers import MXFP8Quantizer, Quantizer
from engine.recipes.base import PerRoleRecipe
from engine.recipes.format import Format
from engine.recipes.roles import Role


class MXFP8BlockScaling(PerRoleRecipe):
    """OCP MX with FP8 elements; `scale_mode` "rceil" (NVIDIA hardware, default) or "floor" (OCP spec)."""

    name: ClassVar[str] = "mxfp8"

    fp8_format: Format = Format.E4M3
    scale_mode: Literal["rceil", "floor"] = "rceil"

    def make_quantizer(self, role: Role) -> Quantizer:
        return MXFP8Quantizer(self.dtype_for(role), scale_mode=self.scale_mode)
