"""The quantized linear as two torch.library custom ops, for torch.compile.

Dynamo cannot trace the eager autograd function's insides (storages are Python objects, the
CPU GEMM reads its scale product on the host), so under torch.compile `linear()` calls

    engine::linear_fwd(inp [M, K], weight, bias, fwd_state, bwd_state, recipe, ...) -> [out, records, counters, saved]
    engine::linear_bwd(dy [M, N], saved_x, saved_w, bwd_state, recipe, ...)         -> [dx, dw, records, counters]

with an autograd formula (`register_autograd`) tying them together. Both run `fprop` /
`bprop`, the functions the eager `LinearFunction` runs, on a recipe state rebuilt from the
recipe's key and the module's state tensors (`op_state.py`), so the quantized bits are the same
compiled and eager. Their fake implementations are the same functions on FakeTensors (the quantize
ops have fake kernels, NVFP4 quantizes fake tensors by its torch-op reference; the GEMM returns an
empty result for fake operands). A saved operand is its columnwise buffers, NVFP4's
amax_columnwise included; an x whose wgrad copy NVFP4's RHT padded to whole 16-token groups is
restored with the padded row count.

Ops may not write their inputs, so delayed scaling's amax recording comes back as
`records` (the amaxes this call saw) and is folded into the amax history with a max outside
the op (`Recipe.merge_records`): in the compiled forward graph for the forward slots, in the
compiled backward graph for grad_output. max is exact, so the history ends bit-identical
to eager. Stochastic rounding's counters (NVFP4's gradients) come back advanced and are copied
into the module's. The scale updates themselves run in `fp8_autocast` (outside the graphs).

An FP8 primary weight (a QuantizedTensor, which Dynamo takes apart by `__tensor_flatten__`) reaches
`engine::linear_fwd` below its autograd formula, where a torch_dispatch rule hands its buffers to
`engine::linear_fwd_stored`; dgrad reads the weight's own storage, as in eager, and its gradient is
a plain tensor.

Not supported under torch.compile (a clear error, not a silent fallback, raised by
`refuse_to_compile` so that its first line is engine's): `is_first_microbatch` weight caching,
`fuse_wgrad_accumulation` and states that say why not (`RecipeState.compile_refusal`: CustomRecipe's).
"""

from __future__ import annotations

import json
from typing import Any, Optional

import torch

from engine.modules.linear_function import GemmInput, LinearArgs, bprop, fprop
from engine.modules.op_state import counters_of, merge_counters, op_inputs, op_state, plan
from engine.recipes.debug_state import DEQUANTIZED
from engine.recipes.plain import recipe_for_key
from engine.schemes import get_scheme
from engine.tensors import QuantizedTensor, QuantizedTensorBase


def _saved_fields(scheme: str) -> tuple[str, ...]:
    """The fields of a columnwise-only storage of `scheme` that a backward GEMM reads: data, scale_inv and, with a
    tensor-level scale, amax_columnwise, in the scheme's order (a fake quantization's dequantized tensor: one)."""
    return ("dequantized",) if scheme == DEQUANTIZED else get_scheme(scheme).usage_fields(columnwise=True)


def _saved_buffers(operand: GemmInput | None, scheme: str | None) -> list[torch.Tensor]:
    """A quantized operand's columnwise buffers, a fake-quantized one's dequantized tensor; a high-precision one is
    saved from the op's inputs."""
    if scheme == DEQUANTIZED and isinstance(operand, torch.Tensor):
        return [operand]
    if operand is None or isinstance(operand, torch.Tensor):
        return []
    return [getattr(operand, f).contiguous() for f in _saved_fields(operand.scheme.name)]


def _restored(scheme: str | None, buffers: list[torch.Tensor], shape: tuple[int, int],
              dtype: torch.dtype) -> GemmInput | None:
    """What `_saved_buffers` (or, for a high-precision operand, the op's input) left: None if not needed."""
    if not buffers:
        return None
    if scheme is None or scheme == DEQUANTIZED:
        return buffers[0]
    return QuantizedTensorBase(scheme=get_scheme(scheme), shape=shape, nominal_dtype=dtype,
                               **dict(zip(_saved_fields(scheme), buffers)))


