"""engine.moe.MoEMLP against a per-token loop over the chosen experts (independent of permute / unpermute): in high
precision with gradients, and under every recipe engine.recipes exports (each expert's engine.Linear run on the
tokens routed to it, gathered by a loop), with capacity drops, an expert no token picks, one token, and none."""

from __future__ import annotations

import copy

import pytest
import torch

import checkpoint_specs as specs
import engine
from engine.modules.activations import ACTIVATIONS
from engine.moe import ExpertLinears, MoEMLP, load_balancing_loss

H, FFN, E = 32, 64, 4


def routing(m: MoEMLP, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k probs, experts) of each token, from the router written out."""
    probs = torch.softmax(tokens.float() @ m.router.weight.T, dim=-1)
    top, experts = probs.topk(m.top_k, dim=-1)
    return (top / top.sum(-1, keepdim=True) if m.normalize_top_k else top), experts


def reference(m: MoEMLP, x: torch.Tensor) -> torch.Tensor:
    """Per expert: the tokens that picked it (in token order, the first `capacity`) through its fc1, act, fc2; then
    per token, the outputs of its picks weighted by their probabilities, added in pick order in fp32."""
    tokens = x.reshape(-1, H)
    top, experts = routing(m, tokens)
    capacity = m.capacity(tokens.shape[0])
    outputs = {}
    for e in range(m.num_experts):
        picks = [(t, k) for t in range(tokens.shape[0]) for k in range(m.top_k) if int(experts[t, k]) == e]
        picks = picks if capacity is None else picks[:capacity]
        rows = torch.stack([tokens[t] for t, _ in picks]) if picks else tokens[:0]
        out = m.fc2.linears[e](ACTIVATIONS[m.activation](m.fc1.linears[e](rows)))
        outputs.update({pick: out[i] for i, pick in enumerate(picks)})
    y = []
    for t in range(tokens.shape[0]):
        acc = torch.zeros(H)
        for k in range(m.top_k):
            if (t, k) in outputs:
                acc = acc + outputs[t, k].float() * top[t, k]
        y.append(acc.to(x.dtype))
    return torch.stack(y).view(x.shape) if y else x * 0


def make(seed: int = 0, **kw) -> MoEMLP:
    torch.manual_seed(seed)
    m = MoEMLP(H, FFN, E, **{"top_k": 2, **kw})
    with torch.no_grad():  # feature 0 of the inputs is >= 3, and expert 3's router weight for it -100: never picked
        m.router.weight[:, 0] = 0.1
        m.router.weight[3, 0] = -100.0
    return m


def as_loop(m: MoEMLP) -> MoEMLP:
    """m with its experts (engine.GroupedLinear, MoEMLP's default) as engine.moe.ExpertLinears, the per-expert loop
    of engine.Linear that `reference` runs, holding copies of the same weights."""
    twin = copy.deepcopy(m)
    for name in ("fc1", "fc2"):
        fc = getattr(m, name)
        loop = ExpertLinears(fc.num_gemms, fc.in_features, fc.out_features, bias=fc.use_bias)
        with torch.no_grad():
            for linear, w, b in zip(loop.linears, *fc.expert_parameters()):
                linear.weight.copy_(w)
                if b is not None:
                    linear.bias.copy_(b)
        setattr(twin, name, loop)
    return twin


def inputs(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = torch.randn(*shape, H)
    x[..., 0] = x[..., 0].abs() + 3
    return x.to(dtype)


def test_high_precision_forward_and_gradients_match_the_loop() -> None:
    m = make(activation="swiglu", capacity_factor=0.75)
    x = inputs(2, 9).requires_grad_()
    y = m(x)
    assert m.capacity(18) == 7 and max(m.fc1.weight0.shape) == 2 * FFN
    twin = as_loop(m)
    x2 = x.detach().requires_grad_()
    want = reference(twin, x2)
    torch.testing.assert_close(y, want)
    grad = torch.randn_like(y)
    y.backward(grad)
    want.backward(grad)
    torch.testing.assert_close(x.grad, x2.grad)
    for (name, p), q in zip(m.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, torch.zeros_like(p) if q.grad is None else q.grad, msg=name)
    assert m.fc1.weight3.grad.abs().sum() == 0  # the expert no token picked


@pytest.mark.parametrize("tokens", [0, 1, 37])
@pytest.mark.parametrize("class_name", [c.__name__ for c in specs.exported_recipe_classes()])
def test_every_recipe_matches_the_loop_bit_for_bit(class_name: str, tokens: int) -> None:
    m = make(capacity_factor=0.9 if tokens > 1 else None)
    twin = as_loop(m)
    x = inputs(tokens, dtype=torch.bfloat16)
    with engine.fp8_autocast(recipe=specs.make_recipe(class_name)):
        got = m(x)
    with engine.fp8_autocast(recipe=specs.make_recipe(class_name)):
        want = reference(twin, x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want), (got.float() - want.float()).abs().max()


def test_load_balancing_loss() -> None:
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]])
    indices = torch.tensor([[0], [0]])  # both on expert 0: f = (1, 0, 0), P_0 = 0.4
    assert torch.allclose(load_balancing_loss(probs, indices), torch.tensor(3 * 0.4))
    uniform = torch.full((4, 4), 0.25)
    assert torch.allclose(load_balancing_loss(uniform, torch.arange(4).view(4, 1)), torch.tensor(1.0))
    m = make(aux_loss_coef=0.5)
    m(inputs(5))
    assert m.aux_loss.ndim == 0 and m.aux_loss > 0.5  # expert 3 unused: above the uniform 1 * 0.5


@pytest.mark.parametrize("kwargs, match", [
    ({"top_k": 5}, "top_k: expected at most num_experts"),
    ({"capacity_factor": 0}, "capacity_factor"),
    ({"activation": "tanh"}, "activation"),
])
def test_bad_arguments_are_refused(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        MoEMLP(H, FFN, E, **kwargs)


def test_experts_refuse_wrong_splits() -> None:
    experts = ExpertLinears(3, 8, 4)
    with pytest.raises(ValueError, match="adds up to 4, but inp has 5 rows"):
        experts(torch.randn(5, 8), [1, 3, 0])
    with pytest.raises(ValueError, match="a list of 3 ints"):
        experts(torch.randn(5, 8), [5])
