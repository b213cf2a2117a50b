"""Quantization as torch.library custom ops: `engine::quantize`, `engine::amax`, `engine::fp8_to_bf16`,
`engine::elements_to_bf16`
(and delayed scaling's state update, `delayed_update`, a plain function).

Each op checks its tensor arguments (plain and dense, `backend.check_tensor`), runs the
kernel the registry names for its scheme's layout and device, and has a fake (meta)
implementation, so FakeTensor mode and torch.compile trace it without running it. The
functions at the bottom are what the layers above call: plain tensors in, plain tensors
(and None for what was not asked for) out. Traced calls go through the ops; eager calls run
the same implementation without the dispatcher's per-call cost (`traced`).
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Iterable
from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor

from engine.ops import backend, registry
from engine.ops import reference as ref
from engine.schemes import Scheme, get_scheme

Buffers = registry.Buffers
#: a rule's scheme-specific kernel options, as sorted (name, value) pairs (NVFP4: ("two_d", True), ...)
Options = tuple[tuple[str, "bool | int | float | str"], ...]


def _shares_scale(scheme: Scheme, rowwise: bool, columnwise: bool) -> bool:
    """One scale per tensor, both usages: the op returns it once; both usages hold that one tensor."""
    return scheme.rowwise_block.is_tensor and rowwise and columnwise


def _output_specs(x: torch.Tensor, scheme: Scheme, rowwise: bool, columnwise: bool) -> list[tuple]:
    """(shape, dtype) of the op's outputs: each of `scheme.fields` (empty where not asked for, or where it is the
    shared per-tensor scale already returned), then max|x| (per-tensor schemes; empty otherwise)."""
    specs = scheme.buffer_specs(x.shape, rowwise=rowwise, columnwise=columnwise)
    if _shares_scale(scheme, rowwise, columnwise):
        del specs["columnwise_scale_inv"]
    out = [specs.get(name, ((0,), torch.uint8)) for name in scheme.fields]
    return out + [((1,) if scheme.rowwise_block.is_tensor else (0,), torch.float32)]


def _counter_spec(rng_counter: torch.Tensor | None) -> tuple:
    return ((2,) if rng_counter is not None else (0,), torch.int64)


def _kernel_args(s: Scheme, scale: torch.Tensor | None, amax_epsilon: float, scale_mode: str,
                 amax_rowwise: torch.Tensor | None, amax_columnwise: torch.Tensor | None,
                 rng_counter: torch.Tensor | None, options: Options, check: bool = True) -> dict:
    """The registry kernel's keyword arguments for the scheme's family: a tensor-level scale's (given amaxes, a
    stochastic-rounding counter, its rule's options), or the one-level schemes' (scale, epsilon, E8M0 mode)."""
    for t, name in ((scale, "scale"), (amax_rowwise, "amax_rowwise"), (amax_columnwise, "amax_columnwise"),
                    (rng_counter, "rng_counter")):
        if t is not None and check:
            backend.check_tensor(t, name)
    if s.tensor_scale:
        if scale is not None:
            raise ValueError(f"scale: {s.name} scales from its tensor-level amaxes; pass amax_rowwise / "
                             "amax_columnwise instead")
        return {"amax_rowwise": amax_rowwise, "amax_columnwise": amax_columnwise, "rng_counter": rng_counter,
                **dict(options)}
    if amax_rowwise is not None or amax_columnwise is not None or rng_counter is not None or options:
        raise ValueError(f"amax_rowwise / amax_columnwise / rng_counter / options: {s.name} has one scale level "
                         f"and rounds to nearest; got options {dict(options)}")
    return {"scale": scale, "amax_epsilon": amax_epsilon, "scale_mode": scale_mode}


def _buffers(x: torch.Tensor, s: Scheme, rowwise: bool, columnwise: bool, args: dict,
             record_amax: Optional[torch.Tensor] = None) -> tuple[Buffers, torch.Tensor | None]:
    """Checked x, then the registry's kernel: the buffers and max|x| (per-tensor schemes)."""
    backend.check_tensor(x, "x")
    fn = registry.kernel("quantize", s.layout, "cpu" if x.is_cpu else x.device.type)  # .device costs ~1 us
    if record_amax is None:
        buffers, amax = fn(x, s, rowwise=rowwise, columnwise=columnwise, **args)
    else:  # per-tensor kernels record max(record_amax, max|x|) themselves
        buffers, amax = fn(x, s, rowwise=rowwise, columnwise=columnwise, record_amax=record_amax, **args)
    if s.rowwise_block.is_tensor and amax is None:
        amax = ref.amax(x)
    return buffers, amax


