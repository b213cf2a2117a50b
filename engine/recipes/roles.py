"""The tensors of a linear layer that a recipe quantizes, and their order in scaling state.

Forward state has three slots per GEMM (input, weight, output); backward state has two
(grad_output, grad_input). Slot i of GEMM g is at index `g * len(roles) + i`, the layout
Transformer Engine uses, so a state tensor reads the same in both.
"""

from __future__ import annotations

from enum import Enum


class Role(str, Enum):
    INPUT = "input"
    WEIGHT = "weight"
    OUTPUT = "output"
    GRAD_OUTPUT = "grad_output"
    GRAD_INPUT = "grad_input"

    @property
    def is_forward(self) -> bool:
        return self in FORWARD_ROLES


FORWARD_ROLES: tuple[Role, ...] = (Role.INPUT, Role.WEIGHT, Role.OUTPUT)
BACKWARD_ROLES: tuple[Role, ...] = (Role.GRAD_OUTPUT, Role.GRAD_INPUT)


def roles_for(forward: bool, num_gemms: int) -> list[Role]:
    """Role of every slot of a forward or backward state for `num_gemms` GEMMs."""
    if not isinstance(num_gemms, int) or isinstance(num_gemms, bool) or num_gemms < 1:
        raise ValueError(f"num_gemms: expected an int >= 1, got {num_gemms!r}")
    return list(FORWARD_ROLES if forward else BACKWARD_ROLES) * num_gemms


def roles_per_gemm(forward: bool) -> int:
    return len(FORWARD_ROLES if forward else BACKWARD_ROLES)


def slot_index(role: Role, gemm: int, *, forward: bool, num_gemms: int) -> int:
    """Index of (role, gemm) in a forward or backward state of `num_gemms` GEMMs."""
    slot_roles = FORWARD_ROLES if forward else BACKWARD_ROLES
    if role not in slot_roles:
        raise ValueError(f"role: expected one of {[r.value for r in slot_roles]}, got {role!r}")
    if not 0 <= gemm < num_gemms:
        raise ValueError(f"gemm: expected 0 <= gemm < {num_gemms}, got {gemm!r}")
    return gemm * len(slot_roles) + slot_roles.index(role)
