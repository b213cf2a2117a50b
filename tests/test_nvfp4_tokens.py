"""NVFP4 training on token counts that are not a multiple of 16 (a 2x15 batch).

The RHT of the columnwise (wgrad) usage mixes 16 tokens, so the layers quantize that usage of x and dy
from zero-padded copies; fprop and dgrad read rowwise data of the unpadded tensors. These tests check
that the padding rows change no other row's result, against independent computations: the same layer
on a larger batch whose extra tokens are zeros, the executable spec on explicitly padded operands with
a float64 GEMM, and the layer without a weight gradient (where nothing is padded).
"""

from __future__ import annotations

import copy

import pytest
import torch

import engine
from engine.autocast import fp8_autocast
from engine.ops import nvfp4, nvfp4_sr
from engine.quantizers import NVFP4Quantizer
from engine.recipes import NVFP4BlockScaling, OperandRecipe, QuantizerSpec

NO_SR = {
    "rht": NVFP4BlockScaling(disable_stochastic_rounding=True),
    "1d": NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True),
    "1d_weights_1d": NVFP4BlockScaling(disable_rht=True, disable_2d_quantization=True,
                                       disable_stochastic_rounding=True),
}


def _step(layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, recipe) -> tuple[torch.Tensor, ...]:
    """(out, dx, dW) of one forward and backward under `recipe`."""
    x = x.clone().requires_grad_()
    with fp8_autocast(recipe=recipe):
        out = layer(x)
    out.backward(grad)
    dw = layer.weight.grad if layer.weight.requires_grad else None
    return out.detach(), x.grad, dw


@pytest.mark.parametrize("recipe", NO_SR.values(), ids=NO_SR.keys())
@pytest.mark.parametrize("k, n", [(48, 40), (40, 24)])  # K and N not multiples of 16 either: partial blocks, tiles
def test_padding_equals_zero_tokens_in_a_larger_batch(recipe, k, n):
    """2x15 tokens give the out, dx and dW bits of the same 30 tokens followed by 2 zero tokens (a batch of
    32, which needs no padding): zero rows change no block amax, and meet zero gradient rows in wgrad."""
    torch.manual_seed(0)
    small = engine.Linear(k, n, bias=False)
    large = copy.deepcopy(small)
    gen = torch.Generator().manual_seed(1)
    x, grad = torch.randn(2, 15, k, generator=gen), torch.randn(2, 15, n, generator=gen)
    out, dx, dw = _step(small, x, grad, recipe)
    out32, dx32, dw32 = _step(large, torch.cat([x.reshape(30, k), torch.zeros(2, k)]),
                              torch.cat([grad.reshape(30, n), torch.zeros(2, n)]), recipe)
    assert out.shape == (2, 15, n) and dx.shape == (2, 15, k)
    assert torch.equal(out.reshape(30, n), out32[:30])
    assert torch.equal(dx.reshape(30, k), dx32[:30])
    assert torch.equal(dw, dw32)


def _rht_columnwise(t: torch.Tensor, rbits_t: torch.Tensor | None = None) -> torch.Tensor:
    """The executable spec's columnwise RHT usage of t [M', C], decoded: the transformed t^T [C, M'] (fp64)."""
    q = nvfp4.quantize(t, rowwise=False, columnwise=True, rht=True, rbits_t=rbits_t)
    return nvfp4.dequantize_2d(q["columnwise_data"], q["columnwise_scale_inv"], q["amax_columnwise"],
                               t.shape[0]).double()


def test_padded_wgrad_is_the_spec_on_explicitly_padded_operands():
    """TE's defaults (RHT, stochastic rounding of dy): dW equals the executable spec applied to x and dy with
    2 zero rows appended (dy's columnwise bits drawn where the layer's counter stands after its rowwise
    dy), multiplied in float64; out and dx equal the layer's without a weight gradient, which pads nothing."""
    recipe = NVFP4BlockScaling()
    torch.manual_seed(0)
    layer = engine.Linear(48, 40, bias=False)
    frozen = copy.deepcopy(layer)
    frozen.weight.requires_grad_(False)
    gen = torch.Generator().manual_seed(1)
    x, grad = torch.randn(2, 15, 48, generator=gen), torch.randn(2, 15, 40, generator=gen)

    torch.manual_seed(7)  # the stochastic-rounding stream, drawn when a module builds its states
    with fp8_autocast(recipe=recipe):
        layer(torch.zeros(16, 48))  # builds the states; quantizes no gradient
    counter = layer._bwd_state.rng_counters[0].clone()
    out, dx, dw = _step(layer, x, grad, recipe)

    x32 = torch.cat([x.reshape(30, 48), torch.zeros(2, 48)])
    dy32 = torch.cat([grad.reshape(30, 40), torch.zeros(2, 40)])
    at_columnwise = counter + torch.tensor([0, 30 * 40])  # the rowwise dy of dgrad drew 30 x 40 bits first
    rbits_t = nvfp4_sr.random_bits((40, 32), at_columnwise)
    want = _rht_columnwise(dy32, rbits_t) @ _rht_columnwise(x32).t()
    torch.testing.assert_close(dw.double(), want, rtol=1e-5, atol=1e-6)
    assert layer._bwd_state.rng_counters[0].tolist() == (at_columnwise + torch.tensor([0, 40 * 32])).tolist()
    exact = grad.reshape(30, 40).double().t() @ x.reshape(30, 48).double()
    assert (dw.double() - exact).norm() / exact.norm() < 0.2  # and it is still dW

    torch.manual_seed(7)
    with fp8_autocast(recipe=recipe):
        frozen(torch.zeros(16, 48))
    assert torch.equal(frozen._bwd_state.rng_counters[0], counter)
    out_frozen, dx_frozen, _ = _step(frozen, x, grad, recipe)
    assert torch.equal(out, out_frozen)
    assert torch.equal(dx, dx_frozen)


