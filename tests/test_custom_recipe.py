"""CustomRecipe(qfactory=...): quantizers from a factory per module, GEMM and operand (issue 27, item 3).

The main check: a factory answering with a built-in recipe's specs (every recipe engine.recipes exports, as the
checkpoint fixtures build it) trains an engine.Linear and an engine.LayerNormMLP to the built-in recipe's bits -
forward output, dx and every parameter gradient over 2 steps - delayed scaling's updated scales and NVFP4's
stochastic-rounding streams included. Factories written as Transformer Engine's (fresh TE-named quantizers per
call, roles compared as strings) give the bits of their recipes too; the errors name the role.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import checkpoint_specs as specs
import engine
from engine.quantizers import (
    Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer, MXFP8Quantizer,
)
from engine.recipes import (
    CustomRecipe, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Gemm, MXFP8BlockScaling, QuantizerRole,
    QuantizerSpec, Recipe, Role,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
STEPS = 2
MODULES = {
    "Linear": lambda: engine.Linear(32, 48),
    "LayerNormMLP": lambda: engine.LayerNormMLP(32, 64),
}


def builtin_recipes() -> list[Recipe]:
    """Every recipe class engine.recipes exports but CustomRecipe itself, built as the checkpoint fixtures build it
    (DelayedScaling with a 4-row history, OperandRecipe with its mixed example)."""
    return [specs.make_recipe(cls.__name__) for cls in specs.exported_recipe_classes() if cls is not CustomRecipe]


def specs_factory(recipe: Recipe):
    """A factory answering each role with the built-in recipe's spec of that operand."""
    operands = recipe.operands()
    return lambda role: operands[role.operand]


def train(recipe: Recipe, module: str, steps: int = STEPS) -> list[torch.Tensor]:
    """Forward output, dx and each parameter's gradient of every step (SGD between steps), from one seed (recipe
    None: high precision)."""
    torch.manual_seed(0)
    model = MODULES[module]()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    got = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        x = torch.randn(32, 32, generator=gen).requires_grad_()
        with engine.fp8_autocast(enabled=recipe is not None, recipe=recipe):
            y = model(x)
        y.backward(torch.randn(y.shape, generator=gen))
        got += [y.detach().clone(), x.grad.clone(), *(p.grad.clone() for p in model.parameters())]
        optimizer.step()
        optimizer.zero_grad()
    return got


def assert_same_bits(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, i
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), (i, (g - w).abs().max().item())


# ---------------------------------------------------------------------------- the bits of every built-in recipe
@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("recipe", builtin_recipes(), ids=lambda r: type(r).__name__)
def test_a_factory_of_a_builtin_recipes_specs_gives_its_bits(recipe, module):
    want = train(recipe, module)
    custom = CustomRecipe(qfactory=specs_factory(recipe), seed=getattr(recipe, "seed", 0))
    assert_same_bits(train(custom, module), want)
    assert not all(torch.equal(a, b) for a, b in zip(train(None, module), want))  # (the recipe quantized)


def te_current(role):
    """Transformer Engine's current_scaling_factory, written for engine: a fresh quantizer per call."""
    return Float8CurrentScalingQuantizer(E5M2 if role == "linear_grad_output" else E4M3)


def te_block(role):
    return Float8BlockQuantizer(E4M3, block_scaling_dim=2 if role == "linear_weight" else 1)


def te_mxfp8(role):
    return MXFP8Quantizer(E4M3)


@pytest.mark.parametrize("factory, recipe", [(te_current, Float8CurrentScaling()), (te_block, Float8BlockScaling()),
                                             (te_mxfp8, MXFP8BlockScaling())], ids=["current", "block", "mxfp8"])
def test_transformer_engine_style_factories_give_their_recipes_bits(factory, recipe):
    assert_same_bits(train(CustomRecipe(qfactory=factory), "LayerNormMLP"), train(recipe, "LayerNormMLP"))


def test_the_two_uses_of_a_tensor_share_a_quantizer_when_the_answers_agree():
    state = CustomRecipe(qfactory=te_block).make_state(forward=True)
    fprop, wgrad = state.operand((Gemm.FPROP, Role.INPUT)), state.operand((Gemm.WGRAD, Role.INPUT))
    assert fprop is wgrad  # two fresh, identical quantizers: one quantization serves both uses
    made = MXFP8Quantizer(E4M3)
    mixed = CustomRecipe(qfactory=lambda role: made if role.gemm == "fprop" else MXFP8Quantizer(E5M2))
    state = mixed.make_state(forward=True)
    assert state.operand((Gemm.FPROP, Role.INPUT)) is not state.operand((Gemm.WGRAD, Role.INPUT))
    assert state.operand((Gemm.FPROP, Role.INPUT)) is not made  # a copy: the module sets its usages
    assert state.operand((Gemm.FPROP, Role.INPUT)).fp8_dtype == E4M3
    assert state.operand((Gemm.WGRAD, Role.INPUT)).fp8_dtype == E5M2


