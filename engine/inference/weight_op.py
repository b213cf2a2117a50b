"""A quantized weight's GEMM as the custom op `engine::weight_linear`, for torch.compile.

Dynamo cannot trace the formats' GEMMs (engine's C++ kernels, oneDNN calls), so under torch.compile
`QuantizedWeight.linear` calls

    engine::weight_linear(x [M, K], operands, spec, bias) -> y [M, N]

where `operands` are the tensors the weight's GEMM reads (`QuantizedWeight.operands`) and `spec` (a string:
the config, the operands' names and the weight's shape) is what the op rebuilds the format from. It runs the format's own `linear`, so compiled
outputs are eager's bits; its fake implementation makes y's shape and dtype (x's). Inference only: the
op has no autograd formula (the weight takes no gradient; x's gradient is not defined through it).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Optional

import torch

from engine.inference.configs import InferenceConfig, config_from_plain
from engine.inference.formats import format_of


def weight_spec(config: InferenceConfig, names: list[str], shape: tuple[int, int]) -> str:
    """The op's `spec` argument: plain data, so compiled code guards on it by value."""
    return json.dumps({"config": config.to_plain(), "operands": names, "shape": list(shape)}, sort_keys=True)


@lru_cache(maxsize=256)
def _read_spec(spec: str) -> tuple[InferenceConfig, list[str], tuple[int, int]]:
    plain = json.loads(spec)
    return config_from_plain(plain["config"]), plain["operands"], tuple(plain["shape"])


def _weight_linear(x: torch.Tensor, operands: list[torch.Tensor], spec: str,
                   bias: Optional[torch.Tensor]) -> torch.Tensor:
    config, names, shape = _read_spec(spec)
    fmt = format_of(config)  # fresh: formats hold quantizers, never shared
    return fmt.linear(x, dict(zip(names, operands)), shape, bias)


def _weight_linear_fake(x: torch.Tensor, operands: list[torch.Tensor], spec: str,
                        bias: Optional[torch.Tensor]) -> torch.Tensor:
    _, _, (n, _) = _read_spec(spec)
    return x.new_empty((x.shape[0], n))


weight_linear = torch.library.custom_op("engine::weight_linear", _weight_linear, mutates_args=())
weight_linear.register_fake(_weight_linear_fake)


def compiled_weight_linear(x2d: torch.Tensor, operands: dict[str, Any], config: InferenceConfig,
                           shape: tuple[int, int], bias: torch.Tensor | None) -> torch.Tensor:
    """x2d [M, K] @ W^T (+ bias) through the op: what `QuantizedWeight.linear` runs while compiling."""
    names = list(operands)
    return weight_linear(x2d, [operands[n] for n in names], weight_spec(config, names, shape), bias)
