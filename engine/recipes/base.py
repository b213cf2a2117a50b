"""Recipe: an immutable, validated choice of how each GEMM operand is quantized.

A recipe makes a `RecipeState` for a module: the quantizers of its forward GEMMs
(input, weight, output per GEMM) or of its backward GEMMs (grad_output, grad_input),
plus any scaling state they share. Recipes know nothing of modules.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, field_validator

from engine.quantizers import Quantizer
from engine.recipes.format import Format
from engine.recipes.roles import Role, roles_for, roles_per_gemm, slot_index


class Recipe(BaseModel):
    """Base of all recipes: frozen pydantic model, strict types, unknown fields rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    fp8_format: Format = Format.HYBRID
    #: short name used in checkpoints, messages and the CLI
    name: ClassVar[str] = "recipe"

    @field_validator("fp8_format", mode="before")
    @classmethod
    def _parse_format(cls, value: Any) -> Any:
        if isinstance(value, str) and not isinstance(value, Format):
            try:
                value = Format(value)
            except ValueError:
                raise ValueError(f"expected one of {[f.value for f in Format]}, got {value!r}") from None
        if value is Format.E5M2:
            raise ValueError("pure E5M2 training is not supported; use Format.HYBRID (E4M3 forward, E5M2 backward) "
                             "or Format.E4M3")
        return value

    def dtype_for(self, role: Role) -> torch.dtype:
        return self.fp8_format.forward_dtype if role.is_forward else self.fp8_format.backward_dtype

    @abstractmethod
    def make_state(self, *, forward: bool, num_gemms: int = 1, device: torch.device | str | None = None) -> RecipeState:
        """The quantizers (and shared scaling state) of one module's forward or backward GEMMs."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in type(self).model_fields)
        return f"{type(self).__name__}({fields})"

    __str__ = __repr__


class PerRoleRecipe(Recipe):
    """A recipe whose quantizers are independent: one fresh quantizer per slot, no shared state."""

    def make_state(self, *, forward: bool, num_gemms: int = 1, device: torch.device | str | None = None) -> RecipeState:
        roles = roles_for(forward, num_gemms)
        return RecipeState(self, forward, roles, [self.make_quantizer(role) for role in roles])

    @abstractmethod
    def make_quantizer(self, role: Role) -> Quantizer:
        """A fresh quantizer for one GEMM operand."""


class RecipeState:
    """Quantizers of one module's forward or backward GEMMs, in role order."""

    #: states that must be updated after the step (delayed scaling) say so
    needs_update: ClassVar[bool] = False

    def __init__(self, recipe: Recipe, forward: bool, roles: list[Role], quantizers: list[Quantizer]) -> None:
        self.recipe = recipe
        self.forward = forward
        self.roles = roles
        self.quantizers = quantizers

    @property
    def num_gemms(self) -> int:
        return len(self.roles) // roles_per_gemm(self.forward)

    def slot(self, role: Role, gemm: int = 0) -> int:
        """Index of (role, gemm) in `quantizers` (and in delayed-scaling state columns)."""
        return slot_index(role, gemm, forward=self.forward, num_gemms=self.num_gemms)

    def quantizer(self, role: Role, gemm: int = 0) -> Quantizer:
        return self.quantizers[self.slot(role, gemm)]
