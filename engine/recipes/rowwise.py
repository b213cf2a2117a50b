"""Float8 rowwise scaling: torchao's `ROWWISE` and `ROWWISE_WITH_GW_HP` recipes as operand maps.

Every operand has one scale per index of its non-contracted dim (`Float8RowwiseQuantizer`):

    fprop  y  = x  @ W^T   x per token (row),         W per output channel (row)
    dgrad  dx = dy @ W     dy per token (row),        W per K (column)
    wgrad  dW = dy^T @ x   dy per N (column),         x per K (column)

`high_precision_wgrad=True` is torchao's `ROWWISE_WITH_GW_HP`: dgrad reads a per-tensor
(power-of-2) weight against rowwise dy, and wgrad runs in high precision. It is a field of
one recipe rather than a second preset because it is the same recipe with one switch (as
Transformer Engine's recipes carry theirs), so checkpoints, the CLI and `RECIPES` name one
thing, and its fprop is bit for bit the plain recipe's. With FP8 primary weights
(`fp8_model_init`) a weight is stored once, in fprop's per-row scheme with its per-K columnwise
copy, and dgrad reads that copy, as under any recipe whose two weight uses differ.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from engine.quantizers.rowwise import TORCHAO_EPS
from engine.recipes.base import Recipe
from engine.recipes.format import Format
from engine.recipes.operands import OPERANDS, Gemm, Operand, QuantizerSpec, Role
from engine.schemes import fp8_scheme


class Float8RowwiseScaling(Recipe):
    """torchao's float8 rowwise recipe: E4M3 everywhere, one power-of-2 scale per row of each operand.

    `use_power_2_scales` is torchao's `round_scales_to_power_of_2` (True in both of its
    rowwise recipes) and `amax_epsilon` its EPS; `fp8_format=Format.HYBRID` makes gradients E5M2.
    """

    name: ClassVar[str] = "rowwise"

    fp8_format: Format = Format.E4M3
    high_precision_wgrad: bool = False
    use_power_2_scales: bool = True
    amax_epsilon: float = Field(TORCHAO_EPS, ge=0.0, allow_inf_nan=False)

    def _spec(self, layout: str, role: Role) -> QuantizerSpec:
        scheme = fp8_scheme(layout, self.dtype_for(role), pow2=self.use_power_2_scales)
        return QuantizerSpec(scheme=scheme.name, rule="current", params={"amax_epsilon": self.amax_epsilon})

    def operands(self) -> dict[Operand, QuantizerSpec | None]:
        specs: dict[Operand, QuantizerSpec | None] = {op: self._spec("axiswise", op[1]) for op in OPERANDS}
        if self.high_precision_wgrad:
            specs[Gemm.DGRAD, Role.WEIGHT] = self._spec("tensor", Role.WEIGHT)
            specs[Gemm.WGRAD, Role.GRAD_OUTPUT] = specs[Gemm.WGRAD, Role.INPUT] = None
        return specs
