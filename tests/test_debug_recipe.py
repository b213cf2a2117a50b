"""engine.recipes.Debug: TE's debug switches per layer, each checked against an independent computation."""

from __future__ import annotations

import io

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F

import engine
from engine.recipes import (Debug, DelayedScaling, Float8CurrentScaling, Gemm, MXFP8BlockScaling, NVFP4BlockScaling, RecipeMap, Role,
                            recipe_from_plain, recipe_to_plain)

N, K, M = 32, 64, 48  # out features, in features, tokens


def layer(seed: int = 0, fp8_weights=None) -> engine.Linear:
    """The layer; `fp8_weights`: a recipe to store its weight in (fp8_model_init)."""
    torch.manual_seed(seed)
    with engine.fp8_model_init(enabled=fp8_weights is not None, recipe=fp8_weights):
        m = engine.Linear(K, N, bias=False)
    m.name = "lin"
    return m


def run(recipe, seed: int = 0, steps: int = 1, fp8_weights=None):
    """(y, dx, dW, x, dy) of the layer under `recipe` (fp32 activations, the same x and dy each time)."""
    m = layer(seed, fp8_weights)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M, K, generator=g)
    dy = torch.randn(M, N, generator=g)
    for _ in range(steps):
        xr = x.clone().requires_grad_()
        m.weight.grad = None
        with engine.fp8_autocast(recipe=recipe):
            y = m(xr)
        y.backward(dy)
    return y.detach(), xr.grad, m.weight.grad, x, dy, m.weight.detach()


def fake(recipe, operand, t: torch.Tensor) -> torch.Tensor:
    """dequantize(quantize(t)) for one use, by a fresh quantizer of the recipe's spec for it."""
    q = recipe.operands()[operand].make()
    columnwise = operand in ((Gemm.WGRAD, Role.INPUT), (Gemm.WGRAD, Role.GRAD_OUTPUT), (Gemm.DGRAD, Role.WEIGHT))
    q.set_usage(rowwise=not columnwise, columnwise=columnwise)
    return q.quantize_storage(t).dequantize()


def test_a_high_precision_wgrad_is_dy_t_x_in_fp32_and_leaves_fprop_and_dgrad_quantized():
    plain = run(MXFP8BlockScaling())
    y, dx, dw, x, dy, _ = run(Debug(MXFP8BlockScaling(), high_precision=("wgrad",)))
    assert torch.equal(dw, dy.t() @ x)
    assert not torch.equal(plain[2], dy.t() @ x)  # the recipe's own wgrad is quantized
    assert torch.equal(y, plain[0]) and torch.equal(dx, plain[1])


@pytest.mark.parametrize("gemm", ["fprop", "dgrad"])
def test_a_high_precision_fprop_or_dgrad_is_the_fp32_gemm(gemm):
    y, dx, dw, x, dy, w = run(Debug(NVFP4BlockScaling(), high_precision=(gemm,)))
    if gemm == "fprop":
        assert torch.equal(y, x @ w.t())
    else:
        assert torch.equal(dx, dy @ w)


def test_fake_quantize_runs_the_fp32_gemms_on_dequantized_operands():
    recipe = MXFP8BlockScaling()
    state = Debug(recipe, fake_quantize=("fprop",)).make_state(forward=True)
    row, col = state.uses(Role.INPUT)
    assert type(row.quantize_storage(torch.ones(M, K))) is torch.Tensor  # MXFP8's GEMM is exact: say it is skipped
    assert not isinstance(col.quantize_storage(torch.ones(M, K)), torch.Tensor)
    y, dx, dw, x, dy, w = run(Debug(recipe, fake_quantize=("fprop", "dgrad", "wgrad")))
    assert torch.equal(y, F.linear(fake(recipe, (Gemm.FPROP, Role.INPUT), x), fake(recipe, (Gemm.FPROP, Role.WEIGHT), w)))
    assert torch.equal(dx, fake(recipe, (Gemm.DGRAD, Role.GRAD_OUTPUT), dy) @ fake(recipe, (Gemm.DGRAD, Role.WEIGHT), w))
    assert torch.equal(dw, fake(recipe, (Gemm.WGRAD, Role.GRAD_OUTPUT), dy).t()
                       @ fake(recipe, (Gemm.WGRAD, Role.INPUT), x))


