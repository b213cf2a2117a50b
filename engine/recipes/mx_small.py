"""MXFP4 and MXFP6 block scaling: OCP MX with E2M1 (FP4) or E2M3 / E3M2 (FP6) elements, E8M0 scales per 32.

Each recipe quantizes the three GEMMs' operands in MX; `backward_element` lets the backward GEMMs
(dgrad's grad_output and weight, wgrad's grad_output and input) use another MX element, typically
MXFP8 E4M3: 4/6-bit forward GEMMs with 8-bit gradients, the usual way to keep gradient noise down
(the forward GEMM of the weight stays FP4/FP6, the backward ones read an MXFP8 copy of it).
`MXFP4MixedBlockScaling` is that choice for FP4 as a preset (a name for the demo and checkpoints).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import field_validator

from engine.recipes.base import Recipe
from engine.recipes.format import Format, fixed_format
from engine.recipes.operands import OPERANDS, Gemm, Operand, QuantizerSpec, Role
from engine.schemes import mx_scheme

ScaleMode = Literal["rceil", "floor"]
#: the operands of the backward GEMMs (dgrad, wgrad)
BACKWARD_OPERANDS = frozenset(op for op in OPERANDS if op[0] is not Gemm.FPROP)


def _mx_operands(forward: str, backward: str, scale_mode: str) -> dict[Operand, QuantizerSpec | None]:
    specs = {element: QuantizerSpec(scheme=mx_scheme(element).name, rule="e8m0", params={"scale_mode": scale_mode})
             for element in {forward, backward}}
    return {op: specs[backward if op in BACKWARD_OPERANDS else forward] for op in OPERANDS}


class _MXSmall(Recipe):
    """Shared by the MXFP4 / MXFP6 recipes: every operand MX-quantized; `fp8_format` is unused (E4M3)."""

    fp8_format: Format = Format.E4M3
    scale_mode: ScaleMode = "rceil"

    @field_validator("fp8_format", mode="after")
    @classmethod
    def _elements_come_from_their_own_fields(cls, value: Any) -> Any:
        return fixed_format(value, Format.E4M3, cls.__name__,
                            "picks its elements with its own fields (backward_element, element)")

    def forward_element(self) -> str:
        """The element of the forward GEMMs' operands (each MX recipe names its own)."""
        raise NotImplementedError(f"{type(self).__name__}: an MX recipe names its forward element")

    def operands(self) -> dict[Operand, QuantizerSpec | None]:
        forward = self.forward_element()
        return _mx_operands(forward, self.backward_element or forward, self.scale_mode)

    def element_for(self, role: Role) -> str:
        return self.forward_element() if role.is_forward else (self.backward_element or self.forward_element())


class MXFP4BlockScaling(_MXSmall):
    """MXFP4: E2M1 elements (max 6) in 1x32 / 32x1 blocks with E8M0 scales, for every GEMM operand.

    `scale_mode`: "rceil" (amax / 6 rounded up to a power of two: nothing saturates) or "floor" (the OCP
    spec's floor(log2 amax) - 2: up to 4/3 of the max saturates, one more binade of resolution).
    `backward_element`: the backward GEMMs' element, None = E2M1 too, "e4m3" / "e5m2" = MXFP8 gradients.
    """

    name: ClassVar[str] = "mxfp4"

    backward_element: Literal["e2m1", "e4m3", "e5m2"] | None = None

    def forward_element(self) -> str:
        return "e2m1"


class MXFP4MixedBlockScaling(MXFP4BlockScaling):
    """MXFP4 forward GEMMs, MXFP8 (E4M3) backward GEMMs: `MXFP4BlockScaling(backward_element="e4m3")` by name."""

    name: ClassVar[str] = "mxfp4_mixed"

    backward_element: Literal["e2m1", "e4m3", "e5m2"] | None = "e4m3"


class MXFP6BlockScaling(_MXSmall):
    """MXFP6: E2M3 (max 7.5, more precision) or E3M2 (max 28, more range) elements in MX blocks, every operand.

    `element` picks the FP6 element; `backward_element` the backward GEMMs' (None = the same; "e3m2" is the
    usual choice for gradients, "e4m3" / "e5m2" give MXFP8 gradients).
    """

    name: ClassVar[str] = "mxfp6"

    element: Literal["e2m3", "e3m2"] = "e2m3"
    backward_element: Literal["e2m3", "e3m2", "e4m3", "e5m2"] | None = None

    def forward_element(self) -> str:
        return self.element
