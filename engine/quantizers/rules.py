"""Scale rules: where a quantizer's scales come from.

* `DelayedRule`: a given per-tensor scale, read from scaling state that the recipe updates
  from an amax history; quantizing records max|x| into that state (the only stateful rule).
* `CurrentRule`: from the data itself, fp8_max / max(amax, eps) per tensor, per tile or per row
  (power-of-2 or not, as the scheme's scale encoding says); a per-tensor amax can be
  all-reduced over a process group first.
* `E8M0Rule`: an E8M0 exponent per MX block, "rceil" (NVIDIA hardware) or "floor" (OCP spec).

A rule is small data plus one method, `quantize`, that asks `engine.ops.quantize` for the
buffers of a scheme. Which schemes a rule fits it says from their fields (`fits`). Each rule registers
itself (`registry.register_rule`) under the name a quantizer spec gives it, with the pydantic
model of its parameters.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Literal, Union

import torch
import torch.distributed as dist
from pydantic import Field

from engine.collectives import all_reduce_max
from engine.ops import quantize as qops
from engine.ops import reference as ref
from engine.quantizers.registry import RuleParams, register_rule
from engine.schemes import ScaleEncoding, Scheme

Buffers = qops.Buffers


def check_epsilon(amax_epsilon: Any) -> float:
    if (isinstance(amax_epsilon, bool) or not isinstance(amax_epsilon, (int, float))
            or not (0 <= amax_epsilon < float("inf"))):
        raise ValueError(f"amax_epsilon: expected a finite number >= 0, got {amax_epsilon!r}")
    return float(amax_epsilon)


NOT_RECORDED = ref.NOT_RECORDED


def check_state_tensor(t: Any, name: str, *, zero_ok: bool) -> torch.Tensor:
    """A 1-element fp32 tensor holding a finite value > 0 whose fp32 reciprocal is finite too (an amax: >= 0
    or NOT_RECORDED if `zero_ok`); read once, at construction."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 1:
        got = f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{name}: expected a 1-element float32 tensor, got {got}")
    if t.is_meta:  # no value to check (e.g. a checkpoint loaded with map_location="meta")
        return t
    value = t.detach().reshape(()).item()
    if zero_ok and not (math.isfinite(value) and (value >= 0 or value == NOT_RECORDED)):
        raise ValueError(f"{name}: expected a finite value >= 0, got {value}")
    if not zero_ok and not bool(ref.usable_scales(t.detach()).all()):
        raise ValueError(f"{name}: expected a finite value > 0 with a finite reciprocal (scale_inv), got {value}")
    return t


class ScaleRule(ABC):
    """How the scales of one quantization are found."""

    @classmethod
    @abstractmethod
    def fits(cls, scheme: Scheme) -> bool:
        """Whether this rule can scale `scheme` (what a quantizer spec may pair it with), from its fields."""

    @classmethod
    def from_config(cls, **settings: Any) -> ScaleRule:
        """A rule from its `config()` (plus, for a checkpoint, its `state()` tensors)."""
        return cls(**settings)

    def check_scheme(self, scheme: Scheme) -> None:
        """ValueError where these settings cannot scale `scheme` (its fields fit: `fits`); nothing here."""

    def config(self) -> dict[str, Any]:
        """Settings as plain data (what makes two rules scale alike)."""
        return {}

    def state(self) -> dict[str, torch.Tensor]:
        """Tensors the rule reads or records into (delayed scaling: scale and amax)."""
        return {}

    @abstractmethod
    def quantize(self, x: torch.Tensor, scheme: Scheme, *, rowwise: bool, columnwise: bool) -> Buffers:
        """The buffers of x under `scheme` for the asked usages."""

    def kernel_args(self) -> dict[str, Any] | None:
        """When `quantize` is exactly one call of the registry's quantize kernel: that call's scale arguments
        (`scale`, `amax_epsilon`, `scale_mode`, and `record_amax` for a delayed record), so an eager
        quantization can call the kernel without the layers in between; None when the rule does more."""
        return None


MAX_MARGIN = 126  # 2**-margin must be a normal fp32 number, or the scale underflows
MAX_HISTORY_LEN = 1 << 16
AmaxAlgo = Union[Literal["max", "most_recent"], Callable[[torch.Tensor], torch.Tensor]]
#: scaling_factor_compute_algo(amax [n], scale [n], fp8_max, recipe) -> new scale [n]
ScaleAlgo = Callable[..., torch.Tensor]


class DelayedParams(RuleParams):
    """How delayed scales evolve (DelayedScaling's fields, bar the format: the scheme's element says it). The
    scaling state itself (scale, amax history) belongs to the recipe state that builds the quantizers."""

    margin: int = Field(0, ge=0, le=MAX_MARGIN)
    amax_history_len: int = Field(1024, ge=1, le=MAX_HISTORY_LEN)
    amax_compute_algo: AmaxAlgo = "max"
    scaling_factor_compute_algo: Union[ScaleAlgo, None] = None
    reduce_amax: bool = True


