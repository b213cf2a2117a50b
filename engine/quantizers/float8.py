"""Per-tensor FP8 quantizers: delayed scaling (scale given) and current scaling (scale from x)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from engine.distributed import all_reduce_max
from engine.ops import backend as ops
from engine.ops import reference as ref
from engine.quantizers.base import (
    Buffers, Quantizer, check_bool, check_epsilon, check_fp8_dtype, dtype_name, per_tensor_buffers,
)
from engine.tensors.float8 import Float8TensorStorage


def _check_state_tensor(t: Any, name: str, *, zero_ok: bool) -> torch.Tensor:
    """A 1-element fp32 tensor holding a finite value > 0 (>= 0 if `zero_ok`); read once, at construction."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 1:
        got = f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{name}: expected a 1-element float32 tensor, got {got}")
    if t.is_meta:  # no value to check (e.g. a checkpoint loaded with map_location="meta")
        return t
    value = t.detach().reshape(()).item()
    if not (math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):
        raise ValueError(f"{name}: expected a finite value {'>=' if zero_ok else '>'} 0, got {value}")
    return t


class Float8Quantizer(Quantizer):
    """Delayed scaling: quantize with the given `scale`; record max(|x|) into `amax` (max with what is there).

    `scale` must hold a finite value > 0 and `amax` a finite value >= 0 (checked here, once).

    `scale` and `amax` are the caller's tensors (typically views into a module's scaling
    state), read and written in place; the recipe updates `scale` from the amax history.
    """

    storage_class = Float8TensorStorage

    def __init__(
        self, scale: torch.Tensor, amax: torch.Tensor, fp8_dtype: torch.dtype, *,
        rowwise: bool = True, columnwise: bool = True, internal: bool = False,
    ) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise, internal=internal)
        self.scale = _check_state_tensor(scale, "scale", zero_ok=False)
        self.amax = _check_state_tensor(amax, "amax", zero_ok=True)
        self.fp8_dtype = check_fp8_dtype(fp8_dtype)

    def config(self) -> dict[str, Any]:
        return {"fp8_dtype": dtype_name(self.fp8_dtype)}

    def state(self) -> dict[str, torch.Tensor]:
        return {"scale": self.scale.detach().clone(), "amax": self.amax.detach().clone()}

    def record_amax(self, x: torch.Tensor, amax: torch.Tensor | None = None) -> None:
        """amax = max(amax, max|x|), in place (also used alone, for calibration)."""
        current = ops.amax(x.detach()) if amax is None else amax
        self.amax.copy_(torch.maximum(self.amax, current.to(self.amax.device).reshape(self.amax.shape)))

    def compute_buffers(self, x: torch.Tensor, *, rowwise: bool, columnwise: bool) -> Buffers:
        buffers, amax = per_tensor_buffers(x, self.scale, self.fp8_dtype, rowwise=rowwise, columnwise=columnwise)
        self.record_amax(x, amax)
        return buffers


class Float8CurrentScalingQuantizer(Quantizer):
    """Current scaling: the scale comes from this tensor's own amax (all-reduced over a group if given)."""

    storage_class = Float8TensorStorage

    def __init__(
        self, fp8_dtype: torch.dtype, *, force_pow_2_scales: bool = False, amax_epsilon: float = 0.0,
        amax_reduction_group: dist.ProcessGroup | None = None,
        rowwise: bool = True, columnwise: bool = True, internal: bool = False,
    ) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise, internal=internal)
        self.fp8_dtype = check_fp8_dtype(fp8_dtype)
        self.force_pow_2_scales = check_bool(force_pow_2_scales, "force_pow_2_scales")
        self.amax_epsilon = check_epsilon(amax_epsilon)
        self.amax_reduction_group = amax_reduction_group

    def config(self) -> dict[str, Any]:
        return {"fp8_dtype": dtype_name(self.fp8_dtype), "force_pow_2_scales": self.force_pow_2_scales,
                "amax_epsilon": self.amax_epsilon}

    def _reduced_amax(self, x: torch.Tensor) -> torch.Tensor:
        amax = ops.amax(x)
        if self.amax_reduction_group is not None:
            all_reduce_max([amax], self.amax_reduction_group)
        return amax

    def compute_buffers(self, x: torch.Tensor, *, rowwise: bool, columnwise: bool) -> Buffers:
        scale = ref.compute_scale(self._reduced_amax(x), self.fp8_dtype,
                                  force_pow_2_scales=self.force_pow_2_scales, amax_epsilon=self.amax_epsilon)
        buffers, _ = per_tensor_buffers(x, scale, self.fp8_dtype, rowwise=rowwise, columnwise=columnwise)
        return buffers
