"""engine.optim.SGD (momentum) with the momentum buffer in any state format, and master-weight modes.

fp32 buffer: torch.optim.SGD's step bit for bit (single-tensor / foreach, or torch's fused kernel with
`fused=True`). A compressed buffer: plain fp32 operations on the buffer as stored:

    g = -g (maximize); g = g + w*wd
    b = g on the first step, else b*momentum + g*(1-dampening);  store b, read back bq
    d = g + bq*momentum (nesterov) or bq;  w = w - d*lr
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.optim import weights
from engine.optim.base import LowPrecisionOptimizer, StateDtype


class SGD(LowPrecisionOptimizer):
    """torch.optim.SGD's interface (momentum > 0 keeps a `momentum_buffer`) plus `state_dtype` and `weights`."""

    STATES = ("momentum_buffer",)

    def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, fused: bool | None = None, state_dtype: StateDtype = "fp32",
                 weights: str = "master", seed: int = 0) -> None:
        for what, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{what}: expected a number >= 0, got {value!r}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov: needs momentum > 0 and dampening 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov, maximize=maximize, foreach=foreach, fused=fused,
                                      state_dtype=state_dtype, weights=weights, seed=seed))

    def init_states(self, p: torch.Tensor, state: dict, group: dict, index: int) -> None:
        """The buffer appears at the first step (torch's: a copy of that step's gradient)."""
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        if self.format_of(group, "momentum_buffer").stochastic:
            state["state_counter"] = torch.tensor([group["seed"] * 65537 + index, 0], dtype=torch.int64)
        weights.init_state(p, group["weights"], state, seed=group["seed"] * 65537 + index + (1 << 20))

    def step_group(self, group: dict, params: list[torch.Tensor]) -> None:
        if group["fused"] and self.all_fp32(group) and params:
            self._fused_step(group, params)
            return
        for p in params:
            state = self.state[p]
            w = weights.working_value(p, state)
            self._one(group, state, w, p.grad)
            state["step"] += 1
            weights.write_back(p, w, state)

    def _fused_step(self, group: dict, params: list[torch.Tensor]) -> None:
        states = [self.state[p] for p in params]
        ws = [weights.working_value(p, s) for p, s in zip(params, states)]
        momentum = group["momentum"]
        first = momentum != 0 and "momentum_buffer" not in states[0]
        bufs = []
        if momentum != 0:
            for w, s in zip(ws, states):
                s.setdefault("momentum_buffer", torch.empty_like(w))
                bufs.append(s["momentum_buffer"])
        torch._fused_sgd_(ws, [p.grad.float() for p in params], bufs, weight_decay=group["weight_decay"],
                          momentum=momentum, lr=group["lr"], dampening=group["dampening"],
                          nesterov=group["nesterov"], maximize=group["maximize"], is_first_step=first)
        for p, w, s in zip(params, ws, states):
            s["step"] += 1
            weights.write_back(p, w, s)

    @torch.compiler.disable  # under torch.compile the step runs eagerly (a graph break)
    def _one(self, group: dict, state: dict, w: torch.Tensor, grad: torch.Tensor) -> None:
        fp32 = self.all_fp32(group)
        g = grad.float()
        g = -g if group["maximize"] else g
        wd, momentum, lr = group["weight_decay"], group["momentum"], group["lr"]
        if wd != 0:
            g = g.add(w, alpha=wd) if fp32 else g + w * wd
        if momentum != 0:
            first = "momentum_buffer" not in state
            if fp32:  # torch's
                if first:
                    state["momentum_buffer"] = g.clone()
                else:
                    state["momentum_buffer"].mul_(momentum).add_(g, alpha=1 - group["dampening"])
                buf = state["momentum_buffer"]
            else:
                b = g if first else self.load(state, group, "momentum_buffer") * momentum + g * (1 - group["dampening"])
                self.store(state, group, "momentum_buffer", b, state.get("state_counter"))
                buf = self.load(state, group, "momentum_buffer")
            if group["nesterov"]:
                g = g.add(buf, alpha=momentum) if fp32 else g + buf * momentum
            else:
                g = buf
        if fp32:
            w.add_(g, alpha=-lr)
        else:
            w.sub_(g * lr)
