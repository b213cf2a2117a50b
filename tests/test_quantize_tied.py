"""engine.quantize_ and tied weights: a tie between quantized layers holds (one quantized copy), a weight tied
to a module quantize_ does not quantize (GPT-2's output head and its input embedding) stays in high precision
with a warning; memory never grows, outputs and save/reload are right."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch

import engine
from engine.inference import Int8WeightOnly, QuantizedWeight

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def gpt2(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=1, pad_token_id=1))
    return model.eval()


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct tensor the model's parameters hold (a QuantizedWeight's storage buffers and GEMM
    operands; a tie counted once)."""
    seen, total = set(), 0
    for _, param in model.named_parameters(remove_duplicate=False):
        tensors = [param]
        if isinstance(param, QuantizedWeight):
            tensors = [*param.operands.values(), *(t for t in param.storage.buffers().values() if t is not None)]
        for t in tensors:
            key = (t.untyped_storage().data_ptr(), t.storage_offset())
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


def saved_and_loaded(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("converted", [False, True], ids=["hf-gpt2", "converted-gpt2"])
def test_gpt2_tied_head_stays_tied_with_a_warning(converted):
    model = gpt2()
    if converted:  # its Conv1D layers become engine.Linear, which quantize_ takes; the head stays an nn.Linear
        engine.convert(model)
    reference = copy.deepcopy(model)
    before = held_bytes(model)
    with pytest.warns(UserWarning, match=r"lm_head\.weight is tied to transformer\.wte\.weight \(Embedding\)"):
        engine.quantize_(model, Int8WeightOnly())
    assert model.lm_head.weight is model.transformer.wte.weight
    assert type(model.lm_head.weight) is torch.nn.Parameter
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)
    quantized = [m for m in model.modules() if isinstance(getattr(m, "weight", None), QuantizedWeight)]
    assert len(quantized) == (8 if converted else 0)  # c_attn, c_proj, c_fc, mlp.c_proj per block
    assert held_bytes(model) <= before  # nothing is held twice
    with torch.no_grad():
        logits, want = model(IDS).logits, reference(IDS).logits
    if converted:  # int8 weights: a small, not a large, change
        assert (logits - want).norm() <= 0.02 * want.norm()
    else:  # nothing quantized: the same logits
        assert torch.equal(logits, want)

    state = saved_and_loaded(model.state_dict())
    fresh = gpt2(seed=7)
    if converted:
        engine.convert(fresh)
    with pytest.warns(UserWarning, match="tied weight"):
        engine.quantize_(fresh, Int8WeightOnly())
    fresh.load_state_dict(state)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    with torch.no_grad():
        assert torch.equal(fresh(IDS).logits, logits)


def test_untied_head_is_quantized_without_a_warning():
    model = gpt2()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # the fix the warning names
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.quantize_(model, Int8WeightOnly())
    assert isinstance(model.lm_head.weight, QuantizedWeight)
    assert type(model.transformer.wte.weight) is torch.nn.Parameter


def test_module_filter_leaving_the_head_out_silences_the_warning():
    model = gpt2()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.quantize_(engine.convert(model), Int8WeightOnly(), module_filter=lambda fqn, m: fqn != "lm_head")
    assert model.lm_head.weight is model.transformer.wte.weight


class TiedPair(torch.nn.Module):
    """Two Linear layers sharing one weight (an encoder and a decoder with the same square map)."""

    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = torch.nn.Linear(32, 32)
        self.dec = torch.nn.Linear(32, 32)
        if tie:
            self.dec.weight = self.enc.weight

    def forward(self, x):
        return self.dec(torch.relu(self.enc(x)))


def test_a_weight_tied_between_quantized_layers_is_quantized_once_and_stays_tied():
    model, untied = TiedPair(), TiedPair(tie=False)
    with torch.no_grad():
        untied.dec.weight.copy_(untied.enc.weight)  # the same values, held twice
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.quantize_(model, Int8WeightOnly())
    engine.quantize_(untied, Int8WeightOnly())
    assert isinstance(model.enc.weight, QuantizedWeight) and model.dec.weight is model.enc.weight
    assert held_bytes(model) < held_bytes(untied)  # one quantized copy instead of two
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    assert torch.equal(model(x), untied(x))  # each layer quantized on its own gives the same bits

    fresh = TiedPair()
    with torch.no_grad():
        fresh.enc.weight.mul_(3)
    engine.quantize_(fresh, Int8WeightOnly())
    fresh.load_state_dict(saved_and_loaded(model.state_dict()))
    assert fresh.dec.weight is fresh.enc.weight and torch.equal(fresh(x), model(x))


def test_a_weight_tied_to_a_filtered_out_layer_is_left_alone():
    model = TiedPair()
    with pytest.warns(UserWarning, match=r"enc\.weight is tied to dec\.weight \(Linear\)"):
        engine.quantize_(model, Int8WeightOnly(), module_filter=lambda fqn, m: fqn == "enc")
    assert type(model.enc.weight) is torch.nn.Parameter and model.dec.weight is model.enc.weight
