"""engine: FP8 and MX low-precision training for PyTorch, in the style of Transformer Engine."""

from engine import formats
from engine.quantizers import (
    Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer, MXFP8Quantizer, Quantizer,
)
from engine.tensors import (
    Float8BlockwiseTensor, Float8Tensor, MXFP8Tensor, QuantizedTensor, QuantizedTensorBase,
)

__version__ = "0.1.0"

__all__ = [
    "Float8BlockQuantizer", "Float8BlockwiseTensor", "Float8CurrentScalingQuantizer", "Float8Quantizer",
    "Float8Tensor", "MXFP8Quantizer", "MXFP8Tensor", "QuantizedTensor", "QuantizedTensorBase", "Quantizer",
    "formats",
]
