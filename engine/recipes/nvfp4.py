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

from typing import ClassVar, Literal

from pydantic import field_validator, model_validator

from engine.recipes.base import Recipe
from engine.recipes.format import Format, StreamSeed, fixed_format
from engine.recipes.operands import BACKWARD_ROLES, FORWARD_ROLES, OPERANDS, Operand, QuantizerSpec, Role


class NVFP4BlockScaling(Recipe):
    """NVFP4 for every GEMM operand; `disable_rht`, `disable_stochastic_rounding`, `disable_2d_quantization`
    as TE's (all False by default); `seed` for the stochastic rounding of gradients."""

    name: ClassVar[str] = "nvfp4"
    written_when_set: ClassVar[frozenset[str]] = frozenset(
        {"nvfp4_4over6", "nvfp4_4over6_err_mode", "nvfp4_4over6_e4m3_use_256"})

    fp8_format: Format = Format.E4M3  # the block scales' format (TE's fp8_format); the elements are E2M1
    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    seed: StreamSeed = 0  # the low 32 bits of every stochastic-rounding stream (plus the GEMM index): 0 <= seed < 2**32
    #: NVFP4 "4over6" (TE 2.x, arXiv 2512.02010): each block quantized with its max mapped to 6 and to 4, the one
    #: nearer x kept; for weights, activations (inputs: needs disable_rht, TE refuses the RHT with it) or both,
    #: never gradients. `nvfp4_4over6_e4m3_use_256`: which of those take the global bound E = 256 (else 448)
    nvfp4_4over6: Literal["none", "weights", "activations", "all"] = "none"
    nvfp4_4over6_err_mode: Literal["MAE", "MSE"] = "MAE"
    nvfp4_4over6_e4m3_use_256: Literal["none", "weights", "activations", "all"] = "all"

    @field_validator("fp8_format", mode="after")
    @classmethod
    def _scales_are_e4m3(cls, value: Format) -> Format:
        return fixed_format(value, Format.E4M3, cls.__name__, "quantizes every operand, forward and backward, to "
                            "E2M1 elements with E4M3 block scales (as Transformer Engine's NVFP4 recipe does)")

    @model_validator(mode="after")
    def _4over6_without_rht(self) -> NVFP4BlockScaling:
        if self.nvfp4_4over6 in ("activations", "all") and not self.disable_rht:
            raise ValueError(f"nvfp4_4over6={self.nvfp4_4over6!r}: 4over6 does not take the random Hadamard "
                             "transform the inputs' wgrad copy gets (Transformer Engine refuses it); set "
                             "disable_rht=True, or nvfp4_4over6='weights'")
        return self

    def element_for(self, role: Role) -> str:
        return "e2m1"

    def operands(self) -> dict[Operand, QuantizerSpec | None]:
        def spec(rht: bool = False, role: Role | None = None, **params: bool) -> QuantizerSpec:
            scheme = "nvfp4_rht_e2m1" if rht else "nvfp4_e2m1"
            scope = {Role.WEIGHT: ("weights", "all"), Role.INPUT: ("activations", "all")}.get(role, ())
            if self.nvfp4_4over6 in scope:
                params.update(four_over_six=True, four_over_six_err_mode=self.nvfp4_4over6_err_mode)
                if self.nvfp4_4over6_e4m3_use_256 in scope:
                    scheme = "nvfp4_e256_e2m1"
            return QuantizerSpec(scheme=scheme, rule="nvfp4", params=params)

        by_role = {
            Role.INPUT: spec(rht=not self.disable_rht, role=Role.INPUT),
            Role.WEIGHT: spec(with_2d_quantization=not self.disable_2d_quantization, role=Role.WEIGHT),
            Role.GRAD_OUTPUT: spec(rht=not self.disable_rht, stochastic_rounding=not self.disable_stochastic_rounding),
        }
        return {op: by_role[op[1]] for op in OPERANDS}
