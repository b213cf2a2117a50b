"""The scale rules a quantizer spec can name, and the quantizer class that names each (rule, scheme) pair.

A rule registers itself where it is defined (`@register_rule("current", CurrentParams)` on its class):
its spec name, the pydantic model of its parameters, and whether its quantizers need scaling state that
a recipe owns and updates (delayed scaling). The schemes it fits are the registered schemes its class
accepts (`ScaleRule.fits`). A quantizer spec `{scheme, rule, params}` (`engine.recipes.QuantizerSpec`)
is checked against this table, and `engine.quantizers.quantizer_from_spec` builds from it.

For a stateless rule the parameters are exactly the settings the rule reports (`ScaleRule.config()`),
so the spec of any quantizer can be read back from it. Transformer Engine's quantizer classes
(`Float8CurrentScalingQuantizer`, `MXFP8Quantizer`, ...) say which (rule, scheme) pairs they are the
name of (`name_quantizer`); a spec builds that class, so checkpoints keep naming it.

The table is filled once, at import, by the modules that define rules and quantizer classes; a user
rule registers the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from engine.schemes import SCHEMES, Scheme

# (ScaleRule and Quantizer, which import this module, appear in annotations only as names: no import back)


class RuleParams(BaseModel):
    """Base of every rule's parameter model: frozen, strict, unknown fields rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


@dataclass(frozen=True)
class RuleEntry:
    """One registered rule: its spec name, class, parameter model and whether it is stateful."""

    name: str
    rule: type[ScaleRule]
    params: type[RuleParams]
    #: its quantizers read and record scaling state a recipe state owns and updates (delayed scaling): a spec
    #: of it has no stand-alone quantizer
    stateful: bool = False

    def fits(self, scheme: Scheme) -> bool:
        return self.rule.fits(scheme)

    @property
    def schemes(self) -> tuple[str, ...]:
        """The registered schemes this rule can scale, by name."""
        return tuple(name for name, scheme in SCHEMES.items() if self.fits(scheme))

    def check_params(self, params: Any) -> RuleParams:
        """`params` (a dict or this rule's model) as this rule's model; ValueError naming the bad field."""
        if isinstance(params, self.params):
            return params
        if not isinstance(params, dict):
            raise ValueError(f"params: expected a dict of the {self.name!r} rule's parameters "
                             f"{sorted(self.params.model_fields)}, got {type(params).__name__}")
        try:
            return self.params(**params)
        except ValidationError as err:
            first = err.errors()[0]
            field = ".".join(str(part) for part in first["loc"]) or "?"
            raise ValueError(f"params.{field}: {first['msg']} (the {self.name!r} rule takes "
                             f"{sorted(self.params.model_fields)}), got {params!r}") from None

    def make_rule(self, params: RuleParams) -> ScaleRule:
        """A fresh rule with these parameters (a stateful rule has none: ValueError)."""
        if self.stateful:
            raise ValueError(f"rule: a {self.name!r} spec quantizes with scaling state that a recipe state owns "
                             "and updates (DelayedScaling, or a CustomRecipe given the spec); it has no "
                             "stand-alone quantizer")
        return self.rule.from_config(**params.model_dump())


#: every registered rule, by spec name ("current", "delayed", "e8m0", "nvfp4", ...)
RULE_ENTRIES: dict[str, RuleEntry] = {}
#: the same rules by class name (what a checkpoint of a plain `Quantizer` names)
RULE_CLASSES: dict[str, type[ScaleRule]] = {}
#: (rule name, scheme name) -> the Transformer Engine quantizer class a spec of that pair builds
QUANTIZER_NAMES: dict[tuple[str, str], type[Quantizer]] = {}

R = TypeVar("R", bound=type)


def register_rule(name: str, params: type[RuleParams], *, stateful: bool = False) -> Callable[[R], R]:
    """Class decorator: register a ScaleRule under a spec name with its parameter model."""
    def register(cls: R) -> R:
        if name in RULE_ENTRIES and RULE_ENTRIES[name].rule is not cls:
            raise ValueError(f"rule: {name!r} is registered already (by {RULE_ENTRIES[name].rule.__name__})")
        if not (isinstance(params, type) and issubclass(params, RuleParams)):
            raise TypeError(f"params: expected a RuleParams subclass, got {params!r}")
        RULE_ENTRIES[name] = RuleEntry(name, cls, params, stateful)
        RULE_CLASSES[cls.__name__] = cls
        return cls

    return register


def rule_entry(name: Any) -> RuleEntry:
    """The registered rule of a spec name; ValueError listing the known names otherwise."""
    if not isinstance(name, str) or name not in RULE_ENTRIES:
        raise ValueError(f"rule: expected one of {sorted(RULE_ENTRIES)}, got {name!r}")
    return RULE_ENTRIES[name]


def entry_of(rule: ScaleRule) -> RuleEntry | None:
    """The registered entry of a rule instance (None for a rule class nobody registered)."""
    return next((e for e in RULE_ENTRIES.values() if type(rule) is e.rule), None)


def name_quantizer(cls: type[Quantizer], rule: str, schemes: Iterable[Scheme]) -> None:
    """Say that `cls` is the quantizer class of `rule` on each of `schemes` (what a spec of them builds)."""
    entry = rule_entry(rule)
    for scheme in schemes:
        if not entry.fits(scheme):
            raise ValueError(f"schemes: the {rule!r} rule does not fit {scheme.name!r}")
        QUANTIZER_NAMES[rule, scheme.name] = cls
