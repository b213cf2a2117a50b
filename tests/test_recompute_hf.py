"""Hugging Face gradient checkpointing on a converted model with engine's recompute (`engine.checkpoint_context`
as torch's context_fn): gradients are the bits of the same step without checkpointing, with backward after the
fp8_autocast has exited; HF's plain checkpointing there refuses instead of recomputing in high precision."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import engine
from engine.recipes import DelayedScaling, MXFP8BlockScaling

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return engine.convert(transformers.LlamaForCausalLM(config))


def enable_checkpointing(model: torch.nn.Module, kwargs: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # newer transformers: activation_checkpointing_enable
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def step(model: torch.nn.Module, recipe) -> dict[str, torch.Tensor]:
    """Two steps (delayed scaling's second runs on the scales the first learned), backward outside the autocast;
    the gradients of the last one."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(2):
        opt.zero_grad()
        with engine.fp8_autocast(recipe=recipe):
            loss = model(IDS, labels=IDS).loss
        loss.backward()
        opt.step()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), MXFP8BlockScaling()], ids=["delayed", "mxfp8"])
def test_hf_gradient_checkpointing_with_engine_recompute_gives_the_same_gradients(recipe):
    plain = llama()
    checkpointed = copy.deepcopy(plain)
    enable_checkpointing(checkpointed, {"use_reentrant": False, "context_fn": engine.checkpoint_context})
    assert all(layer.gradient_checkpointing for layer in checkpointed.model.layers)
    calls = {"plain": 0, "checkpointed": 0}
    for name, model in (("plain", plain), ("checkpointed", checkpointed)):
        model.model.layers[0].self_attn.q_proj.register_forward_hook(
            lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    want, got = step(plain, recipe), step(checkpointed, recipe)
    assert calls == {"plain": 2, "checkpointed": 4}  # two steps; each recomputed once in backward
    assert want.keys() == got.keys() and len(want) > 10
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_hf_plain_gradient_checkpointing_refuses_to_recompute_in_high_precision():
    model = llama()
    enable_checkpointing(model, {"use_reentrant": False})
    with pytest.raises(RuntimeError, match=r"engine\.checkpoint"):
        step(model, DelayedScaling(amax_history_len=4))