def test_fake_quantize_of_nvfp4_fprop_is_f_linear_on_its_dequantized_values():
    recipe = NVFP4BlockScaling()
    y, *_, x, dy, w = run(Debug(recipe, fake_quantize=("fprop",)))
    assert torch.equal(y, F.linear(fake(recipe, (Gemm.FPROP, Role.INPUT), x), fake(recipe, (Gemm.FPROP, Role.WEIGHT), w)))


def test_current_scaling_gives_the_named_gemm_per_tensor_current_fp8():
    y, dx, dw, *_ = run(Debug(MXFP8BlockScaling(), current_scaling=("fprop",)))
    current, mx = run(Float8CurrentScaling()), run(MXFP8BlockScaling())
    assert torch.equal(y, current[0])  # Float8CurrentScaling: per-tensor E4M3 forward, current scales
    assert torch.equal(dx, mx[1]) and torch.equal(dw, mx[2])


def test_current_scaling_of_a_4_bit_recipe_takes_hybrid_fp8():
    assert Debug(NVFP4BlockScaling(), current_scaling=("fprop", "dgrad")).operands() == {
        **NVFP4BlockScaling().operands(),
        **{op: spec for op, spec in Float8CurrentScaling().operands().items() if op[0] is not Gemm.WGRAD}}


def test_the_dump_writes_the_operands_of_the_asked_call_only(tmp_path):
    recipe = MXFP8BlockScaling()
    *_, x, dy, w = run(Debug(recipe, dump_step=1, dump_dir=str(tmp_path), high_precision=("wgrad",)), steps=3)
    files = sorted(p.name for p in tmp_path.iterdir())
    # MXFP8's x: one quantizer for fprop and wgrad, but wgrad is high precision here: fprop's use only
    assert files == ["lin.dgrad_grad_output.step1.safetensors", "lin.fprop_input.step1.safetensors",
                     "lin.weight.step1.safetensors"]
    got = safetensors.torch.load_file(tmp_path / "lin.fprop_input.step1.safetensors")
    assert set(got) == {"input", "rowwise"}
    assert torch.equal(got["input"], x) and torch.equal(got["rowwise"], fake(recipe, (Gemm.FPROP, Role.INPUT), x))
    weight = safetensors.torch.load_file(tmp_path / "lin.weight.step1.safetensors")
    assert torch.equal(weight["columnwise"], fake(recipe, (Gemm.DGRAD, Role.WEIGHT), w))
    grad = safetensors.torch.load_file(tmp_path / "lin.dgrad_grad_output.step1.safetensors")
    assert torch.equal(grad["input"], dy)


def test_a_map_with_switches_survives_a_state_dict_and_trains_alike(tmp_path):
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(engine.Linear(K, K), engine.Linear(K, N))

    debug = Debug(NVFP4BlockScaling(), high_precision=("wgrad",), fake_quantize=("dgrad",),
                  dump_step=5, dump_dir=str(tmp_path))
    recipe_map = RecipeMap(rules=[("1", debug)], default=MXFP8BlockScaling())
    a = engine.set_recipe_map(model(), recipe_map)
    x = torch.randn(M, K)
    with engine.fp8_autocast(recipe=NVFP4BlockScaling()):
        a(x).sum().backward()
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    b = model()
    b.load_state_dict(torch.load(buffer, weights_only=True))
    assert engine.recipe_map_of(b).recipe_for("1") == debug
    c = model()
    c.load_state_dict(safetensors.torch.load(safetensors.torch.save(a.state_dict())))
    assert engine.recipe_map_of(c).recipe_for("1") == debug and engine.recipe_map_of(c).recipe_for("0") == MXFP8BlockScaling()
    for m in (a, b):
        m.zero_grad()
        with engine.fp8_autocast(recipe=NVFP4BlockScaling()):
            m(x).sum().backward()
    assert torch.equal(a[1].weight.grad, b[1].weight.grad) and torch.equal(a[0].weight.grad, b[0].weight.grad)


def test_the_recipe_as_plain_data_comes_back_equal():
    debug = Debug(NVFP4BlockScaling(disable_rht=True), high_precision=("wgrad",), current_scaling=("fprop",),
                  dump_step=3, dump_dir="d")
    import json

    assert recipe_from_plain(json.loads(json.dumps(recipe_to_plain(debug)))) == debug


@pytest.mark.parametrize("fields, message", [
    ({"high_precision": "wgrad"}, "tuple of GEMM names"),
    ({"high_precision": ("bprop",)}, "high_precision"),
    ({"high_precision": ("wgrad",), "fake_quantize": ("wgrad",)}, "also has fake_quantize"),
    ({"current_scaling": ("fprop", "fprop")}, "named twice"),
    ({"dump_step": 3}, "give both or neither"),
    ({"dump_step": -1, "dump_dir": "d"}, "int >= 0"),
])
def test_bad_switches_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        Debug(MXFP8BlockScaling(), **fields)