def _check_record_amax(record_amax: object, scheme: Scheme, traced: bool) -> None:
    if not traced:  # FakeTensors while tracing: the op's fake kernel, no memory read
        backend.check_tensor(record_amax, "record_amax")
    if not scheme.rowwise_block.is_tensor:
        raise ValueError(f"record_amax: only per-tensor schemes record an amax, got {scheme.name}")
    if record_amax.dtype != torch.float32 or record_amax.numel() != 1:
        raise TypeError(f"record_amax: expected a 1-element float32 tensor, got a {record_amax.dtype} tensor of "
                        f"shape {tuple(record_amax.shape)}")


@functools.lru_cache(maxsize=None)
def _parse_options(text: str) -> Options:
    """`options` of the op: JSON of the sorted pairs (what `_options_text` wrote)."""
    return tuple((k, v) for k, v in json.loads(text))


def _options_text(options: Options) -> str:
    return json.dumps(sorted(options))


@torch.library.custom_op("engine::quantize", mutates_args=())
def quantize_op(
    x: torch.Tensor, scheme: str, rowwise: bool, columnwise: bool, scale: Optional[torch.Tensor],
    amax_epsilon: float, scale_mode: str, amax_rowwise: Optional[torch.Tensor],
    amax_columnwise: Optional[torch.Tensor], rng_counter: Optional[torch.Tensor], options: str,
) -> list[torch.Tensor]:
    """x quantized by the named scheme: each of the scheme's `fields` (empty where absent), max|x| (per-tensor
    schemes), and the stochastic-rounding counter advanced (empty without one).

    `scale` / `amax_epsilon` / `scale_mode`: a one-level scheme's rule (a given per-tensor scale, current
    scaling's epsilon, E8M0's rounding). `amax_rowwise` / `amax_columnwise` (given tensor-level amaxes),
    `rng_counter` (stochastic rounding's (stream, offset); the op is functional: it returns the advanced
    counter, which the caller copies back) and `options` (JSON pairs: the rule's kernel options): a scheme
    with a tensor-level scale.
    """
    s = get_scheme(scheme)
    counter = None if rng_counter is None else rng_counter.clone()
    args = _kernel_args(s, scale, amax_epsilon, scale_mode, amax_rowwise, amax_columnwise, counter,
                        _parse_options(options))
    buffers, amax = _buffers(x, s, rowwise, columnwise, args)
    if _shares_scale(s, rowwise, columnwise):
        buffers = {**buffers, "columnwise_scale_inv": None}
    outputs = []
    storages = {t.untyped_storage().data_ptr() for t in (x, scale, amax_rowwise, amax_columnwise) if t is not None}
    for name, (shape, dtype) in zip((*s.fields, "amax"), _output_specs(x, s, rowwise, columnwise)):
        t = amax if name == "amax" else buffers.get(name)
        if t is None or (name == "amax" and not s.rowwise_block.is_tensor):
            t = torch.empty(shape, dtype=dtype, device=x.device)
        elif t.numel() and t.untyped_storage().data_ptr() in storages:
            t = t.clone()  # a view (a transpose that needed no copy, a given amax): custom ops return no aliases
        storages.add(t.untyped_storage().data_ptr())
        outputs.append(t)
    return outputs + [torch.empty(0, dtype=torch.int64, device=x.device) if counter is None else counter]


@quantize_op.register_fake
def _quantize_fake(x, scheme, rowwise, columnwise, scale, amax_epsilon, scale_mode, amax_rowwise, amax_columnwise,
                   rng_counter, options):
    specs = _output_specs(x, get_scheme(scheme), rowwise, columnwise) + [_counter_spec(rng_counter)]
    return [x.new_empty(shape, dtype=dtype) for shape, dtype in specs]


def _amax(x: torch.Tensor) -> torch.Tensor:
    backend.check_tensor(x, "x")
    return registry.kernel("amax", registry.ANY, x.device.type)(x)


@torch.library.custom_op("engine::amax", mutates_args=())
def amax_op(x: torch.Tensor) -> torch.Tensor:
    """max|x| as fp32 [1] (NaN if x has NaN, 0 for an empty tensor)."""
    return _amax(x)


@amax_op.register_fake
def _amax_fake(x):
    return x.new_empty(1, dtype=torch.float32)


def _fp8_to_bf16(data: torch.Tensor) -> torch.Tensor:
    backend.check_tensor(data, "data")
    return registry.kernel("fp8_to_bf16", registry.ANY, data.device.type)(data)


@torch.library.custom_op("engine::fp8_to_bf16", mutates_args=())
def fp8_to_bf16_op(data: torch.Tensor) -> torch.Tensor:
    """FP8 values as bf16 (exact), same shape."""
    return _fp8_to_bf16(data)


@fp8_to_bf16_op.register_fake
def _fp8_to_bf16_fake(data):
    return data.new_empty(data.shape, dtype=torch.bfloat16)


