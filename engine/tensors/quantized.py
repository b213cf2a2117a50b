"""QuantizedTensor: a torch.Tensor that holds a QuantizedTensorBase and behaves like its value.

It has the nominal (high-precision) dtype and shape, so it can flow through autograd and
be a Parameter, while its bytes are FP8 data plus scales. Ops it understands keep the
data quantized (detach, clone, copy_, .to(device), views that keep the last dim, empty_like,
per-tensor t()); any other op runs on the dequantized value with a QuantizedFallbackWarning
(Python shows it once per op and call site), and ops that write into a quantized tensor
(in place, `out=`, or as an element of a written tensor list) quantize their result back
into it. An optimizer's updates of FP8 weights (add_, mul_, lerp_, addcdiv_, ..., their
multi-tensor `_foreach_*_` forms and the fused Adam/AdamW/SGD steps) take that path without
a warning.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map_only

from engine.collectives import all_reduce_max
from engine.hooks import Hook
from engine.ops import quantize as qops
from engine.tensors.storage import DEQUANTIZE_DTYPES, QuantizedTensorBase, check_dequantize_dtype

aten = torch.ops.aten

#: FSDP2's all-gather extension (`fsdp_pre_all_gather` / `fsdp_post_all_gather` below): engine.distributed.fsdp,
#: above this layer, registers it
FSDP_PRE_ALL_GATHER: Hook = Hook("QuantizedTensor.fsdp_pre_all_gather", "engine.distributed")
FSDP_POST_ALL_GATHER: Hook = Hook("QuantizedTensor.fsdp_post_all_gather", "engine.distributed")
#: what a pickled QuantizedTensor is rebuilt by (`engine.tensors.serialization.rebuild_quantized_tensor`)
REBUILD_QUANTIZED_TENSOR: Hook = Hook("QuantizedTensor.__reduce_ex__", "engine.tensors.serialization")
#: prefix of the inner tensors' names in `__tensor_flatten__` (a storage field's name after it)
_INNER = "_inner_"


class QuantizedFallbackWarning(UserWarning):
    """An op on a QuantizedTensor ran on its dequantized value (slow, high-precision path)."""


class QuantizedTensor(torch.Tensor):
    """Tensor subclass over one storage; subclasses name their `storage_class`."""

    storage_class: type[QuantizedTensorBase] = QuantizedTensorBase
    _qstorage: QuantizedTensorBase
    _by_storage: dict[type, type[QuantizedTensor]] = {}

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        QuantizedTensor._by_storage[cls.storage_class] = cls

    @staticmethod
    def __new__(cls, storage: QuantizedTensorBase, requires_grad: bool = False) -> QuantizedTensor:
        if not isinstance(storage, cls.storage_class):
            raise TypeError(f"storage: expected {cls.storage_class.__name__}, got {type(storage).__name__}")
        tensor = torch.Tensor._make_wrapper_subclass(
            cls, storage.shape, dtype=storage.nominal_dtype, device=storage.device, requires_grad=requires_grad
        )
        tensor._qstorage = storage
        return tensor

    @staticmethod
    def wrap(storage: QuantizedTensorBase, requires_grad: bool = False) -> QuantizedTensor:
        """The tensor class for this storage's scheme, around it."""
        return QuantizedTensor._by_storage.get(type(storage), QuantizedTensor)(storage, requires_grad=requires_grad)

    # ------------------------------------------------------------------ the storage API, delegated
    @property
    def qstorage(self) -> QuantizedTensorBase:
        return self._qstorage

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self._qstorage.fp8_dtype

    @property
    def scheme(self) -> Any:
        return self._qstorage.scheme

    @property
    def quantizer(self) -> Any:
        return self._qstorage.quantizer

    def update_usage(self, rowwise_usage: bool | None = None, columnwise_usage: bool | None = None) -> None:
        self._qstorage.update_usage(rowwise_usage=rowwise_usage, columnwise_usage=columnwise_usage)

    def prepare_for_saving(self) -> tuple[list[torch.Tensor | None], QuantizedTensor]:
        tensors, _ = self._qstorage.prepare_for_saving()
        return tensors, self

    def restore_from_saved(self, tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        return self._qstorage.restore_from_saved(tensors)

    def update_quantizer(self, quantizer: Any) -> None:
        self._qstorage.update_quantizer(quantizer)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:  # type: ignore[override]
        """The high-precision value; differentiable (the gradient passes straight through)."""
        dtype = self.dtype if dtype is None else check_dequantize_dtype(dtype)
        if torch.is_grad_enabled() and self.requires_grad:
            return _Dequantize.apply(self, dtype)
        return self._qstorage.dequantize(dtype)

    def quantize_(self, src: torch.Tensor, noop_flag: torch.Tensor | None = None) -> QuantizedTensor:
        """Quantize `src` into this tensor's buffers with its quantizer (in place)."""
        quantizer = self._qstorage.quantizer
        if quantizer is None:
            raise ValueError(f"quantize_: this {type(self).__name__} has no quantizer; call update_quantizer first")
        quantizer.update_quantized(src, self, noop_flag=noop_flag)
        return self

    # ------------------------------------------------------------------ FSDP2's all-gather extension
    def untyped_storage(self) -> torch.UntypedStorage:  # type: ignore[override]
        """The storage of the data (rowwise, else columnwise): where this value's bytes are (FSDP2 compares it).

        While torch.compile traces, the wrapper's own (empty) storage: it fakes the buffers as inner tensors
        (`__tensor_flatten__`), and the wrapper must not look like an alias of one of them."""
        if torch._guards.TracingContext.try_get() is not None:
            return super().untyped_storage()
        st = self._qstorage
        data = st.rowwise_data if st.rowwise_data is not None else st.columnwise_data
        if data is None:
            raise ValueError(f"{type(self).__name__} holds no data (emptied by prepare_for_saving)")
        return data.untyped_storage()

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: Any,
                            mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        """FSDP2 all-gathers the FP8 bytes and scales of this shard (engine.distributed.fsdp)."""
        return FSDP_PRE_ALL_GATHER(self, mesh, outer_size)

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: torch.Tensor | None = None) -> Any:
        """The unsharded quantized weight from the gathered bytes (engine.distributed.fsdp)."""
        return FSDP_POST_ALL_GATHER(all_gather_outputs, metadata, param_dtype, out=out)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        st = self._qstorage
        usages = [u for u, on in (("rowwise", st.has_rowwise), ("columnwise", st.has_columnwise)) if on]
        buffers = [t for t in st.buffers().values() if t is not None]
        if any(type(t) is not torch.Tensor for t in buffers):  # FakeTensors (torch.compile traces): no values
            value = "<" + ", ".join(f"{type(t).__name__} {t.dtype} {tuple(t.shape)}" for t in buffers) + ">"
        else:
            value = st.dequantize() if usages else "<emptied by prepare_for_saving>"
        return f"{type(self).__name__}(scheme={st.scheme.name}, usages={usages}, data={value})"

    def __reduce_ex__(self, protocol: int) -> tuple:
        return REBUILD_QUANTIZED_TENSOR.impl, (self._qstorage.to_plain(), self.requires_grad)

    # ------------------------------------------------------------------ torch.compile (traceable subclass)
    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        """The buffers as inner tensors (each once: one per-tensor scale_inv serves both usages), and the rest
        as metadata: (scheme name, shape, nominal dtype, quantizer, each field's inner name or None)."""
        st = self._qstorage
        inner: dict[int, str] = {}
        fields = []
        for name, t in st.buffers().items():
            if t is not None and id(t) not in inner:
                inner[id(t)] = _INNER + name
            fields.append((name, None if t is None else inner[id(t)]))
        meta = (st.scheme.name, tuple(st.shape), st.nominal_dtype, _QuantizerRef(st.quantizer), tuple(fields))
        return list(inner.values()), meta

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: tuple, outer_size: Any,
                             outer_stride: Any) -> QuantizedTensor:
        from engine.schemes import get_scheme

        scheme, shape, dtype, quantizer, fields = meta
        buffers = {name: None if key is None else inner[key] for name, key in fields}
        storage = QuantizedTensorBase.made(get_scheme(scheme), torch.Size(shape), dtype, quantizer.quantizer, buffers)
        return QuantizedTensor.wrap(storage)

    def __getattr__(self, name: str) -> Any:  # __tensor_flatten__'s inner names
        if name.startswith(_INNER) and "_qstorage" in self.__dict__:
            t = getattr(self.__dict__["_qstorage"], name[len(_INNER):], None)
            if isinstance(t, torch.Tensor):
                return t
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    # ------------------------------------------------------------------ dispatch
    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            out = handler(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return _fallback(func, args, kwargs)


class _QuantizerRef:
    """A tensor's quantizer in its `__tensor_flatten__` metadata, which Dynamo copies and compares to guard a
    compiled graph: equal for quantizers of one kind and settings, never copied (it is the tensor's own)."""

    __slots__ = ("quantizer",)

    def __init__(self, quantizer: Any) -> None:
        self.quantizer = quantizer

    def _key(self) -> Any:
        q = self.quantizer
        return None if q is None else (type(q), repr(q.config()))

    def __eq__(self, other: object) -> bool:  # checked at every compiled call: the same quantizer first
        return isinstance(other, _QuantizerRef) and (self.quantizer is other.quantizer or self._key() == other._key())

    def __hash__(self) -> int:
        return hash(self._key())

    def __deepcopy__(self, memo: dict) -> _QuantizerRef:
        return self


def storage_of(t: Any, name: str) -> QuantizedTensorBase:
    """The storage behind a QuantizedTensor, or the storage itself; TypeError naming `name` otherwise."""
    if isinstance(t, QuantizedTensor):
        return t._qstorage
    if isinstance(t, QuantizedTensorBase):
        return t
    raise TypeError(f"{name}: expected a quantized tensor (engine.QuantizedTensor or its storage), "
                    f"got {type(t).__name__}")


class _Dequantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.input_dtype = tensor.dtype
        return tensor._qstorage.dequantize(dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.input_dtype), None


# ---------------------------------------------------------------------------------- handlers
_HANDLERS: dict[Any, Callable[..., Any]] = {}


def _handles(*ops: Any) -> Callable:
    def register(fn: Callable) -> Callable:
        for op in ops:
            _HANDLERS[op] = fn
        return fn

    return register


def map_buffers(storage: QuantizedTensorBase, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedTensorBase:
    """A storage whose buffers are fn(buffer); a buffer shared by two fields stays shared."""
    done: dict[int, torch.Tensor] = {}
    changes = {}
    for name, t in storage.buffers().items():
        if t is not None and id(t) not in done:
            done[id(t)] = fn(t)
        changes[name] = None if t is None else done[id(t)]
    return storage.replace(**changes)


@_handles(aten.detach.default, aten.alias.default)
def _detach(self: QuantizedTensor) -> QuantizedTensor:
    return QuantizedTensor.wrap(self._qstorage.replace())


@_handles(aten.clone.default)
def _clone(self: QuantizedTensor, memory_format: Any = None) -> QuantizedTensor:
    return QuantizedTensor.wrap(map_buffers(self._qstorage, torch.clone))


@_handles(aten.copy_.default)
def _copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """dst = src. Between quantized tensors of one layout and quantizer settings the buffers are
    copied (bit exact); otherwise src's value is requantized with dst's quantizer."""
    if not isinstance(dst, QuantizedTensor):
        dst.copy_(src.dequantize(), non_blocking=non_blocking)
        return dst
    if not isinstance(src, QuantizedTensor):
        return dst.quantize_(src)
    if src.shape != dst.shape:
        raise ValueError(f"copy_: src has shape {tuple(src.shape)}, dst {type(dst).__name__} has shape "
                         f"{tuple(dst.shape)}; they must be equal")
    d, s = dst._qstorage, src._qstorage
    if not _same_quantization(d, s):
        if d.quantizer is None:
            raise ValueError(f"copy_: dst ({type(dst).__name__}) has no quantizer to requantize the "
                             f"{type(src).__name__} src with; call dst.update_quantizer first")
        return dst.quantize_(s.dequantize(dst.dtype))
    for name in d.buffers():  # BUFFER_FIELDS and a layout's own (NVFP4's amaxes)
        mine, theirs = getattr(d, name), getattr(s, name)
        if theirs is None:
            setattr(d, name, None)
        elif mine is not None and mine.shape == theirs.shape and mine.dtype == theirs.dtype:
            mine.copy_(theirs, non_blocking=non_blocking)
        else:
            setattr(d, name, theirs.clone())
    if d.shares_scale_inv and d.rowwise_scale_inv is not None and d.columnwise_scale_inv is not None:
        d.columnwise_scale_inv = d.rowwise_scale_inv
    return dst


def _same_quantization(a: QuantizedTensorBase, b: QuantizedTensorBase) -> bool:
    """Same scheme and, where both have one, quantizers of one kind and settings."""
    if a.scheme != b.scheme:
        return False
    qa, qb = a.quantizer, b.quantizer
    return qa is None or qb is None or (type(qa) is type(qb) and qa.config() == qb.config())


@_handles(aten._to_copy.default)
def _to_copy(self: QuantizedTensor, **kwargs: Any) -> torch.Tensor:
    dtype, device = kwargs.get("dtype"), kwargs.get("device")
    if dtype is not None and dtype != self.dtype:
        # dequantize() gives floating dtypes only; other targets are a cast of the nominal value (as torch does)
        out = self._qstorage.dequantize(dtype if dtype in DEQUANTIZE_DTYPES else None).to(dtype)
        return out if device is None else out.to(device)
    target = self.device if device is None else torch.device(device)
    return QuantizedTensor.wrap(map_buffers(self._qstorage, lambda t: t.to(target, copy=True)))


def _infer_shape(size: Any, numel: int) -> torch.Size:
    size = list(size)
    if -1 in size:
        known = 1
        for s in size:
            if s != -1:
                known *= s
        size[size.index(-1)] = numel // known if known else 0
    return torch.Size(size)


@_handles(aten.view.default, aten._unsafe_view.default)
def _view(self: QuantizedTensor, size: Any) -> Any:
    shape = _infer_shape(size, self.numel())
    viewed = self._qstorage.view(shape)
    return NotImplemented if viewed is None else QuantizedTensor.wrap(viewed)


@_handles(aten.t.default)
def _transpose(self: QuantizedTensor) -> Any:
    transposed = self._qstorage.transpose()
    return NotImplemented if transposed is None else QuantizedTensor.wrap(transposed)


@_handles(aten.empty_like.default)
def _empty_like(self: QuantizedTensor, **kwargs: Any) -> Any:
    if kwargs.get("dtype") not in (None, self.dtype):
        return torch.empty(self.shape, dtype=kwargs["dtype"], device=kwargs.get("device") or self.device)
    return QuantizedTensor.wrap(self._qstorage.empty_like(self.shape, device=kwargs.get("device")))


@_handles(aten.zeros_like.default)
def _zeros_like(self: QuantizedTensor, **kwargs: Any) -> torch.Tensor:
    """Plain zeros (the value is not read): e.g. an optimizer's state for an FP8 weight."""
    return torch.zeros(self.shape, dtype=kwargs.get("dtype") or self.dtype, device=kwargs.get("device") or self.device)


@_handles(aten.new_empty.default)
def _new_empty(self: QuantizedTensor, size: Any, **kwargs: Any) -> Any:
    if kwargs.get("dtype") not in (None, self.dtype):
        return torch.empty(size, dtype=kwargs["dtype"], device=kwargs.get("device") or self.device)
    return QuantizedTensor.wrap(self._qstorage.empty_like(torch.Size(size), device=kwargs.get("device")))


# Updates an optimizer makes to FP8 primary weights: no faster path exists, so they run on the
# dequantized value and are quantized back without a warning. The multi-tensor (`foreach=True`)
# forms of the in-place ops and the fused optimizer steps (`fused=True`) count as well.
_INPLACE_UPDATES = ("add_", "sub_", "mul_", "div_", "addcdiv_", "addcmul_", "lerp_", "zero_", "fill_")
_FUSED_STEPS = ("_fused_sgd_", "_fused_adam_", "_fused_adamw_", "_fused_adagrad_")


def _overloads(name: str) -> list[Any]:
    packet = getattr(aten, name, None)
    return [] if packet is None else [getattr(packet, o) for o in packet.overloads()]


QUANTIZED_UPDATES = frozenset({
    aten.add_.Tensor, aten.add_.Scalar, aten.sub_.Tensor, aten.sub_.Scalar, aten.mul_.Tensor, aten.mul_.Scalar,
    aten.div_.Tensor, aten.div_.Scalar, aten.addcdiv_.default, aten.addcmul_.default, aten.lerp_.Scalar,
    aten.lerp_.Tensor, aten.zero_.default, aten.fill_.Scalar,
    *(op for name in _INPLACE_UPDATES for op in _overloads("_foreach_" + name)),
    *(op for name in _FUSED_STEPS for op in _overloads(name)),
})

# (argument position or keyword, index in a tensor list or None, the quantized tensor)
Written = tuple[int | str, int | None, QuantizedTensor]


def _mutated_arguments(func: Any, args: tuple, kwargs: dict) -> list[Written]:
    """Every quantized tensor that `func` writes to: self of x_, out=, elements of a `Tensor(a!)[]` list."""
    found: list[Written] = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        key: int | str = i if i < len(args) else a.name
        value = args[key] if isinstance(key, int) else kwargs.get(key)
        if isinstance(value, QuantizedTensor):
            found.append((key, None, value))
        elif isinstance(value, (list, tuple)):
            found.extend((key, j, t) for j, t in enumerate(value) if isinstance(t, QuantizedTensor))
    return found


def _fallback(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run `func` on dequantized values; quantize the result back into any quantized tensor it mutates."""
    mutated = _mutated_arguments(func, args, kwargs)
    for key, index, tensor in mutated:  # refuse before anything is written
        if tensor._qstorage.quantizer is None:
            where = (func._schema.arguments[key].name if isinstance(key, int) else key) + (
                "" if index is None else f"[{index}]")
            raise ValueError(f"{func}: {where} is a {type(tensor).__name__} without a quantizer, so the result "
                             "cannot be quantized back into it; call update_quantizer first")
    if func not in QUANTIZED_UPDATES:
        warnings.warn(
            f"{func} has no quantized implementation; it runs on the dequantized (high-precision) tensor",
            QuantizedFallbackWarning,
            stacklevel=3,
        )
    plain_args, plain_kwargs = tree_map_only(QuantizedTensor, lambda t: t._qstorage.dequantize(), (args, kwargs))
    out = func(*plain_args, **plain_kwargs)
    results = []
    for key, index, tensor in mutated:
        plain = plain_args[key] if isinstance(key, int) else plain_kwargs[key]
        results.append((tensor, plain if index is None else plain[index]))
    _requantize(results)
    if len(mutated) == 1 and mutated[0][1] is None:
        return mutated[0][2]
    return out


def _requantize(results: list[tuple[QuantizedTensor, torch.Tensor]]) -> None:
    """Quantize each result back into its tensor. Per-tensor current-scaling weights whose amax is all-reduced
    over a group (FSDP2 shards) agree on all their amaxes in one collective per group, not one per weight (a
    multi-tensor optimizer update)."""
    groups: dict[Any, list[int]] = {}
    for i, (tensor, _) in enumerate(results):
        group = tensor._qstorage.quantizer.tensor_amax_group
        if group is not None:
            groups.setdefault(group, []).append(i)
    agreed = {}
    for group, members in groups.items():
        if len(members) > 1:
            amaxes = [qops.amax(results[i][1]) for i in members]
            all_reduce_max(amaxes, group)
            agreed.update(zip(members, amaxes))
    for i, (tensor, plain) in enumerate(results):
        if i not in agreed:
            tensor.quantize_(plain)
            continue
        own = tensor._qstorage.quantizer
        own.with_agreed_amax(agreed[i]).update_quantized(plain, tensor)
        tensor._qstorage.quantizer = own  # keeps quantizing with its group afterwards
