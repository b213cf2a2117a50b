"""The steady-state plan of a linear layer's step: its quantize and GEMM kernels resolved once, called directly.

`LinearFunction` asks, for every operand of every step, which quantizer applies, which usages
it makes, which GEMM pairs the two sides and how each side's buffers are read. For a layer
whose recipe, shapes, dtypes and flags do not change, those answers do not change either: a
`LinearPlan` holds them, resolved at the second call alike per (args, shapes, dtypes, flags) and
cached on the layer's `LinearArgs` (which the module keeps while nothing they hold changes).
`PlannedLinear` then runs the same kernels on the same buffers as `LinearFunction` - one quantize
call per tensor (both usages at once, scale state read and recorded in the kernel), one exact GEMM
call per GEMM (a tile wider than K passed as K wide: the same scales) - so its results are
bit-identical (tests/test_linear_plan.py); only the Python between the kernels is gone.

A plan exists only for the common case: an eager CPU step on plain tensors, per-tensor FP8
(delayed and current scaling) or power-of-2 tile scales (block scaling, MXFP8, rowwise), each tensor's
two uses sharing one built-in quantizer that is one kernel call. Everything else - FP8 primary
weights, weight caching across micro-batches, fused wgrad accumulation, FP32 tile scales,
NVFP4 / MXFP4, Debug and custom quantizers, forced non-native backends - returns no plan and
runs `LinearFunction` (dispatch.py has already sent DTensors, torch.compile and the inspector
their own ways).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from engine import memory
from engine.formats import FP8_DTYPES
from engine.gemm.cpu import _per_tensor_rescaled
from engine.gemm.operand import GemmOperand
from engine.modules.linear_function import LinearArgs, torch_autocast_on, unviewed
from engine.ops import backend as ops_backend
from engine.ops import native, registry
from engine.ops import reference as ref
from engine.quantizers.base import Quantizer
from engine.recipes import RecipeState, Role
from engine.recipes.debug_state import DebugState
from engine.schemes import ScaleEncoding, Scheme

PLAIN = (torch.nn.Parameter, torch.Tensor)  # a weight's exact types the plan takes (not FP8 primary weights)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SEEN_ONCE = "seen once"  # a key's first call: the general path runs, the plan is built at its second
#: at most this many plans per LinearArgs (a layer that sees many token counts plans each; older ones are dropped)
MAX_PLANS = 8

#: the quantize a plan stands for (as defined here, not as replaced later: a replaced one runs as it is)
BUILT_IN_QUANTIZE, BUILT_IN_CHECKED_BUFFERS = Quantizer.quantize_storage, Quantizer._checked_buffers


@dataclass(frozen=True)
class UsePlan:
    """How a GEMM reads one usage of a quantized [rows, K] tensor: its data and scale_inv as stored, or both
    transposed (columnwise data kept in x's layout: MXFP8), with one scale per `tile` ((0, 0): per tensor)."""

    transposed_view: bool
    tile: tuple[int, int]
    encoding: ScaleEncoding

    @property
    def per_tensor(self) -> bool:
        return self.tile == (0, 0)


Usage = tuple[torch.Tensor, torch.Tensor]  # (data, scale_inv) as a GEMM reads them
#: a direct kernel call: (t, rowwise, columnwise, the rule's kernel_args) -> (row data, row scale_inv, col data,
#: col scale_inv)
DirectCall = Callable[[torch.Tensor, bool, bool, dict], tuple]


def direct_call(scheme: Scheme, kernel: Callable[..., Any], numel: int) -> DirectCall | None:
    """The C++ call the registry's quantize `kernel` makes for this scheme, without its Python layers (argument
    checks done once here, output-buffer reuse that only tensors of `memory.REUSED_OUTPUT_MIN_BYTES` get):
    same arguments, same bits. None where the kernel is not the native one of these three layouts."""
    if not (isinstance(kernel, functools.partial) and kernel.args == (native,) and not kernel.keywords) \
            or numel >= memory.REUSED_OUTPUT_MIN_BYTES or scheme.element not in native._FP8_KIND:
        return None
    ext, kind, pow2 = native._ext(), native._FP8_KIND[scheme.element], scheme.scale.is_pow2
    if kernel.func is registry.quantize_per_tensor_fused:
        def per_tensor(t: torch.Tensor, rowwise: bool, columnwise: bool, kw: dict) -> tuple:
            data, data_t, scale_inv, _ = ext.quantize_per_tensor(
                t, kind, rowwise, columnwise, kw["scale"], pow2, kw["amax_epsilon"], kw.get("record_amax"),
                None, None, None, None)
            return data, scale_inv, data_t, scale_inv

        return per_tensor
    if kernel.func is registry.quantize_per_tile:
        tile_rows, tile_cols = scheme.rowwise_block.rows, scheme.rowwise_block.cols

        def per_tile(t: torch.Tensor, rowwise: bool, columnwise: bool, kw: dict) -> tuple:
            return ext.quantize_block_usages(t, kind, tile_rows, tile_cols, pow2, float(kw["amax_epsilon"]),
                                             ref.block_value_for_inf(t.dtype), rowwise, columnwise, None, None)

        return per_tile
    if kernel.func is registry.quantize_mx and not scheme.coded:
        def mx(t: torch.Tensor, rowwise: bool, columnwise: bool, kw: dict) -> tuple:
            return ext.quantize_mxfp8_usages(t, kind, kw["scale_mode"] == "rceil", rowwise, columnwise, None, None)

        return mx
    return None


@dataclass(frozen=True)
class TensorPlan:
    """One tensor's quantization for its GEMM uses: one kernel call making the usages wanted."""

    quantizer: Quantizer
    kernel: Callable[..., Any]  # the registry's quantize kernel
    direct: DirectCall | None  # the same call without the Python layers, where there is one
    rowwise: UsePlan | None
    columnwise: UsePlan | None

    def quantize(self, t: torch.Tensor) -> tuple[Usage | None, Usage | None]:
        """t (2D) quantized: (rowwise (data, scale_inv), columnwise (data, scale_inv)) as the GEMMs read them."""
        q, rowwise, columnwise = self.quantizer, self.rowwise is not None, self.columnwise is not None
        if self.direct is not None:
            data, scale_inv, data_t, scale_inv_t = self.direct(t, rowwise, columnwise, q.rule.kernel_args())
        else:
            buffers = self.kernel(t, q.scheme, rowwise=rowwise, columnwise=columnwise, **q.rule.kernel_args())[0]
            data, scale_inv = buffers["rowwise_data"], buffers["rowwise_scale_inv"]
            data_t, scale_inv_t = buffers["columnwise_data"], buffers["columnwise_scale_inv"]
        row = (data, scale_inv) if rowwise else None
        col = None
        if columnwise:
            col = (data_t.t(), scale_inv_t.t()) if self.columnwise.transposed_view else (data_t, scale_inv_t)
        return row, col


def use_plan(scheme: Scheme, columnwise: bool, rows: int, k: int) -> UsePlan | None:
    """How `engine.gemm.operand.gemm_operand` reads this usage of a 2D [rows, K] tensor, if the exact GEMM
    takes it (per-tensor FP8, or power-of-2 tile scales); None for anything else."""
    if scheme.per_tensor_fp8_usages[columnwise]:
        return UsePlan(False, (0, 0), scheme.scale)
    if scheme.tensor_scale or scheme.coded or scheme.element not in FP8_DTYPES or scheme.zero_point \
            or scheme.columnwise_transform is not None:
        return None
    block = scheme.stored_block(columnwise)
    view_t = columnwise and not scheme.columnwise_transposed
    if view_t:
        block = block.transposed()
    if block.is_tensor:
        return UsePlan(view_t, (0, 0), scheme.scale)
    if not scheme.scale.is_pow2:  # fp32 tile scales: per-K-block GEMM (engine.gemm.cpu.fp32_tiles)
        return None
    # the operand GEMM reads is [rows, K] whatever the storage: tiles resolve 0 against it
    op_rows, op_k = (k, rows) if columnwise else (rows, k)
    tile_rows, tile_cols = block.tile(op_rows, op_k)
    # a tile wider than K is one scale per row either way; as K wide it takes the decode's whole-tile path (a wgrad
    # over 16 tokens: 7-11 us less per GEMM), same scales, same bits
    return UsePlan(view_t, (max(tile_rows, 1), max(min(tile_cols, op_k), 1)), scheme.scale)


def tensor_plan(state: RecipeState, role: Role, gemm: int, shape: tuple[int, int], rowwise: bool,
                columnwise: bool, forced: str | None) -> TensorPlan | None:
    """The plan of one tensor (x, W or dy, 2D `shape`), or None when its quantization is not one plain call."""
    q_row, q_col = state.uses(role, gemm)
    if q_row is None or q_row is not q_col:
        return None
    kind = type(q_row)
    if kind.quantize_storage is not BUILT_IN_QUANTIZE or kind._checked_buffers is not BUILT_IN_CHECKED_BUFFERS:
        return None  # a quantizer with a quantize of its own (a custom recipe's, a wrapper's): its own path
    if q_row.rule.kernel_args() is None:
        return None
    scheme = q_row.scheme
    rows, k = shape
    row = use_plan(scheme, False, rows, k) if rowwise else None
    col = use_plan(scheme, True, rows, k) if columnwise else None
    if (rowwise and row is None) or (columnwise and col is None):
        return None
    kernel = registry.kernel_for("quantize", scheme.layout, "cpu", forced)
    return TensorPlan(q_row, kernel, direct_call(scheme, kernel, rows * k), row, col)


def pairs(a: UsePlan, b: UsePlan) -> bool:
    """The exact GEMM takes this pair as `general_gemm` would send it there: both per tensor, or both
    power-of-2 tiles with the same K tiles and at most one 2D side (else `general_gemm` decides, or raises)."""
    if a.per_tensor or b.per_tensor:
        return a.per_tensor and b.per_tensor
    return a.tile[1] == b.tile[1] and (a.tile[0] == 1 or b.tile[0] == 1)


@dataclass(frozen=True)
class LinearPlan:
    """Everything one step's kernels need besides the tensors."""

    x: TensorPlan
    w: TensorPlan
    dy: TensorPlan | None  # None: no backward
    need_dgrad: bool
    need_wgrad: bool
    bf16_gemm: bool  # the exact GEMM may run torch's bf16 GEMM for a bf16 output (native bf16 here)
    gemm: Callable[..., torch.Tensor | None]  # the C++ exact GEMM

    def run_gemm(self, a: tuple, a_use: UsePlan, b: tuple, b_use: UsePlan, bias: torch.Tensor | None,
                 out_dtype: torch.dtype) -> torch.Tensor:
        """`general_gemm(a, b, out_dtype=..., bias=...)` on operands as `TensorPlan.quantize` gives them."""
        (a_data, a_scale), (b_data, b_scale) = a, b
        ta, tb = a_use.tile, b_use.tile
        out = self.gemm(a_data, a_scale, ta[0], ta[1], b_data, b_scale, tb[0], tb[1], bias, out_dtype,
                        self.bf16_gemm and out_dtype == torch.bfloat16)
        if out is None:  # per-tensor scales whose product is not a normal fp32 number
            out = _per_tensor_rescaled(GemmOperand(a_data, a_scale, True, a_use.encoding),
                                       GemmOperand(b_data, b_scale, True, b_use.encoding), out_dtype, bias)
        return out


def build_plan(args: LinearArgs, m: int, k: int, n: int, need_dgrad: bool, need_wgrad: bool,
               forced: str | None) -> LinearPlan | None:
    """The plan of this step, or None where `LinearFunction` must run."""
    fwd, bwd, g = args.fwd, args.bwd, args.gemm
    if isinstance(fwd, DebugState) or isinstance(bwd, DebugState) or fwd is None:
        return None
    if forced not in (None, "native") or not native.available():
        return None
    x = tensor_plan(fwd, Role.INPUT, g, (m, k), True, need_wgrad, forced)
    w = tensor_plan(fwd, Role.WEIGHT, g, (n, k), True, need_dgrad, forced)
    if x is None or w is None or not pairs(x.rowwise, w.rowwise):
        return None
    dy = None
    if need_dgrad or need_wgrad:
        if bwd is None:
            return None
        dy = tensor_plan(bwd, Role.GRAD_OUTPUT, g, (m, n), need_dgrad, need_wgrad, forced)
        if dy is None or (need_dgrad and not pairs(dy.rowwise, w.columnwise)) \
                or (need_wgrad and not pairs(dy.columnwise, x.columnwise)):
            return None
    from engine.ops.exact_gemm import native_bf16_gemm

    return LinearPlan(x, w, dy, need_dgrad, need_wgrad, native_bf16_gemm(), native._ext().exact_gemm)


def plan_for(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, args: LinearArgs) -> LinearPlan | None:
    """The cached plan of this call (built at the second call alike), or None where `LinearFunction` runs."""
    if not args.fp8 or args.is_first_microbatch is not None or args.fuse_wgrad_accumulation:
        return None
    if type(weight) not in PLAIN or weight.dim() != 2 or not (inp.is_cpu and weight.is_cpu) \
            or weight.dtype not in FLOAT_DTYPES:
        return None
    need_dgrad = args.grad_enabled and inp.requires_grad
    need_wgrad = args.grad_enabled and weight.requires_grad
    forced = ops_backend.forced_backend()
    key = (inp.shape, inp.dtype, weight.shape, weight.dtype, None if bias is None else bias.dtype, need_dgrad,
           need_wgrad, forced)
    plans = args.__dict__.setdefault("_plans", {})
    found = plans.get(key, False)
    if found is SEEN_ONCE:  # the second call alike: a steady state, worth the plan (~0.1 ms to build)
        if torch._C._current_graph_task_id() != -1:
            # inside a backward: a recompute (torch.utils.checkpoint) of a forward that ran the general path must run
            # it again, saving the same tensors
            return None
        k = inp.shape[-1]
        found = plans[key] = build_plan(args, inp.numel() // k if k else 0, k, weight.shape[0], need_dgrad,
                                        need_wgrad, forced) if inp.numel() else None
    elif found is False:  # a first call (args made afresh per call, as a checkpointed delayed forward's, stay here)
        if len(plans) >= MAX_PLANS:
            plans.clear()
        plans[key] = SEEN_ONCE
        return None
    return found


class PlannedLinear(torch.autograd.Function):
    """`LinearFunction`'s FP8 step on a plan: the same kernels with the same arguments, bit for bit."""

    @staticmethod
    def forward(ctx: Any, inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                plan: LinearPlan) -> torch.Tensor:
        inp2d = inp if inp.dim() == 2 else inp.reshape(-1, inp.shape[-1])
        x_row, x_col = plan.x.quantize(inp2d)
        w_row, w_col = plan.w.quantize(weight)
        bias_dtype = None if bias is None else bias.dtype
        if bias is not None and bias_dtype != inp.dtype:
            bias = bias.to(inp.dtype)
        out = plan.run_gemm(x_row, plan.x.rowwise, w_row, plan.w.rowwise, bias, inp.dtype)
        if out.dtype != inp.dtype:
            out = out.to(inp.dtype)
        ctx.meta = (plan, inp.shape, inp.dtype, weight.dtype, bias_dtype)
        ctx.save_for_backward(*(x_col or ()), *(w_col or ()))
        return unviewed(out, (*inp.shape[:-1], out.shape[-1]))

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch_autocast_on(grad_out.device.type):  # backward inside torch.autocast: compute as forward did
            with torch.autocast(grad_out.device.type, enabled=False):
                return PlannedLinear._backward(ctx, grad_out)
        return PlannedLinear._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan, inp_shape, inp_dtype, weight_dtype, bias_dtype = ctx.meta
        dy2d = grad_out if grad_out.dim() == 2 else grad_out.reshape(-1, grad_out.shape[-1])
        dy = dy2d.contiguous()
        saved = ctx.saved_tensors
        x_col = saved[:2] if plan.need_wgrad else None
        w_col = saved[-2:] if plan.need_dgrad else None
        need_dgrad = ctx.needs_input_grad[0] and plan.need_dgrad
        need_wgrad = ctx.needs_input_grad[1] and plan.need_wgrad
        dx = dw = None
        if plan.dy is not None:
            dy_row, dy_col = plan.dy.quantize(dy)
            if need_dgrad:
                dx = plan.run_gemm(dy_row, plan.dy.rowwise, w_col, plan.w.columnwise, None, inp_dtype)
                if dx.dtype != inp_dtype:
                    dx = dx.to(inp_dtype)
                if dx.shape != inp_shape:
                    dx = dx.view(inp_shape)
            if need_wgrad:
                dw = plan.run_gemm(dy_col, plan.dy.columnwise, x_col, plan.x.columnwise, None, inp_dtype)
                if dw.dtype != weight_dtype:
                    dw = dw.to(weight_dtype)
        dbias = dy2d.sum(0).to(bias_dtype) if bias_dtype is not None and ctx.needs_input_grad[2] else None
        return dx, dw, dbias, None
