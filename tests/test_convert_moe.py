"""engine.convert on Hugging Face mixture-of-experts models (transformers 5.x, tiny random configs).

The experts of Qwen2-MoE, Mixtral, Qwen3-MoE and OLMoE become engine.GroupedExperts over the same Parameters; the
routers stay in high precision. The original model is the reference: outside fp8_autocast the converted model
computes the logits of Hugging Face's eager experts loop bit for bit (and of its default grouped_mm within fp32
rounding), it trains under the FP8 recipes within the bound the dense models meet (tests/test_convert.py: 5% of the
bf16 loss), runs under every exported recipe, and moves through save_pretrained / from_pretrained.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import safetensors.torch
import torch
from torch import nn

import engine
from conformance.recipes import DEFAULTS, Case
from test_convert import RECIPES, batches, final_loss, logits, token_ids, train

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=1)


def qwen2_moe():  # a shared expert and its per-token gate (an nn.Linear that routes: stays high precision)
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **COMMON, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2))


def mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2))


def qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **COMMON, intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, head_dim=8))


def olmoe():
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        **COMMON, intermediate_size=32, num_experts=4, num_experts_per_tok=2))


MODELS = {"qwen2_moe": qwen2_moe, "mixtral": mixtral, "qwen3_moe": qwen3_moe, "olmoe": olmoe}


def build(name: str, seed: int = 0, experts_implementation: str | None = None) -> nn.Module:
    torch.manual_seed(seed)
    model = MODELS[name]()
    if experts_implementation is not None:
        model.config._experts_implementation = experts_implementation
    return model


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", MODELS)
def test_experts_converted_routers_kept(name):
    original = build(name, experts_implementation="eager")
    model = engine.convert(copy.deepcopy(original))
    for (fqn, before), after in zip(original.named_modules(), model.modules()):
        if type(before).__name__.endswith("Experts"):
            assert isinstance(after, engine.GroupedExperts), fqn
            assert after.num_experts == 4 and after.act_fn is not None
        if fqn.endswith(("mlp.gate", "shared_expert_gate")):  # routers: the same torch modules
            assert type(after) is type(before) and not isinstance(after, engine.modules.FP8Module), fqn
    assert any(isinstance(m, engine.Linear) for m in model.modules())  # attention projections
    assert set(model.state_dict()) == set(original.state_dict())  # no state yet: the same keys
    ids = token_ids()
    with torch.no_grad():
        want = logits(original, ids)
        assert torch.equal(logits(model, ids), want)  # Hugging Face's eager experts loop, bit for bit
        original.config._experts_implementation = "grouped_mm"  # its default: torch._grouped_mm, fp32 rounding
        torch.testing.assert_close(logits(original, ids), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", DEFAULTS, ids=str)
def test_every_recipe_runs_forward_and_backward(case: Case):
    """Each exported recipe: a finite loss near the high-precision one, gradients for every expert weight."""
    original = build("qwen2_moe")
    model = engine.convert(copy.deepcopy(original))
    ids = token_ids()
    with torch.no_grad():
        want = original(ids, labels=ids).loss.item()
    with engine.fp8_autocast(recipe=case.recipe()):
        loss = model(ids, labels=ids).loss
    loss.backward()
    assert abs(loss.item() - want) < 0.05 * want, (loss.item(), want)
    experts = [m for m in model.modules() if isinstance(m, engine.GroupedExperts)]
    assert experts and all(m._recipe is not None for m in experts)
    for m in experts:
        assert torch.isfinite(m.gate_up_proj.grad).all() and m.gate_up_proj.grad.abs().sum() > 0
        assert torch.isfinite(m.down_proj.grad).all() and m.down_proj.grad.abs().sum() > 0


def bf16_loss(name: str) -> float:
    losses = train(build(name), steps=30)
    assert final_loss(losses) < 0.8 * losses[0]  # it learns
    return final_loss(losses)


def training_gap(name: str, recipe: str) -> float:
    """The converted model's final loss under `recipe` (30 AdamW steps, torch.autocast bf16), in % of the
    original's in bf16."""
    bf16 = bf16_loss(name)
    return 100 * (final_loss(train(engine.convert(build(name)), RECIPES[recipe], steps=30)) - bf16) / bf16


#: every model and every FP8 recipe once (the whole table: `python tests/test_convert_moe.py`, docs/moe.md)
PAIRS = list(zip(MODELS, RECIPES))


