"""GroupedLinear: one linear layer per expert over tokens grouped by expert (a mixture of experts' FFN).

`forward(inp, m_splits)`: the first `m_splits[0]` tokens (rows of `inp` viewed as [T, in_features]) go
through expert 0, the next `m_splits[1]` through expert 1, ...; the output keeps the tokens' order.
Expert `e` is GEMM index `e` of the module's recipe states, so each expert has its own quantizers and,
where the recipe keeps state, its own scaling state (delayed scaling: an amax history per expert), saved
in `_extra_state` as every engine module's. Every expert's fprop, dgrad and wgrad run through the same
`linear()` engine.Linear runs (eager, torch.compile, recompute, inspect), so an expert's bits are those
of an `engine.Linear` with its weights; `grouped_function.py` runs all experts in one call where that
gives the same bits faster.

Two parameter layouts, as the two families of MoE code hold experts:
- `GroupedLinear`: `weight0..weight{E-1}` [N, K] and `bias0..` [N], Transformer Engine's names (its
  checkpoints load as they are);
- `StackedGroupedLinear`: one `weight` [E, N, K] and one `bias` [E, N], as Hugging Face transformers 5.x
  and torchtitan hold experts (one tensor for the optimizer, sharding and checkpoints). A separate class,
  not a flag: the state-dict keys and parameter shapes differ, so code that loads or shards the module
  can tell the layouts apart by type.
"""

from __future__ import annotations

from typing import Sequence

import torch

from engine import autocast
from engine.checks import check_params_dtype
from engine.modules.base import FP8Module
from engine.modules.dispatch import linear
from engine.modules.grouped_function import grouped_linear
from engine.modules.linear import InitMethod, check_features, check_input, check_layer_flags, init_linear
from engine.modules.linear_function import LinearArgs, WeightCache


def check_m_splits(m_splits: object, num_gemms: int, tokens: int, owner: str) -> list[int]:
    """m_splits as a list of `num_gemms` ints >= 0 summing to the token count; ValueError/TypeError otherwise."""
    if isinstance(m_splits, torch.Tensor):
        raise TypeError(f"{owner}: m_splits must be a list of ints (the tokens per expert, known on the host), got a "
                        f"tensor; pass m_splits.tolist() (one host sync per step, as Transformer Engine needs too)")
    if not isinstance(m_splits, (list, tuple)):
        raise TypeError(f"{owner}: m_splits must be a list of {num_gemms} ints (the tokens per expert), got "
                        f"{type(m_splits).__name__}")
    if len(m_splits) != num_gemms:
        raise ValueError(f"{owner}: m_splits must have one entry per expert ({num_gemms}), got {len(m_splits)}: "
                         f"{list(m_splits)!r:.200}")
    for m in m_splits:
        if isinstance(m, bool) or not isinstance(m, int):
            raise TypeError(f"{owner}: m_splits must hold ints, got {type(m).__name__} ({m!r}); convert it with "
                            "[int(m) for m in m_splits]")
        if m < 0:
            raise ValueError(f"{owner}: m_splits entries must be >= 0 (tokens per expert), got {list(m_splits)}")
    if sum(m_splits) != tokens:
        raise ValueError(f"{owner}: m_splits must sum to the number of tokens in inp ({tokens}), got "
                         f"sum({list(m_splits)!r:.200}) = {sum(m_splits)}")
    return list(m_splits)


def run_grouped(module: FP8Module, inp2d: torch.Tensor, m_splits: list[int], weights: Sequence[torch.Tensor],
                biases: Sequence[torch.Tensor | None], args: Sequence[LinearArgs]) -> torch.Tensor:
    """`module`'s experts (GEMM indices of `args`) over the token groups of inp2d [T, K]; while calibrating, each
    expert's input and weight amaxes are recorded first."""
    if not args[0].fp8 and args[0].fwd is not None:  # calibrating: high precision, amaxes recorded per expert
        for a, x, w in zip(args, torch.split(inp2d, m_splits), weights):
            module._calibrate(a, x, w)
    return grouped_linear(inp2d, m_splits, weights, biases, args, per_expert=linear)


def check_num_gemms(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"num_gemms: expected the number of experts, an int >= 1, got {value!r}")
    return value


