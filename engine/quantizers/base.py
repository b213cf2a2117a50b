"""Quantizer: turns a high-precision tensor into a quantized one for chosen usages.

A quantizer is a scheme (what the result looks like, `engine.schemes`) plus a scale rule
(where its scales come from, `rules.py`); for delayed scaling the rule holds references to
the scale and amax state it reads and records into. `quantize` is an autograd-transparent
cast: the gradient passes through unchanged. With `internal=True` it returns the bare
storage (no torch.Tensor wrapper), for use inside autograd functions.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import torch

from engine.checks import check_bool
from engine.ops import backend, registry
from engine.ops import quantize as qops
from engine.ops import reference as ref
from engine.quantizers.registry import QUANTIZER_NAMES, RULE_CLASSES, RuleParams, rule_entry
from engine.quantizers.rules import CurrentRule, ScaleRule
from engine.schemes import Scheme, get_scheme
from engine.tensors.quantized import QuantizedTensor, storage_of
from engine.tensors.storage import QuantizedTensorBase

Buffers = dict[str, torch.Tensor | None]
#: every registered scale rule by class name (`registry.RULE_CLASSES`: NVFP4Rule joins when it is defined)
RULES: dict[str, type[ScaleRule]] = RULE_CLASSES


class Quantizer:
    """Quantizes tensors into one scheme with one scale rule, for the usages asked for.

    `Float8Quantizer`, `Float8CurrentScalingQuantizer`, `Float8BlockQuantizer` and
    `MXFP8Quantizer` are this class with the constructor arguments of Transformer Engine.
    """

    _by_name: ClassVar[dict[str, type[Quantizer]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.__name__.startswith("_"):  # a private base is not a quantizer a checkpoint can name
            Quantizer._by_name[cls.__name__] = cls

    def __init__(
        self, scheme: Scheme, rule: ScaleRule, *, rowwise: bool = True, columnwise: bool = True,
        internal: bool = False,
    ) -> None:
        if not isinstance(scheme, Scheme):
            raise TypeError(f"scheme: expected an engine.schemes.Scheme, got {type(scheme).__name__}")
        if not isinstance(rule, ScaleRule) or not rule.fits(scheme):
            raise TypeError(f"rule: expected a scale rule that fits {scheme.name}, got {rule!r}")
        rule.check_scheme(scheme)
        self.scheme = scheme
        self.rule = rule
        self.rowwise_usage = check_bool(rowwise, "rowwise")
        self.columnwise_usage = check_bool(columnwise, "columnwise")
        self.internal = check_bool(internal, "internal")

    @classmethod
    def from_parts(cls, scheme: Scheme, rule: ScaleRule) -> Quantizer:
        """This class over a scheme and a rule, without its Transformer Engine constructor: every quantizer
        class is a scheme plus a rule, its other settings read from those two."""
        quantizer = cls.__new__(cls)
        Quantizer.__init__(quantizer, scheme, rule)
        return quantizer

    # ------------------------------------------------------------------ settings
    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.scheme.element

    @property
    def columnwise_row_multiple(self) -> int:
        """The columnwise usage needs x's row count (tokens) to be a multiple of this (the scheme's transform mixes
        that many: 16 for NVFP4's RHT, else 1). The layers pad their wgrad operands with zero rows up to it."""
        return self.scheme.row_multiple(columnwise=True)

    def config(self) -> dict[str, Any]:
        """The settings as plain data (what makes two quantizers quantize alike)."""
        return {"scheme": self.scheme.name, "rule": type(self.rule).__name__, **self.rule.config()}

    def state(self) -> dict[str, torch.Tensor]:
        """Tensors the quantizer reads or records into (delayed scaling: scale, amax)."""
        return self.rule.state()

    def to_plain(self) -> dict[str, Any]:
        """Plain data that `quantizer_from_plain` rebuilds an equal quantizer from."""
        return {"quantizer_class": type(self).__name__, **self.config(), **self.state(),
                "rowwise": self.rowwise_usage, "columnwise": self.columnwise_usage, "internal": self.internal}

    def set_usage(self, *, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        if rowwise is not None:
            self.rowwise_usage = check_bool(rowwise, "rowwise")
        if columnwise is not None:
            self.columnwise_usage = check_bool(columnwise, "columnwise")

    def copy(self) -> Quantizer:
        """A shallow copy: settings are its own, state tensors (scale, amax) are shared."""
        return copy.copy(self)

    @property
    def tensor_amax_group(self) -> Any:
        """The process group this quantizer all-reduces one per-tensor amax over before scaling (current scaling
        of FSDP2 shards), else None: tensors with the same group can agree on their amaxes in one collective."""
        rule = self.rule
        if isinstance(rule, CurrentRule) and self.scheme.rowwise_block.is_tensor:
            return rule.amax_reduction_group
        return None

    def with_agreed_amax(self, amax: torch.Tensor) -> Quantizer:
        """A copy that scales with `amax`, already reduced over `tensor_amax_group` (no collective of its own)."""
        if self.tensor_amax_group is None:
            raise ValueError(f"{type(self).__name__}: only a per-tensor current-scaling quantizer with an "
                             "amax_reduction_group takes an agreed amax")
        once = self.copy()
        once.rule = CurrentRule(self.rule.amax_epsilon, agreed_amax=amax)
        return once

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v}" for k, v in self.config().items())
        return f"{type(self).__name__}({settings})"

    # ------------------------------------------------------------------ quantizing
    def _checked_buffers(self, x: torch.Tensor, *, rowwise: bool, columnwise: bool) -> Buffers:
        ref.check_input(x, "x")
        if not (rowwise or columnwise):
            raise ValueError(f"{type(self).__name__}: both usages are off; set_usage(rowwise=True) or columnwise")
        if x.requires_grad:
            x = x.detach()
        kernel_args = self.rule.kernel_args()
        if kernel_args is not None and not qops.traced(x):  # eager, and the rule is one kernel call: make it
            backend.check_tensor(x, "x")  # `qops.kernel_buffers`, two Python frames fewer
            fn = registry.kernel_for("quantize", self.scheme.layout, "cpu" if x.is_cpu else x.device.type,
                                     backend.forced_backend())
            return fn(x, self.scheme, rowwise=rowwise, columnwise=columnwise, **kernel_args)[0]
        return self.rule.quantize(x, self.scheme, rowwise=rowwise, columnwise=columnwise)

    def quantize_storage(self, x: torch.Tensor) -> QuantizedTensorBase:
        """x quantized, as a bare storage."""
        buffers = self._checked_buffers(x, rowwise=self.rowwise_usage, columnwise=self.columnwise_usage)
        return QuantizedTensorBase.made(self.scheme, x.shape, x.dtype, self, buffers, self._storage_class())

    def _storage_class(self) -> type[QuantizedTensorBase]:
        """`QuantizedTensorBase.class_for(self.scheme)`, looked up again only when the scheme or the set of
        storage classes changes (the lookup hashes the scheme's dataclass: ~1 us per quantization)."""
        known = self.__dict__.get("_storage_class_of")
        named = len(QuantizedTensorBase._named)
        if known is None or known[0] is not self.scheme or known[1] != named:
            known = self._storage_class_of = (self.scheme, named, QuantizedTensorBase.class_for(self.scheme))
        return known[2]

    def quantize(
        self, x: torch.Tensor, *, out: QuantizedTensor | QuantizedTensorBase | None = None
    ) -> QuantizedTensor | QuantizedTensorBase:
        """x quantized: into `out` if given, else a new tensor (a storage if `internal`)."""
        ref.check_input(x, "x")
        if out is not None:
            return self.update_quantized(x, out)
        if self.internal:
            return self.quantize_storage(x)
        if torch.is_grad_enabled() and x.requires_grad:
            return _Quantize.apply(x, self)
        return QuantizedTensor.wrap(self.quantize_storage(x))

    __call__ = quantize

    def update_quantized(
        self,
        src: torch.Tensor,
        dst: QuantizedTensor | QuantizedTensorBase,
        *,
        noop_flag: torch.Tensor | None = None,
    ) -> QuantizedTensor | QuantizedTensorBase:
        """Quantize src into dst's buffers in place (skipped when noop_flag is non-zero).

        dst keeps the usages it holds (the quantizer's, if it holds none) and takes the
        quantizer's scheme (fp8 dtype, scale encoding) and the quantizer itself.
        """
        if noop_flag is not None and bool(noop_flag.reshape(-1)[0] != 0):
            return dst
        storage = storage_of(dst, "dst")
        if not isinstance(storage, QuantizedTensorBase.class_for(self.scheme)):
            raise TypeError(f"dst: expected a {QuantizedTensorBase.class_for(self.scheme).__name__} (or its tensor), "
                            f"got {type(storage).__name__} ({storage.scheme.name})")
        if tuple(src.shape) != tuple(storage.shape):
            raise ValueError(f"src: expected shape {tuple(storage.shape)} (the shape of dst), got {tuple(src.shape)}")
        rowwise, columnwise = storage.has_rowwise, storage.has_columnwise
        if not (rowwise or columnwise):
            rowwise, columnwise = self.rowwise_usage, self.columnwise_usage
        fresh = self._checked_buffers(src, rowwise=rowwise, columnwise=columnwise)
        storage.scheme = self.scheme
        storage.quantizer = self
        for name in fresh:  # BUFFER_FIELDS and a layout's own (NVFP4's amaxes)
            new, old = fresh[name], getattr(storage, name)
            if new is None:
                setattr(storage, name, None)
            elif old is not None and old.shape == new.shape and old.dtype == new.dtype:
                old.copy_(new)
            else:
                setattr(storage, name, new)
        return dst

    def make_empty(
        self,
        shape: torch.Size | tuple[int, ...],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        requires_grad: bool = False,
    ) -> QuantizedTensor | QuantizedTensorBase:
        """Uninitialised quantized tensor with this quantizer's usages."""
        if not (self.rowwise_usage or self.columnwise_usage):
            raise ValueError(f"{type(self).__name__}: both usages are off; set_usage(rowwise=True) or columnwise")
        storage = QuantizedTensorBase.empty(
            shape, scheme=self.scheme, nominal_dtype=dtype, device=device, rowwise=self.rowwise_usage,
            columnwise=self.columnwise_usage, quantizer=self,
        )
        return storage if self.internal else QuantizedTensor.wrap(storage, requires_grad=requires_grad)


