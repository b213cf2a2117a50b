"""CustomRecipe: the quantizers come from a factory, asked per module, GEMM and operand (Transformer Engine 2.x's
`CustomRecipe(qfactory=...)`).

    import torch, engine
    from engine.quantizers import MXFP8Quantizer
    from engine.recipes import CustomRecipe, QuantizerSpec

    def qfactory(role):                      # role: a QuantizerRole (role.py), == "linear_input", ...
        if role.name == "fc2" and role.gemm == "wgrad":
            return None                      # LayerNormMLP's fc2 wgrad in high precision
        if role == "linear_grad_output":
            return MXFP8Quantizer(torch.float8_e5m2)
        return QuantizerSpec(scheme="tensor_e4m3", rule="delayed", params={"amax_history_len": 16})

    with engine.fp8_autocast(recipe=CustomRecipe(qfactory=qfactory)):
        y = model(x)

When a module first runs under the recipe (and again whenever the recipe changes) it builds its
forward and backward states, and the factory is called once per GEMM of the module and per use
of each tensor: for the forward state with the roles "linear_input" (gemm "fprop", then "wgrad")
and "linear_weight" ("fprop", then "dgrad"), for the backward state with "linear_grad_output"
("dgrad", then "wgrad"); see role.py for every field of a role. It returns:

* a quantizer (`engine.quantizers`): used as it is (a shallow copy per tensor of the module: the
  module sets its usages; its state tensors, e.g. an NVFP4 stochastic-rounding counter, are shared);
* a `QuantizerSpec`: built through the rule registry; the only way to ask for a stateful rule;
* None: that operand stays in high precision.

The two uses of a tensor get one quantizer, quantized once for both, when the factory answers both
with the same object, with equal specs, or with quantizers of one class with equal settings and
state (a TE factory returning a fresh, identical quantizer per call); otherwise each use is
quantized on its own.

Stateful scaling: a delayed-scaling quantizer (`Float8Quantizer`, `DelayedRule`) returned as such is
refused with a ValueError (nothing would ever update its scale). Ask for it with a spec instead,
`QuantizerSpec(scheme="tensor_e4m3", rule="delayed", params={...})` (DelayedScaling's settings as
params, as TE's `DelayedScalingRequest` carries them): the module's state then holds a scale and amax
history in DelayedScaling's layout for it, updated, all-reduced, calibrated and saved exactly as
DelayedScaling's (so a factory answering DelayedScaling's specs gives its bits). The delayed specs of one
state share that scaling state, so they must agree on their params and element (forward tensors are
E4M3). A spec with stochastic rounding gets its counter as NVFP4BlockScaling gives it (`seed` + GEMM
index in the low bits, a draw from torch's generator in the high bits), saved with the module.

An exception raised by the factory propagates with a note naming the role it was called for.
A checkpoint keeps the factory's name only: a module saved under a CustomRecipe loads (without a
warning) into a model run under a CustomRecipe whose factory has the same qualified name. Not supported
under torch.compile (a clear error): the compiled layers rebuild quantizers from the recipe's key,
which cannot carry the factory.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, ClassVar, Sequence

import torch
from pydantic import field_validator

from engine.quantizers import Quantizer
from engine.quantizers.registry import entry_of
from engine.recipes.base import Recipe, RecipeState
from engine.recipes.delayed import DelayedScaling, DelayedScalingState, check_delayed_state
from engine.recipes.format import Format, StreamSeed, fixed_format
from engine.recipes.streams import check_counters, seed_streams
from engine.recipes.operands import BACKWARD_ROLES, FORWARD_ROLES, Operand, check_num_gemms
from engine.recipes.role import QuantizerRole
from engine.recipes.spec import QuantizerSpec

Answer = Quantizer | QuantizerSpec | None
DELAYED_KEYS = ("scale", "amax_history")


class SavedFactory:
    """The factory of a CustomRecipe read from a checkpoint, which keeps only its name: compares by that name,
    is written back under it, and refuses to be called (the recipe the model runs under has the factory)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker  # "<callable module.qualname>"
        module, _, qualname = marker[len("<callable "):-1].partition(".")
        self.__module__, self.__qualname__ = module, qualname  # recipe_to_plain writes the same marker back

    def __call__(self, role: Any) -> Any:
        raise ValueError(f"qfactory: {self.marker[1:-1]} was read from a checkpoint, which keeps only its name; "
                         f"run the model under fp8_autocast(recipe=CustomRecipe(qfactory=...)) with that factory")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SavedFactory) and other.marker == self.marker

    def __hash__(self) -> int:
        return hash(self.marker)

    def __repr__(self) -> str:
        return self.marker


