"""engine.inspect(model, every=N, out=DIR, what_if=None): the numerics of every quantized GEMM of a model.

A step is one forward of `model` (its forward pre-hook counts them). On steps 0, N, 2N, ... the pre-hook
sets this thread's observer (`engine.autocast.swap_inspector`) until the next step, so every engine linear
layer of the model that the forward (and an activation recompute in its backward) runs goes through
`Observer.linear`, and its backward reports through the autograd node's hook. On the other steps the
pre-hook's counter check (and, on the first one after an inspected step, clearing the observer) is all that
runs, and the layers take their usual path. A step's records are complete after its backward: they are
reduced over the ranks (under torch.distributed), made final and written when the next inspected step starts
and when the context exits (not after an error).

Not supported: compiled models (torch.compile): a RuntimeError at entry, or, for a model compiled inside the
context, when its records are next written (its forward runs the compiled custom ops, which are not watched).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from engine import autocast
from engine.collectives import group_size
from engine.modules import FP8Module
from engine.numerics.config import InspectConfig
from engine.numerics.observe import Layer, Observer, Record
from engine.numerics.reduce import finish, reduce_sums
from engine.numerics.writer import RecordWriter
from engine.recipes import Recipe

COMPILED = ("engine.inspect: {what} is compiled with torch.compile; the inspector watches the eager layers only - "
            "inspect the uncompiled model (for torch.compile(m): m._orig_mod)")


def _compiled(module: torch.nn.Module) -> bool:
    return type(module).__name__ == "OptimizedModule" or getattr(module, "_compiled_call_impl", None) is not None


class Inspector:
    """The state of one `engine.inspect` context: the step counter, the layers, the records."""

    def __init__(self, model: torch.nn.Module, config: InspectConfig) -> None:
        self.model, self.config = model, config
        self.step = -1  # the step running (the count of forwards so far, minus one)
        self.records: list[Record] = []  # every record so far, in order
        self._pending: list[Record] = []  # the records of steps not yet written
        self._keys: set[tuple] = set()  # what this step recorded (layer, source, kind, operand, usage, gemm)
        self._writes = group_size(config.group) <= 1 or dist.get_rank(config.group) == 0  # one rank writes
        self._writer = None if config.out is None or not self._writes else RecordWriter(config.out)
        self._layers: dict[int, Layer] = {}
        self._what_if_states: list[Any] = []
        self._observer = Observer(self._locate, self._emit, config.what_if)
        self._armed = False  # the observer is set: from an inspected step's forward to the next step
        self.compiled = False  # a compiled forward ran the model's hooks

    # -------------------------------------------------------------- the model's hooks
    def pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        self.step += 1
        if self.step % self.config.every:
            if self._armed:  # the first skipped step after an inspected one
                self._disarm()
            return
        if torch.compiler.is_compiling():  # compiled after the context began: said when the records are next written
            self.compiled = True
            return
        self.flush()
        self._keys = set()
        for state in self._what_if_states:  # delayed scaling: the what-if scales follow the inspected steps
            state.update()
        autocast.swap_inspector(self._observer)
        self._armed = True

    def _disarm(self) -> None:
        autocast.swap_inspector(None)
        self._armed = False

    # -------------------------------------------------------------- the observer's callbacks
    def _emit(self, record: Record, recomputed: bool) -> None:
        key = tuple(record.get(k) for k in ("layer", "source", "kind", "operand", "usage", "gemm"))
        if recomputed and key in self._keys:
            return  # an activation recompute repeats what the step's forward recorded
        self._keys.add(key)
        self._pending.append({"step": self.step, **record})

    def _locate(self, weight: torch.Tensor) -> Layer | None:
        """The inspected layer whose weight this is (None: a layer of another model)."""
        layer = self._layers.get(id(weight))
        if layer is None:  # first sight, or the weights were replaced: look again
            self._layers = self._scan()
            layer = self._layers.get(id(weight))
        return layer

    def _scan(self) -> dict[int, Layer]:
        old = {layer.name: layer for layer in self._layers.values()}
        found: dict[int, Layer] = {}
        for name, module in self.model.named_modules():
            if not isinstance(module, FP8Module):
                continue
            for gemm, weight_name in enumerate(module.weight_names):
                label = name if module.num_gemms == 1 else f"{name}.{module.gemm_names[gemm]}"
                layer = old.get(label) or self._layer(label, module, gemm)
                found[id(getattr(module, weight_name))] = layer
        return found

    def _layer(self, label: str, module: FP8Module, gemm: int) -> Layer:
        recipe: Recipe | None = self.config.what_if
        if recipe is None:
            return Layer(label)
        device = getattr(module, module.weight_names[gemm]).device
        who = {"num_gemms": 1, "device": device, "module": type(module).__name__,
               "gemm_names": (module.gemm_names[gemm],)}
        with torch.random.fork_rng(devices=[]):  # stochastic-rounding streams draw from torch's generator: the
            # training run's own draws (its modules' states, its data) stay what they would be without the inspector
            fwd, bwd = recipe.make_state(forward=True, **who), recipe.make_state(forward=False, **who)
        self._what_if_states += [fwd, bwd]
        return Layer(label, fwd, bwd)

    # -------------------------------------------------------------- records
    def flush(self) -> None:
        """Write the records of the finished steps (to `out`, if given) and keep them in `records`."""
        if self.compiled:
            raise RuntimeError(COMPILED.format(what="the model, compiled inside the context,"))
        pending, self._pending = self._pending, []
        reduce_sums(pending, self.config.group)
        pending = [finish(r) for r in pending]
        self.records += pending
        if self._writer is not None and self._writes:
            self._writer.write(pending)


@contextlib.contextmanager
def inspect(model: torch.nn.Module, every: int = 1, out: str | Path | None = None,
            what_if: Recipe | None = None, group: dist.ProcessGroup | None = None) -> Iterator[Inspector]:
    """Record the numerics of every engine layer of `model` on steps 0, N, 2N, ... (N = `every`).

    Per layer and step: for each GEMM operand and usage the training recipe quantizes, amax, scale range,
    underflow %, saturation %, SQNR and MSE of dequantize(quantize(x)) against x and the share of zero /
    subnormal / saturated block scales; for fprop, dgrad and wgrad the output's relative error against the
    same GEMM in high precision, and for wgrad the ratio of gradient norm to quantization noise (1 / that
    error; below sqrt(3) low precision stops helping, arXiv 2505.19115). With `what_if`, the same for that
    recipe (one extra quantize per operand). Yields the Inspector (`.records`); writes `out`/records.jsonl and
    records.csv per step. Outside inspected steps the layers run exactly as without it.

    Under torch.distributed each step's numbers are reduced over `group` (default: the world) before they are
    kept, and its rank 0 writes the files: every rank must run the inspected steps.
    """
    config = InspectConfig(every=every, out=out, what_if=what_if, group=group)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    for name, module in model.named_modules():
        if _compiled(module):
            raise RuntimeError(COMPILED.format(what=f"the model's submodule {name!r}" if name else "the model"))
    inspector = Inspector(model, config)
    handles = [model.register_forward_pre_hook(inspector.pre_forward)]
    previous = autocast.swap_inspector(None)
    try:
        yield inspector
    finally:
        for handle in handles:
            handle.remove()
        autocast.swap_inspector(previous)
    inspector.flush()  # not after an error: the step is incomplete (and other ranks may not reach the collective)
