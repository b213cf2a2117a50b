"""Linear, LayerNormLinear, LayerNormMLP against a float64 model written from the formulas.

The reference (tests/torch_reference.py) shares no code with engine. Outside fp8_autocast the
modules must match it to their dtype's rounding; inside, to a bound derived from the FP8
formats; and a wrong weight or a swapped gate must fall far outside those bounds.

Every recipe `engine.recipes` exports runs the module contract (a bound from each operand's element
format) in tests/conformance/test_conformance_modules.py. What stays here is special to the FP8 elements
(E4M3/E5M2): the tight bounds below (with a lower bound: the module ran in FP8), FP8-exact operands, and the
one byte per element a saved FP8 activation takes; FP8_RECIPES holds one recipe per FP8 scaling kind.
`python tests/test_modules.py` prints the measured errors next to the bounds.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import checkpoint_specs
import engine
import torch_reference as ref
from conftest import perturb_norms
from engine import autocast
from engine.autocast import fp8_autocast, fp8_model_init
from engine.recipes import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling, Role
from engine.tensors import QuantizedTensor

#: one recipe per FP8 scaling kind (per tensor delayed / current, 1x128 / 128x128 blocks, MX)
FP8_RECIPES = {
    "delayed": DelayedScaling(amax_history_len=4),
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
}

# ---------------------------------------------------------------------------- tolerances
# Every bound is on the relative Frobenius error ||module - reference|| / ||reference|| of one
# tensor (the output, or the gradient of x or of one parameter), the reference in float64.
#
# fp32 (u = 2^-24): outputs and gradients are sums of <= 128 rounded terms; their rounding errors
# grow like sqrt(K) u ~ 11u in RMS. Bound 2^-20 = 16u; measured worst (5 seeds, every module and
# tensor): 4.2e-7 = 7u.
FP32_BOUND = 2.0**-20


def bf16_bound(kind: str, name: str, tokens: int) -> float:
    """bf16 (u = 2^-8): one rounding per GEMM / norm / activation output on the path.

    A Linear rounds its output (or a gradient) once, as does a bias gradient (the sum of the output
    gradient): 2^-8 (measured <= 1.8e-3 = 0.47 * 2^-8). The norm modules round up to four times on
    a path (norm, fc1, activation, fc2): 2 * 2^-8 (measured <= 5.0e-3 = 1.3 * 2^-8). The norm
    parameters' gradients are sums over the tokens that torch accumulates in bf16, rounding every
    partial sum (of size ~sqrt(t) at step t): RMS error (u/sqrt(3)) sqrt(tokens / 2), times SAFETY
    (measured <= 1.47e-2 = 0.65x that bound at 128 tokens; RMSNorm's gamma gradient, which torch
    accumulates in fp32, stays 5-10x below it).
    """
    if name in ("layer_norm_weight", "layer_norm_bias"):
        return SAFETY * 2.0**-8 / math.sqrt(3) * math.sqrt(tokens / 2)
    return 2.0**-8 if kind == "linear" or name in ("bias", "fc2_bias") else 2 * 2.0**-8


# FP8. A value rounded to an FP8 element format in its normal range has relative error |d| <= u,
# u = 2^-(mantissa bits + 1): E4M3 2^-4, E5M2 2^-3. The scale (per tensor, per 1x128 / 128x128
# tile, per 32-block) only moves the exponent, so u is the same for every recipe. The worst case
# for y = sum_k x_k w_k, |dy| <= 2u sum_k |x_k w_k|, is ~2u * sqrt(K) * 2/pi ~ 10u relative to |y|
# for random data at K = 64: ten times what is measured, a bound no bug could cross. The rounding
# errors are independent and average out in a Frobenius norm instead: the absolute error is
# uniform over half an ulp, so E[d^2] <= u^2 / 3, and a product of rounded operands has relative
# Frobenius error sqrt(sum_i u_i^2 / 3). Errors made earlier in a module (fc1's output, carried
# through the activation and fc2) add the same way, so each tensor gets the number of roundings
# on its path (`rounding_counts`) and the bound SAFETY * sqrt(sum u_i^2 / 3). Measured errors
# are 0.6-0.9 of the unpadded value (mantissas are not uniform: for log-uniform data
# E[d^2] ~ 0.54 u^2 / 3), so SAFETY = 1.25 puts every bound at 1.3-2.1x the worst error
# measured over 5 seeds (the table `python tests/test_modules.py` prints).
SAFETY = 1.25


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def rounding_counts(kind: str, primary_fp8: bool) -> dict[str, tuple[int, int] | None]:
    """(forward-format, gradient-format) roundings on each tensor's path; None: no FP8 on it.

    Forward operands (input, weight, activation) use the recipe's forward format, the output
    gradient its backward format. A weight read by an FP8 GEMM is rounded once, unless it is an
    FP8 primary weight, compared with its own dequantized value: then it is exact (in fprop and
    dgrad: the columnwise copy rounds to the same values, as every scale is per tensor or a
    power of 2). Bias gradients sum the high-precision output gradient: no FP8 on their path.
    """
    w = 0 if primary_fp8 else 1
    if kind in ("linear", "lnlinear"):
        dx = (w, 1)  # Q(dy) Q(W)
        counts = {"out": (1 + w, 0), "x": dx, "weight": (1, 1), "bias": None}  # weight: Q(dy)^T Q(x)
        if kind == "lnlinear":
            counts["layer_norm_weight"] = counts["layer_norm_bias"] = dx  # the norm's backward of dx
        return counts
    z = 1 + w  # fc1's output: Q(ln_out) Q(W1)
    h = z + 1  # the activation of z, rounded again as fc2's input
    dz = z + w  # Q(dy) Q(W2), times the activation's derivative at the (rounded) z
    dln = (dz + w, 2)  # Q(dz) Q(W1)
    return {
        "out": (h + w, 0), "fc2_weight": (h, 1), "fc2_bias": None, "fc1_bias": (dz, 1),
        "fc1_weight": (dz + 1, 2), "x": dln, "layer_norm_weight": dln, "layer_norm_bias": dln,
    }


# relu's derivative jumps at 0. A rounding error of relative RMS e in z flips the sign of z with
# probability arctan(e)/pi ~ e/pi; a flip turns dz_i from dh_i into 0 or back, and about half of
# dz is nonzero, so the gradients behind relu gain 2e/pi in squared relative error. Flips are rare
# (~1.6% of z), so their share of a 128-element gradient (fc1_bias) varies between seeds by up to
# 1.5x: the term is counted twice (FLIP_SPREAD).
FLIP_SPREAD = 2
RELU_FLIPPED = ("fc1_bias", "fc1_weight", "x", "layer_norm_weight", "layer_norm_bias")


def fp8_bounds(spec: dict, recipe, primary_fp8: bool = False) -> dict[str, float]:
    """Bound of every tensor's relative error under `recipe` (FP32_BOUND where no FP8 is involved)."""
    u_fwd = unit_roundoff(recipe.fp8_format.forward_dtype)
    u_bwd = unit_roundoff(recipe.fp8_format.backward_dtype)
    counts = rounding_counts(spec["kind"], primary_fp8)
    z_error = math.sqrt((1 if primary_fp8 else 2) / 3) * u_fwd  # fc1's output: Q(ln_out) (and Q(W1))
    bounds = {}
    for name, count in counts.items():
        if count is None:
            bounds[name] = FP32_BOUND
            continue
        var = (count[0] * u_fwd**2 + count[1] * u_bwd**2) / 3
        if spec.get("activation") == "relu" and name in RELU_FLIPPED:
            var += FLIP_SPREAD * 2 / math.pi * z_error
        bounds[name] = SAFETY * math.sqrt(var)
    return bounds


