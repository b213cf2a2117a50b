"""Inference quantization (torchao's `quantize_` habit): linear weights swapped for quantized tensors in place
(torch.nn.Linear, engine.Linear, engine.LayerNormLinear, engine.LayerNormMLP's fc1 and fc2).

    import engine
    engine.quantize_(model, engine.Int4WeightOnly(group_size=128))
    model(x)                                   # each linear layer runs engine's int4 CPU GEMM
    torch.save(model.state_dict(), path)       # plain tensors; loads with weights_only=True
"""

from engine.inference.configs import (
    CONFIGS, Float8DynamicActivationFloat8Weight, Float8WeightOnly, InferenceConfig, Int4WeightOnly,
    Int8DynamicActivationInt8Weight, Int8WeightOnly, MXWeightOnly, NVFP4WeightOnly, config_from_plain,
)
from engine.inference.quantize import quantize_
from engine.inference.weight import QuantizedWeight

__all__ = [
    "CONFIGS", "Float8DynamicActivationFloat8Weight", "Float8WeightOnly", "InferenceConfig", "Int4WeightOnly",
    "Int8DynamicActivationInt8Weight", "Int8WeightOnly", "MXWeightOnly", "NVFP4WeightOnly", "QuantizedWeight",
    "config_from_plain", "quantize_",
]
