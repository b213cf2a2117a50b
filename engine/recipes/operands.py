"""The operands of a linear layer's three GEMMs, and the quantizer spec a recipe gives each.

    fprop  y  = x  @ W^T   operands (FPROP, INPUT) rowwise,       (FPROP, WEIGHT) rowwise
    dgrad  dx = dy @ W     operands (DGRAD, GRAD_OUTPUT) rowwise, (DGRAD, WEIGHT) columnwise
    wgrad  dW = dy^T @ x   operands (WGRAD, GRAD_OUTPUT) columnwise, (WGRAD, INPUT) columnwise

A recipe maps each operand to a `QuantizerSpec` or to None (that operand stays in high
precision). Where both uses of a tensor have the same spec, one quantization gives both
usages; otherwise each use is quantized (or not) on its own.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.quantizers import (
    Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8RowwiseQuantizer, MXFP8Quantizer, MXQuantizer,
    NVFP4Quantizer, Quantizer,
)


class Gemm(str, Enum):
    FPROP = "fprop"
    DGRAD = "dgrad"
    WGRAD = "wgrad"


class Role(str, Enum):
    """A tensor a linear layer quantizes."""

    INPUT = "input"
    WEIGHT = "weight"
    GRAD_OUTPUT = "grad_output"

    @property
    def is_forward(self) -> bool:
        return self is not Role.GRAD_OUTPUT

    @property
    def uses(self) -> tuple[Operand, Operand]:
        """(the use that reads rowwise data, the use that reads columnwise data)."""
        return USES[self]


Operand = tuple[Gemm, Role]
USES: dict[Role, tuple[Operand, Operand]] = {
    Role.INPUT: ((Gemm.FPROP, Role.INPUT), (Gemm.WGRAD, Role.INPUT)),
    Role.WEIGHT: ((Gemm.FPROP, Role.WEIGHT), (Gemm.DGRAD, Role.WEIGHT)),
    Role.GRAD_OUTPUT: ((Gemm.DGRAD, Role.GRAD_OUTPUT), (Gemm.WGRAD, Role.GRAD_OUTPUT)),
}
OPERANDS: tuple[Operand, ...] = tuple(op for uses in USES.values() for op in uses)
FORWARD_ROLES = (Role.INPUT, Role.WEIGHT)
BACKWARD_ROLES = (Role.GRAD_OUTPUT,)
ELEMENTS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def operand_key(operand: Operand) -> str:
    """"fprop_input", "dgrad_weight", ...: how an operand is named in a recipe's plain data."""
    return f"{operand[0].value}_{operand[1].value}"


class QuantizerSpec(BaseModel):
    """How one operand is quantized: layout, element, where scales come from. Plain, frozen data."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    layout: Literal["tensor", "block1d", "block2d", "mx", "axiswise", "nvfp4"]
    #: FP8 elements for every layout; the MX-only elements E2M1 (MXFP4), E2M3 and E3M2 (MXFP6) for "mx";
    #: E2M1 for "nvfp4"
    element: Literal["e4m3", "e5m2", "e2m1", "e2m3", "e3m2"] = "e4m3"
    scaling: Literal["current", "e8m0", "delayed", "nvfp4"] = "current"
    pow2: bool = False
    amax_epsilon: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    scale_mode: Literal["rceil", "floor"] = "rceil"
    #: NVFP4 only (`NVFP4Quantizer`): RHT of the columnwise usage, stochastic rounding, 16x16 tiles
    rht: bool = False
    stochastic_rounding: bool = False
    two_d: bool = False

    @model_validator(mode="after")
    def _rule_fits_layout(self) -> QuantizerSpec:
        if (self.scaling == "nvfp4") != (self.layout == "nvfp4"):
            raise ValueError(f"scaling: layout 'nvfp4' takes scaling 'nvfp4' and no other layout does; got "
                             f"{self.scaling!r} for layout {self.layout!r}")
        if self.layout == "nvfp4":
            if self.element != "e2m1":
                raise ValueError(f"element: NVFP4 elements are 'e2m1', got {self.element!r}")
            return self
        if self.rht or self.stochastic_rounding or self.two_d:
            raise ValueError(f"rht / stochastic_rounding / two_d: NVFP4 options, got layout {self.layout!r}")
        if (self.scaling == "e8m0") != (self.layout == "mx"):
            raise ValueError(f"scaling: MX layouts take 'e8m0' scales and others 'current' or 'delayed'; got "
                             f"{self.scaling!r} for layout {self.layout!r}")
        if self.scaling == "delayed" and self.layout != "tensor":
            raise ValueError(f"scaling: 'delayed' scales are per tensor; got layout {self.layout!r}")
        if self.element not in ELEMENTS and self.layout != "mx":
            raise ValueError(f"element: {self.element!r} elements (MXFP4/MXFP6) need layout 'mx', got layout "
                             f"{self.layout!r}")
        return self

    @property
    def dtype(self) -> torch.dtype:
        """The FP8 dtype of an FP8 element (MXFP4/MXFP6 elements have none: TypeError)."""
        if self.element not in ELEMENTS:
            raise TypeError(f"element: {self.element!r} has no torch dtype (its data is uint8 codes)")
        return ELEMENTS[self.element]

    def make(self) -> Quantizer:
        """A fresh quantizer (by Transformer Engine's names) for this spec."""
        if self.scaling == "delayed":
            raise ValueError("scaling: a 'delayed' spec quantizes with scaling state that DelayedScaling.make_state "
                             "builds; it has no stand-alone quantizer")
        if self.layout == "nvfp4":
            return NVFP4Quantizer(with_rht=self.rht, stochastic_rounding=self.stochastic_rounding,
                                  with_2d_quantization=self.two_d)
        if self.layout == "mx":
            if self.element not in ELEMENTS:
                return MXQuantizer(self.element, scale_mode=self.scale_mode)
            return MXFP8Quantizer(self.dtype, scale_mode=self.scale_mode)
        if self.layout == "axiswise":
            return Float8RowwiseQuantizer(self.dtype, force_pow_2_scales=self.pow2, amax_epsilon=self.amax_epsilon)
        if self.layout == "tensor":
            return Float8CurrentScalingQuantizer(self.dtype, force_pow_2_scales=self.pow2,
                                                 amax_epsilon=self.amax_epsilon)
        return Float8BlockQuantizer(self.dtype, block_scaling_dim=2 if self.layout == "block2d" else 1,
                                    force_pow_2_scales=self.pow2, amax_epsilon=self.amax_epsilon)


def check_num_gemms(num_gemms: int) -> int:
    if not isinstance(num_gemms, int) or isinstance(num_gemms, bool) or num_gemms < 1:
        raise ValueError(f"num_gemms: expected an int >= 1, got {num_gemms!r}")
    return num_gemms