@pytest.mark.parametrize("name, recipe", PAIRS)
def test_training_tracks_bf16(name, recipe):
    """Within 5% of the bf16 loss, the bound the dense models meet (tests/test_convert.py)."""
    gap = training_gap(name, recipe)
    assert abs(gap) < 5.0, gap


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_save_pretrained_round_trip(name, tmp_path):
    """A converted model trained a step under delayed scaling (per-expert amax histories), saved with
    save_pretrained, loaded with from_pretrained + convert + the file's state: the same logits, bit for bit."""
    recipe = engine.recipes.DelayedScaling()
    model = engine.convert(build(name))
    ids = next(batches(1))
    with engine.fp8_autocast(recipe=recipe):
        model(ids, labels=ids).loss.backward()
    model.save_pretrained(tmp_path)
    reloaded = engine.convert(type(model).from_pretrained(tmp_path))
    # transformers writes the experts in the checkpoint's original per-expert layout and stacks them when loading:
    # the weights come through from_pretrained, the scaling state (`_extra_state`) from the file
    state = safetensors.torch.load_file(f"{tmp_path}/model.safetensors")
    # (Mixtral's files name its `mlp` `block_sparse_moe`, as transformers saves the original layout: renamed back)
    extra = {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in state.items() if k.endswith("_extra_state")}
    assert any(k.endswith("experts._extra_state") for k in extra)
    reloaded.load_state_dict({**reloaded.state_dict(), **extra})
    for key, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), key
    with torch.no_grad(), engine.fp8_autocast(recipe=recipe):
        assert torch.equal(logits(reloaded, ids), logits(model, ids))


def test_unconvert_gives_back_the_hugging_face_experts():
    original = build("olmoe", experts_implementation="eager")
    model = engine.unconvert(engine.convert(copy.deepcopy(original)))
    assert [type(m) for m in model.modules()] == [type(m) for m in original.modules()]
    ids = token_ids()
    with torch.no_grad():
        assert torch.equal(logits(model, ids), logits(original, ids))


def test_fp8_weights_leave_the_experts_with_a_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = engine.convert(build("mixtral"), fp8_weights=True)
    assert not any(isinstance(m, engine.GroupedExperts) for m in model.modules())
    assert any("experts" in str(w.message) and "stacked expert weights" in str(w.message) for w in caught)


def test_grouped_experts_bad_input():
    experts = engine.GroupedExperts(4, 32, 16)
    x = torch.randn(5, 32)
    with pytest.raises(ValueError, match="top_k_index must be an integer tensor"):
        experts(x, torch.zeros(5, 2), torch.ones(5, 2))
    with pytest.raises(ValueError, match="top_k_weights must have"):
        experts(x, torch.zeros(5, 2, dtype=torch.long), torch.ones(5, 3))
    with pytest.raises(ValueError, match=r"hidden_states must be \[tokens, 32\]"):
        experts(torch.randn(5, 31), torch.zeros(5, 2, dtype=torch.long), torch.ones(5, 2))
    with pytest.raises(ValueError, match="sum to the number of tokens"):
        experts.grouped(x, [1, 1, 1, 1])
    with engine.fp8_model_init(recipe=engine.recipes.DelayedScaling()), pytest.raises(TypeError, match="2-D"):
        engine.GroupedExperts(4, 32, 16)


def test_grouped_experts_drops_out_of_range_slots():
    """Index E (Hugging Face's "no expert") drops a slot: the token gets only its other experts' outputs."""
    torch.manual_seed(7)
    experts = engine.GroupedExperts(4, 32, 16)
    x = torch.randn(3, 32)
    index = torch.tensor([[0, 4], [1, 2], [4, 4]])
    weights = torch.tensor([[0.5, 0.5], [0.25, 0.75], [1.0, 1.0]])
    out = experts(x, index, weights)

    def expert(e, t):  # one expert on one token, by the formula
        gate, up = (x[t] @ experts.gate_up_proj[e].t()).chunk(2)
        return (torch.nn.functional.silu(gate) * up) @ experts.down_proj[e].t()

    torch.testing.assert_close(out[0], 0.5 * expert(0, 0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[1], 0.25 * expert(1, 1) + 0.75 * expert(2, 1), rtol=1e-6, atol=1e-6)
    assert torch.equal(out[2], torch.zeros(32))


if __name__ == "__main__":  # the training gaps table of docs/moe.md
    torch.set_num_threads(1)
    print("| model | " + " | ".join(RECIPES) + " |")
    print("|---|" + "---|" * len(RECIPES))
    for model_name in MODELS:
        print(f"| {model_name} | " + " | ".join(f"{training_gap(model_name, r):+.2f}%" for r in RECIPES) + " |")
