"""One inspected linear call: the training GEMMs as they run, watched, plus the high-precision and what-if ones.

`linear()` (engine.modules.dispatch) hands an inspected step's calls to `Observer.linear`, which runs the
unchanged `LinearFunction` with two watchers:

* the recipe states wrapped (`WatchedState`): the quantizers a call uses hand each storage they make to
  `LinearCall.operand` before returning it, so the statistics read the quantizer's own output (an FP8 primary
  weight or a weight cached over micro-batches is not quantized in the call: it has no operand record);
* a hook on the call's autograd node (`Node.register_hook`), which sees dy and the dgrad / wgrad outputs
  after the node ran and changes nothing.

The high-precision references are the same GEMMs in the activation dtype on the unquantized operands (what
the layer computes outside fp8_autocast); the what-if recipe quantizes the same operands once each with its
own states (`engine.modules.linear_function.quantize_uses`) and runs its GEMMs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from engine import autocast
from engine.gemm import general_gemm
from engine.modules.linear_function import LinearArgs, LinearFunction, quantize_uses, same_rows
from engine.recipes import Gemm, Recipe, RecipeState, Role
from engine.recipes.operands import operand_key
from engine.numerics.stats import gemm_sums, usage_sums
from engine.tensors import QuantizedTensor, QuantizedTensorBase

Record = dict[str, Any]


@dataclasses.dataclass
class Layer:
    """Where a call belongs: the layer's name (a LayerNormMLP GEMM gets `.fc1` / `.fc2`) and its what-if states
    (made for this one GEMM: its index in them is 0)."""

    name: str
    what_if_fwd: RecipeState | None = None
    what_if_bwd: RecipeState | None = None


class WatchedQuantizer:
    """A quantizer whose `quantize_storage` also reports the storage it made; everything else is the quantizer's."""

    def __init__(self, quantizer: Any, role: Role, call: LinearCall) -> None:
        object.__setattr__(self, "_inner", quantizer)
        object.__setattr__(self, "_role", role)
        object.__setattr__(self, "_call", call)

    def quantize_storage(self, x: torch.Tensor) -> QuantizedTensorBase:
        storage = self._inner.quantize_storage(x)
        self._call.operand(self._role, storage, x)
        return storage

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:  # quantize_uses sets the usages on the quantizer
        setattr(self._inner, name, value)


class WatchedState:
    """A recipe state whose `uses` hands out watched quantizers (the same object for two uses sharing one)."""

    def __init__(self, state: RecipeState, call: LinearCall) -> None:
        self._state, self._call = state, call
        self._watched: dict[int, WatchedQuantizer] = {}

    def uses(self, role: Role, gemm: int = 0) -> tuple[Any, Any]:
        return tuple(None if q is None else self._watch(q, role) for q in self._state.uses(role, gemm))

    def _watch(self, quantizer: Any, role: Role) -> WatchedQuantizer:
        if id(quantizer) not in self._watched:
            self._watched[id(quantizer)] = WatchedQuantizer(quantizer, role, self._call)
        return self._watched[id(quantizer)]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)


