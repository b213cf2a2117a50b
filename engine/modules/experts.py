"""GroupedExperts: a mixture of experts' gated FFNs over stacked weights, as Hugging Face transformers 5.x holds them.

`gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] (the names and shapes of `Qwen2MoeExperts`, `MixtralExperts`,
`Qwen3MoeExperts`, `OlmoeExperts`, so their checkpoints load), expert e computing
`down_e(act(gate_e(x)) * up_e(x))` with `gate_up_proj[e]` = [gate; up]. Expert e's first GEMM is GEMM index e of
the module's recipe states and its second GEMM index E + e: each has its own quantizers and scaling state.

Two entry points:
- `forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`, the Hugging Face signature: tokens
  are grouped by expert (ordered within an expert as Hugging Face's eager loop orders them: by top-k position,
  then token), run through `grouped`, scaled by their routing weight and added back per token in expert order.
  An index outside [0, E) (Hugging Face's "no expert", E) drops that token's slot. Outside fp8_autocast it
  computes what the Hugging Face module computes, bit for bit.
- `grouped(tokens [T', H], m_splits)`: tokens already grouped by expert (engine's MoE experts interface).
"""

from __future__ import annotations

from typing import Sequence

import torch

from engine import autocast
from engine.checks import check_params_dtype
from engine.modules.base import FP8Module
from engine.modules.grouped_linear import check_m_splits, check_num_gemms, run_grouped
from engine.modules.linear import check_features, init_linear
from engine.modules.linear_function import WeightCache


class GroupedExperts(FP8Module):
    """E gated FFN experts over stacked `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] (no biases), their GEMMs
    quantized inside fp8_autocast. `act_fn`: the gate's activation, a module or callable (default SiLU)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act_fn: torch.nn.Module | None = None,
                 params_dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.num_experts = check_num_gemms(num_experts)
        self.hidden_dim = check_features(hidden_size, "hidden_size")
        self.intermediate_dim = check_features(intermediate_size, "intermediate_size")
        if act_fn is not None and not callable(act_fn):
            raise TypeError(f"act_fn: expected a module or callable (the gate's activation), got {type(act_fn).__name__}")
        if autocast.is_fp8_model_init():
            raise TypeError("GroupedExperts: fp8_model_init is not supported for stacked [E, N, K] expert weights (a "
                            "quantized tensor is 2-D); build it outside fp8_model_init (its GEMMs are quantized "
                            "inside fp8_autocast either way)")
        self.act_fn = torch.nn.SiLU() if act_fn is None else act_fn
        self.fuse_wgrad_accumulation = False
        self.num_gemms = 2 * self.num_experts
        self.weight_names = ("gate_up_proj", "down_proj")
        self.gemm_names = tuple(f"{proj}.expert{e}" for proj in ("gate_up_proj", "down_proj") for e in range(num_experts))
        self._weight_caches = [WeightCache() for _ in range(self.num_gemms)]
        dtype = check_params_dtype(params_dtype)
        gate_up = torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype, device=device)
        down = torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype, device=device)
        for e in range(num_experts):
            init_linear(gate_up[e], None, None)
            init_linear(down[e], None, None)
        self.gate_up_proj = torch.nn.Parameter(gate_up)
        self.down_proj = torch.nn.Parameter(down)

    def grouped(self, tokens: torch.Tensor, m_splits: Sequence[int]) -> torch.Tensor:
        """tokens [T', H] grouped by expert (`m_splits[e]` rows for expert e) -> [T', H]."""
        owner = type(self).__name__
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.shape[1] != self.hidden_dim:
            raise ValueError(f"{owner}.grouped: tokens must be a [tokens, {self.hidden_dim}] tensor, got "
                             f"{getattr(tokens, 'shape', type(tokens).__name__)}")
        splits = check_m_splits(m_splits, self.num_experts, tokens.shape[0], owner)
        args = self._prepare(tokens.device, None)
        E = self.num_experts
        gate_up = run_grouped(self, tokens, splits, list(self.gate_up_proj.unbind(0)), [None] * E, args[:E])
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = self.act_fn(gate) * up
        return run_grouped(self, hidden, splits, list(self.down_proj.unbind(0)), [None] * E, args[E:])

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        owner = type(self).__name__
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2 \
                or hidden_states.shape[1] != self.hidden_dim:
            raise ValueError(f"{owner}: hidden_states must be [tokens, {self.hidden_dim}], got "
                             f"{getattr(hidden_states, 'shape', type(hidden_states).__name__)}")
        if not isinstance(top_k_index, torch.Tensor) or top_k_index.dim() != 2 \
                or top_k_index.shape[0] != hidden_states.shape[0] or top_k_index.dtype.is_floating_point:
            raise ValueError(f"{owner}: top_k_index must be an integer tensor [tokens, top_k] with "
                             f"{hidden_states.shape[0]} tokens, got {getattr(top_k_index, 'shape', top_k_index)!r:.100}")
        if not isinstance(top_k_weights, torch.Tensor) or top_k_weights.shape != top_k_index.shape:
            raise ValueError(f"{owner}: top_k_weights must have top_k_index's shape {tuple(top_k_index.shape)}, got "
                             f"{getattr(top_k_weights, 'shape', top_k_weights)!r:.100}")
        tokens, E = hidden_states.shape[0], self.num_experts
        with torch.no_grad():
            slots = top_k_index.t().reshape(-1)  # (top-k position, token) order, as Hugging Face's loop reads them
            slots = torch.where((slots >= 0) & (slots < E), slots, E)  # out of range: dropped (sorted last)
            order = torch.argsort(slots, stable=True)
            m_splits = torch.bincount(slots, minlength=E + 1)[:E].tolist()  # the one host sync
            kept = order[: sum(m_splits)]
            token_idx, k_pos = kept % tokens, kept // tokens
        out = self.grouped(hidden_states[token_idx], m_splits)
        out = out * top_k_weights[token_idx, k_pos, None]
        final = torch.zeros_like(hidden_states)
        return final.index_add_(0, token_idx, out.to(final.dtype))

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden_size={self.hidden_dim}, intermediate_size={self.intermediate_dim}"
