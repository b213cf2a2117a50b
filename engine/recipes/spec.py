"""QuantizerSpec: how one operand is quantized, as plain data - a scheme, a registered rule, its parameters.

    QuantizerSpec(scheme="tensor_e4m3", rule="current", params={"amax_epsilon": 1e-12})
    QuantizerSpec(scheme="mx_e2m1", rule="e8m0", params={"scale_mode": "floor"})
    QuantizerSpec(scheme="nvfp4_rht_e2m1", rule="nvfp4", params={"stochastic_rounding": True})

`scheme` names an entry of `engine.schemes.SCHEMES`, `rule` a rule of the registry
(`engine.quantizers.RULE_ENTRIES`: "current", "delayed", "e8m0", "nvfp4" and any a user registers),
`params` that rule's parameters (validated by its pydantic model; missing ones take its defaults).
An unknown scheme or rule, a rule that does not fit the scheme, or parameters that do not validate
are a ValueError naming the field, when the spec is made. `make()` builds the quantizer through the
registry.

The first form of a spec, by layout and element (`QuantizerSpec(layout="tensor", element="e4m3")`,
with `scaling`, `pow2`, `amax_epsilon`, `scale_mode`, `rht`, `stochastic_rounding`, `two_d`), is
still accepted and read back (`spec.layout`, ...), and is what a checkpoint stores for a spec it can
say (`to_plain`): recipes saved before keep loading, and are written back byte for byte.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, model_validator

from engine.formats import element_name
from engine.quantizers import Quantizer, RuleParams, quantizer_from_spec, rule_entry
from engine.schemes import SCHEMES, ScaleEncoding, get_scheme

ELEMENTS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


class LegacySpec(BaseModel):
    """The first form of a spec (layout, element, scaling and its options): what it accepts and checks."""

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
    def _rule_fits_layout(self) -> LegacySpec:
        # options the rule (`scaling`) does not read: refused rather than ignored
        defaults = LegacySpec.model_fields
        for field in ("pow2", "amax_epsilon", "scale_mode", "rht", "stochastic_rounding", "two_d"):
            if field not in FIRST_FORM_OPTIONS[self.scaling] and getattr(self, field) != defaults[field].default:
                raise ValueError(f"{field}: not an option of scaling {self.scaling!r} (its quantizer does not read "
                                 f"it), got {getattr(self, field)!r}")
        name = self.scheme()
        if name not in SCHEMES:
            raise ValueError(f"layout / element: there is no {self.layout!r} scheme of {self.element!r} elements "
                             f"(scheme {name!r}); known schemes: {sorted(SCHEMES)}")
        if not rule_entry(self.scaling).rule.fits(SCHEMES[name]):
            raise ValueError(f"scaling: {self.scaling!r} scales do not fit layout {self.layout!r} (scheme {name})")
        return self

    def scheme(self) -> str:
        return f"{self.layout}{'_rht' if self.rht else ''}_{self.element}" + ("_pow2" if self.pow2 else "")

    def params(self) -> dict[str, Any]:
        return {"current": {"amax_epsilon": self.amax_epsilon}, "e8m0": {"scale_mode": self.scale_mode},
                "nvfp4": {"with_2d_quantization": self.two_d, "stochastic_rounding": self.stochastic_rounding},
                "delayed": {}}[self.scaling]


LEGACY_FIELDS = frozenset(LegacySpec.model_fields)
#: the first form's options each rule (`scaling`) reads
FIRST_FORM_OPTIONS = {"current": ("pow2", "amax_epsilon"), "e8m0": ("scale_mode",),
                      "nvfp4": ("rht", "stochastic_rounding", "two_d"), "delayed": ()}
#: the rules the first form can name (its `scaling`)
LEGACY_RULES = ("current", "e8m0", "nvfp4", "delayed")


def first_form_fields(scheme: str, rule: str, params: RuleParams) -> dict[str, Any]:
    """The first form's fields of a (scheme, rule, params) spec, read from the scheme and the parameters
    (an option the rule does not have at its first-form default)."""
    found = get_scheme(scheme)
    given = params.model_dump()
    return {"layout": found.family,
            "element": element_name(found.element), "scaling": rule, "pow2": found.scale is ScaleEncoding.FP32_POW2,
            "amax_epsilon": given.get("amax_epsilon", 0.0), "scale_mode": given.get("scale_mode", "rceil"),
            "rht": found.columnwise_transform is not None,
            "stochastic_rounding": given.get("stochastic_rounding", False),
            "two_d": given.get("with_2d_quantization", False)}


def legacy_of(scheme: str, rule: str, params: RuleParams) -> LegacySpec | None:
    """The spec in the first form, or None where that form cannot say it (another rule, delayed-scaling
    settings, a scheme of another layout)."""
    if rule not in LEGACY_RULES:
        return None
    try:
        legacy = LegacySpec(**first_form_fields(scheme, rule, params))
    except ValueError:
        return None
    same = legacy.scheme() == scheme and rule_entry(rule).check_params(legacy.params()) == params
    return legacy if same else None


class QuantizerSpec(BaseModel):
    """How one operand is quantized: a registered scheme, a registered rule, the rule's parameters."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    scheme: str
    rule: str
    params: SerializeAsAny[RuleParams]

    @model_validator(mode="before")
    @classmethod
    def _checked(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        legacy = LEGACY_FIELDS & set(data)
        if legacy:
            if {"scheme", "rule", "params"} & set(data):
                raise ValueError(f"{sorted(legacy)[0]}: give a spec either as (scheme, rule, params) or in its "
                                 "first form (layout, element, scaling, ...), not both")
            first = LegacySpec(**data)
            data = {"scheme": first.scheme(), "rule": first.scaling, "params": first.params()}
        if "scheme" not in data or "rule" not in data:
            raise ValueError(f"{'scheme' if 'scheme' not in data else 'rule'}: missing; a spec is "
                             "QuantizerSpec(scheme=..., rule=..., params={...})")
        scheme, rule = data["scheme"], data["rule"]
        if not isinstance(scheme, str) or scheme not in SCHEMES:
            raise ValueError(f"scheme: expected one of {sorted(SCHEMES)}, got {scheme!r}")
        entry = rule_entry(rule)
        if not entry.fits(SCHEMES[scheme]):
            raise ValueError(f"rule: {rule!r} fits the schemes {list(entry.schemes)}, got scheme {scheme!r}")
        data["params"] = entry.check_params(data.get("params", {}))
        return data

    # ------------------------------------------------------------------ the first form's fields, read back
    def legacy(self) -> LegacySpec | None:
        """The spec in its first form (layout, element, ...), or None where that form cannot say it."""
        return legacy_of(self.scheme, self.rule, self.params)

    def _legacy_field(self, name: str) -> Any:
        return first_form_fields(self.scheme, self.rule, self.params)[name]

    @property
    def layout(self) -> str:
        return self._legacy_field("layout")

    @property
    def element(self) -> str:
        return self._legacy_field("element")

    @property
    def scaling(self) -> str:
        return self.rule

    @property
    def pow2(self) -> bool:
        return self._legacy_field("pow2")

    @property
    def amax_epsilon(self) -> float:
        return self._legacy_field("amax_epsilon")

    @property
    def scale_mode(self) -> str:
        return self._legacy_field("scale_mode")

    @property
    def rht(self) -> bool:
        return self._legacy_field("rht")

    @property
    def stochastic_rounding(self) -> bool:
        return self._legacy_field("stochastic_rounding")

    @property
    def two_d(self) -> bool:
        return self._legacy_field("two_d")

    @property
    def dtype(self) -> torch.dtype:
        """The FP8 dtype of an FP8 element (MXFP4/MXFP6 elements have none: TypeError)."""
        element = get_scheme(self.scheme).element
        if not isinstance(element, torch.dtype):
            raise TypeError(f"element: {self.scheme!r} has no torch dtype (its data is uint8 codes)")
        return element

    @property
    def stateful(self) -> bool:
        """Its quantizers need scaling state a recipe state owns (delayed scaling)."""
        return rule_entry(self.rule).stateful

    # ------------------------------------------------------------------ use
    def make(self) -> Quantizer:
        """A fresh quantizer (by Transformer Engine's names) for this spec, through the rule registry."""
        return quantizer_from_spec(self.scheme, self.rule, self.params)

    def to_plain(self) -> dict[str, Any]:
        """Plain data for a checkpoint: the first form where it can say the spec (what checkpoints have always
        held), else {"scheme", "rule", "params"}. `QuantizerSpec(**plain)` reads either."""
        legacy = self.legacy()
        if legacy is not None:
            return legacy.model_dump()
        return {"scheme": self.scheme, "rule": self.rule, "params": self.params.model_dump()}

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> QuantizerSpec:
        """A copy with `update` applied and checked (first-form fields too: `update={"element": "e5m2"}`)."""
        if not update:
            return super().model_copy(deep=deep)
        base = self.to_plain() if LEGACY_FIELDS & set(update) else {
            "scheme": self.scheme, "rule": self.rule, "params": self.params.model_dump()}
        return type(self)(**{**base, **update})

    def __repr__(self) -> str:
        return f"QuantizerSpec(scheme={self.scheme!r}, rule={self.rule!r}, params={self.params.model_dump()!r})"

    __str__ = __repr__