class LinearCall:
    """The records of one linear call of an inspected step, and what its backward needs to add its own."""

    def __init__(self, observer: Observer, layer: Layer, recipe: str | None) -> None:
        self.observer, self.layer, self.recipe = observer, layer, recipe
        self.x: torch.Tensor | None = None  # the high-precision operands, kept until backward
        self.w: torch.Tensor | None = None
        self.what_if: dict[str, Any] = {}  # the what-if operands a later GEMM reads
        self.recomputed = False  # a recomputed forward: only what the first one did not record (its backward uses)

    def emit(self, source: str, recipe: str | None, kind: str, **fields: Any) -> None:
        self.observer.emit({"layer": self.layer.name, "source": source, "recipe": recipe, "kind": kind, **fields},
                           self.recomputed)

    # -------------------------------------------------------------- operands of the training recipe
    def operand(self, role: Role, storage: QuantizedTensorBase, hp: torch.Tensor, source: str = "train",
                recipe: str | None = None) -> None:
        """The statistics of each usage `storage` holds (of `hp`); a derivable scheme's columnwise copy is the
        rowwise one transposed, so its numbers are the rowwise ones."""
        recipe = self.recipe if recipe is None else recipe
        rowwise = None
        for columnwise, held in ((False, storage.has_rowwise), (True, storage.has_columnwise)):
            if not held:
                continue
            if columnwise and rowwise is not None and storage.scheme.derivable:
                sums = rowwise
            else:
                sums = usage_sums(storage, hp, columnwise)
            rowwise = sums if not columnwise else rowwise
            operand = role.uses[1 if columnwise else 0]
            self.emit(source, recipe, "operand", operand=operand_key(operand),
                      usage="columnwise" if columnwise else "rowwise", scheme=storage.scheme.name, sums=sums)

    def gemm(self, gemm: Gemm, out: torch.Tensor | None, reference: torch.Tensor, source: str = "train",
             recipe: str | None = None) -> None:
        """A GEMM output against its high-precision reference (the relative error follows from the sums)."""
        if out is None:
            return
        self.emit(source, self.recipe if recipe is None else recipe, "gemm", gemm=gemm.value,
                  sums=gemm_sums(out, reference))

    # -------------------------------------------------------------- the what-if recipe
    def what_if_forward(self, x2d: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                        need_dgrad: bool, need_wgrad: bool, reference: torch.Tensor) -> None:
        state, name = self.layer.what_if_fwd, self.observer.what_if_name
        if state is None:
            return
        x_row, x_col = self._what_if_operand(state, Role.INPUT, x2d, need_wgrad)
        w_row, w_col = self._what_if_operand(state, Role.WEIGHT, w, need_dgrad)
        out = general_gemm(x_row, w_row if isinstance(w_row, QuantizedTensorBase) else w_row.to(x2d.dtype),
                           out_dtype=x2d.dtype, bias=None if bias is None else bias.to(x2d.dtype))
        self.gemm(Gemm.FPROP, out, reference, "what_if", name)
        self.what_if.update(x_wgrad=x_col, w_dgrad=w_col)

    def _what_if_operand(self, state: RecipeState, role: Role, t: torch.Tensor, columnwise: bool) -> tuple[Any, Any]:
        watched = WatchedState(state, _WhatIfSink(self))
        return quantize_uses(t, watched, role, 0, rowwise=True, columnwise=columnwise)

    def what_if_backward(self, dy: torch.Tensor, dx_ref: torch.Tensor | None, dw_ref: torch.Tensor | None) -> None:
        state, name = self.layer.what_if_bwd, self.observer.what_if_name
        if state is None:
            return
        dy_row, dy_col = self._what_if_operand(state, Role.GRAD_OUTPUT, dy, dw_ref is not None)
        if dx_ref is not None and self.what_if.get("w_dgrad") is not None:
            dx = general_gemm(dy_row, _dtype(self.what_if["w_dgrad"], dy.dtype), b_transposed=True,
                              out_dtype=dy.dtype)
            self.gemm(Gemm.DGRAD, dx, dx_ref, "what_if", name)
        if dw_ref is not None and self.what_if.get("x_wgrad") is not None:
            a, b = same_rows(dy_col, _dtype(self.what_if["x_wgrad"], dy.dtype))
            dw = general_gemm(a, b, a_transposed=True, b_transposed=True, out_dtype=dy.dtype)
            self.gemm(Gemm.WGRAD, dw, dw_ref, "what_if", name)

    # -------------------------------------------------------------- backward (the autograd node's hook)
    def backward(self, grad_inputs: tuple[torch.Tensor | None, ...], grad_outputs: tuple[torch.Tensor | None, ...]
                 ) -> None:
        """After LinearFunction's backward: dy in, (dx, dW, dbias) out. Returns None: the gradients stay as they are."""
        dy = grad_outputs[0]
        if dy is None or self.x is None:
            return
        dy2d = dy.reshape(-1, dy.shape[-1])
        dx, dw = grad_inputs[0], grad_inputs[1]
        with torch.no_grad():
            dx_ref = None if dx is None else (dy2d @ self.w.to(dy2d.dtype))
            dw_ref = None if dw is None else (dy2d.t() @ self.x.to(dy2d.dtype))
            if self.recipe is not None:
                self.gemm(Gemm.DGRAD, None if dx is None else dx.reshape(dx_ref.shape), dx_ref)
                self.gemm(Gemm.WGRAD, dw, dw_ref)
            self.what_if_backward(dy2d, dx_ref, dw_ref)
        self.x = self.w = None
        self.what_if.clear()


def _dtype(operand: Any, dtype: torch.dtype) -> Any:
    """A high-precision what-if operand in the GEMM's dtype (a quantized one as it is)."""
    return operand if isinstance(operand, QuantizedTensorBase) else operand.to(dtype)


class _WhatIfSink:
    """Where the what-if quantizers report: the call's records, as source "what_if"."""

    def __init__(self, call: LinearCall) -> None:
        self.call = call

    def operand(self, role: Role, storage: QuantizedTensorBase, hp: torch.Tensor) -> None:
        self.call.operand(role, storage, hp, "what_if", self.call.observer.what_if_name)


class Observer:
    """What `linear()` calls during an inspected step (set in the thread's autocast state from the step's forward
    to the next step). A weight of no inspected layer runs unwatched; an activation recompute
    (`engine.checkpoint`) records only what its first forward did not (the usages only backward reads) and
the backward it serves."""

    def __init__(self, locate: Callable[[torch.Tensor], Layer | None], emit: Callable[[Record, bool], None],
                 what_if: Recipe | None) -> None:
        self.locate, self.emit = locate, emit
        self.what_if_name = None if what_if is None else what_if.name

    def linear(self, inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, args: LinearArgs
               ) -> torch.Tensor:
        layer = self.locate(weight)
        if layer is None:
            return LinearFunction.apply(inp, weight, bias, args)
        call = LinearCall(self, layer, args.fwd.recipe.name if args.fp8 else None)
        call.recomputed = getattr(autocast.recompute_phase(), "recomputing", False)
        if args.fp8:
            args = dataclasses.replace(args, fwd=WatchedState(args.fwd, call), bwd=WatchedState(args.bwd, call))
        out = LinearFunction.apply(inp, weight, bias, args)
        with torch.no_grad():
            x2d = inp.detach().reshape(-1, inp.shape[-1])
            w = (weight.dequantize() if isinstance(weight, QuantizedTensor) else weight.detach()).to(inp.dtype)
            reference = torch.nn.functional.linear(x2d, w, None if bias is None else bias.detach().to(inp.dtype))
            if args.fp8:
                call.gemm(Gemm.FPROP, out.detach().reshape(reference.shape), reference)
            grad = out.grad_fn is not None
            need_dgrad, need_wgrad = grad and inp.requires_grad, grad and weight.requires_grad
            call.what_if_forward(x2d, w, bias, need_dgrad, need_wgrad, reference)
        call.recomputed = False
        if grad:
            call.x, call.w = x2d, w
            out.grad_fn.register_hook(call.backward)
        return out