class CustomRecipe(Recipe):
    """Quantizers from `qfactory(role)` per module, GEMM and operand use (see the module docstring); `seed`: the
    low 32 bits of the stochastic-rounding streams of specs that round stochastically."""

    name: ClassVar[str] = "custom"

    qfactory: Callable[[QuantizerRole], Any]
    seed: StreamSeed = 0

    @field_validator("fp8_format", mode="after")
    @classmethod
    def _quantizers_come_from_the_factory(cls, value: Format) -> Format:
        return fixed_format(value, Format.HYBRID, cls.__name__, "takes every quantizer from its qfactory")

    @classmethod
    def restore_callable(cls, field: str, marker: str) -> Any:
        """A checkpoint's factory: its name stands for it (SavedFactory)."""
        return SavedFactory(marker) if field == "qfactory" else None

    def operands(self) -> dict[Operand, QuantizerSpec | None]:
        raise TypeError("CustomRecipe: its quantizers come from qfactory per module and GEMM; there is no "
                        "module-independent operand map (make_state asks the factory)")

    # ------------------------------------------------------------------ asking the factory
    def ask(self, role: QuantizerRole) -> Answer:
        """The factory's checked answer for one role."""
        try:
            answer = self.qfactory(role)
        except Exception as err:
            err.add_note(f"raised by CustomRecipe.qfactory for role {role!r} ({role.describe()})")
            raise
        if answer is None or isinstance(answer, QuantizerSpec):
            return answer
        if not isinstance(answer, Quantizer):
            raise TypeError(f"qfactory: expected a Quantizer, a QuantizerSpec or None for role {role!r} "
                            f"({role.describe()}), got {type(answer).__name__}: {answer!r:.100}")
        entry = entry_of(answer.rule)
        if entry is not None and entry.stateful:
            raise ValueError(
                f"qfactory: returned a {type(answer).__name__} with a {type(answer.rule).__name__} for role {role!r} "
                f"({role.describe()}): a stateful quantizer whose scale nothing would update. Return "
                f"QuantizerSpec(scheme={answer.scheme.name!r}, rule={entry.name!r}, params={{...}}) instead: the "
                f"recipe state then holds, updates and saves its scaling state as DelayedScaling does")
        return answer

    def make_state(
        self, *, forward: bool, num_gemms: int = 1, device: torch.device | str | None = None,
        module: str = "", gemm_names: Sequence[str] = (),
    ) -> CustomRecipeState:
        check_num_gemms(num_gemms)
        names = tuple(gemm_names) or ("",) * num_gemms
        if len(names) != num_gemms:
            raise ValueError(f"gemm_names: expected {num_gemms} names (one per GEMM), got {names!r}")
        roles = FORWARD_ROLES if forward else BACKWARD_ROLES
        asked: dict[tuple[Operand, int], tuple[QuantizerRole, Answer]] = {}
        for gemm in range(num_gemms):
            for role in roles:
                for use in role.uses:
                    who = QuantizerRole(role.value, use[0].value, gemm, names[gemm], module)
                    asked[use, gemm] = who, self.ask(who)
        delayed = delayed_state(asked, forward, num_gemms, device)
        quantizers: dict[tuple[Operand, int], Quantizer | None] = {}
        from_specs: list[tuple[int, Quantizer]] = []  # (gemm, quantizer built from a spec), each once, in order
        for gemm in range(num_gemms):
            for role in roles:
                (first, a), (second, b) = ((use, asked[use, gemm][1]) for use in role.uses)
                made_a = built(a, first, gemm, delayed)
                made_b = made_a if agree(a, b) else built(b, second, gemm, delayed)
                quantizers[first, gemm], quantizers[second, gemm] = made_a, made_b
                for answer, made in ((a, made_a), (b, made_b)):
                    if isinstance(answer, QuantizerSpec) and not answer.stateful and \
                            all(made is not q for _, q in from_specs):
                        from_specs.append((gemm, made))
        counters = seed_streams(from_specs, self.seed, device)
        return CustomRecipeState(self, forward, num_gemms, quantizers, delayed, counters)

    def check_saved_state(self, part: Any, where: str, slots: int) -> None:
        """None, or a dict of DelayedScaling's state ('scale', 'amax_history') and/or stochastic-rounding counters
        ('rng_counter'), each checked as those recipes check theirs."""
        if part is None:
            return
        if not isinstance(part, dict) or not part or not set(part) <= {*DELAYED_KEYS, "rng_counter"}:
            raise ValueError(f"{where}: expected a dict of {[*DELAYED_KEYS, 'rng_counter']} (delayed scaling's "
                             f"state and stochastic-rounding counters), got {part!r:.200}")
        if set(DELAYED_KEYS) & set(part):
            check_delayed_state({k: part.get(k) for k in DELAYED_KEYS}, where, slots)
        if "rng_counter" in part:
            check_counters({"rng_counter": part["rng_counter"]}, where, None)