# ---------------------------------------------------------------------------- helpers
SIZES = {"linear": (64, 96), "lnlinear": (64, 96), "mlp": (64, 128)}
CLASSES = {"linear": engine.Linear, "lnlinear": engine.LayerNormLinear, "mlp": engine.LayerNormMLP}


def build(spec: dict, seed: int = 0, **kw):
    """The module `spec` describes (kind + constructor arguments), its norm parameters moved off
    their initial 1 (or 0) and 0, so a norm that ignores gamma or beta shows."""
    torch.manual_seed(seed)
    module = CLASSES[spec["kind"]](*SIZES[spec["kind"]], **{k: v for k, v in spec.items() if k != "kind"}, **kw)
    return perturb_norms(module)


def out_features(spec: dict) -> int:
    return SIZES[spec["kind"]][0 if spec["kind"] == "mlp" else 1]


def params_of(module) -> dict[str, torch.Tensor]:
    """The module's parameters by public name; FP8 primary weights as their dequantized values."""
    return {n: (p.dequantize() if isinstance(p, QuantizedTensor) else p).detach()
            for n, p in module.named_parameters()}


def inputs(spec: dict, shape, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(shape, generator=g)
    dy = torch.randn(*shape[:-1], out_features(spec), generator=g)
    return x.to(dtype), dy.to(dtype)


def run(module, x, dy, recipe=None):
    """Output and gradients (of "x" and each parameter) of one step; delayed scaling takes a second
    step, run with the scales the first one learned."""
    steps = 2 if isinstance(recipe, DelayedScaling) else 1
    for _ in range(steps):
        x = x.detach().requires_grad_(True)
        module.zero_grad()
        with fp8_autocast(enabled=recipe is not None, recipe=recipe):
            out = module(x)
        out.backward(dy)
    return out.detach(), {"x": x.grad, **{n: p.grad for n, p in module.named_parameters()}}


def errors(out, got, want_out, want) -> dict[str, float]:
    assert set(got) == set(want)
    return {"out": ref.rel_error(out, want_out), **{n: ref.rel_error(got[n], want[n]) for n in want}}


def fp8_grid(shape, seed: int) -> torch.Tensor:
    """Values +-{1, 1.25, 1.5, 1.75} * 2^e, e in -4..0, one of them 1.75.

    Exact in E4M3 and E5M2 under any power-of-2 scale that keeps them in range, and 1.75 =
    448 / 2^8 = 57344 / 2^15 makes the per-tensor scales powers of 2 too. Products are multiples
    of 2^-12 and sums of <= 128 of them stay below 2^9: every partial sum is exact in fp32.
    """
    g = torch.Generator().manual_seed(seed)
    mantissa = 1 + torch.randint(0, 4, shape, generator=g) / 4
    sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
    t = sign * mantissa * torch.exp2(torch.randint(-4, 1, shape, generator=g).float())
    t.view(-1)[0] = 1.75
    return t


CASES = [
    ({"kind": "linear"}, (4, 32, 64)),
    ({"kind": "linear", "bias": False}, (64, 64)),
    ({"kind": "lnlinear"}, (2, 4, 16, 64)),
    ({"kind": "lnlinear", "normalization": "RMSNorm", "zero_centered_gamma": True}, (4, 32, 64)),
    ({"kind": "mlp"}, (4, 32, 64)),
    ({"kind": "mlp", "activation": "swiglu"}, (4, 32, 64)),
    ({"kind": "mlp", "activation": "geglu", "normalization": "RMSNorm"}, (4, 32, 64)),
    ({"kind": "mlp", "activation": "relu"}, (4, 32, 64)),
    ({"kind": "mlp", "activation": "silu", "zero_centered_gamma": True}, (128, 64)),
]


def case_id(case) -> str:
    spec, shape = case
    return "-".join([spec["kind"], *(f"{k}={v}" for k, v in spec.items() if k != "kind"), "x".join(map(str, shape))])


# ---------------------------------------------------------------------------- high precision
def test_the_reference_formulas_agree_with_torch():
    """The hand-written norms and activations against torch's own, in float64 (a check of the reference)."""
    g = torch.Generator().manual_seed(5)
    x, gamma, beta = (torch.randn(shape, generator=g, dtype=torch.float64) for shape in ((16, 64), (64,), (64,)))
    assert torch.allclose(ref.layer_norm(x, gamma, beta, 1e-5), F.layer_norm(x, (64,), gamma, beta, 1e-5), atol=1e-12)
    assert torch.allclose(ref.rms_norm(x, gamma, 1e-5), F.rms_norm(x, (64,), gamma, 1e-5), atol=1e-12)
    assert torch.allclose(ref.gelu_tanh(x), F.gelu(x, approximate="tanh"), atol=1e-12)
    assert torch.allclose(ref.silu(x), F.silu(x), atol=1e-12)
    assert torch.equal(ref.relu(x), F.relu(x))
    assert torch.allclose(ref.activation("swiglu", x), F.silu(x[:, :32]) * x[:, 32:], atol=1e-12)
    assert torch.allclose(ref.activation("geglu", x, swap_halves=True), F.gelu(x[:, 32:], approximate="tanh") * x[:, :32],
                          atol=1e-12)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_outside_autocast_fp32_modules_match_the_float64_reference(case):
    spec, shape = case
    module = build(spec)
    x, dy = inputs(spec, shape)
    out, got = run(module, x, dy)
    want_out, want = ref.forward_backward(spec, params_of(module), x, dy)
    for name, err in errors(out, got, want_out, want).items():
        assert err < FP32_BOUND, (name, err)


@pytest.mark.parametrize("case", [c for c in CASES if c[0].get("activation") != "relu"], ids=case_id)
def test_outside_autocast_bf16_modules_match_the_float64_reference(case):
    """relu is left out: bf16's rounding of z flips relu's derivative where z ~ 0 (see RELU_FLIPPED)."""
    spec, shape = case
    module = build(spec, params_dtype=torch.bfloat16)
    x, dy = inputs(spec, shape, torch.bfloat16)
    out, got = run(module, x, dy)
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in got.values())
    want_out, want = ref.forward_backward(spec, params_of(module), x, dy)
    for name, err in errors(out, got, want_out, want).items():
        assert err < bf16_bound(spec["kind"], name, math.prod(shape[:-1])), (name, err)


