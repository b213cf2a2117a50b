"""Linear, LayerNormLinear, LayerNormMLP: torch-equivalent outside fp8_autocast, FP8 GEMMs inside."""

import pytest
import torch
import torch.nn.functional as F

import engine
from engine import autocast
from engine.autocast import fp8_autocast, fp8_model_init
from engine.modules.activations import ACTIVATIONS
from engine.recipes import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling, Role
from engine.tensors import QuantizedTensor

RECIPES = {
    "delayed": DelayedScaling(amax_history_len=4),
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
}
# Tolerances (relative Frobenius norm of the error) justified by the formats: a rounded FP8 value
# is within u = 2^-(mantissa bits + 1) of the true value (E4M3: 2^-4, E5M2: 2^-3), so a product
# of two rounded operands is within about u_a + u_b. Outputs multiply two E4M3 operands (2^-3);
# gradients multiply a gradient (E5M2 under HYBRID) by an E4M3 operand (2^-3 + 2^-4).
FWD_TOL = 2.0**-3
BWD_TOL = 2.0**-3 + 2.0**-4


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def make(kind, **kw):
    torch.manual_seed(0)
    if kind == "linear":
        return engine.Linear(64, 96, **kw)
    if kind == "lnlinear":
        return engine.LayerNormLinear(64, 96, **kw)
    return engine.LayerNormMLP(64, 128, **kw)


def torch_reference(module, x):
    """The same computation with plain torch modules/ops and the same parameters."""
    if isinstance(module, engine.Linear):
        return F.linear(x, module.weight, module.bias)  # what torch.nn.Linear computes
    gamma = module.layer_norm_weight + (1 if module.zero_centered_gamma else 0)
    if module.normalization == "LayerNorm":
        h = F.layer_norm(x, (x.shape[-1],), gamma, module.layer_norm_bias, module.eps)
    else:
        h = F.rms_norm(x, (x.shape[-1],), gamma, module.eps)
    if isinstance(module, engine.LayerNormLinear):
        return F.linear(h, module.weight, module.bias)
    return F.linear(ACTIVATIONS[module.activation](F.linear(h, module.fc1_weight, module.fc1_bias)),
                    module.fc2_weight, module.fc2_bias)


def grads(module, x, out):
    x.grad = None
    module.zero_grad()
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
    out.backward(upstream)
    return {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in module.named_parameters()}}


# ---------------------------------------------------------------------------- high precision
@pytest.mark.parametrize("kind, kw", [
    ("linear", {}), ("linear", {"bias": False}), ("lnlinear", {}), ("lnlinear", {"normalization": "RMSNorm"}),
    ("lnlinear", {"zero_centered_gamma": True}), ("mlp", {}), ("mlp", {"activation": "swiglu"}),
    ("mlp", {"activation": "geglu", "normalization": "RMSNorm"}), ("mlp", {"activation": "relu"}),
    ("mlp", {"activation": "silu"}),
])
def test_outside_autocast_modules_match_torch(kind, kw):
    module = make(kind, **kw)
    x = torch.randn(3, 5, 64, requires_grad=True)
    out = module(x)
    got = grads(module, x, out)
    want_out = torch_reference(module, x)
    want = grads(module, x, want_out)
    assert torch.allclose(out, want_out, rtol=1e-5, atol=1e-6)
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=1e-4, atol=1e-5), name


# ---------------------------------------------------------------------------- FP8
@pytest.mark.parametrize("recipe", RECIPES, ids=str)
@pytest.mark.parametrize("kind", ["linear", "lnlinear", "mlp"])
@pytest.mark.parametrize("shape", [(64, 64), (2, 48, 64), (4, 8, 32, 64)])
def test_fp8_outputs_and_gradients_are_within_the_format_tolerance(recipe, kind, shape):
    module = make(kind)
    torch.manual_seed(1)
    x = torch.randn(*shape, requires_grad=True)
    want_out = module(x)
    want = grads(module, x, want_out)
    for _ in range(2):  # the second step runs delayed scaling with scales learned in the first
        with fp8_autocast(recipe=RECIPES[recipe]):
            out = module(x)
        got = grads(module, x, out)
    assert out.shape == want_out.shape and out.dtype == want_out.dtype
    assert rel(out, want_out) < FWD_TOL
    for name in want:
        assert rel(got[name], want[name]) < BWD_TOL, name
    assert rel(out, want_out) > 0  # it really ran in FP8


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
def test_fp8_linear_is_the_gemm_of_its_quantized_operands(recipe):
    """Tight check: fprop equals x_q W_q^T of the operands the recipe's quantizers make."""
    module = make("linear")
    x = torch.randn(64, 64)
    r = RECIPES[recipe]
    with fp8_autocast(recipe=r):
        module(x)  # builds the states; delayed scaling updates its scales at exit
    state = module._fwd_state
    xq = state.quantizer(Role.INPUT).copy()
    wq = state.quantizer(Role.WEIGHT).copy()
    if state.needs_update:
        snapshot = state.scale.clone(), state.amax_history.clone()
    want = F.linear(xq(x).dequantize().double(), wq(module.weight.detach()).dequantize().double(),
                    module.bias.double())
    if state.needs_update:
        state.scale.copy_(snapshot[0])
        state.amax_history.copy_(snapshot[1])
    with fp8_autocast(recipe=r):
        out = module(x)
    assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-5)


