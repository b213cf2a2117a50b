"""The quantized linear as two torch.library custom ops, for torch.compile.

Dynamo cannot trace the eager autograd function's insides (storages are Python objects, the
CPU GEMM reads its scale product on the host), so under torch.compile `linear()` calls

    engine::linear_fwd(inp [M, K], weight, bias, fwd_state, bwd_state, recipe, ...) -> [out, records, saved]
    engine::linear_bwd(dy [M, N], saved_x, saved_w, bwd_state, recipe, ...)       -> [dx, dw, records]

with an autograd formula (`register_autograd`) tying them together. Both run `fprop` /
`bprop`, the functions the eager `LinearFunction` runs, on a recipe state rebuilt from the
recipe's key and the module's state tensors, so the quantized bits are the same compiled
and eager. Their fake implementations are the same functions on FakeTensors (the quantize
ops have fake kernels; the GEMM returns an empty result for fake operands).

Ops may not write their inputs, so delayed scaling's amax recording comes back as
`records` (the amaxes this call saw) and is folded into the amax history with a max outside
the op (`Recipe.merge_records`): in the compiled forward graph for the forward slots, in the
compiled backward graph for grad_output. max is exact, so the history ends bit-identical
to eager. The scale updates themselves run in `fp8_autocast` (outside the graphs).

Not supported under torch.compile (a clear error, not a silent fallback, raised by
`refuse_to_compile` so that its first line is engine's): FP8 primary weights,
`is_first_microbatch` weight caching, `fuse_wgrad_accumulation`, NVFP4 recipes and states that
say why not (`RecipeState.compile_refusal`: CustomRecipe's).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Optional

import torch

from engine.modules.linear_function import GemmInput, LinearArgs, bprop, fprop
from engine.recipes.plain import recipe_for_key
from engine.tensors import QuantizedTensor, QuantizedTensorBase


@lru_cache(maxsize=256)
def _plan(recipe: str, num_gemms: int, gemm: int) -> tuple[tuple[str | None, str | None], int]:
    """(scheme names of the x and W a forward saves, records per forward op) for a recipe key."""
    state = recipe_for_key(recipe).make_state(forward=True, num_gemms=num_gemms)
    return state.saved_schemes[gemm], state.op_records


@lru_cache(maxsize=256)
def _stateless(recipe: str, forward: bool, num_gemms: int):
    """The state of a recipe without scaling state: the same quantizers for every call (made once)."""
    return recipe_for_key(recipe).make_state(forward=forward, num_gemms=num_gemms)


def _op_state(recipe: str, forward: bool, num_gemms: int, tensors: list[torch.Tensor]):
    """(state, records): one reading `tensors` and recording into fresh ones, or the cached stateless one."""
    if not tensors:
        return _stateless(recipe, forward, num_gemms), []
    return recipe_for_key(recipe).op_state(forward=forward, num_gemms=num_gemms, tensors=tensors)


def _saved_buffers(operand: GemmInput | None) -> list[torch.Tensor]:
    """A quantized operand's columnwise buffers; a high-precision one is saved from the op's inputs."""
    if operand is None or isinstance(operand, torch.Tensor):
        return []
    return [operand.columnwise_data.contiguous(), operand.columnwise_scale_inv.contiguous()]


def _restored(scheme: str | None, buffers: list[torch.Tensor], shape: tuple[int, int],
              dtype: torch.dtype) -> GemmInput | None:
    """What `_saved_buffers` (or, for a high-precision operand, the op's input) left: None if not needed."""
    if not buffers:
        return None
    if scheme is None:
        return buffers[0]
    from engine.schemes import get_scheme

    return QuantizedTensorBase(scheme=get_scheme(scheme), shape=shape, nominal_dtype=dtype,
                               columnwise_data=buffers[0], columnwise_scale_inv=buffers[1])


def _linear_fwd(
    inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], fwd_state: list[torch.Tensor],
    bwd_state: list[torch.Tensor], recipe: str, num_gemms: int, gemm: int, need_dgrad: bool, need_wgrad: bool,
) -> list[torch.Tensor]:
    """[out, *records, *saved x buffers, *saved W buffers] (bwd_state is passed for the backward only)."""
    state, records = _op_state(recipe, True, num_gemms, fwd_state)
    args = LinearArgs(fp8=True, fwd=state, gemm=gemm)
    out, x_wgrad, w_dgrad = fprop(inp, weight, bias, args, need_dgrad, need_wgrad)
    return [out, *records, *_saved_buffers(x_wgrad), *_saved_buffers(w_dgrad)]


