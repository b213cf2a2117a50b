"""Recipe: an immutable, validated map from each GEMM operand to a quantizer spec (or None).

A recipe makes a `RecipeState` for a module: the quantizers of the operands its forward
(input, weight) or backward (grad_output) quantizes, for each of its GEMMs, plus any
scaling state they share. Stateful scaling (delayed) overrides the hooks `update`,
`record_amax` and the checkpoint methods; for every other recipe they do nothing, so
modules and autocast call them without asking which recipe runs. Recipes know nothing of
modules.

Scaling state keeps Transformer Engine's column layout: per GEMM, forward columns are
(input, weight, output) and backward columns (grad_output, grad_input); the output and
grad_input columns are never quantized and stay as TE has them, so checkpoints read alike.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from enum import Enum
from functools import cached_property
from typing import Any, ClassVar, Sequence

import torch
from pydantic import BaseModel, ConfigDict, field_validator

from engine.quantizers import Quantizer
from engine.recipes.format import Format
from engine.recipes.streams import check_counters, seed_streams
from engine.recipes.operands import (
    BACKWARD_ROLES, FORWARD_ROLES, Gemm, Operand, QuantizerSpec, Role, check_num_gemms,
)

#: columns per GEMM in forward / backward scaling state, and each quantized role's column
SLOTS_PER_GEMM = {True: 3, False: 2}
SLOT_OF = {Role.INPUT: 0, Role.WEIGHT: 1, Role.GRAD_OUTPUT: 0}


class Recipe(BaseModel):
    """Base of all recipes: frozen pydantic model, strict types, unknown fields rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    fp8_format: Format = Format.HYBRID
    #: short name used in checkpoints, messages and the CLI
    name: ClassVar[str] = "recipe"

    @field_validator("fp8_format", mode="before")
    @classmethod
    def _parse_format(cls, value: Any) -> Any:
        if isinstance(value, str) and not isinstance(value, Format):
            try:
                value = Format(value)
            except ValueError:
                raise ValueError(f"expected one of {[f.value for f in Format]}, got {value!r}") from None
        if value is Format.E5M2:
            raise ValueError("pure E5M2 training is not supported; use Format.HYBRID (E4M3 forward, E5M2 backward) "
                             "or Format.E4M3")
        return value

    #: fields a checkpoint record holds only when they differ from their default (added later to the class)
    written_when_set: ClassVar[frozenset[str]] = frozenset()

    def dtype_for(self, role: Role) -> torch.dtype:
        return self.fp8_format.forward_dtype if role.is_forward else self.fp8_format.backward_dtype

    def element_for(self, role: Role) -> str:
        return "e4m3" if self.dtype_for(role) == torch.float8_e4m3fn else "e5m2"

    @abstractmethod
    def operands(self) -> dict[Operand, QuantizerSpec | None]:
        """The spec of every GEMM operand (None: high precision)."""

    def make_state(
        self, *, forward: bool, num_gemms: int = 1, device: torch.device | str | None = None,
        module: str = "", gemm_names: Sequence[str] = (),
    ) -> RecipeState:
        """The quantizers of one module's forward (input, weight) or backward (grad_output) operands.

        `module` (the asking module's class name) and `gemm_names` (its GEMMs' names, e.g. ("fc1", "fc2")) say
        who asks; only a recipe that builds quantizers per module (CustomRecipe) reads them."""
        check_num_gemms(num_gemms)
        specs = self.operands()
        quantizers: dict[tuple[Operand, int], Quantizer | None] = {}
        for gemm in range(num_gemms):
            for role in FORWARD_ROLES if forward else BACKWARD_ROLES:
                first, second = role.uses
                if specs[first] is not None and specs[first] == specs[second]:
                    quantizers[first, gemm] = quantizers[second, gemm] = specs[first].make()  # one for both uses
                else:
                    for use in (first, second):
                        quantizers[use, gemm] = None if specs[use] is None else specs[use].make()
        state = RecipeState(self, forward, num_gemms, quantizers)
        state.rng_counters = seed_streams([(gemm, q) for (_, gemm), q in quantizers.items()],
                                          getattr(self, "seed", 0), device)
        return state

    @classmethod
    def restore_callable(cls, field: str, marker: str) -> Any:
        """What a checkpoint's callable field (kept as the marker "<callable module.qualname>") is read back as;
        None: the field takes its default, with a warning."""
        return None

    @cached_property
    def key(self) -> str:
        """The recipe as a string (its plain fields): what compiled code and custom ops are keyed by."""
        return json.dumps(recipe_to_plain(self), sort_keys=True)

    # ---------------------------------------------------------------- scaling state through custom ops
    def op_state(self, *, forward: bool, num_gemms: int, tensors: list[torch.Tensor]
                 ) -> tuple[RecipeState, list[torch.Tensor]]:
        """For a custom op, which may not write its inputs: a state reading `tensors` (a state's
        `op_tensors()`) that records into fresh tensors, and those tensors (to `merge_records` later)."""
        return self.make_state(forward=forward, num_gemms=num_gemms), []

    def merge_records(self, tensors: list[torch.Tensor], records: list[torch.Tensor]) -> None:
        """Fold what an op's state recorded into the state holding `tensors` (nothing to fold here)."""

    def check_saved_state(self, part: Any, where: str, slots: int) -> None:
        """A checkpoint's scaling state for this recipe: None, or the stochastic-rounding counters of its
        quantizers that round stochastically (`engine.recipes.streams`)."""
        if part is None:
            return
        if not (isinstance(part, dict) and set(part) == {"rng_counter"}):
            raise ValueError(f"{where}: a {self.name} recipe's state has no scaling state but stochastic-rounding "
                             f"counters ({{'rng_counter': int64 [n, 2]}}), got {part!r:.200}")
        check_counters(part, where, None)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in type(self).model_fields)
        return f"{type(self).__name__}({fields})"

    __str__ = __repr__


