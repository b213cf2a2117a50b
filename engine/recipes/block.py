"""Float8 block scaling (DeepSeek-V3): 1x128 tiles for activations and gradients, 128x128 for weights."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import model_validator

from engine.recipes.base import Recipe
from engine.recipes.format import Format
from engine.recipes.operands import OPERANDS, Operand, QuantizerSpec, Role
from engine.schemes import fp8_scheme

BlockDim = Literal[1, 2]


class Float8BlockScaling(Recipe):
    """Per-tile scales, power-of-2 unless `use_f32_scales`. No GEMM may pair two 2D-tiled operands."""

    name: ClassVar[str] = "block"

    fp8_format: Format = Format.E4M3
    use_f32_scales: bool = False
    x_block_scaling_dim: BlockDim = 1
    w_block_scaling_dim: BlockDim = 2
    grad_block_scaling_dim: BlockDim = 1

    @model_validator(mode="after")
    def _no_2d_by_2d(self) -> Float8BlockScaling:
        gemms = {
            "fprop (x, w)": (self.x_block_scaling_dim, self.w_block_scaling_dim),
            "dgrad (grad, w)": (self.grad_block_scaling_dim, self.w_block_scaling_dim),
            "wgrad (grad, x)": (self.grad_block_scaling_dim, self.x_block_scaling_dim),
        }
        both_2d = [name for name, dims in gemms.items() if dims == (2, 2)]
        if both_2d:
            raise ValueError(f"2D x 2D block-scaled GEMMs are not supported; {', '.join(both_2d)} would pair two "
                             "128x128-tiled operands: make one of them 1 (1x128 tiles)")
        return self

    def block_dim_for(self, role: Role) -> int:
        return {Role.WEIGHT: self.w_block_scaling_dim, Role.INPUT: self.x_block_scaling_dim,
                Role.GRAD_OUTPUT: self.grad_block_scaling_dim}[role]

    def operands(self) -> dict[Operand, QuantizerSpec | None]:
        def spec(role: Role) -> QuantizerSpec:
            scheme = fp8_scheme(f"block{self.block_dim_for(role)}d", self.dtype_for(role), pow2=not self.use_f32_scales)
            return QuantizerSpec(scheme=scheme.name, rule="current")

        return {op: spec(op[1]) for op in OPERANDS}
