"""engine.optim.Adam / AdamW with fp32, bf16, FP8 or 8-bit states (`state_dtype`) and master-weight modes.

With every state fp32 the step is torch.optim's, bit for bit: the single-tensor / foreach formula (`foreach`,
the default) or torch's fused CPU kernel (`fused=True`). With a compressed state the step is `reference_step`:
plain fp32 operations, each rounded once, that the native fused kernel repeats bit for bit:

    g = -g (maximize); Adam: g = g + w*wd
    m = m*b1 + g*(1-b1);  v = v*b2 + (g*g)*(1-b2)          (m, v decoded from their formats)
    store m, v (v as sqrt(v) in the FP8 / int8 formats), and read back mq, sq = sqrt(vq) as stored
    AdamW: w = w * (1 - lr*wd)
    w = w - (mq * (lr/bc1)) / (sq * (1/sqrt(bc2)) + eps)      (a NaN as 0x7FC00000, as fp32 / bf16 states)

sqrt is the correctly rounded one (`formats.sqrt_rn`: torch's CPU sqrt may be an ulp off).

The update uses the states as stored, so one step's update differs from the fp32 update of the same prior
states only by the rounding of m and sqrt(v) to their formats (docs/optim.md states the bound).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from engine.optim import formats, native_step, weights
from engine.optim.base import LowPrecisionOptimizer, StateDtype


class Adam(LowPrecisionOptimizer):
    """torch.optim.Adam's interface plus `state_dtype` (one format, or {"exp_avg": ..., "exp_avg_sq": ...})
    and `weights` (master | kahan | stochastic: how non-fp32 parameters take the update)."""

    STATES = ("exp_avg", "exp_avg_sq")
    SECOND_MOMENTS = ("exp_avg_sq",)
    DECOUPLED = False

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, amsgrad: bool = False, maximize: bool = False,
                 foreach: bool | None = None, fused: bool | None = None, state_dtype: StateDtype = "fp32",
                 weights: str = "master", seed: int = 0) -> None:
        for what, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{what}: expected a number >= 0, got {value!r}")
        if not (len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"betas: expected two numbers in [0, 1), got {betas!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                                      maximize=maximize, foreach=foreach, fused=fused, state_dtype=state_dtype,
                                      weights=weights, seed=seed))
        for group in self.param_groups:
            if group["amsgrad"] and not self.all_fp32(group):
                raise ValueError(f"amsgrad: supported with fp32 states only, got state_dtype={group['state_dtype']}")

    def init_states(self, p: torch.Tensor, state: dict, group: dict, index: int) -> None:
        super().init_states(p, state, group, index)
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32)

    def step_group(self, group: dict, params: list[torch.Tensor]) -> None:
        if self.all_fp32(group):
            self._torch_step(group, params)
            return
        if group["fused"]:  # one native call for the parameters the kernel takes
            params = native_step.adam_group(self, group, params)
        for p in params:
            self._compressed_step(group, p)

    # ------------------------------------------------------------------------------ fp32: torch's step
    def _torch_step(self, group: dict, params: list[torch.Tensor]) -> None:
        if not params:
            return
        states = [self.state[p] for p in params]
        ws = [weights.working_value(p, s) for p, s in zip(params, states)]
        grads = [p.grad.float() if p.grad.dtype != torch.float32 else p.grad for p in params]
        ms, vs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        maxes = [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else []
        steps = [s["step"] for s in states]
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        if group["fused"]:
            torch._foreach_add_(steps, 1)
            fused = torch._fused_adamw_ if self.DECOUPLED else torch._fused_adam_
            fused(ws, grads, ms, vs, maxes, steps, amsgrad=group["amsgrad"], lr=lr, beta1=beta1, beta2=beta2,
                  weight_decay=wd, eps=eps, maximize=group["maximize"], grad_scale=None, found_inf=None)
        else:
            for j, (w, g, m, v, step) in enumerate(zip(ws, grads, ms, vs, steps)):
                step += 1
                g = -g if group["maximize"] else g
                if wd != 0:
                    if self.DECOUPLED:
                        w.mul_(1 - lr * wd)
                    else:
                        g = g.add(w, alpha=wd)
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                t = step.item()
                step_size = lr / (1 - beta1 ** t)
                bc2_sqrt = (1 - beta2 ** t) ** 0.5
                if group["amsgrad"]:
                    torch.maximum(maxes[j], v, out=maxes[j])
                    denom = (maxes[j].sqrt() / bc2_sqrt).add_(eps)
                else:
                    denom = (v.sqrt() / bc2_sqrt).add_(eps)
                w.addcdiv_(m, denom, value=-step_size)
        for p, w, s in zip(params, ws, states):
            weights.write_back(p, w, s)

    # ------------------------------------------------------------------------------ compressed states
    def scalars(self, group: dict, step: float) -> dict[str, float]:
        """The step's scalars, computed in double as torch does (each op then rounds them to fp32)."""
        beta1, beta2 = group["betas"]
        lr, wd = group["lr"], group["weight_decay"]
        return dict(beta1=beta1, one_minus_beta1=1 - beta1, beta2=beta2, one_minus_beta2=1 - beta2,
                    step_size=lr / (1 - beta1 ** step), inv_bc2_sqrt=1 / math.sqrt(1 - beta2 ** step),
                    eps=group["eps"], decay=1 - lr * wd if self.DECOUPLED else 1.0,
                    wd=0.0 if self.DECOUPLED else wd)

    @torch.compiler.disable  # under torch.compile the compressed step runs eagerly (a graph break)
    def _compressed_step(self, group: dict, p: torch.Tensor) -> None:
        state = self.state[p]
        state["step"] += 1
        c = self.scalars(group, state["step"].item())
        w = weights.working_value(p, state)
        g = p.grad
        if group["fused"] and native_step.runs(self, group, p, state):
            native_step.adam(self, group, p, state, w, c)
        else:
            if group["fused"]:
                self.warn_fallback(native_step.why_not(self, group, p, state))
            self.reference_step(group, state, w, g, c, maximize=group["maximize"])
        weights.write_back(p, w, state)

    def reference_step(self, group: dict, state: dict, w: torch.Tensor, grad: torch.Tensor, c: dict[str, float],
                       *, maximize: bool) -> None:
        """The compressed-state step in plain fp32 torch ops (the spec of the native kernel): `w` in place."""
        g = grad.float()
        g = -g if maximize else g
        if c["wd"] != 0:
            g = g + w * c["wd"]
        m = self.load(state, group, "exp_avg") * c["beta1"] + g * c["one_minus_beta1"]
        v = self.load(state, group, "exp_avg_sq") * c["beta2"] + (g * g) * c["one_minus_beta2"]
        counter = state.get("state_counter")
        self.store(state, group, "exp_avg", m, counter)
        self.store(state, group, "exp_avg_sq", v, counter)
        mq = self.load(state, group, "exp_avg")
        sq = self.stored_root(state, group, "exp_avg_sq")
        if c["decay"] != 1.0:
            w.mul_(c["decay"])
        w.sub_((mq * c["step_size"]) / (sq * c["inv_bc2_sqrt"] + c["eps"]))
        w.copy_(formats.canonical_nan(w))


class AdamW(Adam):
    """torch.optim.AdamW's interface (decoupled weight decay, default 1e-2) plus `state_dtype` and `weights`."""

    DECOUPLED = True

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, **kwargs) -> None:  # noqa: ANN003
        super().__init__(params, lr, betas, eps, weight_decay, **kwargs)
