"""format_of(config): the WeightFormat that quantizes a weight into a storage of one config's scheme and runs its GEMM."""

from __future__ import annotations

from engine.inference import engine_formats, int_formats
from engine.inference.configs import (
    Float8DynamicActivationFloat8Weight, Float8WeightOnly, InferenceConfig, Int4WeightOnly,
    Int8DynamicActivationInt8Weight, Int8WeightOnly, MXWeightOnly, NVFP4WeightOnly, check_config,
)
from engine.inference.weight_format import WeightFormat


def format_of(config: InferenceConfig) -> WeightFormat:
    """A fresh format object for `config` (formats hold quantizer objects, never shared between weights)."""
    check_config(config)
    if isinstance(config, Int8WeightOnly):
        return int_formats.Int8WeightOnlyFormat()
    if isinstance(config, Int4WeightOnly):
        return int_formats.Int4Format(config)
    if isinstance(config, Int8DynamicActivationInt8Weight):
        return int_formats.Int8DynamicFormat()
    if isinstance(config, Float8WeightOnly):
        return engine_formats.float8_weight_only()
    if isinstance(config, Float8DynamicActivationFloat8Weight):
        return engine_formats.float8_dynamic(config)
    if isinstance(config, MXWeightOnly):
        return engine_formats.mx_weight_only(config)
    if isinstance(config, NVFP4WeightOnly):
        return engine_formats.nvfp4_weight_only()
    raise TypeError(f"config: no format for {config!r}")
