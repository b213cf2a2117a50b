"""Recipes: which quantizer each GEMM operand gets, and how scales evolve."""

from engine.recipes.base import Recipe, RecipeState
from engine.recipes.block import Float8BlockScaling
from engine.recipes.current import Float8CurrentScaling
from engine.recipes.custom import OperandRecipe
from engine.recipes.debug import Debug
from engine.recipes.delayed import DelayedScaling, DelayedScalingState
from engine.recipes.factory import CustomRecipe, CustomRecipeState
from engine.recipes.format import Format
from engine.recipes.mx_small import MXFP4BlockScaling, MXFP4MixedBlockScaling, MXFP6BlockScaling
from engine.recipes.mxfp8 import MXFP8BlockScaling
from engine.recipes.nvfp4 import NVFP4BlockScaling
from engine.recipes.operands import BACKWARD_ROLES, FORWARD_ROLES, OPERANDS, Gemm, QuantizerSpec, Role
from engine.recipes.plain import RECIPES, SAVED_RECIPES, recipe_from_plain, recipe_to_plain
from engine.recipes.recipe_map import RecipeMap
from engine.recipes.role import QuantizerRole
from engine.recipes.rowwise import Float8RowwiseScaling
from engine.recipes.schedule import RecipeSchedule

__all__ = [
    "BACKWARD_ROLES", "CustomRecipe", "CustomRecipeState", "Debug", "DelayedScaling", "DelayedScalingState", "FORWARD_ROLES",
    "Float8BlockScaling", "Float8CurrentScaling", "Float8RowwiseScaling", "Format", "Gemm", "MXFP4BlockScaling",
    "MXFP4MixedBlockScaling", "MXFP6BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling", "OPERANDS",
    "OperandRecipe", "QuantizerRole", "QuantizerSpec", "RECIPES", "Recipe", "RecipeMap", "RecipeSchedule", "SAVED_RECIPES", "RecipeState", "Role",
    "recipe_from_plain", "recipe_to_plain",
]
