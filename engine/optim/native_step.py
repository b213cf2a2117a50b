"""The fused native step (csrc/optim/): one pass per parameter that decodes the states, updates, re-encodes
them and writes the fp32 weight, bit for bit `Adam.reference_step`. Which states and parameters it takes."""

from __future__ import annotations

import functools

import torch

from engine.ops import native
from engine.optim import dynamic_map, weights
from engine.optim.formats import StateFormat
from engine.optim.sharded import GLOBAL_NUMEL


def why_not(opt, group: dict, p: torch.Tensor, state: dict) -> str:  # noqa: ANN001
    """'' when the native kernel runs this step of one parameter (`adam`), else why not."""
    for name in opt.STATES:
        if opt.format_of(group, name).stochastic:
            return (f"{name}: the kernel rounds bf16 states stochastically in the call per parameter group, and "
                    "a tensor learning rate takes the call per parameter")
    return why_not_group(opt, group) or why_not_param(p, state)


def why_not_group(opt, group: dict) -> str:  # noqa: ANN001
    """'' when the kernel takes the group's state formats (and this build has it), else why not."""
    if not native.available():
        return f"the native kernels are not available ({native.why_unavailable()})"
    if not hasattr(native._ext(), "adam_step"):
        return "this build has no adam_step kernel"
    for name in opt.STATES:
        fmt = opt.format_of(group, name)
        if fmt.kind == "fp8" and not fmt.scheme.startswith("block1d"):
            return f"{name}: the kernel takes fp8 states in 1x128 blocks, got {fmt.scheme}"
    return ""


def why_not_param(p: torch.Tensor, state: dict) -> str:
    """'' when the kernel takes this parameter, its gradient and its states, else why not."""
    if not all(t.is_contiguous() for t in state.values() if isinstance(t, torch.Tensor)):
        return "the states are not contiguous"
    if not p.is_contiguous() or p.device.type != "cpu" or type(p.data) is not torch.Tensor and "master" not in state:
        return "the kernel takes contiguous plain CPU parameters (or an fp32 master)"
    if p.grad.dtype not in (torch.float32, torch.bfloat16) or not p.grad.is_contiguous() or p.grad.is_sparse:
        return f"grad: the kernel takes contiguous fp32 / bf16 gradients, got {p.grad.dtype}"
    return ""


def runs(opt, group: dict, p: torch.Tensor, state: dict) -> bool:  # noqa: ANN001
    return why_not(opt, group, p, state) == ""


@functools.cache
def int8_tables(signed: bool) -> torch.Tensor:
    """The kernel's int8 code-search tables of a map (csrc/optim/adam.h: Int8Map; built and proven once)."""
    if signed:
        return native._ext().adam_int8_tables(dynamic_map.signed_codes(), dynamic_map.midpoints(True))
    return native._ext().adam_int8_tables(dynamic_map.unsigned_codes(), dynamic_map.midpoints(False))


def kind_code(fmt: StateFormat) -> int:
    """The kernel's StateKind (csrc/optim/adam.h) of a format it takes."""
    if fmt.kind == "fp8":
        return 2 if fmt.scheme == "block1d_e4m3" else 3
    if fmt.stochastic:
        return 5
    return {"fp32": 0, "bf16": 1, "int8": 4}[fmt.kind]


def adam(opt, group: dict, p: torch.Tensor, state: dict, w: torch.Tensor, c: dict) -> None:  # noqa: ANN001
    """One fused step of `p` (w: its fp32 working value, updated in place; the states re-encoded in place)."""
    fm, fv = opt.format_of(group, "exp_avg"), opt.format_of(group, "exp_avg_sq")
    tables = (dynamic_map.signed_codes(), dynamic_map.midpoints(True), dynamic_map.unsigned_codes(),
              dynamic_map.midpoints(False))
    scalars = tuple(c[k] for k in ("beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "step_size",
                                   "inv_bc2_sqrt", "eps", "decay", "wd"))
    native.adam_step(w, p.grad, state["exp_avg"], state.get("exp_avg_scale"), kind_code(fm), state["exp_avg_sq"],
                     state.get("exp_avg_sq_scale"), kind_code(fv), fv.stores_sqrt(True), tables, scalars,
                     bool(group["maximize"]))


@torch.compiler.disable  # under torch.compile the compressed step runs eagerly (a graph break)
def adam_group(opt, group: dict, params: list[torch.Tensor]) -> list[torch.Tensor]:  # noqa: ANN001
    """One native call for every parameter of the group the kernel takes (their step counters advanced, the
    scalars computed from them in the kernel's glue as `Adam.scalars` does): returns the others, for the
    per-parameter path. A tensor learning rate is left to that path (its scalars are tensor arithmetic)."""
    if isinstance(group["lr"], torch.Tensor) or why_not_group(opt, group):
        return list(params)
    take, rest = [], []
    for p in params:
        (rest if why_not_param(p, opt.state[p]) else take).append(p)
    if not take:
        return rest
    fm, fv = opt.format_of(group, "exp_avg"), opt.format_of(group, "exp_avg_sq")
    states = [opt.state[p] for p in take]
    ws = [weights.working_value(p, s) for p, s in zip(take, states)]
    beta1, beta2 = group["betas"]
    native._ext().adam_step_group(
        ws, [p.grad for p in take], [s["exp_avg"] for s in states], [s.get("exp_avg_scale") for s in states],
        kind_code(fm), [s["exp_avg_sq"] for s in states], [s.get("exp_avg_sq_scale") for s in states], kind_code(fv),
        fv.stores_sqrt(True), [s["step"] for s in states], dynamic_map.signed_codes(), dynamic_map.midpoints(True),
        dynamic_map.unsigned_codes(), dynamic_map.midpoints(False), float(group["lr"]), float(beta1), float(beta2),
        float(group["eps"]), float(group["weight_decay"]), bool(opt.DECOUPLED), bool(group["maximize"]),
        # stochastic bf16 states: the random bits' counters, advanced by the whole tensor's count per such state
        [s.get("state_counter") for s in states], [int(s.get(GLOBAL_NUMEL, p.numel())) for p, s in zip(take, states)],
        int8_tables(True) if fm.kind == "int8" else None, int8_tables(False) if fv.kind == "int8" else None)
    for p, w, s in zip(take, ws, states):
        if not weights.in_place(p):
            weights.write_back(p, w, s)
    return rest
