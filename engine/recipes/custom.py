"""OperandRecipe: any map from GEMM operand to quantizer spec, e.g. a high-precision wgrad or mixed pairings.

    from engine.recipes import OperandRecipe, QuantizerSpec
    fp8 = QuantizerSpec(scheme="tensor_e4m3", rule="current")
    recipe = OperandRecipe(operands={"fprop_input": fp8, "fprop_weight": fp8,
                                     "dgrad_grad_output": fp8.model_copy(update={"scheme": "tensor_e5m2"}),
                                     "dgrad_weight": fp8})   # wgrad stays in high precision

Operands not named are high precision. Delayed scaling needs scaling state that
`DelayedScaling` (or a `CustomRecipe` given delayed specs) holds, and is not available here.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import field_validator

from engine.recipes.base import Recipe
from engine.recipes.format import Format, fixed_format
from engine.recipes.operands import OPERANDS, Operand, QuantizerSpec, operand_key

KEYS = {operand_key(op): op for op in OPERANDS}


class OperandRecipe(Recipe):
    """Each operand's spec by name ("fprop_input", "dgrad_weight", "wgrad_grad_output", ...); absent = None."""

    name: ClassVar[str] = "operands"

    operands_by_name: dict[str, QuantizerSpec | None] = {}

    def __init__(self, operands: dict[str, QuantizerSpec | None] | None = None, **fields: object) -> None:
        if operands is not None:
            fields["operands_by_name"] = operands
        super().__init__(**fields)

    @field_validator("fp8_format", mode="after")
    @classmethod
    def _elements_come_from_the_specs(cls, value: Format) -> Format:
        return fixed_format(value, Format.HYBRID, cls.__name__, "takes each operand's element from its QuantizerSpec")

    @field_validator("operands_by_name")
    @classmethod
    def _known_operands(cls, value: dict[str, QuantizerSpec | None]) -> dict[str, QuantizerSpec | None]:
        unknown = sorted(set(value) - set(KEYS))
        if unknown:
            raise ValueError(f"unknown operands {unknown}; expected some of {sorted(KEYS)}")
        delayed = sorted(k for k, spec in value.items() if spec is not None and spec.stateful)
        if delayed:
            raise ValueError(f"{delayed}: delayed scaling needs scaling state that DelayedScaling (or a CustomRecipe "
                             "given these specs) holds; use 'current'")
        return value

    def operands(self) -> dict[Operand, QuantizerSpec | None]:
        return {op: self.operands_by_name.get(key) for key, op in KEYS.items()}

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, v) for k, v in self.operands_by_name.items())))
