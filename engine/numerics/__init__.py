"""engine.inspect: the numerics of every quantized GEMM operand and output of a model, per layer and step."""

from engine.numerics.config import InspectConfig
from engine.numerics.recommend import recommend
from engine.numerics.session import Inspector, inspect

__all__ = ["InspectConfig", "Inspector", "inspect", "recommend"]
