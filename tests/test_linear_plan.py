"""The steady-state plan of a linear layer (engine/modules/linear_plan.py) gives the bits of the general path.

Every recipe `engine.recipes` exports runs the same steps twice from the same weights: as the modules run
them (the plan where one exists) and with the plan turned off (`LinearFunction` for every call); outputs,
gradients and the saved scaling state must be equal bit for bit (NaN bits too). The recipes the speed bar
names must take the plan, and the unusual cases must not.
"""

from __future__ import annotations

import checkpoint_specs
import pytest
import torch

import engine
from engine.modules import dispatch, linear_plan
from engine.recipes import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

RECIPE_NAMES = [cls.__name__ for cls in checkpoint_specs.exported_recipe_classes()]
#: what the speed bar (issue 28: FP8 Linear 16x256x256 within 2x) promises a plan for
PLANNED = (DelayedScaling(amax_history_len=4), Float8CurrentScaling(), Float8BlockScaling(), MXFP8BlockScaling())


def without_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "plan_for", lambda *args: None)


def as_bits(t: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor's raw bits (NaN payloads included)."""
    if t is None:
        return None
    return t.detach().view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
                           .get(t.dtype, t.dtype))


def run_steps(recipe, inputs: list[torch.Tensor], dtype: torch.dtype, module_cls=engine.Linear,
              needs: list[tuple[bool, bool]] | None = None, **kwargs) -> list:
    """Outputs, gradients and the saved state of steps of a fresh layer (seeded weights) over `inputs`;
    `needs`: per step, whether x and the weight require gradients (default: both)."""
    torch.manual_seed(0)
    layer = module_cls(inputs[0].shape[-1], 48, params_dtype=dtype, **kwargs)
    results = []
    for i, x in enumerate(inputs):
        x_grad, w_grad = (True, True) if needs is None else needs[i]
        for name, param in layer.named_parameters():
            if name.endswith("weight") and "norm" not in name:  # the GEMMs' weights
                param.requires_grad_(w_grad)
        x = x.clone().requires_grad_(x_grad)
        with engine.fp8_autocast(recipe=recipe):
            out = layer(x)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.linspace(-3, 3, out.numel(), dtype=out.dtype).reshape(out.shape))
        results += [out, x.grad] + [p.grad for p in layer.parameters()]
        layer.zero_grad(set_to_none=True)
    results.append(layer.get_extra_state())  # delayed scaling's scales and amax histories
    return results


def assert_same_bits(got: list, want: list) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), f"result {i}: {g is None} vs {w is None}"
        if w is not None:
            assert g.shape == w.shape and g.dtype == w.dtype, f"result {i}: {g.shape} {g.dtype} vs {w.shape} {w.dtype}"
            assert torch.equal(as_bits(g), as_bits(w)), f"result {i} differs"


def step_inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    """Steps of random tokens (2D, then 3D, each twice: a plan is made at the second call alike), then edge values
    (a zero row, a huge and a tiny value, -0)."""
    g = torch.Generator().manual_seed(1)
    edge = torch.randn(16, 64, generator=g).to(dtype)
    edge[0] = 0
    edge[1, 3], edge[2, 5], edge[3, 7] = 3e4, 1e-7, -0.0
    return [torch.randn(*shape, generator=g).to(dtype) for shape in ((16, 64), (16, 64), (2, 8, 64), (2, 8, 64))] + [edge]


def planned_calls(monkeypatch: pytest.MonkeyPatch) -> list:
    """The plans dispatch takes from here on (None: a call on the general path)."""
    seen = []
    real = dispatch.plan_for
    monkeypatch.setattr(dispatch, "plan_for", lambda *args: seen.append(real(*args)) or seen[-1])
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_linear_steps_have_the_general_paths_bits(name, dtype, monkeypatch):
    recipe = checkpoint_specs.make_recipe(name)
    seen = planned_calls(monkeypatch)
    planned = run_steps(recipe, step_inputs(dtype), dtype)
    if name in {type(r).__name__ for r in PLANNED}:  # the 2D and 3D steps, edge values: planned after their first
        assert [p is not None for p in seen] == [False, True, False, True, True]
    without_plans(monkeypatch)
    assert_same_bits(planned, run_steps(recipe, step_inputs(dtype), dtype))