def _linear_bwd(
    dy: torch.Tensor, saved_x: list[torch.Tensor], saved_w: list[torch.Tensor], bwd_state: list[torch.Tensor],
    recipe: str, num_gemms: int, gemm: int, k: int, inp_dtype: torch.dtype, weight_dtype: torch.dtype,
    bias_dtype: Optional[torch.dtype], need_dgrad: bool, need_wgrad: bool,
) -> list[torch.Tensor]:
    """[dx if need_dgrad, dW if need_wgrad, dbias if bias_dtype, *records] for dy [M, N]."""
    state, records = _op_state(recipe, False, num_gemms, bwd_state)
    (x_scheme, w_scheme), _ = _plan(recipe, num_gemms, gemm)
    m, n = dy.shape
    x_wgrad = _restored(x_scheme, saved_x, (m, k), inp_dtype)
    w_dgrad = _restored(w_scheme, saved_w, (n, k), weight_dtype)
    args = LinearArgs(fp8=True, bwd=state, gemm=gemm)
    dx, dw = bprop(dy, x_wgrad, w_dgrad, args, need_dgrad=need_dgrad, need_wgrad=need_wgrad,
                   inp_dtype=inp_dtype, weight_dtype=weight_dtype)
    dbias = None if bias_dtype is None else dy.sum(0).to(bias_dtype)  # here, so eager's reduction order
    return [t for t in (dx, dw, dbias) if t is not None] + records


# the fake implementations are the same functions: on FakeTensors they only make shapes
linear_fwd = torch.library.custom_op("engine::linear_fwd", _linear_fwd, mutates_args=())
linear_fwd.register_fake(_linear_fwd)
linear_bwd = torch.library.custom_op("engine::linear_bwd", _linear_bwd, mutates_args=())
linear_bwd.register_fake(_linear_bwd)
OPS = (linear_fwd, linear_bwd)


def _setup_context(ctx: Any, inputs: tuple, output: list[torch.Tensor]) -> None:
    inp, weight, bias, fwd_state, bwd_state, recipe, num_gemms, gemm, need_dgrad, need_wgrad = inputs
    (x_scheme, w_scheme), n_records = _plan(recipe, num_gemms, gemm)
    saved = output[1 + n_records:]
    saved_x = (saved[:2] if x_scheme is not None else [inp]) if need_wgrad else []
    saved_w = (saved[-2:] if w_scheme is not None else [weight]) if need_dgrad else []
    ctx.save_for_backward(*saved_x, *saved_w)
    ctx.split = len(saved_x)
    ctx.state_grads = ([None] * len(fwd_state), [None] * len(bwd_state))  # the state lists get no gradient
    ctx.bwd_state = bwd_state  # written in backward (records merged), so not saved: no version check
    ctx.meta = (recipe, num_gemms, gemm, inp.shape[1], inp.dtype, weight.dtype, need_dgrad, need_wgrad)
    ctx.bias_dtype = None if bias is None or not ctx.needs_input_grad[2] else bias.dtype


def _backward(ctx: Any, grads: list[torch.Tensor | None]) -> tuple:
    recipe, num_gemms, gemm, k, inp_dtype, weight_dtype, need_dgrad, need_wgrad = ctx.meta
    dy = grads[0].contiguous()
    saved = list(ctx.saved_tensors)
    results = linear_bwd(dy, saved[:ctx.split], saved[ctx.split:], ctx.bwd_state, recipe, num_gemms, gemm, k,
                         inp_dtype, weight_dtype, ctx.bias_dtype, need_dgrad, need_wgrad)
    dx = results.pop(0) if need_dgrad else None
    dw = results.pop(0) if need_wgrad else None
    dbias = None if ctx.bias_dtype is None else results.pop(0)
    recipe_for_key(recipe).merge_records(ctx.bwd_state, results)
    return dx, dw, dbias, *ctx.state_grads, None, None, None, None, None


linear_fwd.register_autograd(_backward, setup_context=_setup_context)


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
    if isinstance(weight, QuantizedTensor):
        refuse_to_compile("torch.compile: FP8 primary weights (fp8_model_init) are not supported yet; "
                          "use high-precision weights or run eagerly")
    if args.is_first_microbatch is not None:
        refuse_to_compile("torch.compile: is_first_microbatch weight caching is not supported; "
                          "pass is_first_microbatch=None")
    refusal = args.fwd.compile_refusal or (args.bwd is not None and args.bwd.compile_refusal)
    if refusal:
        refuse_to_compile(refusal)
    if args.fwd.nvfp4 or (args.bwd is not None and args.bwd.nvfp4):
        refuse_to_compile("torch.compile: NVFP4 recipes are not supported yet: run NVFP4 models eagerly (without "
                          "torch.compile), or compile under an FP8 or MX recipe (the compiled ops do not carry "
                          "NVFP4's per-tensor amaxes, and stochastic rounding's counter advances only in eager code)")
    inp2d = inp.reshape(-1, inp.shape[-1])
    need_dgrad = args.grad_enabled and inp.requires_grad
    need_wgrad = args.grad_enabled and weight.requires_grad
    fwd_state = args.fwd.op_tensors()
    bwd_state = args.bwd.op_tensors() if args.bwd is not None else []
    outputs = linear_fwd(inp2d, weight, bias, fwd_state, bwd_state, args.fwd.key, args.fwd.num_gemms,
                         args.gemm, need_dgrad, need_wgrad)
    records = outputs[1:1 + args.fwd.op_records]
    args.fwd.merge_records([r.detach() for r in records])
    out = outputs[0]
    return out.view(*inp.shape[:-1], out.shape[-1])