def _linear_fwd(
    inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], fwd_state: list[torch.Tensor],
    bwd_state: list[torch.Tensor], recipe: str, num_gemms: int, gemm: int, need_dgrad: bool, need_wgrad: bool,
) -> list[torch.Tensor]:
    """[out, *records, *counters, *saved x buffers, *saved W buffers] (bwd_state is passed for the backward
    only); `fwd_state` / `bwd_state` are the states' `op_inputs`."""
    state, records, counters = op_state(recipe, True, num_gemms, fwd_state)
    args = LinearArgs(fp8=True, fwd=state, gemm=gemm)
    out, x_wgrad, w_dgrad = fprop(inp, weight, bias, args, need_dgrad, need_wgrad)
    x_scheme, w_scheme = state.saved_schemes[gemm]
    return [out, *records, *counters, *_saved_buffers(x_wgrad, x_scheme), *_saved_buffers(w_dgrad, w_scheme)]


def _linear_bwd(
    dy: torch.Tensor, saved_x: list[torch.Tensor], saved_w: list[torch.Tensor], bwd_state: list[torch.Tensor],
    recipe: str, num_gemms: int, gemm: int, k: int, inp_dtype: torch.dtype, weight_dtype: torch.dtype,
    bias_dtype: Optional[torch.dtype], need_dgrad: bool, need_wgrad: bool, w_scheme: Optional[str] = None,
) -> list[torch.Tensor]:
    """[dx if need_dgrad, dW if need_wgrad, dbias if bias_dtype, *records, *counters] for dy [M, N]; `w_scheme`:
    the scheme of the saved W when it is not the recipe's (an FP8 primary weight's own)."""
    state, records, counters = op_state(recipe, False, num_gemms, bwd_state)
    p = plan(recipe, num_gemms, gemm)
    m, n = dy.shape
    # the x a forward saved for wgrad has m rows, or m padded up to the quantizer's multiple (NVFP4's RHT)
    x_rows = m if p.x_scheme is None else -(-m // p.x_rows) * p.x_rows
    x_wgrad = _restored(p.x_scheme, saved_x, (x_rows, k), inp_dtype)
    w_dgrad = _restored(w_scheme or p.w_scheme, saved_w, (n, k), weight_dtype)
    args = LinearArgs(fp8=True, bwd=state, gemm=gemm)
    dx, dw = bprop(dy, x_wgrad, w_dgrad, args, need_dgrad=need_dgrad, need_wgrad=need_wgrad,
                   inp_dtype=inp_dtype, weight_dtype=weight_dtype)
    dbias = None if bias_dtype is None else dy.sum(0).to(bias_dtype)  # here, so eager's reduction order
    return [t for t in (dx, dw, dbias) if t is not None] + records + counters


# the fake implementations are the same functions: on FakeTensors they only make shapes
linear_fwd = torch.library.custom_op("engine::linear_fwd", _linear_fwd, mutates_args=())
linear_fwd.register_fake(_linear_fwd)
linear_bwd = torch.library.custom_op("engine::linear_bwd", _linear_bwd, mutates_args=())
linear_bwd.register_fake(_linear_bwd)


def _setup_context(ctx: Any, inputs: tuple, output: list[torch.Tensor]) -> None:
    inp, weight, bias, fwd_state, bwd_state, recipe, num_gemms, gemm, need_dgrad, need_wgrad = inputs
    p = plan(recipe, num_gemms, gemm)
    primary = isinstance(weight, QuantizedTensor)  # an FP8 primary weight: dgrad reads its own storage
    w_scheme = weight.scheme.name if primary and p.w_scheme is not None else p.w_scheme
    saved = output[1 + p.fwd_records + p.fwd_counters:]
    n_x = len(_saved_fields(p.x_scheme)) if p.x_scheme is not None else 0
    saved_x = (saved[:n_x] if p.x_scheme is not None else [inp]) if need_wgrad else []
    if w_scheme is not None:
        saved_w = saved[len(saved) - len(_saved_fields(w_scheme)):]
    else:  # dgrad in high precision: the weight (an FP8 primary weight's value, as eager's fprop dequantizes it)
        saved_w = [weight.qstorage.dequantize() if primary else weight]
    saved_w = saved_w if need_dgrad else []
    ctx.save_for_backward(*saved_x, *saved_w)
    ctx.split = len(saved_x)
    ctx.state_grads = ([None] * len(fwd_state), [None] * len(bwd_state))  # the state lists get no gradient
    ctx.bwd_state = bwd_state  # written in backward (records merged), so not saved: no version check
    ctx.meta = (recipe, num_gemms, gemm, inp.shape[1], inp.dtype, weight.dtype, w_scheme, need_dgrad, need_wgrad)
    ctx.bias_dtype = None if bias is None or not ctx.needs_input_grad[2] else bias.dtype


def _backward(ctx: Any, grads: list[torch.Tensor | None]) -> tuple:
    recipe, num_gemms, gemm, k, inp_dtype, weight_dtype, w_scheme, need_dgrad, need_wgrad = ctx.meta
    dy = grads[0].contiguous()
    saved = list(ctx.saved_tensors)
    results = linear_bwd(dy, saved[:ctx.split], saved[ctx.split:], ctx.bwd_state, recipe, num_gemms, gemm, k,
                         inp_dtype, weight_dtype, ctx.bias_dtype, need_dgrad, need_wgrad, w_scheme)
    dx = results.pop(0) if need_dgrad else None
    dw = results.pop(0) if need_wgrad else None
    dbias = None if ctx.bias_dtype is None else results.pop(0)
    _merge(recipe, ctx.bwd_state, results, plan(recipe, num_gemms, gemm).bwd_counters)
    return dx, dw, dbias, *ctx.state_grads, None, None, None, None, None


linear_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------- FP8 primary weights
def _weight_spec(weight: QuantizedTensor) -> tuple[list[torch.Tensor], str]:
    """An FP8 primary weight as plain tensors (each buffer once) and a string the op rebuilds it from."""
    st = weight.qstorage
    buffers: list[torch.Tensor] = []
    fields: dict[str, int] = {}  # field -> index in buffers
    for name, t in st.buffers().items():
        if t is not None:
            if all(t is not b for b in buffers):
                buffers.append(t)
            fields[name] = next(i for i, b in enumerate(buffers) if b is t)
    spec = {"scheme": st.scheme.name, "shape": list(st.shape), "dtype": str(st.nominal_dtype), "fields": fields}
    return buffers, json.dumps(spec, sort_keys=True)


def _linear_fwd_stored(
    inp: torch.Tensor, weight_buffers: list[torch.Tensor], weight_spec: str, bias: Optional[torch.Tensor],
    fwd_state: list[torch.Tensor], bwd_state: list[torch.Tensor], recipe: str, num_gemms: int, gemm: int,
    need_dgrad: bool, need_wgrad: bool,
) -> list[torch.Tensor]:
    """`engine::linear_fwd` on an FP8 primary weight given as its buffers: the same outputs."""
    spec = json.loads(weight_spec)
    fields = {name: weight_buffers[i] for name, i in spec["fields"].items()}
    storage = QuantizedTensorBase.made(get_scheme(spec["scheme"]), torch.Size(spec["shape"]),
                                       getattr(torch, spec["dtype"].removeprefix("torch.")), None, fields)
    outputs = _linear_fwd(inp, QuantizedTensor.wrap(storage), bias, fwd_state, bwd_state, recipe, num_gemms, gemm,
                          need_dgrad, need_wgrad)
    own = {id(t) for t in weight_buffers}  # the weight's own columnwise buffers saved for dgrad: copies, as an op
    return [t.clone() if id(t) in own else t for t in outputs]  # returns no alias of its inputs


linear_fwd_stored = torch.library.custom_op("engine::linear_fwd_stored", _linear_fwd_stored, mutates_args=())
linear_fwd_stored.register_fake(_linear_fwd_stored)
OPS = (linear_fwd, linear_bwd, linear_fwd_stored)


def _fwd_on_primary_weight(cls: type, func: Any, types: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:  # noqa: ARG001
    """`engine::linear_fwd` reached with an FP8 primary weight (below its autograd formula, which saw the weight
    as it is): the op on the weight's buffers."""
    inp, weight, bias, *rest = args
    if not isinstance(weight, QuantizedTensor) or isinstance(inp, QuantizedTensor) or isinstance(bias, QuantizedTensor):
        raise TypeError(f"engine::linear_fwd: only the weight may be a quantized tensor, got input "
                        f"{type(inp).__name__}, weight {type(weight).__name__}, bias {type(bias).__name__}")
    buffers, spec = _weight_spec(weight)
    return linear_fwd_stored(inp, buffers, spec, bias, *rest)


for _cls in {QuantizedTensor, *QuantizedTensor._by_storage.values()}:  # the rule is looked up by exact type
    torch.library.register_torch_dispatch("engine::linear_fwd", _cls, _fwd_on_primary_weight)


def _merge(recipe: str, inputs: list[torch.Tensor], returned: list[torch.Tensor], n_counters: int) -> None:
    """Fold what an op returned (its scaling records, then its advanced counters) into the module's state
    tensors it read (`op_inputs`: scaling state, then counters)."""
    split = len(returned) - n_counters
    recipe_for_key(recipe).merge_records(inputs[:len(inputs) - n_counters], returned[:split])
    merge_counters(inputs[len(inputs) - n_counters:], returned[split:])


def refuse_to_compile(reason: str) -> bool:
    """Raise `reason` while Dynamo traces, as the first line of the error torch.compile shows.

    Dynamo runs this function eagerly while it traces (it is marked as torch.compiler.assume_constant_result
    marks), so the error leaves the tracer as it is: a `raise` in traced code would become Dynamo's
    "Observed exception" with the reason buried in its debug context, and without fullgraph=True a
    silent fallback to eager. Dynamo's UserError passes through unwrapped, in both modes.
    """
    from torch._dynamo.exc import UserError, UserErrorType

    raise UserError(UserErrorType.INVALID_INPUT, reason)


refuse_to_compile._dynamo_marked_constant = True  # type: ignore[attr-defined]  # see _states_while_tracing


def compiled_linear(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    args: LinearArgs) -> torch.Tensor:
    """What `linear()` runs under torch.compile: plain F.linear outside FP8, the ops inside."""
    if args.fuse_wgrad_accumulation:
        refuse_to_compile("torch.compile: fuse_wgrad_accumulation=True is not supported; "
                          "compile the model without it or run it eagerly")
    if not args.fp8:
        w = weight.dequantize() if isinstance(weight, QuantizedTensor) else weight
        return torch.nn.functional.linear(inp, w.to(inp.dtype), None if bias is None else bias.to(inp.dtype))
    if args.is_first_microbatch is not None:
        refuse_to_compile("torch.compile: is_first_microbatch weight caching is not supported; "
                          "pass is_first_microbatch=None")
    refusal = args.fwd.compile_refusal or (args.bwd is not None and args.bwd.compile_refusal)
    if refusal:
        refuse_to_compile(refusal)
    inp2d = inp.reshape(-1, inp.shape[-1])
    need_dgrad = args.grad_enabled and inp.requires_grad
    need_wgrad = args.grad_enabled and weight.requires_grad
    bwd_state = op_inputs(args.bwd) if args.bwd is not None else []
    outputs = linear_fwd(inp2d, weight, bias, op_inputs(args.fwd), bwd_state, args.fwd.key, args.fwd.num_gemms,
                         args.gemm, need_dgrad, need_wgrad)
    n_records, counters = args.fwd.op_records, counters_of(args.fwd)
    args.fwd.merge_records([r.detach() for r in outputs[1:1 + n_records]])
    merge_counters(counters, [c.detach() for c in outputs[1 + n_records:1 + n_records + len(counters)]])
    out = outputs[0]
    return out.view(*inp.shape[:-1], out.shape[-1])
