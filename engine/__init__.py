"""engine: FP8 and MX low-precision training for PyTorch, in the style of Transformer Engine."""

from engine import formats, memory, recipes
from engine.autocast import fp8_autocast, fp8_model_init, quantized_model_init  # engine.autocast: the module, callable as TE 2.x's autocast
from engine.conversion import convert, unconvert
from engine.modules import GroupedExperts, GroupedLinear, LayerNormLinear, LayerNormMLP, Linear, StackedGroupedLinear
from engine.modules.recipe_maps import four_bit_flop_share, recipe_map_of, set_recipe_map
from engine.modules.saving import plain_state_dict
from engine.device import (
    get_device_info, is_fp8_available, is_fp8_block_scaling_available, is_mxfp8_available, is_nvfp4_available,
)
from engine.recompute import checkpoint, checkpoint_context
from engine.numerics import inspect, recommend  # engine.inspect(model, every=N, out=DIR, what_if=None)
from engine.inference import (
    Float8DynamicActivationFloat8Weight, Float8WeightOnly, Int4WeightOnly, Int8DynamicActivationInt8Weight,
    Int8WeightOnly, MXWeightOnly, NVFP4WeightOnly, QuantizedWeight, quantize_,
)
from engine.quantizers import (
    Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer, MXFP8Quantizer, MXQuantizer, NVFP4Quantizer,
    Quantizer,
)
from engine.tensors import (
    Float8BlockwiseTensor, Float8Tensor, MXFP8Tensor, MXTensor, NVFP4Tensor, QuantizedTensor, QuantizedTensorBase,
)
from engine import optim  # low-precision optimizer states (engine.optim.AdamW, ...)
from engine import distributed  # the layer above modules: registers the hooks the layers below call (engine.hooks)
from engine import moe  # mixtures of experts: engine.moe.permute / unpermute, MoEMLP, expert parallel

memory.tune_malloc()  # opt-in (ENGINE_MALLOC_TUNING=1): large CPU tensors reuse freed memory, not fresh pages

__version__ = "0.1.0"

__all__ = [
    "Float8BlockQuantizer", "Float8BlockwiseTensor", "Float8CurrentScalingQuantizer", "Float8Quantizer",
    "Float8Tensor", "GroupedExperts", "GroupedLinear", "LayerNormLinear", "LayerNormMLP", "Linear", "StackedGroupedLinear", "MXFP8Quantizer", "MXFP8Tensor", "MXQuantizer", "MXTensor",
    "NVFP4Quantizer", "NVFP4Tensor",
    "QuantizedTensor", "QuantizedTensorBase", "Quantizer",
    "autocast", "convert", "fp8_autocast", "fp8_model_init", "formats", "get_device_info", "is_fp8_available",
    "is_fp8_block_scaling_available", "is_mxfp8_available", "is_nvfp4_available", "quantized_model_init", "recipes",
    "unconvert",
    "checkpoint", "checkpoint_context", "inspect", "recommend",
    "four_bit_flop_share", "plain_state_dict", "recipe_map_of", "set_recipe_map",
    "Float8DynamicActivationFloat8Weight", "Float8WeightOnly", "Int4WeightOnly", "Int8DynamicActivationInt8Weight",
    "Int8WeightOnly", "MXWeightOnly", "NVFP4WeightOnly", "QuantizedWeight", "quantize_",
]