@pytest.mark.parametrize("plain", ["wgrad_input", "wgrad_grad_output"])
def test_a_high_precision_wgrad_operand_meets_a_padded_one(plain):
    """A recipe that keeps one wgrad operand in high precision and the other NVFP4 with the RHT: the plain one
    gets the same zero rows, and dW is that of the fp64 product of the plain operand and the other dequantized."""
    rht = QuantizerSpec(layout="nvfp4", element="e2m1", scaling="nvfp4", rht=True)
    tiles = QuantizerSpec(layout="nvfp4", element="e2m1", scaling="nvfp4", two_d=True)
    operands = {"fprop_input": rht, "fprop_weight": tiles, "dgrad_grad_output": rht, "dgrad_weight": tiles,
                "wgrad_input": rht, "wgrad_grad_output": rht}
    recipe = OperandRecipe(operands={**operands, plain: None})
    torch.manual_seed(0)
    layer = engine.Linear(32, 24, bias=False)
    gen = torch.Generator().manual_seed(1)
    x, grad = torch.randn(30, 32, generator=gen), torch.randn(30, 24, generator=gen)
    _, _, dw = _step(layer, x, grad, recipe)
    quantizer = NVFP4Quantizer(with_rht=True, rowwise=False, columnwise=True)
    pad = 2
    if plain == "wgrad_input":
        dy = quantizer.quantize_storage(torch.cat([grad, torch.zeros(pad, 24)])).dequantize().double()
        want = dy[:30].t() @ x.double()  # rows 30, 31 of dy's dequantized value meet x's zero rows
    else:
        xq = quantizer.quantize_storage(torch.cat([x, torch.zeros(pad, 32)])).dequantize().double()
        want = grad.double().t() @ xq[:30]
    torch.testing.assert_close(dw.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("two_d", [False, True], ids=["1x16", "16x16"])
def test_other_usages_take_any_token_count(two_d):
    """Without the RHT (1x16 blocks, 16x16 tiles) every usage takes 30 rows: the buffers are those of the 32
    rows with 2 zero rows appended, cut to the 30 real rows (a partial block is a zero-padded one)."""
    x = torch.randn(30, 40, generator=torch.Generator().manual_seed(3))
    quantizer = NVFP4Quantizer(with_2d_quantization=two_d)
    got = quantizer.quantize_storage(x)
    padded = quantizer.quantize_storage(torch.cat([x, torch.zeros(2, 40)]))
    assert torch.equal(got.rowwise_data, padded.rowwise_data[:30])
    assert torch.equal(got.rowwise_scale_inv.view(torch.uint8), padded.rowwise_scale_inv[:30].view(torch.uint8))
    assert torch.equal(got.columnwise_data, padded.columnwise_data[:, :15])  # 30 codes, two per byte
    assert torch.equal(got.columnwise_scale_inv.view(torch.uint8), padded.columnwise_scale_inv.view(torch.uint8))
    assert torch.equal(got.amax_rowwise, padded.amax_rowwise) and torch.equal(got.amax_columnwise,
                                                                               padded.amax_columnwise)
    # and it is x: an E2M1 element is off by at most one unit (the top step's half) of its block scale amax_b / 6
    assert (got.dequantize() - x).abs().max() <= x.abs().max() / 6 * 1.07


def test_hugging_face_llama_trains_on_2x15_tokens():
    """A tiny converted Llama, a 2x15 batch, TE's NVFP4 defaults: forward and backward run, every gradient is
    finite, and the loss and gradients stay near the high-precision model's."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=1, pad_token_id=1))
    model = engine.convert(model)
    ids = torch.randint(2, 128, (2, 15), generator=torch.Generator().manual_seed(1))

    def loss_and_grads(recipe):
        model.zero_grad()
        with fp8_autocast(enabled=recipe is not None, recipe=recipe):
            loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

    base_loss, base_grads = loss_and_grads(None)
    loss, grads = loss_and_grads(NVFP4BlockScaling())
    assert abs(loss - base_loss) < 0.02 * base_loss
    assert all(torch.isfinite(g).all() for g in grads.values())
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        cos = torch.nn.functional.cosine_similarity(grads[name].flatten(), base_grads[name].flatten(), dim=0)
        assert cos > 0.9, (name, cos)