class RecipeState:
    """The quantizers of one module's forward or backward operands, per GEMM."""

    def __init__(
        self, recipe: Recipe, forward: bool, num_gemms: int, quantizers: dict[tuple[Operand, int], Quantizer | None]
    ) -> None:
        self.recipe = recipe
        self.forward = forward
        self.num_gemms = num_gemms
        self._quantizers = quantizers
        self._uses: dict[tuple[Role, int], tuple[Quantizer | None, Quantizer | None]] = {}  # `uses`, looked up once
        self.key = recipe.key  # plain data read by compiled code (a str, guarded by value)
        #: the counters of the quantizers that round stochastically, in order (`engine.recipes.streams`)
        self.rng_counters: list[torch.Tensor] = []
        #: per GEMM, the scheme names of the x (wgrad) and W (dgrad) a forward saves (None: high precision)
        self.saved_schemes = [tuple(None if quantizers.get((use, g)) is None else quantizers[use, g].scheme.name
                                    for use in ((Gemm.WGRAD, Role.INPUT), (Gemm.DGRAD, Role.WEIGHT)))
                              for g in range(num_gemms)] if forward else []

    def _check(self, role: Role, gemm: int) -> None:
        roles = FORWARD_ROLES if self.forward else BACKWARD_ROLES
        if role not in roles:
            raise ValueError(f"role: expected one of {[r.value for r in roles]}, got {role!r}")
        if not (isinstance(gemm, int) and 0 <= gemm < self.num_gemms):
            raise ValueError(f"gemm: expected 0 <= gemm < {self.num_gemms}, got {gemm!r}")

    def operand(self, operand: Operand, gemm: int = 0) -> Quantizer | None:
        """The quantizer of one GEMM operand (None: it stays in high precision)."""
        self._check(operand[1], gemm)
        return self._quantizers[operand, gemm]

    def uses(self, role: Role, gemm: int = 0) -> tuple[Quantizer | None, Quantizer | None]:
        """The quantizers of a tensor's two uses (rowwise, columnwise) in one GEMM: what the modules ask per call."""
        found = self._uses.get((role, gemm))
        if found is None:
            first, second = role.uses
            found = self._uses[role, gemm] = (self.operand(first, gemm), self.operand(second, gemm))
        return found

    def quantizer(self, role: Role, gemm: int = 0) -> Quantizer | None:
        """The quantizer of a tensor (its rowwise use's, else its columnwise use's)."""
        first, second = role.uses
        return self.operand(first, gemm) or self.operand(second, gemm)

    def slot(self, role: Role, gemm: int = 0) -> int:
        """Column of (role, gemm) in scaling state tensors (Transformer Engine's layout)."""
        self._check(role, gemm)
        return gemm * SLOTS_PER_GEMM[self.forward] + SLOT_OF[role]

    #: how many tensors an op running this state returns as records (`Recipe.op_state`)
    op_records: ClassVar[int] = 0
    #: why torch.compile cannot run this state (None: it can); the compiled layers raise it
    compile_refusal: ClassVar[str | None] = None

    def op_tensors(self) -> list[torch.Tensor]:
        """The scaling state a custom op reads (and whose records are merged back): none here."""
        return []

    def merge_records(self, records: list[torch.Tensor]) -> None:
        """Fold an op's records into this state (`Recipe.merge_records`; nothing here)."""

    # ---------------------------------------------------------------- hooks of stateful scaling
    def record_amax(self, slot: int, x: torch.Tensor) -> None:
        """Calibration: remember max|x| for a slot without quantizing (nothing to remember here)."""

    def amaxes_to_reduce(self) -> list[torch.Tensor]:
        """Amax tensors to all-reduce (MAX) across ranks before `update`."""
        return []

    def update(self) -> None:
        """Advance scaling state after a step (nothing to advance here)."""

    def to_plain(self) -> dict[str, torch.Tensor] | None:
        """Scaling state for a checkpoint: the stochastic-rounding counters (None: there are none)."""
        if not self.rng_counters:
            return None
        return {"rng_counter": torch.stack([c.detach().cpu() for c in self.rng_counters])}

    def load_plain(self, part: dict[str, torch.Tensor]) -> None:
        """Take a checked checkpoint state (from `to_plain` of a state of this recipe kind): each counter
        continues where the saved one stopped."""
        saved = part.get("rng_counter")
        if saved is None or len(saved) != len(self.rng_counters):
            raise ValueError(f"_extra_state['rng_counter']: the saved state has {0 if saved is None else len(saved)} "
                             f"stochastic-rounding counters, this module's {self.recipe.name} state has "
                             f"{len(self.rng_counters)}")
        for counter, value in zip(self.rng_counters, saved):
            counter.copy_(value)

    def carry_from(self, old: RecipeState) -> None:
        """Keep what `old` (the state of the recipe used before) learned, where it applies: its stochastic-rounding
        counters, when it has as many."""
        counters = getattr(old, "rng_counters", None)
        if counters and len(counters) == len(self.rng_counters):
            for counter, before in zip(self.rng_counters, counters):
                counter.copy_(before)

    def replay_copy(self) -> RecipeState:
        """What an activation recompute quantizes with to repeat this forward: quantizers that read the
        scaling state as it is now and record into nothing of this state (stateless: this state itself)."""
        return self


def recipe_to_plain(recipe: Recipe) -> dict[str, Any]:
    """{"name": ..., "fields": {...}}; a callable field is kept as its qualified name (a string)."""
    fields: dict[str, Any] = {}
    for key, info in type(recipe).model_fields.items():
        value = getattr(recipe, key)
        if key in recipe.written_when_set and value == info.default:
            continue  # a field added after checkpoints of its class were saved: those records stay byte for byte
        if isinstance(value, Enum):
            value = value.value
        elif isinstance(value, Recipe):  # a recipe wrapping another (Debug)
            value = recipe_to_plain(value)
        elif isinstance(value, dict):  # OperandRecipe: operand name -> spec as plain data
            value = {k: None if v is None else v.to_plain() for k, v in value.items()}
        elif callable(value):
            value = f"<callable {getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', repr(value))}>"
        fields[key] = value
    return {"name": recipe.name, "fields": fields}
