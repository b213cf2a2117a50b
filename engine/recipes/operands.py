"""The operands of a linear layer's three GEMMs, and the quantizer spec a recipe gives each.

    fprop  y  = x  @ W^T   operands (FPROP, INPUT) rowwise,       (FPROP, WEIGHT) rowwise
    dgrad  dx = dy @ W     operands (DGRAD, GRAD_OUTPUT) rowwise, (DGRAD, WEIGHT) columnwise
    wgrad  dW = dy^T @ x   operands (WGRAD, GRAD_OUTPUT) columnwise, (WGRAD, INPUT) columnwise

A recipe maps each operand to a `QuantizerSpec` (spec.py: scheme, rule, params) or to None
(that operand stays in high precision). Where both uses of a tensor have the same spec, one
quantization gives both usages; otherwise each use is quantized (or not) on its own.
"""

from __future__ import annotations

from enum import Enum

from engine.recipes.spec import ELEMENTS, QuantizerSpec  # noqa: F401  (their first home: still importable here)


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


def operand_key(operand: Operand) -> str:
    """"fprop_input", "dgrad_weight", ...: how an operand is named in a recipe's plain data."""
    return f"{operand[0].value}_{operand[1].value}"


def check_num_gemms(num_gemms: int) -> int:
    if not isinstance(num_gemms, int) or isinstance(num_gemms, bool) or num_gemms < 1:
        raise ValueError(f"num_gemms: expected an int >= 1, got {num_gemms!r}")
    return num_gemms