def test_bf16_inputs_and_parameters_stay_bf16():
    module = engine.LayerNormMLP(64, 128, params_dtype=torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    with fp8_autocast(recipe=MXFP8BlockScaling()):
        out = module(x)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert all(p.grad.dtype == torch.bfloat16 for p in module.parameters())


def saved_bytes(fn):
    """Bytes of the distinct tensors autograd saves for backward while fn runs."""
    seen = {}

    def pack(t):
        seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
def test_fp8_linear_saves_about_half_the_activation_bytes_of_bf16(recipe):
    module = engine.Linear(256, 256, params_dtype=torch.bfloat16)
    x = torch.randn(4, 64, 256, dtype=torch.bfloat16, requires_grad=True)
    bf16 = saved_bytes(lambda: module(x))

    def fp8_step():
        with fp8_autocast(recipe=RECIPES[recipe]):
            module(x)

    ratio = saved_bytes(fp8_step) / bf16
    # input and weight saved as one FP8 byte per element instead of two, plus the scales
    assert 0.5 <= ratio <= 0.53


def test_weight_cache_across_microbatches():
    module = make("linear")
    recipe = Float8CurrentScaling()
    x = torch.randn(16, 64)
    with fp8_autocast(recipe=recipe):
        first = module(x, is_first_microbatch=True)
        with torch.no_grad():
            module.weight.mul_(3)  # a change the cache must not see
        cached = module(x, is_first_microbatch=False)
        fresh = module(x, is_first_microbatch=None)
    assert torch.equal(first, cached)
    assert not torch.allclose(fresh, cached)


def test_cached_weight_slot_is_held_under_delayed_scaling():
    module = make("linear")
    recipe = DelayedScaling(amax_history_len=4)
    x = torch.randn(16, 64)
    with fp8_autocast(recipe=recipe):
        module(x, is_first_microbatch=True)
    weight_slot = module._fwd_state.slot(Role.WEIGHT)
    history_before = module._fwd_state.amax_history[:, weight_slot].clone()
    with fp8_autocast(recipe=recipe):
        module(x, is_first_microbatch=False)
    assert torch.equal(module._fwd_state.amax_history[:, weight_slot], history_before)


def test_fuse_wgrad_accumulation_adds_into_main_grad():
    for fp8 in (False, True):
        module = make("linear", fuse_wgrad_accumulation=True)
        module.weight.main_grad = torch.ones_like(module.weight)
        x = torch.randn(8, 64, requires_grad=True)
        with fp8_autocast(enabled=fp8, recipe=Float8CurrentScaling()):
            out = module(x)
        out.sum().backward()
        assert module.weight.grad is None
        want = torch.ones(96, 64) + torch.ones(8, 96).t() @ x.detach()
        tol = BWD_TOL if fp8 else 1e-6
        assert rel(module.weight.main_grad, want) < tol


def test_fuse_wgrad_accumulation_without_main_grad_is_a_clear_error():
    module = make("linear", fuse_wgrad_accumulation=True)
    out = module(torch.randn(4, 64, requires_grad=True))
    with pytest.raises(ValueError, match="main_grad"):
        out.sum().backward()


def test_return_bias_and_return_layernorm_output():
    module = make("lnlinear", return_bias=True, return_layernorm_output=True)
    x = torch.randn(4, 64)
    out, bias, ln_out = module(x)
    assert bias is module.bias
    assert torch.allclose(out + bias, torch_reference(module, x), atol=1e-6)
    assert torch.allclose(ln_out, F.layer_norm(x, (64,), module.layer_norm_weight, module.layer_norm_bias))


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
def test_fp8_primary_weights_train(recipe):
    r = RECIPES[recipe]
    with fp8_model_init(recipe=r):
        module = make("mlp")
    assert isinstance(module.fc1_weight, QuantizedTensor) and isinstance(module.fc2_weight, QuantizedTensor)
    x = torch.randn(64, 64, requires_grad=True)
    with fp8_autocast(recipe=r):
        out = module(x)
    out.sum().backward()
    assert module.fc1_weight.grad is not None and module.fc1_weight.grad.dtype == torch.float32
    assert module.fc1_weight.grad.shape == module.fc1_weight.shape
    hp = torch.nn.functional.linear(x.detach(), module.fc1_weight.dequantize())
    assert hp.isfinite().all() and out.isfinite().all()


def test_delayed_scales_update_after_a_module_step():
    module = make("linear")
    recipe = DelayedScaling(amax_history_len=2)
    x = torch.full((4, 64), 2.0, requires_grad=True)
    with fp8_autocast(recipe=recipe):
        out = module(x)
    fwd, bwd = module._fwd_state, module._bwd_state
    assert fwd.scale[fwd.slot(Role.INPUT)].item() == 224.0  # 448 / 2
    assert bwd.scale.tolist() == [1.0, 1.0]  # not before backward
    out.backward(torch.full_like(out, 4.0))
    assert bwd.scale[bwd.slot(Role.GRAD_OUTPUT)].item() == 57344.0 / 4  # HYBRID: E5M2 gradients


def test_calibration_through_a_module_sets_the_first_fp8_scales():
    module = make("linear")
    recipe = DelayedScaling(amax_history_len=2, fp8_format=Format.E4M3)
    x = torch.full((4, 64), 7.0)
    with fp8_autocast(enabled=False, calibrating=True, recipe=recipe):
        out = module(x)
    assert torch.equal(out, torch_reference(module, x))  # calibration runs in high precision
    fwd = module._fwd_state
    assert fwd.scale[fwd.slot(Role.INPUT)].item() == 64.0  # 448 / 7
    w_amax = module.weight.detach().abs().max()
    assert fwd.scale[fwd.slot(Role.WEIGHT)].item() == (torch.tensor(448.0) / w_amax).item()


def test_bad_inputs_and_arguments_give_clear_errors():
    module = make("linear")
    with pytest.raises(ValueError, match="last dim must be 64"):
        module(torch.randn(4, 63))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        module(torch.ones(4, 64, dtype=torch.int64))
    with pytest.raises(ValueError, match="in_features"):
        engine.Linear(0, 4)
    with pytest.raises(ValueError, match="normalization"):
        engine.LayerNormLinear(8, 8, normalization="BatchNorm")
    with pytest.raises(ValueError, match="activation"):
        engine.LayerNormMLP(8, 8, activation="tanh")
    with pytest.raises(ValueError, match="block_scaling_dim"):
        Float8BlockScaling(x_block_scaling_dim=3)
    assert not autocast.is_fp8_enabled()


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
def test_token_counts_that_are_not_block_multiples(recipe):
    """10 tokens and 40 features: partial 32-blocks and 128-tiles along both dims."""
    torch.manual_seed(3)
    module = engine.Linear(40, 24)
    x = torch.randn(2, 5, 40, requires_grad=True)
    want_out = module(x)
    want = grads(module, x, want_out)
    with fp8_autocast(recipe=RECIPES[recipe]):
        out = module(x)
    got = grads(module, x, out)
    assert rel(out, want_out) < FWD_TOL
    for name in want:
        assert rel(got[name], want[name]) < BWD_TOL, name


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
def test_no_grad_forward_quantizes_only_what_fprop_reads(recipe, monkeypatch):
    """Under torch.no_grad nothing is saved for backward, so no columnwise copies are made."""
    from engine.quantizers import Quantizer

    made = []
    original = Quantizer.quantize_storage

    def spy(self, x):
        storage = original(self, x)
        made.append((storage.has_rowwise, storage.has_columnwise))
        return storage

    monkeypatch.setattr(Quantizer, "quantize_storage", spy)
    module = make("linear")
    with torch.no_grad(), fp8_autocast(recipe=RECIPES[recipe]):
        module(torch.randn(32, 64))
    assert made == [(True, False), (True, False)]  # input, weight
    made.clear()
    with fp8_autocast(recipe=RECIPES[recipe]):
        module(torch.randn(32, 64, requires_grad=True)).sum().backward()
    assert made[:2] == [(True, True), (True, True)]  # wgrad reads x columnwise, dgrad reads W columnwise
