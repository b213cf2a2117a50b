"""NVFP4BlockScaling: Transformer Engine's NVFP4 training recipe (E2M1 per 16, E4M3 block scales, fp32 amax).

As TE 2.x sets it up (`common/recipe/__init__.py`): weights in 16x16 tiles (both usages from one
quantization, so the forward and dgrad weights agree); inputs and output gradients in 1x16 blocks
with the 16-point random Hadamard transform on their columnwise (wgrad) usage; output gradients
stochastically rounded. Each switch turns one of these off, with TE's names and defaults (TE reads
its defaults from NVTE_NVFP4_DISABLE_* environment variables; here they are plain fields).

Stochastic rounding draws from a counter owned by the module's backward recipe state
(`engine.recipes.streams`, as for every recipe whose specs round stochastically): `(stream, offset)`,
seeded from `seed`, saved in the module's `_extra_state`, so a resumed run continues its streams.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import field_validator

from engine.recipes.base import Recipe
from engine.recipes.format import Format, StreamSeed, fixed_format
from engine.recipes.operands import BACKWARD_ROLES, FORWARD_ROLES, OPERANDS, Operand, QuantizerSpec, Role


class NVFP4BlockScaling(Recipe):
    """NVFP4 for every GEMM operand; `disable_rht`, `disable_stochastic_rounding`, `disable_2d_quantization`
    as TE's (all False by default); `seed` for the stochastic rounding of gradients."""

    name: ClassVar[str] = "nvfp4"

    fp8_format: Format = Format.E4M3  # the block scales' format (TE's fp8_format); the elements are E2M1
    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    seed: StreamSeed = 0  # the low 32 bits of every stochastic-rounding stream (plus the GEMM index): 0 <= seed < 2**32

    @field_validator("fp8_format", mode="after")
    @classmethod
    def _scales_are_e4m3(cls, value: Format) -> Format:
        return fixed_format(value, Format.E4M3, cls.__name__, "quantizes every operand, forward and backward, to "
                            "E2M1 elements with E4M3 block scales (as Transformer Engine's NVFP4 recipe does)")

    def element_for(self, role: Role) -> str:
        return "e2m1"

    def operands(self) -> dict[Operand, QuantizerSpec | None]:
        def spec(rht: bool = False, **params: bool) -> QuantizerSpec:
            return QuantizerSpec(scheme="nvfp4_rht_e2m1" if rht else "nvfp4_e2m1", rule="nvfp4", params=params)

        by_role = {
            Role.INPUT: spec(rht=not self.disable_rht),
            Role.WEIGHT: spec(with_2d_quantization=not self.disable_2d_quantization),
            Role.GRAD_OUTPUT: spec(rht=not self.disable_rht, stochastic_rounding=not self.disable_stochastic_rounding),
        }
        return {op: by_role[op[1]] for op in OPERANDS}
