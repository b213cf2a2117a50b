"""A late switch to higher precision: a RecipeMap for the first part of a run, a higher precision after.

The NVFP4 paper (arXiv 2509.25149, appendix D) recovers most of NVFP4's loss gap to bf16 by running the
last part of training in bf16. `RecipeSchedule` says so as data:

    RecipeSchedule(recipe_map=RecipeMap(rules=[("blocks.3.*", None)]), switch_at=0.9, switch_to=None)

Before step `switch_step(total_steps)` (= round(switch_at * total_steps)) the layers take `recipe_map`'s
picks; from that step on, `late_map()`: the layers the map keeps in high precision stay there, every other
layer takes `switch_to` (None: high precision). `engine.recommend(..., switch_at=0.9)` returns one;
`python -m engine train --recipe-map F.json --switch-at 0.9 --switch-to bf16` trains with one and its
checkpoints carry it (`to_plain`). `four_bit_gemms(recipe)` says which GEMMs of a layer under a recipe run
on 4-bit operands, to count the share of GEMM FLOPs in 4-bit over a run.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from engine.recipes.base import Recipe
from engine.recipes.debug import Debug
from engine.recipes.factory import CustomRecipe
from engine.recipes.operands import Gemm, Role
from engine.recipes.recipe_map import RecipeMap, choice_from_plain, choice_to_plain

#: the operands each GEMM multiplies
GEMM_OPERANDS: dict[Gemm, tuple[Role, Role]] = {Gemm.FPROP: (Role.INPUT, Role.WEIGHT),
                                                Gemm.DGRAD: (Role.GRAD_OUTPUT, Role.WEIGHT),
                                                Gemm.WGRAD: (Role.GRAD_OUTPUT, Role.INPUT)}
#: the 4-bit element (NVFP4's and MXFP4's E2M1)
FOUR_BIT = "e2m1"


class RecipeSchedule(BaseModel):
    """`recipe_map` until a fraction `switch_at` of the run's steps, then `late_map()` (module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    recipe_map: RecipeMap = RecipeMap()
    switch_at: float = Field(gt=0, le=1, allow_inf_nan=False)
    switch_to: Recipe | None = None

    def switch_step(self, total_steps: int) -> int:
        """The first step (0-based) of a `total_steps`-step run that runs under `late_map()`."""
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"total_steps: expected an int >= 1 (the run's optimizer steps), got {total_steps!r}")
        return min(total_steps, math.floor(self.switch_at * total_steps + 0.5))

    def late_map(self) -> RecipeMap:
        """The picks after the switch: high precision where the map says so, else `switch_to`."""
        return RecipeMap(rules=[(p, None) for p, r in self.recipe_map.rules if r is None], default=self.switch_to)

    def map_at(self, step: int, total_steps: int) -> RecipeMap:
        """The map in force at `step` (0-based) of a `total_steps`-step run."""
        return self.recipe_map if step < self.switch_step(total_steps) else self.late_map()

    def to_plain(self) -> dict[str, Any]:
        return {"recipe_map": self.recipe_map.to_plain(), "switch_at": self.switch_at,
                "switch_to": choice_to_plain(self.switch_to)}

    @classmethod
    def from_plain(cls, plain: Any) -> RecipeSchedule:
        if not (isinstance(plain, dict) and set(plain) == {"recipe_map", "switch_at", "switch_to"}):
            raise ValueError(f"recipe schedule: expected {{'recipe_map': a RecipeMap's plain form, 'switch_at': a "
                             f"fraction, 'switch_to': a recipe's plain form}}, got {plain!r:.200}")
        return cls(recipe_map=RecipeMap.from_plain(plain["recipe_map"]), switch_at=plain["switch_at"],
                   switch_to=choice_from_plain(plain["switch_to"]))


def four_bit_gemms(recipe: Recipe | None) -> dict[Gemm, bool]:
    """Per GEMM of a layer under `recipe` (None: high precision): both its operands quantized to a 4-bit
    element. A `Debug` GEMM switched to high precision, fake quantization or FP8 current scaling is not. A
    `CustomRecipe` is refused (ValueError): its factory answers per module, not for the recipe as a whole."""
    if recipe is None:
        return {gemm: False for gemm in Gemm}
    if isinstance(recipe, CustomRecipe):
        raise ValueError("recipe: a CustomRecipe's quantizers come from its factory per module and GEMM, so which "
                         "GEMMs run in 4-bit is not known for the recipe; count a layer under it by hand (or give "
                         "the layers OperandRecipe / preset recipes)")
    switched: set[str] = set()
    if isinstance(recipe, Debug):
        switched = {*recipe.high_precision, *recipe.fake_quantize, *recipe.current_scaling}
    specs = recipe.operands()
    return {gemm: gemm.value not in switched and all(
        specs.get((gemm, role)) is not None and specs[(gemm, role)].element == FOUR_BIT for role in roles)
        for gemm, roles in GEMM_OPERANDS.items()}
