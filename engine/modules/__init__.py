"""The layers users put in their models."""

from engine.modules.base import FP8Module
from engine.modules.experts import GroupedExperts
from engine.modules.grouped_linear import GroupedLinear, StackedGroupedLinear
from engine.modules.layernorm_linear import LayerNormLinear
from engine.modules.layernorm_mlp import LayerNormMLP
from engine.modules.linear import Linear

__all__ = ["FP8Module", "GroupedExperts", "GroupedLinear", "StackedGroupedLinear", "LayerNormLinear", "LayerNormMLP", "Linear"]
