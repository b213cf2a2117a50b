"""engine.convert / engine.unconvert on Hugging Face models (random weights from a config) and plain torch models.

The original model is the independent reference: a converted model must compute its logits
outside fp8_autocast, load its checkpoints and give them back, and train under every recipe
close to it. `python tests/test_convert.py` prints the training gaps table.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import pathlib
import warnings

import pytest
import torch
from torch import nn

import checkpoint_specs
import engine
from engine.recipes import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling
from engine.tensors import QuantizedTensor

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

transformers.logging.set_verbosity_error()

#: the FP8 recipes, whose claim it is that a converted model trains within 5% of bf16 (`test_training_tracks_bf16`;
#: 4-bit recipes do not, docs/demo.md); every exported recipe takes every shape (`test_every_recipe_takes_every_shape`)
RECIPES = {
    "delayed": DelayedScaling(amax_history_len=16),
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
}
VOCAB = 256


# ---------------------------------------------------------------------------- models
def llama(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=1))


def gpt2(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=1, pad_token_id=1))


def qwen2(seed: int = 0) -> nn.Module:  # biases on q/k/v, an untied head
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=1))


class PlainNet(nn.Module):
    """A torch model with Linear layers in a Sequential and outside one, with and without bias."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, 48)
        self.body = nn.Sequential(nn.LayerNorm(48), nn.Linear(48, 80), nn.GELU(), nn.Linear(80, 48, bias=False))
        self.head = nn.Linear(48, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        return self.head(h + self.body(h))


MODELS = {"llama": llama, "gpt2": gpt2, "qwen2": qwen2, "plain": PlainNet}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread is faster than two, and much faster on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def token_ids(batch: int = 2, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def layer_types(model: nn.Module) -> dict[str, type]:
    return {name: type(m) for name, m in model.named_modules()}


def converted(name: str, **kwargs) -> tuple[nn.Module, nn.Module]:
    original = MODELS[name]()
    return original, engine.convert(copy.deepcopy(original), **kwargs)


def no_extra_state(state: dict) -> dict:
    return {k: v for k, v in state.items() if not k.endswith("_extra_state")}


# ---------------------------------------------------------------------------- logits and checkpoints
@pytest.mark.parametrize("name", MODELS)
def test_logits_equal_the_original_outside_autocast(name):
    original, model = converted(name, keep_output_head=False)
    swapped = [n for n, m in model.named_modules() if isinstance(m, engine.Linear)]
    expected = [n for n, m in original.named_modules() if type(m) in (nn.Linear, Conv1D)]
    assert swapped == expected and swapped
    for mode in ("train", "eval"):
        getattr(original, mode)(), getattr(model, mode)()
        with torch.no_grad():
            want, got = logits(original, token_ids()), logits(model, token_ids())
        if name == "gpt2":
            # Conv1D computes addmm(b, x, W) with W [in, out]; engine.Linear x @ W^T from W [out, in]:
            # the same products, possibly summed in another order: fp32 rounding, not bitwise by contract
            # (bitwise on the machines measured)
            torch.testing.assert_close(got, want, rtol=2.0**-20, atol=2.0**-20 * want.abs().max().item())
        else:
            assert torch.equal(got, want)


@pytest.mark.parametrize("name", MODELS)
def test_checkpoints_move_both_ways(name):
    original, model = converted(name, keep_output_head=False)
    plain_state = original.state_dict()
    state = model.state_dict()
    assert list(no_extra_state(state)) == list(plain_state)
    assert {k: v.shape for k, v in no_extra_state(state).items()} == {k: v.shape for k, v in plain_state.items()}

    other = MODELS[name](seed=7)  # other weights: a load that does nothing shows
    ids = token_ids()
    model.load_state_dict(other.state_dict(), strict=True)  # the original checkpoint loads as it is
    with torch.no_grad():
        torch.testing.assert_close(logits(model.eval(), ids), logits(other.eval(), ids), rtol=2.0**-20, atol=1e-6)

    fresh = MODELS[name](seed=3)
    fresh.load_state_dict(no_extra_state(model.state_dict()), strict=True)  # and the converted one back
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), other.state_dict().values()))

    engine.unconvert(model)
    assert layer_types(model) == layer_types(original)
    fresh = MODELS[name](seed=3)
    fresh.load_state_dict(model.state_dict(), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), other.state_dict().values()))


