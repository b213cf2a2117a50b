"""QuantizerRole: which operand of which GEMM of which module a CustomRecipe's factory is asked about.

A role is a `str` equal to Transformer Engine 2.x's role name, so a factory written for TE's
`CustomRecipe(qfactory)` (`if role == "linear_input": ...`) runs unchanged:

    "linear_input"        x, read by fprop (rowwise) and wgrad (columnwise)
    "linear_weight"       W, read by fprop (rowwise) and dgrad (columnwise)
    "linear_grad_output"  dy, read by dgrad (rowwise) and wgrad (columnwise)

(TE's "linear_output" and "linear_grad_input" are never quantized by engine's layers, so never
asked.) It also carries the finer fields engine asks per operand, named as in TE's later
`QuantizerRole` where TE has them:

    module_type  "linear" (every engine layer: Linear, LayerNormLinear, LayerNormMLP)
    tensor_type  "input" | "weight" | "grad_output"
    gemm         "fprop" | "dgrad" | "wgrad": the GEMM this use of the tensor feeds
    gemm_index   which of the module's GEMMs (LayerNormMLP: 0 = fc1, 1 = fc2; else 0)
    name         that GEMM's name in its module ("fc1", "fc2" in LayerNormMLP; "" elsewhere)
    module       the module's class name ("Linear", "LayerNormLinear", "LayerNormMLP"; "" if not said)

`role.operand` is the (Gemm, Role) pair of `engine.recipes.OPERANDS`. Two roles compare as
their TE names (`str` equality); compare `operand`, `gemm_index` and `name` for the full identity.
"""

from __future__ import annotations

from typing import Any

from engine.recipes.operands import OPERANDS, Gemm, Operand, Role

MODULE_TYPE = "linear"


class QuantizerRole(str):
    """A str equal to TE 2.x's role name ("linear_input", ...), with the operand's fields as attributes."""

    module_type: str
    tensor_type: str
    gemm: str
    gemm_index: int
    name: str
    module: str

    def __new__(cls, tensor_type: str, gemm: str, gemm_index: int = 0, name: str = "",
                module: str = "") -> QuantizerRole:
        roles = [r.value for r in Role]
        if tensor_type not in roles:
            raise ValueError(f"tensor_type: expected one of {roles}, got {tensor_type!r}")
        operand = (Gemm(gemm) if gemm in [g.value for g in Gemm] else None, Role(tensor_type))
        if operand not in OPERANDS:
            gemms = [g.value for g, r in OPERANDS if r.value == tensor_type]
            raise ValueError(f"gemm: the {tensor_type} is read by {gemms}, got {gemm!r}")
        if not isinstance(gemm_index, int) or isinstance(gemm_index, bool) or gemm_index < 0:
            raise ValueError(f"gemm_index: expected an int >= 0, got {gemm_index!r}")
        for field, value in (("name", name), ("module", module)):
            if not isinstance(value, str):
                raise TypeError(f"{field}: expected a str, got {type(value).__name__}")
        role = super().__new__(cls, f"{MODULE_TYPE}_{tensor_type}")
        fields = {"module_type": MODULE_TYPE, "tensor_type": tensor_type, "gemm": operand[0].value,
                  "gemm_index": gemm_index, "name": name, "module": module}
        for field, value in fields.items():
            object.__setattr__(role, field, value)
        return role

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"QuantizerRole is immutable: cannot set {key}")

    def __reduce__(self) -> tuple:
        return type(self), (self.tensor_type, self.gemm, self.gemm_index, self.name, self.module)

    @property
    def operand(self) -> Operand:
        """(Gemm, Role): the operand of `engine.recipes.OPERANDS` this role is."""
        return Gemm(self.gemm), Role(self.tensor_type)

    @property
    def is_forward(self) -> bool:
        """A tensor the forward quantizes (input, weight); the backward quantizes grad_output."""
        return self.tensor_type != Role.GRAD_OUTPUT.value

    def describe(self) -> str:
        """'the wgrad use of input of GEMM 1 (fc2) of a LayerNormMLP': for messages."""
        where = f"GEMM {self.gemm_index}" + (f" ({self.name})" if self.name else "")
        return f"the {self.gemm} use of {self.tensor_type} of {where} of a {self.module or 'module'}"

    def __repr__(self) -> str:
        return (f"QuantizerRole({str.__repr__(self)}, gemm={self.gemm!r}, gemm_index={self.gemm_index}, "
                f"name={self.name!r}, module={self.module!r})")