def agree(a: Answer, b: Answer) -> bool:
    """Whether the two uses of a tensor can share one quantizer (one quantization serving both)."""
    if a is None or b is None:
        return False
    if a is b or (isinstance(a, QuantizerSpec) and a == b):
        return True
    if not (isinstance(a, Quantizer) and isinstance(b, Quantizer)):
        return False
    return type(a) is type(b) and a.scheme == b.scheme and type(a.rule) is type(b.rule) and \
        same_settings(vars(a.rule), vars(b.rule))


def same_settings(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal rule attributes, tensors by value (a host read, once per state built)."""
    if a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            same = isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and (x is y or (
                x.dtype == y.dtype and x.shape == y.shape and x.device == y.device and not x.is_meta
                and bool(torch.equal(x, y))))
        else:
            same = x is y or x == y
        if not same:
            return False
    return True


def built(answer: Answer, use: Operand, gemm: int, delayed: DelayedScalingState | None) -> Quantizer | None:
    """The quantizer of one use: the delayed state's slot quantizer for a delayed spec, a fresh one for another
    spec, a copy of a factory's quantizer."""
    if answer is None:
        return None
    if isinstance(answer, QuantizerSpec):
        return delayed.operand(use, gemm) if answer.stateful else answer.make()
    return answer.copy()


def delayed_state(asked: dict[tuple[Operand, int], tuple[QuantizerRole, Answer]], forward: bool, num_gemms: int,
                  device: torch.device | str | None) -> DelayedScalingState | None:
    """One DelayedScalingState for the delayed specs of this state (None without any), as DelayedScaling with
    their params would build it; its unused columns stay at their initial values."""
    stateful = [(who, a) for who, a in asked.values() if isinstance(a, QuantizerSpec) and a.stateful]
    if not stateful:
        return None
    first_role, first = stateful[0]
    for who, spec in stateful:
        if spec.rule != "delayed":
            raise ValueError(f"qfactory: role {who!r} ({who.describe()}) asks for the stateful rule {spec.rule!r}; "
                             "a CustomRecipe holds scaling state for 'delayed' specs only")
        if spec.params != first.params or spec.scheme != first.scheme:
            raise ValueError(f"qfactory: the delayed specs of one module's {'forward' if forward else 'backward'} "
                             f"share one scaling state (as under DelayedScaling), so they must agree; role "
                             f"{first_role!r} ({first_role.describe()}) has {first!r}, role {who!r} "
                             f"({who.describe()}) {spec!r}")
    element = first.dtype
    if forward and element != torch.float8_e4m3fn:
        raise ValueError(f"qfactory: role {first_role!r} ({first_role.describe()}) asks for delayed scaling to "
                         f"{first.scheme!r}; delayed scaling quantizes forward tensors to E4M3 (no recipe format has "
                         "E5M2 forward tensors): use 'tensor_e4m3'")
    fmt = Format.HYBRID if forward or element == torch.float8_e5m2 else Format.E4M3
    return DelayedScalingState(DelayedScaling.from_params(first.params, fmt), forward, num_gemms, device)


class CustomRecipeState(RecipeState):
    """A CustomRecipe's quantizers for one module and direction, with the delayed-scaling state and the
    stochastic-rounding counters of its specs (the hooks of stateful scaling go to them)."""

    compile_refusal = ("torch.compile: CustomRecipe is not supported yet (the compiled layers rebuild quantizers "
                       "from the recipe's key, which cannot carry the factory); run the model eagerly, or compile "
                       "under a built-in recipe or an OperandRecipe")

    def __init__(self, recipe: CustomRecipe, forward: bool, num_gemms: int,
                 quantizers: dict[tuple[Operand, int], Quantizer | None], delayed: DelayedScalingState | None,
                 rng_counters: list[torch.Tensor]) -> None:
        super().__init__(recipe, forward, num_gemms, quantizers)
        self.delayed = delayed
        self.rng_counters = rng_counters

    def record_amax(self, slot: int, x: torch.Tensor) -> None:
        if self.delayed is not None:
            self.delayed.record_amax(slot, x)

    def amaxes_to_reduce(self) -> list[torch.Tensor]:
        return [] if self.delayed is None else self.delayed.amaxes_to_reduce()

    def update(self) -> None:
        if self.delayed is not None:
            self.delayed.update()

    def to_plain(self) -> dict[str, torch.Tensor] | None:
        part = {} if self.delayed is None else self.delayed.to_plain()
        if self.rng_counters:
            part["rng_counter"] = torch.stack([c.detach().cpu() for c in self.rng_counters])
        return part or None

    def load_plain(self, part: dict[str, torch.Tensor]) -> None:
        """A checked saved state; ValueError where it does not fit what the factory asks of this module now."""
        if ("scale" in part) != (self.delayed is not None):
            raise ValueError(f"_extra_state: the saved state {'has' if 'scale' in part else 'has no'} delayed "
                             f"scaling state, but this CustomRecipe's qfactory asks for "
                             f"{'none' if self.delayed is None else 'some'} in this module")
        counters = part.get("rng_counter")
        if len(self.rng_counters) != (0 if counters is None else len(counters)):
            raise ValueError(f"_extra_state['rng_counter']: the saved state has "
                             f"{0 if counters is None else len(counters)} stochastic-rounding counters, this "
                             f"CustomRecipe's qfactory makes {len(self.rng_counters)} in this module")
        if self.delayed is not None:
            self.delayed.load_plain({k: part[k] for k in DELAYED_KEYS})
        for counter, saved in zip(self.rng_counters, [] if counters is None else counters):
            counter.copy_(saved)

    def carry_from(self, old: RecipeState) -> None:
        before = old.delayed if isinstance(old, CustomRecipeState) else old
        if self.delayed is not None and isinstance(before, DelayedScalingState):
            self.delayed.carry_from(before)
        counters = getattr(old, "rng_counters", None)
        if counters is not None and len(counters) == len(self.rng_counters):
            for counter, previous in zip(self.rng_counters, counters):
                counter.copy_(previous)

    def replay_copy(self) -> CustomRecipeState:
        """Stateless: itself; with delayed scaling, its quantizers over the delayed state's replay twin."""
        if self.delayed is None:
            return self
        twin = copy.copy(self)
        twin.delayed = self.delayed.replay_copy()
        twin_of = {id(q): t for q, t in zip(self.delayed.quantizers, twin.delayed.quantizers)}
        twin._quantizers = {key: twin_of.get(id(q), q) for key, q in self._quantizers.items()}
        twin._uses = {}
        return twin