# ---------------------------------------------------------------------------- what the factory is asked
def test_the_factory_is_asked_per_module_gemm_and_operand_use():
    asked = []
    recipe = CustomRecipe(qfactory=lambda role: asked.append(role))  # None for all: high precision
    layer = engine.LayerNormMLP(32, 64)
    with engine.fp8_autocast(recipe=recipe):
        layer(torch.randn(4, 32))
    want = [(tensor, gemm, index, name) for index, name in enumerate(("fc1", "fc2"))
            for tensor, gemm in (("input", "fprop"), ("input", "wgrad"), ("weight", "fprop"), ("weight", "dgrad"))]
    want += [("grad_output", gemm, index, name) for index, name in enumerate(("fc1", "fc2"))
             for gemm in ("dgrad", "wgrad")]
    assert [(r.tensor_type, r.gemm, r.gemm_index, r.name) for r in asked] == want
    assert [str(r) for r in asked[:4]] == ["linear_input", "linear_input", "linear_weight", "linear_weight"]
    assert {r.module for r in asked} == {"LayerNormMLP"} and {r.module_type for r in asked} == {"linear"}
    assert asked[1].operand == (Gemm.WGRAD, Role.INPUT) and asked[-1] == "linear_grad_output"
    asked.clear()
    with engine.fp8_autocast(recipe=recipe):
        layer(torch.randn(4, 32))
    assert asked == []  # the states are built once per recipe
    with engine.fp8_autocast(recipe=recipe):
        engine.Linear(32, 16)(torch.randn(4, 32))
    assert {(r.module, r.name, r.gemm_index) for r in asked} == {("Linear", "", 0)}


def test_a_role_is_checked_and_immutable():
    role = QuantizerRole("weight", "dgrad", 1, "fc2", "LayerNormMLP")
    assert role == "linear_weight" and role.operand == (Gemm.DGRAD, Role.WEIGHT) and role.is_forward
    with pytest.raises(ValueError, match=r"gemm: the weight is read by \['fprop', 'dgrad'\], got 'wgrad'"):
        QuantizerRole("weight", "wgrad")
    with pytest.raises(ValueError, match="tensor_type: expected one of"):
        QuantizerRole("output", "fprop")
    with pytest.raises(AttributeError, match="immutable"):
        role.name = "fc1"