def _elements_to_bf16(data: torch.Tensor, scheme: Scheme, cols: int) -> torch.Tensor:
    backend.check_tensor(data, "data")
    if not scheme.coded:
        raise TypeError(f"scheme: expected an MX scheme with E2M1/E2M3/E3M2 codes, got {scheme.name}")
    if data.dtype != torch.uint8:
        raise TypeError(f"data: expected uint8 element codes, got {data.dtype}")
    if data.dim() == 0 or data.shape[-1] != -(-cols // scheme.elements_per_byte):
        raise ValueError(f"cols: {cols} elements need {-(-cols // scheme.elements_per_byte)} bytes along the last "
                         f"dim of data, got shape {tuple(data.shape)}")
    return registry.kernel("elements_to_bf16", scheme.layout, data.device.type)(data, scheme.element, cols)


@torch.library.custom_op("engine::elements_to_bf16", mutates_args=())
def elements_to_bf16_op(data: torch.Tensor, scheme: str, cols: int) -> torch.Tensor:
    """MX element codes (E2M1 packed / E2M3 / E3M2) of the named scheme as bf16 values [..., cols] (exact, unscaled)."""
    return _elements_to_bf16(data, get_scheme(scheme), cols)


@elements_to_bf16_op.register_fake
def _elements_to_bf16_fake(data, scheme, cols):
    return data.new_empty((*data.shape[:-1], cols), dtype=torch.bfloat16)


OPS = (quantize_op, amax_op, fp8_to_bf16_op, elements_to_bf16_op)


# ------------------------------------------------------------------------------- what callers use
def kernel_buffers(x: torch.Tensor, scheme: Scheme, rowwise: bool, columnwise: bool,
                   kernel_args: dict) -> Buffers:
    """An eager quantization that is one kernel call (`ScaleRule.kernel_args`): x checked, then the
    registry's kernel for the scheme's layout and x's device."""
    backend.check_tensor(x, "x")
    fn = registry.kernel("quantize", scheme.layout, "cpu" if x.is_cpu else x.device.type)
    return fn(x, scheme, rowwise=rowwise, columnwise=columnwise, **kernel_args)[0]


def traced(x: torch.Tensor) -> bool:
    """Under torch.compile or with FakeTensors the ops must be seen; eager calls skip the dispatcher.

    A custom op costs 60-80 us per call in eager (its autograd and dispatch wrappers), as much as
    the whole quantization of a small tensor; eager runs the same implementation directly.
    """
    return torch.compiler.is_compiling() or isinstance(x, FakeTensor)


def quantize(
    x: torch.Tensor,
    scheme: Scheme,
    *,
    rowwise: bool,
    columnwise: bool,
    scale: torch.Tensor | None = None,
    amax_epsilon: float = 0.0,
    scale_mode: str = "rceil",
    record_amax: torch.Tensor | None = None,
    amax_rowwise: torch.Tensor | None = None,
    amax_columnwise: torch.Tensor | None = None,
    rng_counter: torch.Tensor | None = None,
    options: Options = (),
) -> tuple[Buffers, torch.Tensor | None]:
    """(the buffers of x under `scheme` for the asked usages, max|x| for per-tensor schemes else None).

    One-level schemes: `scale`, a given per-tensor scale (delayed scaling); otherwise scales come from
    the data (the current-scaling rule with `amax_epsilon`, or E8M0 by `scale_mode`). `record_amax`
    (per-tensor schemes; a 1-element fp32 tensor) becomes max(record_amax, max|x|) in place, NaN if
    either is NaN: delayed scaling's record, in the same kernel call on the CPU. A scheme with a
    tensor-level scale: `amax_rowwise` / `amax_columnwise` (given, e.g. all-reduced, amaxes; else x's),
    `rng_counter` (stochastic rounding, advanced in place) and its rule's `options`.
    """
    backend.check_not_subclass(x, "x")
    if record_amax is not None:
        _check_record_amax(record_amax, scheme, traced(x))
    args = _kernel_args(scheme, scale, float(amax_epsilon), scale_mode, amax_rowwise, amax_columnwise, rng_counter,
                        options, check=not traced(x))
    if not traced(x):  # eager: the op's implementation, without packing its outputs into tensors
        return _buffers(x, scheme, rowwise, columnwise, args, record_amax)
    *outputs, amax, counter = quantize_op(x, scheme.name, rowwise, columnwise, scale, float(amax_epsilon),
                                          scale_mode, amax_rowwise, amax_columnwise, rng_counter,
                                          _options_text(options))
    if record_amax is not None:  # the op is functional: the record is a torch op after it
        registry.record_max(record_amax, amax)
    if rng_counter is not None:  # and so is the counter's advance
        rng_counter.copy_(counter)
    buffers = dict(zip(scheme.fields, outputs))
    if _shares_scale(scheme, rowwise, columnwise):
        buffers["columnwise_scale_inv"] = buffers["rowwise_scale_inv"]
    for columnwise_usage, wanted in ((False, rowwise), (True, columnwise)):
        if not wanted:
            buffers.update(dict.fromkeys(scheme.usage_fields(columnwise_usage)))
    return buffers, (amax if scheme.rowwise_block.is_tensor else None)


def delayed_update(
    amax_history: torch.Tensor, scale: torch.Tensor, fp8_max: float, margin: int, algo: str,
    held: Iterable[int] = (),
) -> None:
    """Delayed scaling's update of its state, in place (`registry.delayed_update_reference` says what it does).

    amax_history [L, n] and scale [n] are fp32; `algo` is "max" or "most_recent"; `held` slots
    keep their history and scale. On the CPU one native call; elsewhere (and when traced, or
    with ENGINE_BACKEND=triton, which has no such kernel) the reference's torch ops.
    """
    for t, name in ((amax_history, "amax_history"), (scale, "scale")):
        backend.check_tensor(t, name)
        if t.dtype != torch.float32:
            raise TypeError(f"{name}: expected a float32 tensor, got {t.dtype}")
    if amax_history.dim() != 2 or amax_history.shape[0] < 1:
        raise ValueError(f"amax_history: expected shape [rows >= 1, n], got {tuple(amax_history.shape)}")
    if tuple(scale.shape) != (amax_history.shape[1],):
        raise ValueError(f"scale: expected shape ({amax_history.shape[1]},) (one per amax_history column), "
                         f"got {tuple(scale.shape)}")
    if algo not in ("max", "most_recent"):
        raise ValueError(f"algo: expected 'max' or 'most_recent', got {algo!r}")
    if isinstance(margin, bool) or not isinstance(margin, int) or not 0 <= margin <= 126:
        raise ValueError(f"margin: expected an int in [0, 126], got {margin!r}")
    if isinstance(fp8_max, bool) or not isinstance(fp8_max, (int, float)) or not 0 < fp8_max < float("inf"):
        raise ValueError(f"fp8_max: expected a finite number > 0, got {fp8_max!r}")
    n = scale.shape[0]
    held = list(held)
    if any(isinstance(j, bool) or not isinstance(j, int) or not -n <= j < n for j in held):
        raise ValueError(f"held: expected slots in [{-n}, {n}), got {held!r}")
    native = (scale.is_cpu and amax_history.is_cpu and backend.forced_backend() != "triton"
              and not torch.compiler.is_compiling() and not isinstance(scale, FakeTensor))
    fn = registry.kernel("delayed_update", registry.ANY, "cpu") if native else registry.REFERENCE["delayed_update"]
    fn(amax_history, scale, fp8_max, margin, algo, held)


def delayed_update_state(amax_history: torch.Tensor, scale: torch.Tensor, fp8_max: float, margin: int,
                         algo: str) -> None:
    """`delayed_update` of a DelayedScalingState's own tensors, checked when the state was built: the same
    kernel, without checking the arguments again at every update (~10 us a call, three calls a step)."""
    if scale.is_cpu and backend.forced_backend() in (None, "native") and not torch.compiler.is_compiling():
        native = sys.modules.get("engine.ops.native")  # loaded by now (an import statement costs ~1 us a call)
        if native is None:
            from engine.ops import native

        if native.available():
            native.delayed_update_unchecked(amax_history, scale, fp8_max, margin, algo == "most_recent")
            return
    delayed_update(amax_history, scale, fp8_max, margin, algo)


def amax(x: torch.Tensor) -> torch.Tensor:
    """max|x| as fp32 [1] (NaN if x has NaN, 0 for an empty tensor)."""
    backend.check_not_subclass(x, "x")
    return amax_op(x) if traced(x) else _amax(x)


def fp8_to_bf16(data: torch.Tensor) -> torch.Tensor:
    """FP8 values as bf16 (exact), same shape."""
    backend.check_not_subclass(data, "data")
    return fp8_to_bf16_op(data) if traced(data) else _fp8_to_bf16(data)


def elements_to_bf16(data: torch.Tensor, scheme: Scheme, *, cols: int | None = None) -> torch.Tensor:
    """The values of `scheme`'s stored element codes (MX E2M1 / E2M3 / E3M2) as bf16 [..., cols]: exact, without
    the block scales (an element times an E8M0 scale is exact in bf16 too). `cols`: the unpacked last dim
    (default: every element the bytes hold)."""
    backend.check_not_subclass(data, "data")
    if cols is None:
        cols = data.shape[-1] * scheme.elements_per_byte if data.dim() else 1
    return elements_to_bf16_op(data, scheme.name, cols) if traced(data) else _elements_to_bf16(data, scheme, cols)
