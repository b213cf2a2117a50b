"""MoEMLP: a mixture-of-experts MLP block, `y = sum over the top-k experts e of p_e(x) * fc2_e(act(fc1_e(x)))`.

The router is a torch.nn.Linear in fp32 (high precision, as Transformer Engine and Megatron keep it); its softmax
picks `top_k` experts per token (probabilities renormalised over them if `normalize_top_k`). Tokens are permuted into
rows grouped by expert (`engine.moe.permute`, an expert keeping at most capacity_factor * T * k / E rows when
`capacity_factor` is set), run through the experts' fc1, the activation and fc2 (grouped modules: `experts`, by
engine.GroupedLinear by default; engine.moe.ExpertLinears is the per-expert loop it is measured against), and merged back weighted by their probabilities (`unpermute`). After each forward,
`aux_loss` holds the load-balancing loss times `aux_loss_coef` (add it to the training loss). With `expert_parallel`
(engine.moe.parallel), this rank holds E / world of the experts and exchanges rows with the others; the aux loss
and the capacity are then the group's (engine.moe.balance: one process's values over every rank's tokens).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from engine.modules.activations import ACTIVATIONS, GATED, check_activation
from engine.modules.grouped_linear import GroupedLinear
from engine.moe.aux_loss import load_balancing_loss
from engine.moe.balance import group_routing
from engine.moe.experts import ExpertsFactory
from engine.moe.parallel import expert_range, run_experts_parallel
from engine.moe.permute import permute, unpermute

__all__ = ["MoEMLP"]


def _check_positive(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return value


class MoEMLP(torch.nn.Module):
    """`forward(x [..., hidden]) -> [..., hidden]`; `aux_loss` after it (a scalar tensor)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_experts: int, top_k: int = 2, *,
                 activation: str = "gelu", bias: bool = False, normalize_top_k: bool = True,
                 capacity_factor: float | None = None, aux_loss_coef: float = 0.01,
                 experts: ExpertsFactory = GroupedLinear, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hidden_size = _check_positive(hidden_size, "hidden_size")
        self.num_experts = _check_positive(num_experts, "num_experts")
        self.top_k = _check_positive(top_k, "top_k")
        if top_k > num_experts:
            raise ValueError(f"top_k: expected at most num_experts ({num_experts}), got {top_k}")
        if capacity_factor is not None and not (isinstance(capacity_factor, (int, float)) and capacity_factor > 0):
            raise ValueError(f"capacity_factor: expected None (no token dropped) or a number > 0, "
                             f"got {capacity_factor!r}")
        self.activation = check_activation(activation)
        self.normalize_top_k = normalize_top_k
        self.capacity_factor = capacity_factor
        self.aux_loss_coef = float(aux_loss_coef)
        self.router = torch.nn.Linear(hidden_size, num_experts, bias=False)  # fp32: routing stays in high precision
        width = _check_positive(ffn_hidden_size, "ffn_hidden_size") * (2 if activation in GATED else 1)
        self.fc1 = experts(num_experts, hidden_size, width, bias=bias, params_dtype=params_dtype)
        self.fc2 = experts(num_experts, ffn_hidden_size, hidden_size, bias=bias, params_dtype=params_dtype)
        self.group: dist.ProcessGroup | None = None
        self.local_experts = (0, num_experts)
        self.aux_loss = torch.zeros(())

    def __getstate__(self) -> dict:
        """The module's state with the last aux loss detached (copy.deepcopy and pickle take only graph leaves)."""
        state = self.__dict__.copy()
        state["aux_loss"] = state["aux_loss"].detach()
        return state

    def expert_parallel(self, group: dist.ProcessGroup | None = None) -> None:
        """Keep this rank's share of the experts (E / world of `group`, default the world) and exchange rows with
        the other ranks from now on. Every rank must have built the same experts (the same seed)."""
        first, stop = expert_range(self.num_experts, group)
        for fc in (self.fc1, self.fc2):
            if not callable(getattr(fc, "keep", None)):
                raise TypeError(f"experts: {type(fc).__name__} cannot drop experts (no keep(first, stop)); build "
                                "MoEMLP with experts=engine.GroupedLinear (the default) or engine.moe.ExpertLinears, or give the experts module keep()")
            fc.keep(first, stop)
        self.group = dist.group.WORLD if group is None else group
        self.local_experts = (first, stop)

    def capacity(self, tokens: int) -> int | None:
        """Rows an expert keeps at most for `tokens` tokens (None: all)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)

    def _experts(self, rows: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        return self.fc2(ACTIVATIONS[self.activation](self.fc1(rows, m_splits)), m_splits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.hidden_size:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x: expected [..., {self.hidden_size}] (hidden_size last), got {got}")
        tokens = x.reshape(-1, self.hidden_size)
        # fp32 as built; a router cast (engine generate casts blocks to bf16) or quantized for inference runs as such
        probs = torch.softmax(self.router(tokens.to(self.router.weight.dtype)).float(), dim=-1)
        top_probs, top_experts = probs.topk(self.top_k, dim=-1)
        if self.normalize_top_k:
            top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
        if self.group is None:
            capacity, aux_loss = self.capacity(tokens.shape[0]), load_balancing_loss(probs, top_experts)
        else:  # the group's batch: the aux loss and capacity one process computes over every rank's tokens
            stats = group_routing(probs, top_experts, self.capacity_factor, self.group)
            capacity, aux_loss = stats.capacity, stats.aux_loss
        rows, route, m_splits = permute(tokens, top_experts, num_experts=self.num_experts, capacity=capacity)
        if self.group is None:
            out = self._experts(rows, m_splits)
        else:
            out = run_experts_parallel(rows, m_splits, self._experts, self.group)
        self.aux_loss = self.aux_loss_coef * aux_loss
        return unpermute(out, route, top_probs).view(x.shape)
