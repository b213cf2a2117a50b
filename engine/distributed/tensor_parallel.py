"""Tensor-parallel plans for engine modules: `ColwiseParallel`, `RowwiseParallel`, `SequenceParallel`.

torch's styles refuse modules other than `nn.Linear` / `nn.Embedding`. These are torch's styles
(same constructor arguments, same defaults; other modules are handed to torch's own `_apply`)
that also take `engine.Linear` and `engine.LayerNormLinear`:

    parallelize_module(model, mesh, {"fc1": engine.distributed.ColwiseParallel(),
                                     "fc2": engine.distributed.RowwiseParallel()})

The weights become DTensors (column parallel: weight and bias `Shard(0)`, a LayerNormLinear's
norm replicated; row parallel: weight `Shard(1)`, bias replicated) and the module runs its
quantized GEMMs on the local shards (`dtensor_linear`). A column-parallel engine module given
`input_layouts=Shard(seq_dim)` (sequence parallel) receives the sequence shard itself and
all-gathers it in FP8 (torch's style would gather it in high precision before the module).
`SequenceParallel` is torch's: it already takes any module (norms, dropout).
`LayerNormMLPParallel` splits a LayerNormMLP as Megatron does (fc1 by columns, fc2 by rows).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import style as torch_style
from torch.distributed.tensor.parallel.style import SequenceParallel

from engine.modules import FP8Module, LayerNormLinear, LayerNormMLP, Linear
from engine.modules.activations import GATED
from engine.tensors import QuantizedTensor

__all__ = ["ColwiseParallel", "LayerNormMLPParallel", "RowwiseParallel", "SequenceParallel"]


def _check_module(module: torch.nn.Module, style: str, accepted: tuple[type, ...], mesh: DeviceMesh) -> None:
    if not isinstance(module, accepted) or (isinstance(module, LayerNormMLP) and LayerNormMLP not in accepted):
        names = " and ".join(t.__name__ for t in accepted)
        hint = " (LayerNormMLP: engine.distributed.LayerNormMLPParallel)" if isinstance(module, LayerNormMLP) else ""
        raise NotImplementedError(f"{style}: takes torch.nn.Linear, torch.nn.Embedding and engine's {names}; "
                                  f"got {type(module).__name__}{hint}")
    if mesh.ndim != 1:
        raise ValueError(f"device_mesh: {style} of an engine module needs a 1-D mesh, got {mesh.ndim}-D {mesh}")
    fp8 = [name for name, p in module.named_parameters() if isinstance(p, QuantizedTensor)]
    if fp8:
        raise NotImplementedError(f"{style}: {type(module).__name__} holds FP8 primary weights ({', '.join(fp8)}, "
                                  "from fp8_model_init), which are not sharded; build it without fp8_model_init")


def _sequence_or_replicate(layouts: tuple[Any, ...]) -> tuple[Any, ...]:
    """What a column-parallel engine module is given: a sequence shard as it is (it gathers it, in FP8 where it
    can), anything else made replicated."""
    layout = layouts[0]
    return layouts if isinstance(layout, Shard) and layout.dim != -1 else (Replicate(),)


def _distribute(module: FP8Module, mesh: DeviceMesh, placements: dict[str, Any], src_data_rank: int | None) -> None:
    """Replace each parameter by a DTensor with its placement (default: replicated)."""
    for name, param in list(module.named_parameters(recurse=False)):
        dist_param = distribute_tensor(param, mesh, [placements.get(name, Replicate())], src_data_rank=src_data_rank)
        module.register_parameter(name, torch.nn.Parameter(dist_param, requires_grad=param.requires_grad))
    module._weight_caches = [type(c)() for c in module._weight_caches]  # quantized copies of the whole weight


class ColwiseParallel(torch_style.ColwiseParallel):
    """torch's ColwiseParallel, also for engine.Linear and engine.LayerNormLinear (their norm stays replicated).

    With `input_layouts=Shard(d)` (d not the feature dim: sequence parallel) the engine module gathers
    its input itself, in FP8 where the recipe allows; otherwise the input is made replicated first.
    """

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            return super()._apply(module, device_mesh)
        _check_module(module, "ColwiseParallel", (Linear, LayerNormLinear), device_mesh)
        return distribute_module(
            module, device_mesh,
            lambda name, mod, mesh: _distribute(mod, mesh, {"weight": Shard(0), "bias": Shard(0)}, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, _sequence_or_replicate(self.input_layouts)),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class RowwiseParallel(torch_style.RowwiseParallel):
    """torch's RowwiseParallel, also for engine.Linear: weight `Shard(1)`, bias replicated and added once.

    The module's output is a partial sum, reduced to `output_layouts` (all-reduce to `Replicate()`,
    the default, or reduce-scatter to `Shard(seq_dim)` for sequence parallel).
    """

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            return super()._apply(module, device_mesh)
        _check_module(module, "RowwiseParallel", (Linear,), device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh,
            lambda name, mod, mesh: _distribute(mod, mesh, {"weight": Shard(1)}, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_outputs, self.output_layouts, self.use_local_output),
        )

    @classmethod
    def _prepare_outputs(cls, output_layouts: Any, use_local_output: bool, mod: torch.nn.Module, outputs: Any,
                         device_mesh: DeviceMesh) -> Any:
        """torch's output handling; with `return_bias=True` the output is reduced and the bias (replicated, not
        added: the caller adds it once, after the reduction, as Megatron's skip_bias_add) passed along."""
        if not isinstance(outputs, tuple):
            return cls._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        out, bias = outputs
        out = cls._prepare_output_fn(output_layouts, use_local_output, mod, out, device_mesh)
        return out, (bias.to_local() if use_local_output and isinstance(bias, DTensor) else bias)


