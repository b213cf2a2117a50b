"""Who makes quantized tensors: one Quantizer (a scheme plus a scale rule), under TE's names too."""

from engine.quantizers.base import Quantizer, quantizer_class, quantizer_from_plain
from engine.quantizers.named import (
    Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer, MXFP8Quantizer, MXQuantizer,
)
from engine.quantizers.nvfp4 import NVFP4Quantizer, NVFP4Rule
from engine.quantizers.rowwise import Float8RowwiseQuantizer
from engine.quantizers.rules import CurrentRule, DelayedRule, E8M0Rule, ScaleRule
from engine.tensors.serialization import QUANTIZER_LOADERS

QUANTIZER_LOADERS["quantizer"] = quantizer_from_plain
QUANTIZER_LOADERS["class"] = quantizer_class

__all__ = [
    "CurrentRule", "DelayedRule", "E8M0Rule", "Float8BlockQuantizer", "Float8CurrentScalingQuantizer",
    "Float8Quantizer", "Float8RowwiseQuantizer", "MXFP8Quantizer", "MXQuantizer", "NVFP4Quantizer", "NVFP4Rule",
    "Quantizer", "ScaleRule", "quantizer_from_plain",
]
