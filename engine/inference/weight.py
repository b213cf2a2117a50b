"""QuantizedWeight: a Linear's weight Parameter held quantized, whose F.linear / matmul runs the quantized GEMM.

A wrapper tensor subclass (torchao's habit): to the module it is a [N, K] tensor of the weight's
dtype; inside it holds a storage of its config's scheme (`storage`: an `engine.tensors.QuantizedTensorBase`
with the [N, K] shape and rowwise buffers, the same storage type training quantizes into, and what the
weight is: `dequantize()`, save and load go through it) and the tensors its GEMM reads (`operands`: the
checkpoint's parts, in a kernel's own layout where it has one; `engine.inference.weight_format`).
`F.linear(x, w, b)` (what torch.nn.Linear and the engine modules outside fp8_autocast call), `x @ w.t()` and
`torch.matmul` run the format's GEMM on x's last dim, for any leading dims. `.to(dtype)` changes only the
nominal dtype (the output follows x's dtype anyway). Other ops are refused with a clear error:
call `.dequantize()` for a plain tensor. Inference only: the weight takes no gradient.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from engine.inference.configs import InferenceConfig
from engine.inference.formats import format_of
from engine.inference.weight_format import WeightFormat
from engine.inference.weight_op import compiled_weight_linear
from engine.schemes import get_scheme
from engine.tensors.storage import QuantizedTensorBase

aten = torch.ops.aten
HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)


class QuantizedWeight(torch.Tensor):
    """A quantized [N, K] Linear weight (`transposed`: its [K, N] view, from `.t()`)."""

    _held: QuantizedTensorBase  # the storage, less what a kernel's own copy in `operands` holds (`storage`)
    operands: dict[str, torch.Tensor]
    config: InferenceConfig
    #: engine's modules refuse it inside fp8_autocast (it runs its own GEMM, on their high-precision path only)
    inference_only: ClassVar[bool] = True

    @staticmethod
    def __new__(cls, storage: QuantizedTensorBase, config: InferenceConfig, dtype: torch.dtype | None = None,
                transposed: bool = False, fmt: WeightFormat | None = None,
                operands: dict[str, torch.Tensor] | None = None) -> QuantizedWeight:
        n, k = storage.shape
        return torch.Tensor._make_wrapper_subclass(cls, (k, n) if transposed else (n, k),
                                                   dtype=dtype or storage.nominal_dtype,
                                                   device=storage.device, requires_grad=False)

    def __init__(self, storage: QuantizedTensorBase, config: InferenceConfig, dtype: torch.dtype | None = None,
                 transposed: bool = False, fmt: WeightFormat | None = None,
                 operands: dict[str, torch.Tensor] | None = None) -> None:
        """`operands`: the GEMM's tensors made already (else made from the storage's parts, and the storage's
        buffers become views of them: `WeightFormat.from_parts`)."""
        self.config = config
        self.fmt = format_of(config) if fmt is None else fmt
        self.transposed = transposed
        dtype = dtype or storage.nominal_dtype
        if operands is None:
            parts = self.fmt.to_parts(storage)
            storage, operands = self.fmt.from_parts(parts, tuple(storage.shape), dtype), self.fmt.prepare(parts)
        storage = storage if storage.nominal_dtype == dtype else storage.replace(nominal_dtype=dtype)
        self._held = self.fmt.held(storage, operands)
        self.operands = operands

    @property
    def storage(self) -> QuantizedTensorBase:
        """The weight as a storage of its config's scheme ([N, K], rowwise buffers): what it is."""
        return self.fmt.restored(self._held, self.operands)

    # ------------------------------------------------------------------ making and reading
    @classmethod
    def from_float(cls, weight: torch.Tensor, config: InferenceConfig, name: str = "weight") -> QuantizedWeight:
        """`weight` [N, K] (float32, bfloat16 or float16) quantized under `config`."""
        check_weight(weight, name)
        fmt = format_of(config)
        with torch.no_grad():
            storage = fmt.quantize(weight.detach())
        return cls(storage, config, weight.dtype, fmt=fmt)

    @classmethod
    def from_parts(cls, parts: dict[str, torch.Tensor], config: InferenceConfig, shape: tuple[int, int],
                   dtype: torch.dtype, transposed: bool = False, fmt: WeightFormat | None = None) -> QuantizedWeight:
        """A weight from its checkpoint parts (checked by `engine.inference.saving`); the storage views them."""
        fmt = format_of(config) if fmt is None else fmt
        return cls(fmt.from_parts(parts, shape, dtype), config, dtype, transposed, fmt, fmt.prepare(parts))

    @property
    def weight_shape(self) -> tuple[int, int]:
        """[N, K] (whatever `transposed` says)."""
        n, k = self._held.shape
        return int(n), int(k)

    def _with(self, **changes: Any) -> QuantizedWeight:
        kw = {"storage": self._held, "config": self.config, "dtype": self.dtype, "transposed": self.transposed,
              "fmt": self.fmt, "operands": self.operands, **changes}
        return QuantizedWeight(**kw)

    def _cloned(self, fmt: WeightFormat | None = None) -> QuantizedWeight:
        """A weight with its own memory: cloned parts, the operands made from them again."""
        parts = {k: v.clone() for k, v in self.plain_parts().items()}
        return QuantizedWeight.from_parts(parts, self.config, self.weight_shape, self.dtype, self.transposed,
                                          self.fmt if fmt is None else fmt)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The storage's high-precision value (in the nominal dtype unless `dtype`): what the GEMMs compute with."""
        w = self.storage.dequantize(self.dtype if dtype is None else dtype)
        return w.t() if self.transposed else w

    def plain_parts(self) -> dict[str, torch.Tensor]:
        """The storage as a checkpoint holds it: plain dense tensors (`operands` may hold a kernel's layout)."""
        return self.fmt.to_parts(self.storage)

    def nbytes_quantized(self) -> int:
        """Bytes of memory the weight holds (its storage, and a kernel's own copy next to it: oneDNN's prepacked
        int8), each allocation once."""
        held = {}
        for t in (*self._held.buffers().values(), *self.operands.values()):
            if t is not None and t.is_mkldnn:
                held[id(t)] = t.numel() * t.element_size()
            elif t is not None:
                held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(held.values())

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: ARG002 - torch's signature
        t = ", transposed" if self.transposed else ""
        return (f"QuantizedWeight({self.config!r}, shape={list(self.shape)}, dtype={self.dtype}{t}, "
                f"scheme={self._held.scheme.name}, operands={{"
                f"{', '.join(f'{k}: {v.dtype} {list(v.shape)}' for k, v in self.operands.items())}}})")

    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        # the format goes along as it is: made anew, its quantizers would make tensors while torch.compile traces
        fields = tuple(name for name, t in self._held.buffers().items() if t is not None)
        return [f"storage_{f}" for f in fields] + [f"op_{name}" for name in self.operands], (
            self.config, self.weight_shape, self.dtype, self.transposed, self._held.scheme.name, fields,
            tuple(self.operands), _Carried(self.fmt))

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: tuple, outer_size: Any,
                             outer_stride: Any) -> QuantizedWeight:
        config, shape, dtype, transposed, scheme, fields, ops, fmt = meta
        storage = QuantizedTensorBase.made(get_scheme(scheme), torch.Size(shape), dtype, None,
                                           {f: inner[f"storage_{f}"] for f in fields})
        return QuantizedWeight(storage, config, dtype, transposed, fmt.value, {n: inner[f"op_{n}"] for n in ops})

    def __getattr__(self, name: str) -> Any:  # __tensor_flatten__'s inner names
        held = self.__dict__
        if name.startswith("storage_") and "_held" in held and name[8:] in held["_held"].scheme.fields:
            return getattr(held["_held"], name[8:])
        if name.startswith("op_") and name[3:] in held.get("operands", {}):
            return held["operands"][name[3:]]
        raise AttributeError(name)

    # ------------------------------------------------------------------ the GEMM
    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x[..., K] @ W^T (+ bias) by the config's quantized GEMM, in x's dtype."""
        if self.transposed:
            raise ValueError("linear: expected the [N, K] weight, got its transposed view; call .t() first")
        n, k = self.weight_shape
        if not isinstance(x, torch.Tensor) or isinstance(x, QuantizedWeight):
            raise TypeError(f"input: expected a plain torch.Tensor, got {type(x).__name__}")
        if x.dtype not in HIGH_PRECISION:
            raise TypeError(f"input: expected float32, bfloat16 or float16, got {x.dtype}")
        if x.dim() < 1 or x.shape[-1] != k:
            raise ValueError(f"input: expected a last dim of {k} (the weight is [{n}, {k}]), got {tuple(x.shape)}")
        if bias is not None and tuple(bias.shape) != (n,):
            raise ValueError(f"bias: expected shape ({n},), got {tuple(bias.shape)}")
        if k == 0:  # no input features: an empty sum, as torch.nn.Linear(0, N) gives
            out = x.new_zeros(*x.shape[:-1], n)
            return out if bias is None else out + bias.to(x.dtype)
        x2d = x.reshape(-1, k)
        if torch.compiler.is_compiling() or isinstance(x, FakeTensor):  # the GEMM as a custom op Dynamo can trace
            out = compiled_weight_linear(x2d, self.operands, self.config, self.weight_shape, bias)
        else:
            out = self.fmt.linear(x2d, self.operands, self.weight_shape, bias)
        return out.reshape(*x.shape[:-1], n)

    # ------------------------------------------------------------------ torch dispatch
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if isinstance(w, QuantizedWeight) and not isinstance(x, QuantizedWeight):
                return w.linear(x, bias)
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm):
            a, b = args[0], args[1]
            if isinstance(b, QuantizedWeight) and b.transposed and not isinstance(a, QuantizedWeight) \
                    and (func not in (torch.mm, torch.Tensor.mm) or a.dim() == 2):
                return b._with(transposed=False).linear(a)
        if func is torch.Tensor.to:
            return _to(args[0], *args[1:], **kwargs)
        if func is torch.Tensor.__deepcopy__:
            return _deepcopy(args[0], args[1])
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            return args[0]._with()
        if func in (aten.t.default,) or (func is aten.transpose.int and sorted(a % 2 for a in args[1:3]) == [0, 1]):
            return args[0]._with(transposed=not args[0].transposed)
        if func is aten.clone.default:
            return args[0]._cloned()
        if func is aten._to_copy.default:
            return _to(args[0], dtype=kwargs.get("dtype"), device=kwargs.get("device"), copy=True)
        if func is aten.copy_.default:
            return _copy_into(args[0], args[1])
        if func is aten.is_same_size.default:
            return args[0].shape == args[1].shape
        names = ", ".join(type(a).__name__ for a in args)
        raise NotImplementedError(f"QuantizedWeight ({args[0].config if isinstance(args[0], QuantizedWeight) else ''}"
                                  f") does not support {func} (arguments: {names}); the weight runs F.linear, "
                                  "x @ w.t() and torch.matmul; call .dequantize() for a plain tensor")


class _Carried:
    """A value in `__tensor_flatten__`'s metadata that is not data (the format, which the config next to it
    determines): carried as it is, never copied, equal to any other (Dynamo copies and compares the metadata)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Carried)

    def __hash__(self) -> int:
        return 0

    def __deepcopy__(self, memo: dict) -> _Carried:
        return self