# ---------------------------------------------------------------------------- stateful quantizers
def test_delayed_scaling_from_a_factory_updates_and_is_saved_as_delayed_scalings():
    """A delayed spec for some roles only: the module's state keeps DelayedScaling's scale and history (its
    columns, updated after each step from the amaxes seen), which `_extra_state` saves and a load restores."""
    def factory(role):
        if role == "linear_input":
            return QuantizerSpec(scheme="tensor_e4m3", rule="delayed", params={"amax_history_len": 3, "margin": 1})
        if role == "linear_weight":
            return Float8CurrentScalingQuantizer(E4M3)
        return QuantizerSpec(scheme="tensor_e5m2", rule="current")

    recipe = CustomRecipe(qfactory=factory)
    layer = engine.Linear(32, 16, bias=False)
    with engine.fp8_autocast(recipe=recipe):
        x = torch.randn(8, 32) * 3
        layer(x)
    state = layer._fwd_state
    assert state.delayed is not None and state.delayed.amax_history.shape == (3, 3)  # x, W, output columns
    amax = x.abs().max()
    assert torch.equal(state.delayed.amax_history[-1, 0], amax)  # recorded, then rolled by the update at exit
    assert torch.equal(state.delayed.scale[0], torch.tensor(448.0) / amax / 2)  # fp8_max / amax * 2**-margin
    assert state.delayed.scale[1:].tolist() == [1.0, 1.0]  # W is current-scaled: its column is never recorded
    assert state.operand((Gemm.WGRAD, Role.INPUT)) is state.delayed.quantizers[0]
    assert layer._bwd_state.delayed is None
    saved = layer.state_dict()
    fresh = engine.Linear(32, 16, bias=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.load_state_dict(saved)
        with engine.fp8_autocast(recipe=recipe):
            fresh(torch.zeros(8, 32))
    assert torch.equal(fresh._fwd_state.delayed.scale, state.delayed.scale)


def test_a_stateful_quantizer_returned_as_such_is_refused_naming_the_role():
    recipe = CustomRecipe(qfactory=lambda role: Float8Quantizer(torch.ones(1), torch.zeros(1), E4M3))
    with pytest.raises(ValueError, match=r"role QuantizerRole\('linear_input', gemm='fprop'.*a stateful quantizer "
                                         r"whose scale nothing would update.*rule='delayed'"):
        recipe.make_state(forward=True)


# ---------------------------------------------------------------------------- errors name the role
def test_a_factory_returning_a_non_quantizer_is_a_type_error_naming_the_role():
    recipe = CustomRecipe(qfactory=lambda role: "fp8" if role.gemm == "dgrad" else None)
    layer = engine.Linear(32, 16)
    with pytest.raises(TypeError, match=r"qfactory: expected a Quantizer, a QuantizerSpec or None for role "
                                        r"QuantizerRole\('linear_weight', gemm='dgrad'.*got str: 'fp8'"):
        with engine.fp8_autocast(recipe=recipe):
            layer(torch.randn(4, 32))


def test_an_exception_inside_the_factory_keeps_its_type_and_names_the_role():
    def factory(role):
        return {"linear_input": None, "linear_weight": None}[role]  # TE 2.x style: no grad_output entry

    with pytest.raises(KeyError) as err:
        CustomRecipe(qfactory=factory).make_state(forward=False, num_gemms=2, module="LayerNormMLP",
                                                   gemm_names=("fc1", "fc2"))
    assert err.value.__notes__ == ["raised by CustomRecipe.qfactory for role QuantizerRole('linear_grad_output', "
                                   "gemm='dgrad', gemm_index=0, name='fc1', module='LayerNormMLP') (the dgrad use of "
                                   "grad_output of GEMM 0 (fc1) of a LayerNormMLP)"]


def test_a_spec_for_the_wrong_role_is_refused_naming_it():
    """Delayed scaling to E5M2 for a forward tensor (no recipe format has one), and delayed specs of one state that
    disagree (they share one scaling state)."""
    e5m2 = CustomRecipe(qfactory=lambda role: QuantizerSpec(scheme="tensor_e5m2", rule="delayed"))
    with pytest.raises(ValueError, match=r"role QuantizerRole\('linear_input'.*delayed scaling quantizes forward "
                                         r"tensors to E4M3.*use 'tensor_e4m3'"):
        e5m2.make_state(forward=True)
    assert e5m2.make_state(forward=False).delayed.fp8_max == 57344.0  # E5M2 gradients are fine

    def disagreeing(role):
        return QuantizerSpec(scheme="tensor_e4m3", rule="delayed", params={"margin": 1 if role.gemm_index else 0})

    with pytest.raises(ValueError, match=r"must agree; role QuantizerRole\('linear_input'.*gemm_index=0.*role "
                                         r"QuantizerRole\('linear_input'.*gemm_index=1"):
        CustomRecipe(qfactory=disagreeing).make_state(forward=True, num_gemms=2)


def test_recipe_fields_and_what_it_cannot_do():
    with pytest.raises(ValueError, match="qfactory"):
        CustomRecipe()
    with pytest.raises(ValueError, match="fp8_format: CustomRecipe takes every quantizer from its qfactory"):
        CustomRecipe(qfactory=te_mxfp8, fp8_format="E4M3")
    with pytest.raises(ValueError, match="seed"):
        CustomRecipe(qfactory=te_mxfp8, seed=-1)
    with pytest.raises(TypeError, match="no module-independent operand map"):
        CustomRecipe(qfactory=te_mxfp8).operands()
    with pytest.raises(ValueError, match="gemm_names: expected 2 names"):
        CustomRecipe(qfactory=te_mxfp8).make_state(forward=True, num_gemms=2, gemm_names=("fc1",))


def test_a_checkpoint_keeps_the_factorys_name():
    """Saved under one factory: loads silently under a factory of the same name, with the recipe warning under
    another; the factory read back from the checkpoint is a name that refuses to be called."""
    layer = engine.Linear(32, 16)
    with engine.fp8_autocast(recipe=CustomRecipe(qfactory=te_mxfp8)):
        layer(torch.randn(4, 32))
    saved = layer.state_dict()
    saved_recipe = engine.recipes.recipe_from_plain(engine.recipes.recipe_to_plain(layer._recipe))
    assert saved_recipe.key == layer._recipe.key
    with pytest.raises(ValueError, match=r"qfactory: callable test_custom_recipe\.te_mxfp8 was read from a "
                                         r"checkpoint, which keeps only its name"):
        saved_recipe.qfactory(QuantizerRole("input", "fprop"))
    other = engine.Linear(32, 16)
    other.load_state_dict(saved)
    with pytest.warns(UserWarning, match="checkpoint was saved under CustomRecipe.*te_mxfp8.*loaded under "
                                         "CustomRecipe.*te_block"):
        with engine.fp8_autocast(recipe=CustomRecipe(qfactory=te_block)):
            other(torch.randn(4, 32))


def test_torch_compile_refuses_it_with_the_reason():
    layer = engine.Linear(32, 32)
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    with pytest.raises(Exception) as err:
        with engine.fp8_autocast(recipe=CustomRecipe(qfactory=te_mxfp8)):
            compiled(torch.randn(4, 32))
    assert str(err.value).splitlines()[0].startswith("torch.compile: CustomRecipe is not supported yet")
