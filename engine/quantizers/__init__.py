"""Who makes quantized tensors: one Quantizer (a scheme plus a scale rule), under TE's names too."""

from engine.quantizers.base import Quantizer, quantizer_class, quantizer_from_plain, quantizer_from_spec
from engine.quantizers.named import (
    Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer, MXFP8Quantizer, MXQuantizer,
)
from engine.quantizers.nvfp4 import NVFP4Params, NVFP4Quantizer, NVFP4Rule
from engine.quantizers.registry import RULE_ENTRIES, RuleEntry, RuleParams, name_quantizer, register_rule, rule_entry
from engine.quantizers.rowwise import Float8RowwiseQuantizer
from engine.quantizers.rules import (
    CurrentParams, CurrentRule, DelayedParams, DelayedRule, E8M0Params, E8M0Rule, ScaleRule,
)
from engine.tensors.serialization import QUANTIZER_LOADERS

QUANTIZER_LOADERS["quantizer"] = quantizer_from_plain
QUANTIZER_LOADERS["class"] = quantizer_class

__all__ = [
    "CurrentParams", "CurrentRule", "DelayedParams", "DelayedRule", "E8M0Params", "E8M0Rule", "Float8BlockQuantizer",
    "Float8CurrentScalingQuantizer", "Float8Quantizer", "Float8RowwiseQuantizer", "MXFP8Quantizer", "MXQuantizer",
    "NVFP4Params", "NVFP4Quantizer", "NVFP4Rule", "Quantizer", "RULE_ENTRIES", "RuleEntry", "RuleParams", "ScaleRule",
    "name_quantizer", "quantizer_from_plain", "quantizer_from_spec", "register_rule", "rule_entry",
]
