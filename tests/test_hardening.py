"""Hardening of autocast, delayed scaling, module arguments and checkpoints (the layers around the kernels).

Each test here failed on the code before the hardening pass; the expected values come from
plain torch (F.linear, torch.nn.Linear) or from hand-written rules, never from the code under test.
"""

from __future__ import annotations

import io
import math
import threading

import pytest
import torch
import torch.nn.functional as F

import checkpoint_specs
import engine
from engine import autocast
from engine.modules.saving import encode_extra_state, read_extra_state
from engine.recipes import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, Role
from engine.tensors import QuantizedTensor

#: every recipe `engine.recipes` exports (tests/checkpoint_specs.py builds them)
RECIPES = [checkpoint_specs.make_recipe(cls.__name__) for cls in checkpoint_specs.exported_recipe_classes()]
RECIPE_IDS = [type(r).__name__ for r in RECIPES]


def plain_linear(module: engine.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, module.weight, module.bias)


# ---------------------------------------------------------------------------- 1. per-thread autocast
def run_threads(*targets, timeout: float = 30.0) -> None:
    errors: list[BaseException] = []

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as err:  # reported in the main thread
                errors.append(err)
        return run

    threads = [threading.Thread(target=guarded(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


def wait(event: threading.Event) -> None:
    assert event.wait(10), "the other thread never got there"


def test_fp8_autocast_is_per_thread_with_overlapping_contexts():
    torch.manual_seed(0)
    lin_a, lin_b = engine.Linear(64, 32), engine.Linear(64, 32)
    x = torch.randn(16, 64)
    with engine.fp8_autocast(recipe=MXFP8BlockScaling()):  # what lin_b gives under MXFP8, computed alone first
        want_b_mx = engine.Linear(64, 32)
        want_b_mx.load_state_dict(lin_b.state_dict())
        want_b_mx = want_b_mx(x)
    a_inside, b_checked, b_inside, a_done = (threading.Event() for _ in range(4))

    def thread_a():
        with engine.fp8_autocast(recipe=DelayedScaling()):
            a_inside.set()
            wait(b_checked)
            wait(b_inside)
            assert autocast.is_fp8_enabled() and isinstance(autocast.get_recipe(), DelayedScaling)
            assert not torch.equal(lin_a(x), plain_linear(lin_a, x))  # A runs in FP8
        a_done.set()

    def thread_b():
        wait(a_inside)
        assert not autocast.is_fp8_enabled()  # never entered: A's context is not ours
        assert torch.equal(lin_b(x), plain_linear(lin_b, x))
        b_checked.set()
        with engine.fp8_autocast(recipe=MXFP8BlockScaling()):
            b_inside.set()
            wait(a_done)  # A's exit must not end our context
            assert autocast.is_fp8_enabled() and isinstance(autocast.get_recipe(), MXFP8BlockScaling)
            assert torch.equal(lin_b(x), want_b_mx)
        assert not autocast.is_fp8_enabled()

    run_threads(thread_a, thread_b)
    assert not autocast.is_fp8_enabled()
    assert torch.equal(lin_a(x), plain_linear(lin_a, x)) and torch.equal(lin_b(x), plain_linear(lin_b, x))


def test_fp8_model_init_is_per_thread():
    a_inside, b_done = threading.Event(), threading.Event()
    made = {}

    def thread_a():
        with engine.fp8_model_init(recipe=Float8CurrentScaling()):
            a_inside.set()
            wait(b_done)
            made["a"] = engine.Linear(32, 32)

    def thread_b():
        wait(a_inside)
        made["b"] = engine.Linear(32, 32)
        b_done.set()

    run_threads(thread_a, thread_b)
    assert isinstance(made["a"].weight, QuantizedTensor)
    assert not isinstance(made["b"].weight, QuantizedTensor)
    assert not autocast.is_fp8_model_init()


# ----------------------------------------------------------------- 2. NaN / inf batches and delayed scaling
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_batch_does_not_freeze_the_delayed_scale(bad):
    state = DelayedScaling(amax_history_len=16).make_state(forward=True)
    q = state.quantizers[0]
    for amax in (1.0, bad, 4.0):
        q(torch.tensor([[amax, 0.5]]))
        state.update()
    # the bad batch is dropped from the history: the max of the finite amaxes is 4 -> 448 / 4
    assert state.scale[0].item() == 112.0
    assert torch.isfinite(state.amax_history).all()


def test_linear_recovers_from_a_nan_batch_when_activations_grow():
    torch.manual_seed(0)
    lin = engine.Linear(64, 64, bias=False)
    recipe = DelayedScaling(amax_history_len=1024)
    errors = []
    for step in range(8):
        x = torch.randn(32, 64) * (1.0 if step < 4 else 1000.0)
        if step == 2:
            x[0, 0] = float("nan")
        with engine.fp8_autocast(recipe=recipe):
            y = lin(x)
        if step >= 5:  # step 4 saturates (its scale is from |x| ~ 1); later steps see the new range
            want = plain_linear(lin, x)
            errors.append(((y - want).norm() / want.norm()).item())
    # a scale frozen by the NaN would saturate activations 1000x past the range: errors near 100%
    assert max(errors) < 0.1, errors


# ------------------------------------------------------------- 3. scaling state validated at load time
def delayed_state(module_factory):
    module = module_factory()
    with engine.fp8_autocast(recipe=DelayedScaling(amax_history_len=4)):
        module(torch.randn(4, 64)).sum().backward()
    return module.state_dict()


def tamper(state, change, fmt):
    """The state with its _extra_state changed, saved as a record (today) or a version-1 dict (before)."""
    extra = read_extra_state(state["_extra_state"])
    extra = {k: (dict(v) if isinstance(v, dict) else v) for k, v in extra.items()}
    change(extra)
    saved = encode_extra_state(extra) if fmt == "record" else {"version": 1, **extra}
    return {**state, "_extra_state": saved}


def _set(path, value):
    def change(extra):
        target = extra
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return change


def _recipe_fields(**fields):
    def change(extra):
        extra["recipe"] = {"name": extra["recipe"]["name"], "fields": {**extra["recipe"]["fields"], **fields}}
    return change


BAD_STATES = {
    "scale float64": (_set(("forward", "scale"), torch.ones(3, dtype=torch.float64)), r"\['forward'\]\['scale'\]"),
    "scale inf": (_set(("forward", "scale"), torch.tensor([1.0, math.inf, 1.0])), r"\['forward'\]\['scale'\]"),
    "scale zero": (_set(("backward", "scale"), torch.tensor([1.0, 0.0])), r"\['backward'\]\['scale'\]"),
    "scale negative": (_set(("forward", "scale"), torch.tensor([1.0, -2.0, 1.0])), r"\['forward'\]\['scale'\]"),
    "scale nan": (_set(("forward", "scale"), torch.tensor([math.nan, 1.0, 1.0])), r"\['forward'\]\['scale'\]"),
    "history nan": (_set(("forward", "amax_history"), torch.full((4, 3), math.nan)), r"\['amax_history'\]"),
    "history negative": (_set(("backward", "amax_history"), -torch.ones(4, 2)), r"\['amax_history'\]"),
    "history 1D": (_set(("forward", "amax_history"), torch.ones(3)), r"\['amax_history'\]"),
    "scale not a tensor": (_set(("forward", "scale"), [1.0, 1.0, 1.0]), r"\['forward'\]\['scale'\]"),
    "unknown recipe": (_set(("recipe",), {"name": "fp9", "fields": {}}), r"\['recipe'\]"),
    "unknown field": (_recipe_fields(colour="red"), r"\['recipe'\]"),
    "margin -1": (_recipe_fields(margin=-1), r"(?s)\['recipe'\].*margin"),
    "margin 200": (_recipe_fields(margin=200), r"(?s)\['recipe'\].*margin"),
    "unknown key": (_set(("surprise",), 1), "surprise"),
    "missing backward": (lambda extra: extra.pop("backward"), r"\['backward'\]"),
}


#: changes a record cannot hold (it holds only tensors and JSON): test_saving.py has its own malformed records
DICT_ONLY = {"scale not a tensor", "unknown key"}
BAD_CASES = [(case, fmt) for case in sorted(BAD_STATES) for fmt in ("record", "dict")
             if fmt == "dict" or case not in DICT_ONLY]


@pytest.mark.parametrize("has_run", [False, True], ids=["fresh", "has-run"])
@pytest.mark.parametrize("case, fmt", BAD_CASES, ids=[f"{c}-{f}" for c, f in BAD_CASES])
def test_bad_scaling_state_is_rejected_at_load_naming_the_key(case, fmt, has_run):
    change, key = BAD_STATES[case]
    state = tamper(delayed_state(lambda: engine.Linear(64, 32)), change, fmt)
    target = engine.Linear(64, 32)
    if has_run:
        with engine.fp8_autocast(recipe=DelayedScaling(amax_history_len=4)):
            target(torch.randn(4, 64))
    with pytest.raises(ValueError, match=key):
        target.load_state_dict(state)


@pytest.mark.parametrize("has_run", [False, True], ids=["fresh", "has-run"])
def test_a_layernorm_mlp_state_does_not_load_into_a_linear(has_run):
    mlp_state = delayed_state(lambda: engine.LayerNormMLP(64, 64))
    target = engine.Linear(64, 64)
    if has_run:
        with engine.fp8_autocast(recipe=DelayedScaling(amax_history_len=4)):
            target(torch.randn(4, 64))
    state = {**target.state_dict(), "_extra_state": mlp_state["_extra_state"]}
    with pytest.raises(ValueError, match=r"_extra_state\['forward'\]\['scale'\].*3 slots"):
        target.load_state_dict(state)


def test_the_error_names_the_submodule_key():
    model = torch.nn.Sequential(engine.Linear(64, 64), engine.Linear(64, 32))
    state = model.state_dict()
    with engine.fp8_autocast(recipe=DelayedScaling(amax_history_len=4)):
        model(torch.randn(4, 64))
    state = model.state_dict()
    extra = read_extra_state(state["1._extra_state"])
    extra["forward"]["scale"] = torch.zeros(3)
    state["1._extra_state"] = encode_extra_state(extra)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    with pytest.raises(ValueError, match=r"^1\._extra_state\['forward'\]\['scale'\]"):
        torch.nn.Sequential(engine.Linear(64, 64), engine.Linear(64, 32)).load_state_dict(
            torch.load(buffer, weights_only=True))


# ------------------------------------------------------------------------- 4. nonsense at construction
@pytest.mark.parametrize("kwargs, name", [
    ({"margin": 200}, "margin"), ({"margin": 2000}, "margin"), ({"margin": -1}, "margin"),
    ({"amax_history_len": 10**9}, "amax_history_len"), ({"amax_history_len": 0}, "amax_history_len"),
])
def test_delayed_scaling_rejects_out_of_range_fields(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DelayedScaling(**kwargs)


def test_the_largest_margin_still_gives_finite_outputs():
    lin = engine.Linear(32, 32)
    recipe = DelayedScaling(margin=126, amax_history_len=2)
    for _ in range(3):
        with engine.fp8_autocast(recipe=recipe):
            y = lin(torch.randn(8, 32))
    scale = lin._fwd_state.scale
    assert torch.isfinite(y).all() and (scale > 0).all() and torch.isfinite(scale).all()
    # scale = 448 / amax * 2^-126 exactly
    want = torch.full((1,), 448.0) / lin._fwd_state.amax_history[1:].max(0).values[:1] * 2.0**-126
    assert scale[0].item() == want.item()


MODULES = {
    "Linear": lambda **kw: engine.Linear(32, 16, **kw),
    "LayerNormLinear": lambda **kw: engine.LayerNormLinear(32, 16, **kw),
    "LayerNormMLP": lambda **kw: engine.LayerNormMLP(32, 16, **kw),
}


@pytest.mark.parametrize("module", sorted(MODULES))
@pytest.mark.parametrize("name, value, error", [
    ("bias", 1, TypeError), ("return_bias", "yes", TypeError), ("fuse_wgrad_accumulation", None, TypeError),
    ("params_dtype", torch.int32, TypeError), ("params_dtype", torch.float64, TypeError),
    ("params_dtype", "float32", TypeError),
])
def test_modules_reject_bad_arguments_by_name(module, name, value, error):
    with pytest.raises(error, match=name):
        MODULES[module](**{name: value})


@pytest.mark.parametrize("module", sorted(MODULES))
def test_is_first_microbatch_must_be_a_bool_or_none(module):
    with pytest.raises(TypeError, match="is_first_microbatch"):
        MODULES[module]()(torch.randn(2, 32), is_first_microbatch=1)


def test_default_float64_dtype_is_named():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with pytest.raises(TypeError, match="params_dtype.*get_default_dtype"):
            engine.Linear(8, 8)
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize("field, algo, match", [
    ("amax_compute_algo", lambda history: history.max(), "amax_compute_algo.*shape"),
    ("amax_compute_algo", lambda history: 3.0, "amax_compute_algo"),
    ("scaling_factor_compute_algo", lambda amax, scale, fp8_max, recipe: scale[:1], "scaling_factor_compute_algo.*shape"),
    ("scaling_factor_compute_algo", lambda amax, scale, fp8_max, recipe: scale * math.nan, "scaling_factor_compute_algo.*finite"),
    ("scaling_factor_compute_algo", lambda amax, scale, fp8_max, recipe: scale * 0, "scaling_factor_compute_algo.*finite"),
])
def test_user_algorithms_that_return_nonsense_get_a_clear_error(field, algo, match):
    state = DelayedScaling(amax_history_len=4, **{field: algo}).make_state(forward=True)
    state.quantizers[0](torch.randn(4, 4))
    with pytest.raises(ValueError, match=match):
        state.update()


# --------------------------------------------------------------------------------- 5. empty batches
@pytest.mark.parametrize("recipe", [None] + RECIPES, ids=["bf16"] + RECIPE_IDS)
@pytest.mark.parametrize("module", sorted(MODULES))
@pytest.mark.parametrize("shape", [(0, 32), (3, 0, 32)])
def test_empty_batches_work_like_torch_linear(recipe, module, shape):
    layer = MODULES[module]()
    x = torch.randn(*shape, requires_grad=True)
    if recipe is None:
        y = layer(x)
    else:
        with engine.fp8_autocast(recipe=recipe):
            y = layer(x)
    assert y.shape == (*shape[:-1], 32 if module == "LayerNormMLP" else 16)
    y.sum().backward()
    assert x.grad.shape == x.shape
    for p in layer.parameters():
        assert p.grad is not None and p.grad.shape == p.shape and not p.grad.any()


# --------------------------------------------------- 7. a weight cached under no_grad, then used in training
@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_weight_cached_without_grad_then_used_with_backward(recipe):
    torch.manual_seed(0)
    x1, x2, dy = torch.randn(16, 64), torch.randn(16, 64), torch.randn(16, 32)
    layers = [engine.Linear(64, 32) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    grads = []
    for layer, first_has_grad in zip(layers, (True, False)):
        torch.manual_seed(1)  # the states built at the first forward draw their stochastic-rounding streams alike
        with engine.fp8_autocast(recipe=recipe):
            with torch.set_grad_enabled(first_has_grad):
                layer(x1, is_first_microbatch=True)
            x = x2.clone().requires_grad_()
            y = layer(x, is_first_microbatch=False)
        y.backward(dy)
        grads.append((y.detach(), x.grad, layer.weight.grad))
    for got, want in zip(grads[1], grads[0]):  # as if the first micro-batch had run with gradients
        assert torch.equal(got, want)


# ------------------------------------------------------------- 14. inference_mode before training
@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_an_eval_under_inference_mode_then_training(recipe):
    torch.manual_seed(0)
    layer = engine.LayerNormMLP(32, 64)
    with torch.inference_mode(), engine.fp8_autocast(recipe=recipe):
        layer(torch.randn(4, 32))
    for _ in range(2):
        with engine.fp8_autocast(recipe=recipe):
            layer(torch.randn(4, 32)).sum().backward()
    if isinstance(recipe, DelayedScaling):
        state = layer._fwd_state
        used = [state.slot(role, gemm) for role in (Role.INPUT, Role.WEIGHT) for gemm in range(2)]
        assert (state.scale[used] != 1).all()  # the training steps updated it
        assert not layer._fwd_state.scale.is_inference()


# ------------------------------------------------------------------------- 15. under torch.autocast
@pytest.mark.parametrize("recipe", [None] + RECIPES, ids=["bf16"] + RECIPE_IDS)
@pytest.mark.parametrize("module", sorted(MODULES))
def test_torch_autocast_gives_the_autocast_dtype_like_nn_linear(recipe, module):
    torch.manual_seed(0)
    layer = MODULES[module]()
    x = torch.randn(8, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), engine.fp8_autocast(enabled=recipe is not None, recipe=recipe):
        out = layer(x)
        nn_out = torch.nn.Linear(32, 16)(x)
    assert out.dtype == nn_out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32 and all(p.grad.dtype == p.dtype for p in layer.parameters())


@pytest.mark.parametrize("recipe", [None] + RECIPES, ids=["bf16"] + RECIPE_IDS)
def test_linear_under_torch_autocast_is_linear_on_the_bf16_input(recipe):
    torch.manual_seed(0)
    layer = engine.Linear(32, 16)
    twin = engine.Linear(32, 16)
    twin.load_state_dict(layer.state_dict())
    x = torch.randn(8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16), engine.fp8_autocast(enabled=recipe is not None, recipe=recipe):
        got = layer(x)
    with engine.fp8_autocast(enabled=recipe is not None, recipe=recipe):
        want = twin(x.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