@pytest.mark.parametrize("recipe", PLANNED, ids=lambda r: type(r).__name__)
def test_nonfinite_and_subnormal_scale_products_keep_their_bits(recipe, monkeypatch):
    """NaN/inf inputs, and inputs so small that a per-tensor scale product is not a normal fp32 number (the
    exact GEMM returns None and the rescaled GEMM runs)."""
    nonfinite = torch.randn(16, 64)
    nonfinite[4, 4], nonfinite[5, 1] = float("nan"), float("inf")
    tiny = torch.randn(16, 64) * 1e-36
    inputs = [torch.randn(16, 64), nonfinite, tiny, tiny * 1e-3]
    planned = run_steps(recipe, inputs, torch.float32)
    without_plans(monkeypatch)
    assert_same_bits(planned, run_steps(recipe, inputs, torch.float32))


@pytest.mark.parametrize("recipe", PLANNED, ids=lambda r: type(r).__name__)
def test_steps_that_need_fewer_gradients_keep_their_bits(recipe, monkeypatch):
    """A first layer's input (no dx), a frozen weight (no dW), then both again, through one layer: each step's
    plan makes what that step's backward reads."""
    needs = [(False, True), (False, True), (True, True), (True, True), (True, False), (True, False)]
    inputs = [torch.randn(16, 64, generator=torch.Generator().manual_seed(i)) for i in range(len(needs))]
    planned = run_steps(recipe, inputs, torch.float32, needs=needs)
    without_plans(monkeypatch)
    assert_same_bits(planned, run_steps(recipe, inputs, torch.float32, needs=needs))


@pytest.mark.parametrize("module_cls", [engine.LayerNormLinear, engine.LayerNormMLP], ids=lambda c: c.__name__)
@pytest.mark.parametrize("recipe", PLANNED, ids=lambda r: type(r).__name__)
def test_layernorm_layers_have_the_general_paths_bits(recipe, module_cls, monkeypatch):
    seen = planned_calls(monkeypatch)
    planned = run_steps(recipe, step_inputs(torch.bfloat16), torch.bfloat16, module_cls)
    assert any(p is not None for p in seen)
    without_plans(monkeypatch)
    assert_same_bits(planned, run_steps(recipe, step_inputs(torch.bfloat16), torch.bfloat16, module_cls))


def plan_of(layer: torch.nn.Module, x: torch.Tensor, recipe, **forward_kwargs):
    """The plan a call of `layer` on x takes (None: the general path), found by watching dispatch."""
    seen = []
    real = dispatch.plan_for

    def watching(*args):
        seen.append(real(*args))
        return seen[-1]

    dispatch.plan_for = watching
    try:
        with engine.fp8_autocast(recipe=recipe):
            layer(x, **forward_kwargs)
    finally:
        dispatch.plan_for = real
    return seen[-1] if seen else None


@pytest.mark.parametrize("recipe", PLANNED, ids=lambda r: type(r).__name__)
def test_the_bars_recipes_take_a_plan_made_once(recipe):
    layer = engine.Linear(64, 48)
    x = torch.randn(16, 64, requires_grad=True)
    assert plan_of(layer, x, recipe) is None  # a first call runs the general path: a plan is for a steady state
    first = plan_of(layer, x, recipe)
    assert isinstance(first, linear_plan.LinearPlan)
    assert plan_of(layer, x, recipe) is first  # cached: resolved once per (args, shapes, dtypes, flags)
    with torch.no_grad():
        plan_of(layer, x, recipe)
        inference = plan_of(layer, x, recipe)
    assert inference is not first and inference.dy is None
    assert inference.x.columnwise is None and inference.w.columnwise is None  # nothing saved: no columnwise copies


def test_unusual_calls_take_the_general_path():
    recipe = Float8CurrentScaling()
    x = torch.randn(16, 64, requires_grad=True)

    def steady_plan(layer, **forward_kwargs):  # the plan of a third call alike
        return [plan_of(layer, x, recipe, **forward_kwargs) for _ in range(3)][-1]

    assert steady_plan(engine.Linear(64, 48), is_first_microbatch=True) is None
    fused = engine.Linear(64, 48, fuse_wgrad_accumulation=True)
    fused.weight.main_grad = torch.zeros_like(fused.weight)
    assert steady_plan(fused) is None
    with engine.fp8_model_init(recipe=recipe):
        primary = engine.Linear(64, 48)
    assert steady_plan(primary) is None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ENGINE_BACKEND", "reference")
        assert steady_plan(engine.Linear(64, 48)) is None
    assert steady_plan(engine.Linear(64, 48)) is not None  # the same calls, usual: planned