@register_rule("delayed", DelayedParams, stateful=True)
class DelayedRule(ScaleRule):
    """Quantize with the given `scale`; record max|x| into `amax` (max with what is there), both in place."""

    @classmethod
    def fits(cls, scheme: Scheme) -> bool:  # one given fp32 scale (any value) per tensor, one scale level
        return scheme.rowwise_block.is_tensor and scheme.scale is ScaleEncoding.FP32 and \
            isinstance(scheme.element, torch.dtype) and not scheme.tensor_scale

    def __init__(self, scale: torch.Tensor, amax: torch.Tensor, *, check: bool = True) -> None:
        # check=False: views into scaling state its owner keeps valid (no host reads; traceable)
        self.scale = check_state_tensor(scale, "scale", zero_ok=False) if check else scale
        self.amax = check_state_tensor(amax, "amax", zero_ok=True) if check else amax

    def state(self) -> dict[str, torch.Tensor]:
        return {"scale": self.scale.detach().clone(), "amax": self.amax.detach().clone()}

    def record_amax(self, x: torch.Tensor, amax: torch.Tensor | None = None) -> None:
        """amax = max(amax, max|x|), in place (also used alone, for calibration)."""
        current = qops.amax(x.detach()) if amax is None else amax
        self.amax.copy_(torch.maximum(self.amax, current.to(self.amax.device).reshape(self.amax.shape)))

    def quantize(self, x: torch.Tensor, scheme: Scheme, *, rowwise: bool, columnwise: bool) -> Buffers:
        buffers, _ = qops.quantize(x, scheme, rowwise=rowwise, columnwise=columnwise, scale=self.scale,
                                   record_amax=self.amax)  # the record happens in the same kernel call
        return buffers

    def kernel_args(self) -> dict[str, Any] | None:
        return {"scale": self.scale, "amax_epsilon": 0.0, "scale_mode": "rceil", "record_amax": self.amax}


class CurrentParams(RuleParams):
    amax_epsilon: float = Field(0.0, ge=0.0, allow_inf_nan=False)


@register_rule("current", CurrentParams)
class CurrentRule(ScaleRule):
    """fp8_max / max(amax, amax_epsilon) from this tensor (or each tile); amax all-reduced over a group if given.

    `agreed_amax`: a per-tensor amax already reduced over the group (with other tensors' amaxes in one
    collective, `agree_on_amaxes`); used as it is.
    """

    @classmethod
    def fits(cls, scheme: Scheme) -> bool:  # fp32 scales from the data, per tensor, tile or row, FP8 elements
        return scheme.scale in (ScaleEncoding.FP32, ScaleEncoding.FP32_POW2) and \
            isinstance(scheme.element, torch.dtype) and scheme.element.is_floating_point and not scheme.tensor_scale

    def __init__(self, amax_epsilon: float = 0.0, amax_reduction_group: dist.ProcessGroup | None = None, *,
                 agreed_amax: torch.Tensor | None = None) -> None:
        self.amax_epsilon = check_epsilon(amax_epsilon)
        self.amax_reduction_group = amax_reduction_group
        self.agreed_amax = agreed_amax

    def config(self) -> dict[str, Any]:
        return {"amax_epsilon": self.amax_epsilon}

    def quantize(self, x: torch.Tensor, scheme: Scheme, *, rowwise: bool, columnwise: bool) -> Buffers:
        scale = None
        if (self.amax_reduction_group is not None or self.agreed_amax is not None) and scheme.rowwise_block.is_tensor:
            amax = self.agreed_amax
            if amax is None:
                amax = qops.amax(x)
                all_reduce_max([amax], self.amax_reduction_group)
            scale = ref.compute_scale(amax, scheme.element, force_pow_2_scales=scheme.scale.is_pow2,
                                      amax_epsilon=self.amax_epsilon)
        buffers, _ = qops.quantize(x, scheme, rowwise=rowwise, columnwise=columnwise, scale=scale,
                                   amax_epsilon=self.amax_epsilon)
        return buffers

    def kernel_args(self) -> dict[str, Any] | None:
        if self.amax_reduction_group is not None or self.agreed_amax is not None:
            return None
        return {"scale": None, "amax_epsilon": self.amax_epsilon, "scale_mode": "rceil"}


class E8M0Params(RuleParams):
    scale_mode: Literal["rceil", "floor"] = "rceil"


@register_rule("e8m0", E8M0Params)
class E8M0Rule(ScaleRule):
    """MX shared exponents: "rceil" rounds amax / fp8_max up to a power of two; "floor" is the OCP rule."""

    @classmethod
    def fits(cls, scheme: Scheme) -> bool:
        return scheme.scale is ScaleEncoding.E8M0 and not scheme.tensor_scale

    def __init__(self, scale_mode: str = "rceil") -> None:
        if scale_mode not in ref.SCALE_MODES:
            raise ValueError(f"scale_mode: expected one of {sorted(ref.SCALE_MODES)}, got {scale_mode!r}")
        self.scale_mode = scale_mode

    def config(self) -> dict[str, Any]:
        return {"scale_mode": self.scale_mode}

    def quantize(self, x: torch.Tensor, scheme: Scheme, *, rowwise: bool, columnwise: bool) -> Buffers:
        buffers, _ = qops.quantize(x, scheme, rowwise=rowwise, columnwise=columnwise, scale_mode=self.scale_mode)
        return buffers

    def kernel_args(self) -> dict[str, Any] | None:
        return {"scale": None, "amax_epsilon": 0.0, "scale_mode": self.scale_mode}
