"""MXFP8 block scaling: E8M0 scales per 32 elements for every operand."""

from __future__ import annotations

from typing import ClassVar, Literal

from engine.recipes.base import Recipe
from engine.recipes.format import Format
from engine.recipes.operands import OPERANDS, Operand, QuantizerSpec
from engine.schemes import mx_scheme


class MXFP8BlockScaling(Recipe):
    """OCP MX with FP8 elements; `scale_mode` "rceil" (NVIDIA hardware, default) or "floor" (OCP spec)."""

    name: ClassVar[str] = "mxfp8"

    fp8_format: Format = Format.E4M3
    scale_mode: Literal["rceil", "floor"] = "rceil"

    def operands(self) -> dict[Operand, QuantizerSpec | None]:
        return {op: QuantizerSpec(scheme=mx_scheme(self.dtype_for(op[1])).name, rule="e8m0",
                                  params={"scale_mode": self.scale_mode}) for op in OPERANDS}