# ---------------------------------------------------------------------------- FP8
@pytest.mark.parametrize("recipe", FP8_RECIPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fp8_outputs_and_gradients_are_within_the_format_bound(recipe, case):
    spec, shape = case
    module = build(spec)
    x, dy = inputs(spec, shape)
    out, got = run(module, x, dy, FP8_RECIPES[recipe])
    want_out, want = ref.forward_backward(spec, params_of(module), x, dy)
    assert out.shape == want_out.shape and out.dtype == torch.float32
    bounds = fp8_bounds(spec, FP8_RECIPES[recipe])
    for name, err in errors(out, got, want_out, want).items():
        assert err < bounds[name], (name, err, bounds[name])
        if bounds[name] > FP32_BOUND:  # it ran in FP8, and the bound is not padded
            assert err > bounds[name] / 3, (name, err, bounds[name])


@pytest.mark.parametrize("recipe", FP8_RECIPES, ids=str)
@pytest.mark.parametrize("primary", [False, True], ids=["hp_weight", "fp8_weight"])
def test_fp8_gemms_of_exactly_representable_operands_are_exact(recipe, primary):
    """Inputs, weights, biases and output gradients the FP8 formats hold exactly, with partial sums
    exact in fp32: fprop, dgrad, wgrad and the bias gradient must equal the float64 reference."""
    r = FP8_RECIPES[recipe]
    with fp8_model_init(enabled=primary, recipe=r):
        module = engine.Linear(64, 96)
    module.load_state_dict({"weight": fp8_grid((96, 64), 1), "bias": fp8_grid((96,), 2)})
    assert isinstance(module.weight, QuantizedTensor) == primary
    x, dy = fp8_grid((4, 32, 64), 3), fp8_grid((4, 32, 96), 4)
    out, got = run(module, x, dy, r)
    want_out, want = ref.forward_backward({"kind": "linear"}, params_of(module), x, dy)
    assert torch.equal(params_of(module)["weight"], fp8_grid((96, 64), 1))
    assert torch.equal(out, want_out.float())
    for name in want:
        assert torch.equal(got[name], want[name].float()), name


# ---------------------------------------------------------------------------- mutants must fail
@pytest.mark.parametrize("recipe", [None, "current"])
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_a_model_gating_the_other_half_is_far_outside_the_bound(activation, recipe):
    """Within the bound of the reference, 5x (output) and 3x (gradients) outside it from a reference
    that gates fc1's second half: the swapped model is 0.55-0.9 away in every tensor but fc2_bias."""
    spec = {"kind": "mlp", "activation": activation}
    module = build(spec)
    x, dy = inputs(spec, (4, 32, 64))
    r = FP8_RECIPES.get(recipe)
    out, got = run(module, x, dy, r)
    params = params_of(module)
    bounds = fp8_bounds(spec, r) if r is not None else dict.fromkeys(["out", "x", *params], FP32_BOUND)
    right = errors(out, got, *ref.forward_backward(spec, params, x, dy))
    swapped = errors(out, got, *ref.forward_backward(spec, params, x, dy, swap_halves=True))
    for name, err in right.items():
        assert err < bounds[name], (name, err)
        if name != "fc2_bias":  # the sum of the output gradient: no activation on its path
            assert swapped[name] > (5 if name == "out" else 3) * bounds[name], (name, swapped[name])


WRONG_WEIGHTS = {
    "zero": torch.zeros_like,
    "doubled": lambda w: 2 * w,
    "rows_rolled": lambda w: w.roll(1, dims=0),  # the right values wired to the wrong outputs
}


@pytest.mark.parametrize("recipe", FP8_RECIPES, ids=str)
@pytest.mark.parametrize("spec", [{"kind": "linear"}, {"kind": "mlp", "activation": "swiglu"}], ids=lambda s: s["kind"])
def test_fp8_primary_weights_match_their_dequantized_values_and_not_a_wrong_weight(recipe, spec):
    r = FP8_RECIPES[recipe]
    with fp8_model_init(recipe=r):
        module = build(spec)
    weights = [n for n, p in module.named_parameters() if isinstance(p, QuantizedTensor)]
    assert weights == (["weight"] if spec["kind"] == "linear" else ["fc1_weight", "fc2_weight"])
    x, dy = inputs(spec, (4, 32, 64))
    out, got = run(module, x, dy, r)
    for name in weights:
        p = getattr(module, name)
        assert got[name].dtype == torch.float32 and got[name].shape == p.shape
    params = params_of(module)
    want_out, want = ref.forward_backward(spec, params, x, dy)
    bounds = fp8_bounds(spec, r, primary_fp8=True)
    for name, err in errors(out, got, want_out, want).items():
        assert err < bounds[name], (name, err, bounds[name])
        if bounds[name] > FP32_BOUND:
            assert err > bounds[name] / 3, (name, err, bounds[name])
    # the same comparison with a wrong weight in the reference fails by far (the nearest miss: dx of a
    # doubled fc2_weight, 0.5 away = 3.7x the bound)
    for name in weights:
        for wrong in WRONG_WEIGHTS.values():
            bad_out, bad = ref.forward_backward(spec, {**params, name: wrong(params[name])}, x, dy)
            assert ref.rel_error(out, bad_out) > 5 * bounds["out"], name
            assert ref.rel_error(got["x"], bad["x"]) > 3 * bounds["x"], name


@pytest.mark.parametrize("recipe", FP8_RECIPES, ids=str)
@pytest.mark.parametrize("spec", [{"kind": "linear"}, {"kind": "mlp"}], ids=lambda s: s["kind"])
def test_fp8_primary_weight_forward_follows_the_loaded_weight(recipe, spec):
    r = FP8_RECIPES[recipe]
    with fp8_model_init(recipe=r):
        module = build(spec)
    x, _ = inputs(spec, (4, 32, 64))
    primary, master = fp8_bounds(spec, r, primary_fp8=True)["out"], fp8_bounds(spec, r)["out"]
    with torch.no_grad(), fp8_autocast(recipe=r):
        before = module(x)
    assert ref.rel_error(before, ref.output(spec, params_of(module), x)) < primary
    new = build(spec, seed=1)
    module.load_state_dict(new.state_dict())
    with torch.no_grad(), fp8_autocast(recipe=r):
        after = module(x)
    weights = ["weight"] if spec["kind"] == "linear" else ["fc1_weight", "fc2_weight"]
    assert all(isinstance(getattr(module, n), QuantizedTensor) for n in weights)
    assert ref.rel_error(after, ref.output(spec, params_of(module), x)) < primary
    # against the loaded high-precision values, which the load rounded once more
    assert ref.rel_error(after, ref.output(spec, params_of(new), x)) < master
    assert ref.rel_error(after, before) > 4 * master


# ---------------------------------------------------------------------------- other behaviour
@pytest.mark.parametrize("recipe", [cls.__name__ for cls in checkpoint_specs.exported_recipe_classes()])
def test_fp8_linear_is_the_gemm_of_its_quantized_operands(recipe):
    """Tight check, every recipe `engine.recipes` exports: fprop equals x_q W_q^T of the operands the recipe's
    quantizers make."""
    module = build({"kind": "linear"})
    x = torch.randn(64, 64)
    r = checkpoint_specs.make_recipe(recipe)
    with fp8_autocast(recipe=r):
        module(x)  # builds the states; delayed scaling updates its scales at exit
    state = module._fwd_state
    xq = state.quantizer(Role.INPUT).copy()
    wq = state.quantizer(Role.WEIGHT).copy()
    saved = state.to_plain()  # quantizing below records amaxes: put the state back afterwards
    want = F.linear(xq(x).dequantize().double(), wq(module.weight.detach()).dequantize().double(),
                    module.bias.double())
    if saved is not None:
        state.load_plain(saved)
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


@pytest.mark.parametrize("recipe", FP8_RECIPES, ids=str)
def test_fp8_linear_saves_about_half_the_activation_bytes_of_bf16(recipe):
    module = engine.Linear(256, 256, params_dtype=torch.bfloat16)
    x = torch.randn(4, 64, 256, dtype=torch.bfloat16, requires_grad=True)
    bf16 = saved_bytes(lambda: module(x))

    def fp8_step():
        with fp8_autocast(recipe=FP8_RECIPES[recipe]):
            module(x)

    ratio = saved_bytes(fp8_step) / bf16
    # input and weight saved as one FP8 byte per element instead of two, plus the scales
    assert 0.5 <= ratio <= 0.53


def test_weight_cache_across_microbatches():
    module = build({"kind": "linear"})
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
    module = build({"kind": "linear"})
    recipe = DelayedScaling(amax_history_len=4)
    x = torch.randn(16, 64)
    with fp8_autocast(recipe=recipe):
        module(x, is_first_microbatch=True)
    weight_slot = module._fwd_state.slot(Role.WEIGHT)
    history_before = module._fwd_state.amax_history[:, weight_slot].clone()
    with fp8_autocast(recipe=recipe):
        module(x, is_first_microbatch=False)
    assert torch.equal(module._fwd_state.amax_history[:, weight_slot], history_before)


@pytest.mark.parametrize("fp8", [False, True])
def test_fuse_wgrad_accumulation_adds_into_main_grad(fp8):
    spec = {"kind": "linear"}
    module = build(spec, fuse_wgrad_accumulation=True)
    module.weight.main_grad = torch.ones_like(module.weight)
    x, dy = inputs(spec, (8, 64))
    recipe = Float8CurrentScaling()
    with fp8_autocast(enabled=fp8, recipe=recipe):
        out = module(x.requires_grad_(True))
    out.backward(dy)
    assert module.weight.grad is None
    _, want = ref.forward_backward(spec, params_of(module), x, dy)
    bound = fp8_bounds(spec, recipe)["weight"] if fp8 else FP32_BOUND
    assert ref.rel_error(module.weight.main_grad - 1, want["weight"]) < bound


def test_fuse_wgrad_accumulation_without_main_grad_is_a_clear_error():
    module = build({"kind": "linear"}, fuse_wgrad_accumulation=True)
    out = module(torch.randn(4, 64, requires_grad=True))
    with pytest.raises(ValueError, match="main_grad"):
        out.sum().backward()


def test_return_bias_and_return_layernorm_output():
    spec = {"kind": "lnlinear"}
    module = build(spec, return_bias=True, return_layernorm_output=True)
    x = torch.randn(4, 64)
    out, bias, ln_out = module(x)
    assert bias is module.bias
    p = params_of(module)
    assert ref.rel_error(out + bias, ref.output(spec, p, x)) < FP32_BOUND
    want_ln = ref.layer_norm(x.double(), p["layer_norm_weight"].double(), p["layer_norm_bias"].double(), 1e-5)
    assert ref.rel_error(ln_out, want_ln) < FP32_BOUND


def test_delayed_scales_update_after_a_module_step():
    module = build({"kind": "linear"})
    recipe = DelayedScaling(amax_history_len=2)
    x = torch.full((4, 64), 2.0, requires_grad=True)
    with fp8_autocast(recipe=recipe):
        out = module(x)
    fwd, bwd = module._fwd_state, module._bwd_state
    assert fwd.scale[fwd.slot(Role.INPUT)].item() == 224.0  # 448 / 2
    assert bwd.scale.tolist() == [1.0, 1.0]  # not before backward
    out.backward(torch.full_like(out, 4.0))
    assert bwd.scale.tolist() == [1.0, 1.0]  # folded in when the next step's autocast is entered
    with fp8_autocast(recipe=recipe):
        assert bwd.scale[bwd.slot(Role.GRAD_OUTPUT)].item() == 57344.0 / 4  # HYBRID: E5M2 gradients


def test_calibration_through_a_module_sets_the_first_fp8_scales():
    spec = {"kind": "linear"}
    module = build(spec)
    recipe = DelayedScaling(amax_history_len=2, fp8_format=Format.E4M3)
    x = torch.full((4, 64), 7.0)
    with fp8_autocast(enabled=False, calibrating=True, recipe=recipe):
        out = module(x)
    # calibration runs in high precision
    assert ref.rel_error(out, ref.output(spec, params_of(module), x)) < FP32_BOUND
    fwd = module._fwd_state
    assert fwd.scale[fwd.slot(Role.INPUT)].item() == 64.0  # 448 / 7
    w_amax = module.weight.detach().abs().max()
    assert fwd.scale[fwd.slot(Role.WEIGHT)].item() == (torch.tensor(448.0) / w_amax).item()


def test_bad_inputs_and_arguments_give_clear_errors():
    module = build({"kind": "linear"})
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


@pytest.mark.parametrize("recipe", FP8_RECIPES, ids=str)
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
    module = build({"kind": "linear"})
    with torch.no_grad(), fp8_autocast(recipe=FP8_RECIPES[recipe]):
        module(torch.randn(32, 64))
    assert made == [(True, False), (True, False)]  # input, weight
    made.clear()
    with fp8_autocast(recipe=FP8_RECIPES[recipe]):
        module(torch.randn(32, 64, requires_grad=True)).sum().backward()
    assert made[:2] == [(True, True), (True, True)]  # wgrad reads x columnwise, dgrad reads W columnwise


# ---------------------------------------------------------------------------- the error table
def worst_errors(spec: dict, shape, recipe, seeds: int, primary: bool = False, dtype=torch.float32) -> dict[str, float]:
    worst: dict[str, float] = {}
    for seed in range(seeds):
        with fp8_model_init(enabled=primary, recipe=recipe):
            module = build(spec, seed, params_dtype=dtype)
        x, dy = inputs(spec, shape, dtype, seed=seed)
        out, got = run(module, x, dy, recipe)
        for k, err in errors(out, got, *ref.forward_backward(spec, params_of(module), x, dy)).items():
            worst[k] = max(worst.get(k, 0.0), err)
    return worst


def print_error_table(seeds: int = 5) -> None:
    """Worst relative error over `seeds` seeds / its bound (bound / worst), for every case and recipe."""
    rows = []
    for spec, shape in CASES:
        rows.append(("fp32", spec, shape, None, False, worst_errors(spec, shape, None, seeds), lambda k: FP32_BOUND))
        if spec.get("activation") != "relu":
            rows.append(("bf16", spec, shape, None, False, worst_errors(spec, shape, None, seeds, dtype=torch.bfloat16),
                         lambda k, sp=spec, sh=shape: bf16_bound(sp["kind"], k, math.prod(sh[:-1]))))
    for primary in (False, True):
        for spec, shape in CASES:
            for name, recipe in FP8_RECIPES.items():
                bounds = fp8_bounds(spec, recipe, primary)
                rows.append((name + (" fp8_weight" if primary else ""), spec, shape, recipe, primary,
                             worst_errors(spec, shape, recipe, seeds, primary), bounds.__getitem__))
    for label, spec, shape, recipe, primary, worst, bound in rows:
        cells = [f"{k}={worst[k]:.3g}/{bound(k):.3g}({bound(k) / worst[k]:.2f}x)"
                 for k in worst if recipe is None or bound(k) > FP32_BOUND]
        print(f"{label} {case_id((spec, shape))}: {' '.join(cells)}")


if __name__ == "__main__":
    print_error_table()


def test_fp32_weights_get_the_wgrad_in_the_activation_dtype_as_transformer_engine_does():
    """With bf16 activations, the wgrad GEMM outputs bf16 (fp32 accumulation, one rounding), then takes the fp32
    weight's dtype: TE's `out_dtype=activation_dtype` when not fusing into main_grad. Checked against the
    product of the current-scaling FP8 values in fp64, rounded once to bf16."""
    torch.manual_seed(0)
    layer = engine.Linear(64, 48, bias=False, params_dtype=torch.float32)
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    grad = torch.randn(40, 48, dtype=torch.bfloat16)
    recipe = Float8CurrentScaling(fp8_format=Format.E4M3)
    with fp8_autocast(recipe=recipe):
        out = layer(x)
    out.backward(grad)

    def fp8_values(t: torch.Tensor) -> torch.Tensor:  # current scaling, E4M3, per tensor
        scale = 448.0 / t.float().abs().max()
        return (t.float() * scale).to(torch.float8_e4m3fn).double() / scale.double()

    want = (fp8_values(grad).t() @ fp8_values(x)).to(torch.bfloat16).float()
    got = layer.weight.grad
    assert got.dtype == torch.float32
    assert torch.equal(got, got.to(torch.bfloat16).float()), "the wgrad was not rounded to bf16 once"
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(1e-30)
    assert ((got - want).abs() <= ulp).all()