class GroupedLinear(FP8Module):
    """`num_gemms` linear layers (experts) over consecutive groups of tokens: out[rows of expert e] = x W_e^T + b_e.

    `forward(inp, m_splits, is_first_microbatch=None)`, as Transformer Engine's GroupedLinear: `inp` [..., K]
    viewed as [T, K], `m_splits` the tokens per expert (sum T; zeros allowed); out [..., N].
    `return_bias` returns (out, [bias_e]) with the biases not added (StackedGroupedLinear: (out, bias [E, N])).
    """

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        return_bias: bool = False,
        fuse_wgrad_accumulation: bool = False,
        init_method: InitMethod | None = None,
    ) -> None:
        super().__init__()
        self.num_gemms = check_num_gemms(num_gemms)
        self.in_features = check_features(in_features, "in_features")
        self.out_features = check_features(out_features, "out_features")
        check_layer_flags(bias=bias, return_bias=return_bias, fuse_wgrad_accumulation=fuse_wgrad_accumulation)
        self.return_bias = return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.use_bias = bias
        # each expert's name for a CustomRecipe's factory (QuantizerRole.name), engine.inspect and Debug's dumps
        self.gemm_names = tuple(f"expert{e}" for e in range(self.num_gemms))
        self._weight_caches = [WeightCache() for _ in range(self.num_gemms)]
        self._make_parameters(check_params_dtype(params_dtype), device, init_method)

    def _make_parameters(self, dtype: torch.dtype, device: torch.device | str | None,
                         init_method: InitMethod | None) -> None:
        self.weight_names = tuple(f"weight{e}" for e in range(self.num_gemms))
        for e in range(self.num_gemms):
            weight = torch.empty(self.out_features, self.in_features, dtype=dtype, device=device)
            b = torch.empty(self.out_features, dtype=dtype, device=device) if self.use_bias else None
            init_linear(weight, b, init_method)
            self.register_parameter(f"weight{e}", self._new_weight(weight, e))
            self.register_parameter(f"bias{e}", None if b is None else torch.nn.Parameter(b))

    def expert_parameters(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """(weights [N, K], biases [N] or None), one per expert."""
        params = self._parameters
        return ([params[f"weight{e}"] for e in range(self.num_gemms)],
                [params[f"bias{e}"] for e in range(self.num_gemms)])

    def keep(self, first: int, stop: int) -> None:
        """Hold only experts first..stop-1, renumbered from 0 (expert parallel: this rank's share of the experts).

        Before the first step: the recipe states (an amax history per expert) are made for the experts held."""
        if isinstance(first, bool) or isinstance(stop, bool) or not isinstance(first, int) \
                or not isinstance(stop, int) or not 0 <= first < stop <= self.num_gemms:
            raise ValueError(f"keep: expected 0 <= first < stop <= num_gemms ({self.num_gemms}), got "
                             f"first={first!r}, stop={stop!r}")
        if self._fwd_state is not None or self._pending_extra_state is not None:
            raise RuntimeError(f"{type(self).__name__}.keep: call it before the first step and before loading a "
                               "state dict (the experts' scaling state is per expert); build the model, call "
                               "expert_parallel / keep, then load or train")
        weights, biases = self.expert_parameters()
        self._drop_parameters()
        self.num_gemms = stop - first
        self.gemm_names = tuple(f"expert{e}" for e in range(self.num_gemms))
        self._weight_caches = [WeightCache() for _ in range(self.num_gemms)]
        self._hold(weights[first:stop], biases[first:stop])

    def _drop_parameters(self) -> None:
        for name in list(self._parameters):
            del self._parameters[name]

    def _hold(self, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]) -> None:
        """Register `weights` / `biases` (this module's own Parameters) as experts 0.. of this layout."""
        self.weight_names = tuple(f"weight{e}" for e in range(len(weights)))
        for e, (weight, b) in enumerate(zip(weights, biases)):
            self.register_parameter(f"weight{e}", weight)
            self.register_parameter(f"bias{e}", b)

    def forward(self, inp: torch.Tensor, m_splits: Sequence[int], is_first_microbatch: bool | None = None):
        weights, biases = self.expert_parameters()
        owner = type(self).__name__
        check_input(inp, self.in_features, owner, is_first_microbatch, weight=weights[0])
        tokens = inp.numel() // self.in_features
        splits = check_m_splits(m_splits, self.num_gemms, tokens, owner)
        args = self._prepare(inp.device, is_first_microbatch)
        out = run_grouped(self, inp.reshape(tokens, self.in_features), splits, weights,
                          [None] * self.num_gemms if self.return_bias else biases, args)
        out = out.view(*inp.shape[:-1], self.out_features)
        return (out, self._returned_bias(biases)) if self.return_bias else out

    def _returned_bias(self, biases: list[torch.Tensor | None]):
        return biases

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.use_bias}")


class StackedGroupedLinear(GroupedLinear):
    """GroupedLinear over one stacked `weight` [E, N, K] (and `bias` [E, N]), the layout of Hugging Face
    transformers 5.x and torchtitan experts. Expert e reads `weight[e]`; its gradient lands in `weight.grad[e]`.
    FP8 primary weights (fp8_model_init) and fuse_wgrad_accumulation are not supported for this layout (an error
    says so and names GroupedLinear)."""

    def _make_parameters(self, dtype: torch.dtype, device: torch.device | str | None,
                         init_method: InitMethod | None) -> None:
        if self.fuse_wgrad_accumulation:
            raise ValueError("StackedGroupedLinear: fuse_wgrad_accumulation=True needs a main_grad per expert weight; "
                             "use engine.GroupedLinear (weight0..weight{E-1}, each with its own main_grad), or "
                             "fuse_wgrad_accumulation=False")
        if autocast.is_fp8_model_init():
            raise TypeError("StackedGroupedLinear: fp8_model_init is not supported for a stacked [E, N, K] weight "
                            "(a quantized tensor is 2-D); use engine.GroupedLinear (weight0..weight{E-1}) for FP8 "
                            "primary weights, or build this module outside fp8_model_init")
        self.weight_names = ("weight",)
        weight = torch.empty(self.num_gemms, self.out_features, self.in_features, dtype=dtype, device=device)
        b = torch.empty(self.num_gemms, self.out_features, dtype=dtype, device=device) if self.use_bias else None
        for e in range(self.num_gemms):  # each expert as torch.nn.Linear initialises its weight
            init_linear(weight[e], None if b is None else b[e], init_method)
        self.weight = torch.nn.Parameter(weight)
        self.bias = None if b is None else torch.nn.Parameter(b)

    def expert_parameters(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        weight, bias = self._parameters["weight"], self._parameters["bias"]
        return list(weight.unbind(0)), [None] * self.num_gemms if bias is None else list(bias.unbind(0))

    def _returned_bias(self, biases: list[torch.Tensor | None]):
        return self._parameters["bias"]

    def _hold(self, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]) -> None:
        self.weight = torch.nn.Parameter(torch.stack([w.detach() for w in weights]))
        self.bias = None if biases[0] is None else torch.nn.Parameter(torch.stack([b.detach() for b in biases]))
