"""fp8_autocast / fp8_model_init: nesting, when delayed scales update, calibration, FP8 primary weights."""

import pytest
import torch

from engine import autocast
from engine.autocast import fp8_autocast, fp8_model_init
from engine.parameters import clear_high_precision_init_val, get_high_precision_init_val, make_parameter
from engine.recipes import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, Role
from engine.tensors import Float8Tensor, MXFP8Tensor


def test_nesting_restores_the_outer_settings():
    outer, inner = DelayedScaling(margin=1), MXFP8BlockScaling()
    assert not autocast.is_fp8_enabled()
    with fp8_autocast(recipe=outer):
        assert autocast.is_fp8_enabled() and autocast.get_recipe() is outer
        with fp8_autocast(enabled=False, recipe=inner):
            assert not autocast.is_fp8_enabled() and autocast.get_recipe() is inner
        assert autocast.is_fp8_enabled() and autocast.get_recipe() is outer
    assert not autocast.is_fp8_enabled()
    assert autocast.get_recipe() == DelayedScaling()


def test_default_recipe_is_delayed_scaling():
    with fp8_autocast():
        assert autocast.get_recipe() == DelayedScaling()


def test_state_is_restored_when_the_body_raises():
    with pytest.raises(KeyError):
        with fp8_autocast(recipe=Float8CurrentScaling()):
            raise KeyError("boom")
    assert not autocast.is_fp8_enabled() and autocast.get_recipe() == DelayedScaling()


@pytest.mark.parametrize("kwargs, name", [
    ({"enabled": 1}, "enabled"), ({"calibrating": "no"}, "calibrating"),
    ({"recipe": "delayed"}, "recipe"), ({"fp8_group": 3}, "fp8_group"),
])
def test_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises(TypeError, match=name):
        with fp8_autocast(**kwargs):
            pass


def record_forward(state, amax):
    """What a module does in forward under delayed scaling: quantize with every slot, register the state."""
    autocast.register_forward_state(state)
    for q in state.quantizers:
        q(torch.tensor([amax]))


def test_forward_scales_update_when_the_outermost_autocast_exits():
    recipe = DelayedScaling(amax_history_len=2)
    state = recipe.make_state(forward=True)
    with fp8_autocast(recipe=recipe):
        record_forward(state, 4.0)
        with fp8_autocast(recipe=recipe):
            record_forward(state, 8.0)
        assert state.scale.tolist() == [1.0, 1.0, 1.0]  # the inner exit does not update
    assert state.scale.tolist() == [56.0, 56.0, 56.0]  # 448 / max(4, 8)
    assert state.amax_history.tolist() == [[-1.0] * 3, [8.0] * 3]  # row 0: nothing recorded yet


@pytest.mark.parametrize("backward_inside", [False, True])
def test_backward_scales_fold_in_once_before_the_next_backward(backward_inside):
    """Backward slots update at the outermost exit (if the backward ran inside) or at the next entry."""
    recipe = DelayedScaling(amax_history_len=2)
    first, second = recipe.make_state(forward=False), recipe.make_state(forward=False)

    def backward(amax):  # the second module's gradients first, then the first module's
        second.quantizers[0](torch.tensor([amax / 2]))
        first.quantizers[0](torch.tensor([amax]))

    with fp8_autocast(recipe=recipe):
        autocast.register_backward_state(first)
        autocast.register_backward_state(second)
        if backward_inside:
            backward(4.0)
    if not backward_inside:
        backward(4.0)
        assert first.scale.tolist() == [1.0, 1.0]  # not yet: at the next entry
    with fp8_autocast(recipe=recipe):
        assert first.scale[0].item() == 57344.0 / 4 and second.scale[0].item() == 57344.0 / 2
        assert first.scale[1].item() == 1.0  # grad_input slot: never recorded, left as it is
    # the exit above and later entries/exits without a new backward change nothing
    for _ in range(2):
        with fp8_autocast(recipe=recipe):
            pass
    assert first.amax_history[:, 0].tolist() == [-1.0, 4.0]
    assert first.scale[0].item() == 57344.0 / 4


def test_registering_outside_autocast_is_an_error():
    state = DelayedScaling().make_state(forward=True)
    with pytest.raises(RuntimeError, match="outside fp8_autocast"):
        autocast.register_forward_state(state)


def test_stateless_recipes_have_nothing_to_update_or_reduce():
    state = Float8CurrentScaling().make_state(forward=True)
    assert state.amaxes_to_reduce() == [] and state.to_plain() is None
    with fp8_autocast(recipe=Float8CurrentScaling()):
        autocast.register_forward_state(state)
    q = state.quantizer(Role.INPUT)
    assert q.config() == Float8CurrentScaling().make_state(forward=True).quantizer(Role.INPUT).config()


def test_calibration_records_amaxes_in_high_precision_and_seeds_the_first_fp8_step():
    recipe = DelayedScaling(amax_history_len=4)
    state = recipe.make_state(forward=True)
    x = torch.tensor([[3.0, -7.0], [0.5, 1.0]])
    with fp8_autocast(enabled=False, calibrating=True, recipe=recipe):
        assert autocast.is_calibrating() and not autocast.is_fp8_enabled()
        autocast.register_forward_state(state)
        state.record_amax(state.slot(Role.INPUT), x)
    assert state.scale[0].item() == 64.0  # 448 / 7
    with fp8_autocast(recipe=recipe):
        q = state.quantizer(Role.INPUT)(x)
    assert q.qstorage.rowwise_data.float().tolist() == [[192.0, -448.0], [32.0, 64.0]]


def test_fp8_model_init_makes_quantized_parameters_with_an_optional_high_precision_copy():
    value = torch.randn(64, 64)
    quantizer = MXFP8BlockScaling().make_state(forward=True).quantizer(Role.WEIGHT)
    assert type(make_parameter(value, quantizer)) is torch.nn.Parameter
    with fp8_model_init(recipe=MXFP8BlockScaling(), preserve_high_precision_init_val=True):
        assert autocast.is_fp8_model_init() and autocast.model_init_recipe() == MXFP8BlockScaling()
        param = make_parameter(value, quantizer)
    assert not autocast.is_fp8_model_init()
    assert isinstance(param, MXFP8Tensor) and isinstance(param, torch.nn.Parameter) and param.requires_grad
    assert torch.equal(param.dequantize(), quantizer(value).dequantize())
    assert torch.equal(get_high_precision_init_val(param), value)
    clear_high_precision_init_val(param)
    assert get_high_precision_init_val(param) is None


def test_fp8_model_init_without_preserving_keeps_no_copy():
    quantizer = DelayedScaling().make_state(forward=True).quantizer(Role.WEIGHT)
    with fp8_model_init():
        param = make_parameter(torch.ones(4, 4), quantizer)
    assert isinstance(param, Float8Tensor) and get_high_precision_init_val(param) is None
