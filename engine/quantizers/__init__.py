"""Who makes quantized tensors: one quantizer per scaling scheme."""

from engine.quantizers.base import Quantizer, quantizer_from_plain
from engine.quantizers.blockwise import Float8BlockQuantizer
from engine.quantizers.float8 import Float8CurrentScalingQuantizer, Float8Quantizer
from engine.quantizers.mxfp8 import MXFP8Quantizer

__all__ = [
    "Float8BlockQuantizer", "Float8CurrentScalingQuantizer", "Float8Quantizer", "MXFP8Quantizer", "Quantizer",
    "quantizer_from_plain",
]