def test_conv1d_layout_is_saved_and_loaded_transposed():
    original, model = converted("gpt2")
    c_attn, plain = model.transformer.h[0].attn.c_attn, original.transformer.h[0].attn.c_attn
    assert tuple(c_attn.weight.shape) == (192, 64) and torch.equal(c_attn.weight, plain.weight.t())
    assert torch.equal(c_attn.state_dict()["weight"], plain.weight)
    other = gpt2(seed=5).transformer.h[0].attn.c_attn
    c_attn.load_state_dict(other.state_dict())
    assert torch.equal(c_attn.weight, other.weight.t())


def test_safetensors_file_of_an_unconverted_model_loads_into_the_original(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    original, model = converted("gpt2", keep_output_head=False)
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight.mul_(2)  # a change the file must carry
    engine.unconvert(model)
    model.save_pretrained(tmp_path)
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert torch.equal(reloaded.transformer.h[1].mlp.c_fc.weight, 2 * original.transformer.h[1].mlp.c_fc.weight)
    assert set(safetensors.load_file(tmp_path / "model.safetensors")) <= set(original.state_dict())


# ---------------------------------------------------------------------------- what is kept
def test_parameters_requires_grad_main_grad_and_modes_are_kept():
    original = gpt2()
    linear_layer, conv = original.lm_head, original.transformer.h[0].mlp.c_fc
    original.transformer.h[0].attn.c_proj.weight.requires_grad_(False)
    buffer = torch.zeros(64, 256)
    conv.weight.main_grad = buffer
    q = llama()
    q.model.layers[0].self_attn.q_proj.weight.main_grad = torch.zeros(64, 64)
    q.model.layers[1].mlp.eval()
    params = {n: p for n, p in q.named_parameters()}
    engine.convert(q)
    assert all(p is params[n] for n, p in q.named_parameters())  # the same objects (optimizer state, ties)
    assert q.model.layers[0].self_attn.q_proj.weight.main_grad is params[
        "model.layers.0.self_attn.q_proj.weight"].main_grad
    assert not q.model.layers[1].mlp.down_proj.training and q.model.layers[0].mlp.down_proj.training

    engine.convert(original, keep_output_head=False)
    assert original.lm_head.weight is linear_layer.weight
    new = original.transformer.h[0].mlp.c_fc
    assert new.weight.main_grad.data_ptr() == buffer.data_ptr()  # a view of the caller's buffer, transposed
    assert tuple(new.weight.main_grad.shape) == (256, 64)
    assert not original.transformer.h[0].attn.c_proj.weight.requires_grad
    assert original.transformer.h[0].attn.c_attn.weight.requires_grad

    fused = engine.Linear(64, 256, fuse_wgrad_accumulation=True)  # the view takes accumulated gradients
    fused.weight, fused.bias = new.weight, new.bias
    fused(torch.randn(3, 64)).sum().backward()
    assert buffer.abs().sum() > 0 and torch.equal(buffer.t(), new.weight.main_grad)


def test_tied_head_stays_tied_and_trains():
    model = engine.convert(gpt2(), keep_output_head=False)
    assert isinstance(model.lm_head, engine.Linear)
    assert model.lm_head.weight is model.transformer.wte.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.transformer.wte.weight.detach().clone()
    ids = token_ids()
    with engine.fp8_autocast(recipe=RECIPES["current"]):
        loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert not torch.equal(before, model.transformer.wte.weight)


def test_keep_output_head():
    for name, head in (("llama", "lm_head"), ("gpt2", "lm_head"), ("plain", "head")):
        _, model = converted(name)
        assert type(getattr(model, head)) is nn.Linear, name
        _, model = converted(name, keep_output_head=False)
        assert type(getattr(model, head)) is engine.Linear, name
    bare = nn.Linear(8, 4)
    assert engine.convert(bare) is bare  # a bare layer is its own output head
    new = engine.convert(bare, keep_output_head=False)
    assert type(new) is engine.Linear and new.weight is bare.weight


def test_module_filter_gets_each_layer_once_by_name():
    seen = []

    def mlp_only(fqn, module):
        seen.append((fqn, type(module)))
        return ".mlp." in fqn

    model = engine.convert(llama(), module_filter=mlp_only)
    linears = [n for n, m in llama().named_modules() if type(m) is nn.Linear and n != "lm_head"]
    assert seen == [(n, nn.Linear) for n in linears]
    for n, m in model.named_modules():
        if n in linears:
            assert type(m) is (engine.Linear if ".mlp." in n else nn.Linear), n


def test_a_module_registered_twice_gets_one_replacement():
    shared = nn.Linear(8, 8)
    model = nn.Sequential(shared, nn.ReLU(), shared, nn.Linear(8, 2))
    engine.convert(model)
    assert type(model[0]) is engine.Linear and model[0] is model[2]


# ---------------------------------------------------------------------------- skipped layers
def test_layers_engine_cannot_take_are_named_in_one_warning():
    attention = nn.MultiheadAttention(8, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "Initializing zero-element tensors is a no-op"
        empty = nn.Linear(0, 5)
    model = nn.Sequential(nn.Linear(4, 6).double(), empty, nn.Linear(7, 5), attention, nn.Linear(5, 3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.convert(model)
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    for name, why in (("0", "float64"), ("1", "empty weight"), ("3.out_proj", "NonDynamicallyQuantizableLinear")):
        assert f"{name} (" in message and why in message
    assert type(model[0]) is nn.Linear and type(model[1]) is nn.Linear and type(model[2]) is engine.Linear
    assert type(attention.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear


@pytest.mark.parametrize("fp8_weights", [False, True])
@pytest.mark.parametrize("recipe", [cls.__name__ for cls in checkpoint_specs.exported_recipe_classes()])
def test_every_recipe_takes_every_shape(recipe, fp8_weights):
    """No shape is skipped, under every recipe `engine.recipes` exports: partial blocks, dims of 1 and odd sizes run
    forward and backward, the output within twice the bound of fprop's two quantized operands
    (tests/conformance/bounds.py; twice: 3 x 1 outputs are too few values for its RMS estimate): rounding, not
    garbage."""
    from conformance import bounds
    from engine.recipes import Gemm, Role

    r = checkpoint_specs.make_recipe(recipe)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 7), nn.Linear(7, 129), nn.Linear(129, 33), nn.Linear(33, 1))
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.convert(model, keep_output_head=False, fp8_weights=fp8_weights, recipe=r if fp8_weights else None)
    assert all(isinstance(m, engine.Linear) for m in model)
    for layer, plain in zip(model, reference):
        x = torch.randn(3, plain.in_features)
        for _ in range(2):  # the second step runs on delayed scales learned from the first
            with engine.fp8_autocast(recipe=r):
                y = layer(x)
        y.sum().backward()
        want = plain(x)
        fprop = [layer._fwd_state.operand((Gemm.FPROP, role)) for role in (Role.INPUT, Role.WEIGHT)]
        errors = [bounds.use_error(q, t) for q, t in zip(fprop, (x, plain.weight))]
        bound = 2 * max(bounds.FP32_BOUND, bounds.SAFETY * (errors[0] ** 2 + errors[1] ** 2) ** 0.5)
        assert bound < 1
        assert (y - want).norm() <= bound * want.norm(), ((y - want).norm() / want.norm(), bound)
        assert layer.weight.grad is not None and layer.bias.grad is not None


@pytest.mark.parametrize("recipe", ["current", "mxfp8"])
def test_a_recipe_without_fp8_weights_is_refused_with_the_fix(recipe):
    """The recipe a converted model computes under is the fp8_autocast's (Transformer Engine's rule); convert's
    recipe= only makes FP8 primary weights, so alone it would be ignored: refused, the model left as it was."""
    model = PlainNet()
    with pytest.raises(ValueError, match=r"recipe: \w+\(\.\.\.\) given without fp8_weights=True.*"
                                         r"engine\.fp8_autocast\(recipe=\.\.\.\).*fp8_weights=True"):
        engine.convert(model, recipe=RECIPES[recipe])
    assert not any(isinstance(m, engine.Linear) for m in model.modules())
    engine.convert(model, recipe=None)  # the default and the fix
    assert isinstance(model.body[1], engine.Linear)


# ---------------------------------------------------------------------------- FP8 primary weights
def test_fp8_weights_are_the_weights_rounded_to_e4m3():
    original, model = converted("llama", fp8_weights=True, recipe=DelayedScaling())
    for (name, new), old in zip(model.named_modules(), original.modules()):
        if type(old) is nn.Linear and name != "lm_head":
            assert isinstance(new.weight, QuantizedTensor) and new.weight.requires_grad, name
            # a fresh delayed-scaling quantizer has scale 1: the value is torch's own E4M3 cast
            assert torch.equal(new.weight.dequantize(), old.weight.detach().to(torch.float8_e4m3fn).float()), name
    assert type(model.lm_head.weight) is nn.Parameter
    ids = token_ids()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with engine.fp8_autocast(recipe=DelayedScaling()):
        loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    assert isinstance(model.model.layers[0].mlp.up_proj.weight, QuantizedTensor)


def test_fp8_weights_keep_requires_grad_and_skip_tied_weights():
    original = gpt2()
    original.transformer.h[0].mlp.c_fc.weight.requires_grad_(False)
    with pytest.warns(UserWarning, match=r"lm_head keep\(s\) a high-precision weight: it is tied") as caught:
        model = engine.convert(original, keep_output_head=False, fp8_weights=True, recipe=Float8CurrentScaling())
    assert len(caught) == 1
    assert model.lm_head.weight is model.transformer.wte.weight and type(model.lm_head) is engine.Linear
    c_fc = model.transformer.h[0].mlp.c_fc
    assert isinstance(c_fc.weight, QuantizedTensor) and not c_fc.weight.requires_grad


def test_fp8_conv1d_checkpoint_loads_into_plain_gpt2():
    original, model = converted("gpt2", fp8_weights=True, recipe=DelayedScaling())
    plain = gpt2(seed=4)
    plain.load_state_dict(no_extra_state(model.state_dict()))
    c_attn = model.transformer.h[1].attn.c_attn
    assert torch.equal(plain.transformer.h[1].attn.c_attn.weight, c_attn.weight.dequantize().t())
    model.load_state_dict(original.state_dict())  # plain GPT-2 weights requantized into the FP8 ones
    assert torch.equal(c_attn.weight.dequantize().t(),
                       original.transformer.h[1].attn.c_attn.weight.detach().to(torch.float8_e4m3fn).float())


# ---------------------------------------------------------------------------- fused norms
def test_fuse_norms_in_sequential_and_back():
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.RMSNorm(64), nn.Linear(64, 16),
                          nn.LayerNorm(16, bias=False), nn.Linear(16, 8))
    with torch.no_grad():
        for m in model:
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
                m.weight.uniform_(0.5, 1.5)
    original, x = copy.deepcopy(model), torch.randn(5, 32)
    state, norm_weight = original.state_dict(), model[0].weight
    engine.convert(model, fuse_norms=True, keep_output_head=False)
    assert [type(m) for m in model] == [nn.Identity, engine.LayerNormLinear, nn.GELU, nn.Identity,
                                        engine.LayerNormLinear, nn.Identity, engine.LayerNormLinear]
    assert model[4].normalization == "RMSNorm" and model[6].layer_norm_bias is None
    assert model[1].layer_norm_weight is norm_weight
    assert torch.equal(model(x), original(x))
    with engine.fp8_autocast(recipe=RECIPES["mxfp8"]):
        model(x).sum().backward()
    assert model[1].layer_norm_weight.grad is not None
    engine.unconvert(model)
    assert [type(m) for m in model] == [type(m) for m in original]
    model.load_state_dict(state, strict=True)
    assert torch.equal(model(x), original(x))


def test_fuse_norms_says_when_nothing_is_fused():
    with pytest.warns(UserWarning, match="nothing was fused"):
        engine.convert(llama(), fuse_norms=True)


# ---------------------------------------------------------------------------- unconvert
def test_unconvert_dequantizes_fp8_weights_and_leaves_what_torch_cannot_express():
    original, model = converted("qwen2", fp8_weights=True, recipe=Float8BlockScaling())
    up = model.model.layers[0].mlp.up_proj
    expected, up.weight.main_grad = up.weight.dequantize(), torch.zeros(96, 64)
    model.model.layers[1].mlp.down_proj = engine.Linear(96, 64, return_bias=True)
    with pytest.warns(UserWarning, match=r"model.layers.1.mlp.down_proj stay engine.Linear"):
        engine.unconvert(model)
    weight = model.model.layers[0].mlp.up_proj.weight
    assert type(model.model.layers[0].mlp.up_proj) is nn.Linear and type(weight) is nn.Parameter
    assert torch.equal(weight, expected) and weight.main_grad is up.weight.main_grad
    assert set(vars(weight)) == {"main_grad"}  # not the quantized tensor's internals
    assert type(model.model.layers[1].mlp.down_proj) is engine.Linear


# ---------------------------------------------------------------------------- generate
@pytest.mark.parametrize("name,recipe", [("llama", "delayed"), ("gpt2", "mxfp8"), ("qwen2", "block"),
                                         ("llama", "current")])
def test_generate_under_fp8_autocast(name, recipe):
    original, model = converted(name)
    original.eval(), model.eval()
    prompt = token_ids(batch=2, seq=5)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=1)
    assert torch.equal(model.generate(prompt, **kwargs), original.generate(prompt, **kwargs))
    with engine.fp8_autocast(recipe=RECIPES[recipe]):
        out = model.generate(prompt, **kwargs)
    assert out.shape == (2, 9) and torch.equal(out[:, :5], prompt)
    q_layer = model.model.layers[0].self_attn.q_proj if name != "gpt2" else model.transformer.h[0].attn.c_attn
    assert q_layer._recipe == RECIPES[recipe]  # the layers ran under the recipe


# ---------------------------------------------------------------------------- training tracks bf16
TEXT = (pathlib.Path(json.__file__).parent / "decoder.py").read_bytes()


def batches(steps: int, batch: int = 4, seq: int = 32):
    data = torch.tensor(list(TEXT), dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq, (batch,), generator=g)
        yield torch.stack([data[s:s + seq] for s in starts])


def train(model: nn.Module, recipe=None, steps: int = 30) -> list[float]:
    """AdamW steps with fp32 master weights under torch.autocast(bf16); FP8 GEMMs too when `recipe`."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for ids in batches(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16), engine.fp8_autocast(enabled=recipe is not None,
                                                                               recipe=recipe):
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def final_loss(losses: list[float]) -> float:
    return sum(losses[-5:]) / 5


@functools.lru_cache(maxsize=None)
def bf16_final_loss(name: str) -> float:
    """The original model's final loss (mean of the last 5 of 30 steps) in bf16."""
    losses = train(MODELS[name]())
    assert final_loss(losses) < 0.8 * losses[0]  # it learns
    return final_loss(losses)


def training_gap(name: str, recipe: str) -> float:
    """The converted model's final loss under `recipe`, in % of the original's in bf16."""
    bf16 = bf16_final_loss(name)
    return 100 * (final_loss(train(engine.convert(MODELS[name]()), RECIPES[recipe])) - bf16) / bf16


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_training_tracks_bf16(name, recipe):
    gap = training_gap(name, recipe)
    assert abs(gap) < 5.0, gap  # measured: within 2% (the table `python tests/test_convert.py` prints)


# ---------------------------------------------------------------------------- Transformer Engine 2.x names
def test_te2_names():
    assert list(inspect.signature(engine.autocast).parameters) == [
        "enabled", "calibrating", "recipe", "amax_reduction_group"]  # transformer_engine.pytorch.autocast's
    assert callable(engine.autocast.register_forward_state)  # still the module
    recipe = Float8CurrentScaling()
    with engine.autocast(recipe=recipe, amax_reduction_group=None):
        assert engine.autocast.is_fp8_enabled() and engine.autocast.get_recipe() is recipe
    with engine.autocast(enabled=False, calibrating=True):
        assert engine.autocast.is_calibrating() and not engine.autocast.is_fp8_enabled()
    assert not engine.autocast.is_fp8_enabled()
    with pytest.raises(TypeError, match="recipe"):
        with engine.autocast(recipe="delayed"):
            pass
    with engine.quantized_model_init(recipe=RECIPES["mxfp8"]):
        layer = engine.Linear(32, 32)
    assert isinstance(layer.weight, QuantizedTensor)
    assert list(inspect.signature(engine.quantized_model_init).parameters) == [
        "enabled", "recipe", "preserve_high_precision_init_val"]


def test_delayed_scaling_updates_when_te2_autocast_exits():
    layer = engine.convert(nn.Linear(16, 16), keep_output_head=False)
    x = torch.full((4, 16), 3.0)
    recipe = DelayedScaling(amax_history_len=4)
    with engine.autocast(recipe=recipe):
        layer(x)
    assert layer._fwd_state.scale[0] == 448 / 3  # the input's scale, from its amax


# ---------------------------------------------------------------------------- bad arguments
@pytest.mark.parametrize("kwargs,name", [
    ({"module_filter": 3}, "module_filter"), ({"keep_output_head": "yes"}, "keep_output_head"),
    ({"fp8_weights": 1}, "fp8_weights"), ({"recipe": "delayed"}, "recipe"), ({"fuse_norms": None}, "fuse_norms"),
])
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises(TypeError, match=name):
        engine.convert(nn.Sequential(nn.Linear(4, 4)), **kwargs)


def test_bad_model_and_filter_results():
    for fn in (engine.convert, engine.unconvert):
        with pytest.raises(TypeError, match="model: expected a torch.nn.Module, got str"):
            fn("gpt2")
    with pytest.raises(TypeError, match=r"module_filter: expected it to return a bool, got 1 for '0'"):
        engine.convert(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), module_filter=lambda fqn, m: 1)


if __name__ == "__main__":
    torch.set_num_threads(1)
    print("| model | bf16 loss | " + " | ".join(RECIPES) + " |\n|---|---|" + "---|" * len(RECIPES))
    for model_name in ("llama", "gpt2", "qwen2"):
        gaps = [f"{training_gap(model_name, key):+.2f}%" for key in RECIPES]
        print(f"| {model_name} | {bf16_final_loss(model_name):.4f} | " + " | ".join(gaps) + " |")
