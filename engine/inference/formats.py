"""format_of(config): the object that quantizes, dequantizes and runs a Linear for one inference config."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from engine.inference import engine_formats, int_formats
from engine.inference.configs import (
    Float8DynamicActivationFloat8Weight, Float8WeightOnly, InferenceConfig, Int4WeightOnly,
    Int8DynamicActivationInt8Weight, Int8WeightOnly, MXWeightOnly, NVFP4WeightOnly, check_config,
)
from engine.inference.int_formats import PartSpecs


class WeightFormat(Protocol):
    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]: ...
    def part_specs(self, shape: tuple[int, int]) -> PartSpecs: ...
    def check_values(self, parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> None: ...
    def dequantize(self, parts: dict[str, torch.Tensor], shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor: ...
    def linear(self, x: torch.Tensor, parts: dict[str, torch.Tensor], shape: tuple[int, int],
               bias: torch.Tensor | None) -> torch.Tensor: ...


def format_of(config: InferenceConfig) -> Any:
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
