"""The fused native step (csrc/optim/): one pass per parameter that decodes the states, updates, re-encodes
them and writes the fp32 weight, bit for bit `Adam.reference_step`. Which states and parameters it takes."""

from __future__ import annotations

import torch

from engine.ops import native
from engine.optim import dynamic_map
from engine.optim.formats import StateFormat


def why_not(opt, group: dict, p: torch.Tensor, state: dict) -> str:  # noqa: ANN001
    """'' when the native kernel runs this step, else why not."""
    if not native.available():
        return f"the native kernels are not available ({native.why_unavailable()})"
    if not hasattr(native._ext(), "adam_step"):
        return "this build has no adam_step kernel"
    for name in opt.STATES:
        fmt = opt.format_of(group, name)
        if fmt.kind == "fp8" and not fmt.scheme.startswith("block1d"):
            return f"{name}: the kernel takes fp8 states in 1x128 blocks, got {fmt.scheme}"
        if fmt.stochastic:
            return f"{name}: the kernel does not round bf16 states stochastically"
    if not all(t.is_contiguous() for t in state.values() if isinstance(t, torch.Tensor)):
        return "the states are not contiguous"
    if not p.is_contiguous() or p.device.type != "cpu" or type(p.data) is not torch.Tensor and "master" not in state:
        return "the kernel takes contiguous plain CPU parameters (or an fp32 master)"
    if p.grad.dtype not in (torch.float32, torch.bfloat16) or not p.grad.is_contiguous() or p.grad.is_sparse:
        return f"grad: the kernel takes contiguous fp32 / bf16 gradients, got {p.grad.dtype}"
    return ""


def runs(opt, group: dict, p: torch.Tensor, state: dict) -> bool:  # noqa: ANN001
    return why_not(opt, group, p, state) == ""


def kind_code(fmt: StateFormat) -> int:
    """The kernel's StateKind (csrc/optim/adam.h) of a format it takes."""
    if fmt.kind == "fp8":
        return 2 if fmt.scheme == "block1d_e4m3" else 3
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