class LayerNormMLPParallel(torch_style.ParallelStyle):
    """A LayerNormMLP split as Megatron and Transformer Engine split it: the norm replicated, fc1 by columns
    (`Shard(0)`), the activation on each rank's columns, fc2 by rows (`Shard(1)`, bias added once).

    `input_layouts`: `Replicate()` (default) or `Shard(seq_dim)` (sequence parallel: gathered inside, in FP8
    where the recipe allows); `output_layouts`: `Replicate()` (default, all-reduce) or `Shard(seq_dim)`
    (reduce-scatter). Gated activations (swiglu, geglu) are refused: their two halves of fc1 would need
    interleaved shards.
    """

    def __init__(self, *, input_layouts: Any = None, output_layouts: Any = None, use_local_output: bool = True) -> None:
        super().__init__()
        self.input_layouts = (input_layouts or Replicate(),)
        self.output_layouts = (output_layouts or Replicate(),)
        self.use_local_output = use_local_output

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        _check_module(module, "LayerNormMLPParallel", (LayerNormMLP,), device_mesh)
        if module.activation in GATED:
            raise NotImplementedError(f"LayerNormMLPParallel: gated activations ({module.activation}) are not split "
                                      "(their halves of fc1 would need interleaved shards)")
        if module.return_bias or module.return_layernorm_output:
            raise NotImplementedError("LayerNormMLPParallel: return_bias / return_layernorm_output are not supported")
        placements = {"fc1_weight": Shard(0), "fc1_bias": Shard(0), "fc2_weight": Shard(1)}
        return distribute_module(
            module, device_mesh,
            lambda name, mod, mesh: _distribute(mod, mesh, placements, self.src_data_rank),
            partial(torch_style.ColwiseParallel._prepare_input_fn, self.input_layouts,
                    _sequence_or_replicate(self.input_layouts)),
            partial(torch_style.RowwiseParallel._prepare_output_fn, self.output_layouts, self.use_local_output),
        )

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(input_layouts={self.input_layouts}, output_layouts={self.output_layouts}, "
                f"use_local_output={self.use_local_output})")
