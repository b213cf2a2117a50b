"""NVFP4BlockScaling: Transformer Engine's NVFP4 training recipe (E2M1 per 16, E4M3 block scales, fp32 amax).

As TE 2.x sets it up (`common/recipe/__init__.py`): weights in 16x16 tiles (both usages from one
quantization, so the forward and dgrad weights agree); inputs and output gradients in 1x16 blocks
with the 16-point random Hadamard transform on their columnwise (wgrad) usage; output gradients
stochastically rounded. Each switch turns one of these off, with TE's names and defaults (TE reads
its defaults from NVTE_NVFP4_DISABLE_* environment variables; here they are plain fields).

Stochastic rounding draws from a counter owned by the module's backward recipe state: `(seed + gemm
index, offset)`, the offset advancing by the elements quantized, so a run is reproducible. Every
module starts from the same seed (its own state); the counter is not in checkpoints (a resumed run
restarts its random stream).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from engine.recipes.base import Recipe, RecipeState
from engine.recipes.format import Format
from engine.recipes.operands import OPERANDS, Operand, QuantizerSpec, Role


class NVFP4BlockScaling(Recipe):
    """NVFP4 for every GEMM operand; `disable_rht`, `disable_stochastic_rounding`, `disable_2d_quantization`
    as TE's (all False by default); `seed` for the stochastic rounding of gradients."""

    name: ClassVar[str] = "nvfp4"

    fp8_format: Format = Format.E4M3  # the block scales' format (TE's fp8_format); the elements are E2M1
    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    seed: int = 0

    def element_for(self, role: Role) -> str:
        return "e2m1"

    def operands(self) -> dict[Operand, QuantizerSpec | None]:
        def spec(**options: bool) -> QuantizerSpec:
            return QuantizerSpec(layout="nvfp4", element="e2m1", scaling="nvfp4", **options)

        by_role = {
            Role.INPUT: spec(rht=not self.disable_rht),
            Role.WEIGHT: spec(two_d=not self.disable_2d_quantization),
            Role.GRAD_OUTPUT: spec(rht=not self.disable_rht, stochastic_rounding=not self.disable_stochastic_rounding),
        }
        return {op: by_role[op[1]] for op in OPERANDS}

    def make_state(self, *, forward: bool, num_gemms: int = 1, device: torch.device | str | None = None) -> RecipeState:
        state = super().make_state(forward=forward, num_gemms=num_gemms, device=device)
        for gemm in range(num_gemms):
            for role in ((Role.INPUT, Role.WEIGHT) if forward else (Role.GRAD_OUTPUT,)):
                q = state.quantizer(role, gemm)
                if q is not None and q.stochastic_rounding:
                    q.rule.rng_counter = torch.tensor([self.seed + gemm, 0], dtype=torch.int64, device=device)
        return state