def check_weight(weight: Any, name: str) -> None:
    """A 2D float32/bfloat16/float16 tensor with data; TypeError/ValueError naming `name` otherwise."""
    if not isinstance(weight, torch.Tensor) or isinstance(weight, QuantizedWeight):
        raise TypeError(f"{name}: expected a plain torch.Tensor, got {type(weight).__name__}")
    if weight.dtype not in HIGH_PRECISION:
        raise TypeError(f"{name}: expected a float32, bfloat16 or float16 weight, got {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"{name}: expected a 2D weight [out_features, in_features], got shape {tuple(weight.shape)}")
    if weight.is_meta or weight.device.type != "cpu":
        raise ValueError(f"{name}: expected a CPU weight with data (the quantized GEMMs here are torch's CPU ops), "
                         f"got one on {weight.device}")


def _to(w: QuantizedWeight, *args: Any, **kwargs: Any) -> QuantizedWeight:
    """Only the nominal dtype changes (a float dtype); the storage stays as it is, on the CPU."""
    copy = kwargs.pop("copy", False)
    if args or kwargs.get("dtype") is not None or kwargs.get("device") is not None:
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
    else:
        device, dtype = None, None
    if device is not None and torch.device(device).type != "cpu":
        raise NotImplementedError(f"QuantizedWeight.to: the quantized weights here run on the CPU only, got {device}")
    if dtype is not None and dtype not in HIGH_PRECISION:
        raise TypeError(f"dtype: a QuantizedWeight's nominal dtype must be float32, bfloat16 or float16, got {dtype}")
    if dtype is None or dtype == w.dtype:
        return w._cloned() if copy else w
    return w._with(dtype=dtype)


def _deepcopy(w: QuantizedWeight, memo: dict) -> QuantizedWeight:
    """Cloned parts (torch's deepcopy cannot copy a kernel's opaque layout, and would not keep the storage a view
    of the operands) and deep copies of the rest (the format, `_is_param` when the weight is a module's
    Parameter)."""
    out = w._cloned(copy.deepcopy(w.fmt, memo))
    for name, value in w.__dict__.items():
        if name not in out.__dict__:
            out.__dict__[name] = copy.deepcopy(value, memo)
    memo[id(w)] = out
    return out


def _copy_into(dst: QuantizedWeight, src: torch.Tensor) -> QuantizedWeight:
    """dst's storage and operands take src's (a QuantizedWeight of the same config, shape and scheme), or src
    quantized (a plain tensor), in place."""
    if not isinstance(dst, QuantizedWeight):
        raise TypeError(f"copy_: cannot copy a QuantizedWeight into a {type(dst).__name__}; call .dequantize()")
    if isinstance(src, QuantizedWeight):
        if src.config != dst.config or src.weight_shape != dst.weight_shape or src.transposed != dst.transposed:
            raise ValueError(f"src: expected a QuantizedWeight of {dst.config!r} and shape {list(dst.shape)}, got "
                             f"{src.config!r} and shape {list(src.shape)}")
    else:
        plain = src.t() if dst.transposed else src
        src = QuantizedWeight.from_float(plain.to(dst.dtype), dst.config, "src")
    if src._held.scheme != dst._held.scheme:
        raise ValueError(f"src: a {src._held.scheme.name} weight, expected {dst._held.scheme.name} (a weight "
                         "quantized from another dtype: quantize the model from weights of the saved dtype)")
    for name, t in src.operands.items():
        mine = dst.operands.get(name)
        if mine is None or mine.shape != t.shape or mine.dtype != t.dtype or mine.is_mkldnn != t.is_mkldnn:
            raise ValueError(f"src: operand {name!r} is {t.dtype} {list(t.shape)}, expected "
                             f"{None if mine is None else (mine.dtype, list(mine.shape))}")
    for field, t in src._held.buffers().items():  # (a buffer a kernel's copy holds instead: the operands below)
        if t is not None and getattr(dst._held, field) is not None:
            getattr(dst._held, field).copy_(t)
    for name, t in src.operands.items():
        if t.is_mkldnn:  # a kernel's opaque layout: no copy_ into it; the weight (and its views) take a copy
            dst.operands[name] = t.clone()
        else:  # (a view of the storage, or the memory the storage views: the same values again)
            dst.operands[name].copy_(t)
    return dst


__all__ = ["QuantizedWeight", "check_weight"]
