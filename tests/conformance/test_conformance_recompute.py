"""Contract: `engine.checkpoint` recomputes exactly: the same outputs, gradients and scaling state, bit for bit,
as the same steps without recompute, under every case of tests/conformance/recipes.py.

The model stacks every engine module with residuals, each block checkpointed on its own (so a recomputed block
feeds the next one, and its no-grad forward output is what the next block reads under the reentrant mode):
LayerNormLinear -> Linear, then two LayerNormMLPs (GELU, SwiGLU). 2 x 15 tokens: not a multiple of NVFP4's 16
(its RHT'd wgrad operands are padded) nor of MX's 32. High-precision and FP8 primary weights; three SGD steps,
so delayed scaling's histories and NVFP4's stochastic-rounding counters carry over; both of torch's
checkpoint implementations, backward after the fp8_autocast (the README's loop) and, non-reentrant, inside it.
Every case runs the first mode with high-precision weights; each recipe class as `make_recipe` builds it runs
every mode and both kinds of weights.
"""

from __future__ import annotations

import pytest
import torch

import engine
from conformance.recipes import CASES, DEFAULTS, Case
from engine.modules import FP8Module

D, FFN, TOKENS, STEPS = 32, 64, (2, 15), 2
MODES = {"reentrant": (True, False), "non_reentrant": (False, False), "non_reentrant_inside": (False, True)}


class Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = engine.LayerNormLinear(D, 2 * D)
        self.proj = engine.Linear(2 * D, D)
        self.mlp = engine.LayerNormMLP(D, FFN)
        self.glu = engine.LayerNormMLP(D, FFN, normalization="RMSNorm", activation="swiglu")
        self.blocks = [lambda x: x + self.proj(self.qkv(x)), lambda x: x + self.mlp(x), lambda x: x + self.glu(x)]

    def forward(self, x: torch.Tensor, reentrant: bool | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) if reentrant is None else engine.checkpoint(block, x, use_reentrant=reentrant)
        return x


def train(recipe, primary: bool, reentrant: bool | None, inside: bool) -> tuple[list[torch.Tensor], list]:
    """Per step the output, the input gradient and every parameter gradient; then every module's scaling state."""
    torch.manual_seed(0)
    with engine.fp8_model_init(enabled=primary, recipe=recipe):
        model = Blocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for step in range(STEPS):
        x = torch.randn(*TOKENS, D, generator=torch.Generator().manual_seed(step), requires_grad=True)
        with engine.fp8_autocast(recipe=recipe):
            out = model(x, reentrant)
            loss = out.square().mean()
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        seen += [out.detach(), x.grad] + [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
    with engine.fp8_autocast(recipe=recipe):  # fold the last backward in
        pass
    states = []
    for module in model.modules():
        if isinstance(module, FP8Module):
            for state in (module._fwd_state, module._bwd_state):
                part = state.to_plain() or {}
                states += [part[k] for k in sorted(part)]
    return seen, states


RUNS = [(case, "reentrant", "hp") for case in CASES] + [
    (case, mode, weights) for case in DEFAULTS for mode in MODES for weights in ("hp", "fp8")
    if (mode, weights) != ("reentrant", "hp")]


@pytest.mark.parametrize("case, mode, weights", RUNS, ids=lambda v: str(v))
def test_recompute_is_bit_identical(case: Case, mode: str, weights: str) -> None:
    reentrant, inside = MODES[mode]
    want, want_states = train(case.recipe(), weights == "fp8", None, inside)
    got, got_states = train(case.recipe(), weights == "fp8", reentrant, inside)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        step, item = divmod(i, len(want) // STEPS)
        assert torch.equal(g, w), f"step {step}, item {item} (0: output, 1: input gradient): {(g - w).abs().max()}"
    assert len(got_states) == len(want_states)
    for i, (g, w) in enumerate(zip(got_states, want_states)):
        assert torch.equal(g, w), f"scaling state tensor {i} differs"
    if case.id in ("DelayedScaling", "NVFP4BlockScaling"):
        assert want_states, "no scaling state was compared"