class _Quantize(torch.autograd.Function):
    """Quantize in forward; in backward the gradient passes straight through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, quantizer: Quantizer) -> QuantizedTensor:
        return QuantizedTensor.wrap(quantizer.quantize_storage(x))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def quantizer_from_spec(scheme: str, rule: str, params: RuleParams | dict[str, Any] | None = None) -> Quantizer:
    """A fresh quantizer for a spec's (scheme, rule, params), through the rule registry: the class Transformer
    Engine names for that pair (`Float8CurrentScalingQuantizer`, `MXFP8Quantizer`, ...), else `Quantizer`.
    ValueError naming the field for an unknown scheme or rule, a rule that does not fit the scheme, parameters
    that do not validate, or a stateful rule (its scaling state belongs to a recipe state)."""
    entry = rule_entry(rule)
    found = get_scheme(scheme)
    if not entry.fits(found):
        raise ValueError(f"rule: {rule!r} fits the schemes {list(entry.schemes)}, got scheme {scheme!r}")
    made = entry.make_rule(entry.check_params({} if params is None else params))
    return QUANTIZER_NAMES.get((rule, scheme), Quantizer).from_parts(found, made)


def quantizer_from_plain(plain: dict[str, Any]) -> Quantizer:
    """Inverse of `Quantizer.to_plain`; malformed input raises ValueError."""
    known = {"Quantizer": Quantizer, **Quantizer._by_name}
    if not isinstance(plain, dict) or plain.get("quantizer_class") not in known:
        raise ValueError(f"quantizer state: expected a dict naming one of {sorted(known)}, got {plain!r}")
    kwargs = dict(plain)
    cls = known[kwargs.pop("quantizer_class")]
    try:
        for key, value in list(kwargs.items()):
            if key.endswith("dtype"):
                kwargs[key] = parse_dtype(value, key)
        if cls is Quantizer:
            scheme, rule_cls = get_scheme(kwargs.pop("scheme")), RULES[kwargs.pop("rule")]
            usages = {k: kwargs.pop(k) for k in ("rowwise", "columnwise", "internal") if k in kwargs}
            return Quantizer(scheme, rule_cls.from_config(**kwargs), **usages)
        return cls(**kwargs)
    except (TypeError, KeyError) as err:
        raise ValueError(f"quantizer state for {cls.__name__} is malformed: {err!r}") from err


def quantizer_class(name: Any) -> type[Quantizer]:
    """The quantizer class a checkpoint names (`type(q).__name__`); ValueError listing the known names otherwise."""
    known = {"Quantizer": Quantizer, **Quantizer._by_name}
    if not isinstance(name, str) or name not in known:
        raise ValueError(f"expected one of {sorted(known)}, got {name!r:.100}")
    return known[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: Any, field: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{field}: expected the name of a torch dtype, got {name!r}")
    return dtype