def test_debug_of_debug_or_of_no_recipe_is_refused():
    with pytest.raises(ValueError, match="other than Debug"):
        Debug(Debug(MXFP8BlockScaling()))
    with pytest.raises(ValueError, match="engine recipe"):
        Debug("mxfp8")


def compiled_run(recipe, fp8_weights=None):
    """run()'s (y, dx, dW) with the layer compiled whole (aot_eager: Dynamo and AOTAutograd, eager kernels)."""
    import torch._dynamo

    torch._dynamo.reset()
    m = layer(fp8_weights=fp8_weights)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M, K, generator=g).requires_grad_()
    dy = torch.randn(M, N, generator=g)
    with engine.fp8_autocast(recipe=recipe):
        y = compiled(x)
    y.backward(dy)
    return y.detach(), x.grad, m.weight.grad


@pytest.mark.parametrize("switches", [{"current_scaling": ("dgrad",)}, {"high_precision": ("fprop",)}])
def test_spec_switches_compile_with_eager_bits(switches):
    recipe = Debug(NVFP4BlockScaling(), **switches)
    for got, want in zip(compiled_run(recipe), run(recipe)[:3]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("inner, gemms, fp8_weights", [
    (NVFP4BlockScaling(), ("fprop", "dgrad", "wgrad"), False),  # stochastic rounding of the fake-quantized dy
    (NVFP4BlockScaling(), ("dgrad",), True),  # an FP8 primary weight read as stored, dy fake-quantized
    (MXFP8BlockScaling(), ("wgrad",), True),  # the saved x: its dequantized columnwise use
    (DelayedScaling(), ("fprop", "wgrad"), False),  # amax records of fake-quantized operands
])
def test_fake_quantize_compiles_with_eager_bits(inner, gemms, fp8_weights):
    recipe = Debug(inner, fake_quantize=gemms)
    weights = recipe if fp8_weights else None
    assert_same(two_steps(recipe, weights, compiled=True), two_steps(recipe, weights, compiled=False))


@pytest.mark.parametrize("inner", [NVFP4BlockScaling(), MXFP8BlockScaling(), Float8CurrentScaling()])
def test_fp8_weights_with_a_high_precision_dgrad_compile_with_eager_bits(inner):
    recipe = Debug(inner, high_precision=("dgrad",))  # dgrad reads the stored weight's value, dequantized
    assert_same(two_steps(recipe, recipe, compiled=True), two_steps(recipe, recipe, compiled=False))


def two_steps(recipe, fp8_weights, *, compiled: bool) -> list[torch.Tensor]:
    """(y, dx, dW) of two steps, then the layer's scaling state and stochastic-rounding counters."""
    import torch._dynamo

    torch._dynamo.reset()
    m = layer(fp8_weights=fp8_weights)
    f = torch.compile(m, fullgraph=True, backend="aot_eager") if compiled else m
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(M, K, generator=g), torch.randn(M, N, generator=g)
    seen = []
    for _ in range(2):
        xr = x.clone().requires_grad_()
        m.weight.grad = None
        with engine.fp8_autocast(recipe=recipe):
            y = f(xr)
        y.backward(dy)
        seen += [y.detach(), xr.grad, m.weight.grad]
    with engine.fp8_autocast(recipe=recipe):  # fold in the last backward
        pass
    return seen + [t.clone() for s in (m._fwd_state, m._bwd_state) for t in [*s.op_tensors(), *s.rng_counters]]


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and torch.equal(g, w), f"item {i} differs"


def test_dumps_refuse_to_compile():
    with pytest.raises(Exception, match="torch.compile: engine.recipes.Debug with dump_step runs eagerly only"):
        compiled_run(Debug(MXFP8BlockScaling(), dump_step=0, dump_dir="unused"))


def test_fp8_weights_refuse_current_scaling_of_a_gemm_reading_them():
    with pytest.raises(ValueError, match="recipe: fp8_model_init stores the weights in nvfp4's format"):
        with engine.fp8_model_init(recipe=Debug(NVFP4BlockScaling(), current_scaling=("fprop",))):
            pass
    with engine.fp8_model_init(recipe=Debug(NVFP4BlockScaling(), current_scaling=("wgrad",))):
        assert isinstance(engine.Linear(K, N).weight, engine.QuantizedTensor)
