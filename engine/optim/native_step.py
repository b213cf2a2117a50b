"""The fused native step (csrc/optim/): one pass per parameter that decodes the states, updates, re-encodes
them and writes the fp32 weight, bit for bit `Adam.reference_step`. Which states and parameters it takes."""

from __future__ import annotations

import torch

from engine.ops import native


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
    if p.grad.dtype not in (torch.float32, torch.bfloat16) or not p.grad.is_contiguous():
        return f"grad: the kernel takes contiguous fp32 / bf16 gradients, got {p.grad.dtype}"
    return ""


def runs(opt, group: dict, p: torch.Tensor, state: dict) -> bool:  # noqa: ANN001
    return why_not(opt, group, p, state) == ""


def adam(opt, group: dict, p: torch.Tensor, state: dict, w: torch.Tensor, c: dict) -> None:  # noqa: ANN001
    raise NotImplementedError
