"""Recipes: validation, immutability, the quantizers they make, and delayed-scaling state updates."""

import math

import pytest
import torch
from pydantic import ValidationError

from engine.quantizers import Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer, MXFP8Quantizer
from engine.recipes.delayed import NOT_RECORDED
from engine.recipes import (
    RECIPES, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, MXFP8BlockScaling, Role,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FLT_MAX = torch.finfo(torch.float32).max


# ------------------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    "cls, kwargs, field",
    [
        (DelayedScaling, {"margin": -1}, "margin"),
        (DelayedScaling, {"margin": 1.5}, "margin"),
        (DelayedScaling, {"margin": "1"}, "margin"),
        (DelayedScaling, {"amax_history_len": 0}, "amax_history_len"),
        (DelayedScaling, {"amax_compute_algo": "min"}, "amax_compute_algo"),
        (DelayedScaling, {"reduce_amax": "yes"}, "reduce_amax"),
        (DelayedScaling, {"fp8_format": "E5M2"}, "fp8_format"),
        (DelayedScaling, {"fp8_format": Format.E5M2}, "fp8_format"),
        (DelayedScaling, {"fp8_format": "E3M4"}, "fp8_format"),
        (DelayedScaling, {"histroy": 3}, "histroy"),
        (Float8CurrentScaling, {"amax_epsilon": -1e-6}, "amax_epsilon"),
        (Float8CurrentScaling, {"amax_epsilon": float("nan")}, "amax_epsilon"),
        (Float8CurrentScaling, {"use_power_2_scales": 1}, "use_power_2_scales"),
        (Float8BlockScaling, {"x_block_scaling_dim": 3}, "x_block_scaling_dim"),
        (MXFP8BlockScaling, {"scale_mode": "nearest"}, "scale_mode"),
    ],
)
def test_bad_values_name_the_field(cls, kwargs, field):
    with pytest.raises(ValidationError) as err:
        cls(**kwargs)
    assert field in str(err.value)
    assert isinstance(err.value, ValueError)


@pytest.mark.parametrize("pairing", [
    {"x_block_scaling_dim": 2},  # fprop and wgrad 2D x 2D
    {"grad_block_scaling_dim": 2},  # dgrad 2D x 2D
    {"x_block_scaling_dim": 2, "grad_block_scaling_dim": 2, "w_block_scaling_dim": 1},  # wgrad
])
def test_block_recipe_rejects_2d_by_2d(pairing):
    with pytest.raises(ValidationError, match="2D x 2D"):
        Float8BlockScaling(**pairing)


def test_block_recipe_allows_all_1d():
    r = Float8BlockScaling(x_block_scaling_dim=1, w_block_scaling_dim=1, grad_block_scaling_dim=1)
    assert r.w_block_scaling_dim == 1


def test_recipes_are_immutable_readable_and_compare_by_value():
    r = DelayedScaling(margin=2, amax_history_len=16)
    with pytest.raises(ValidationError):
        r.margin = 3
    assert r == DelayedScaling(margin=2, amax_history_len=16)
    assert r != DelayedScaling(margin=1, amax_history_len=16)
    assert hash(r) == hash(DelayedScaling(margin=2, amax_history_len=16))
    text = repr(r)
    assert text.startswith("DelayedScaling(") and "margin=2" in text and "Format.HYBRID" in text
    assert str(Float8BlockScaling()).startswith("Float8BlockScaling(fp8_format=Format.E4M3")


def test_format_accepts_names_and_gives_dtypes():
    assert DelayedScaling(fp8_format="E4M3").fp8_format is Format.E4M3
    assert (Format.HYBRID.forward_dtype, Format.HYBRID.backward_dtype) == (E4M3, E5M2)
    assert (Format.E4M3.forward_dtype, Format.E4M3.backward_dtype) == (E4M3, E4M3)


def test_defaults_match_transformer_engine():
    r = DelayedScaling()
    assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo, r.reduce_amax) == (
        0, Format.HYBRID, 1024, "max", True)
    assert set(RECIPES) == {"delayed", "current", "block", "mxfp8", "rowwise", "mxfp4", "mxfp4_mixed", "mxfp6",
                            "nvfp4"}


# ------------------------------------------------------------------------------ quantizers per role
@pytest.mark.parametrize("fmt, fwd, bwd", [(Format.HYBRID, E4M3, E5M2), (Format.E4M3, E4M3, E4M3)])
@pytest.mark.parametrize("recipe_cls, quantizer_cls", [
    (DelayedScaling, Float8Quantizer),
    (Float8CurrentScaling, Float8CurrentScalingQuantizer),
    (Float8BlockScaling, Float8BlockQuantizer),
    (MXFP8BlockScaling, MXFP8Quantizer),
])
def test_states_hold_one_quantizer_per_role_with_the_right_dtype(recipe_cls, quantizer_cls, fmt, fwd, bwd):
    recipe = recipe_cls(fp8_format=fmt)
    fwd_state = recipe.make_state(forward=True, num_gemms=2)
    bwd_state = recipe.make_state(forward=False, num_gemms=2)
    fwd_qs = [fwd_state.quantizer(role, g) for g in range(2) for role in (Role.INPUT, Role.WEIGHT)]
    bwd_qs = [bwd_state.quantizer(Role.GRAD_OUTPUT, g) for g in range(2)]
    assert all(type(q) is quantizer_cls for q in fwd_qs + bwd_qs)
    assert [q.fp8_dtype for q in fwd_qs] == [fwd] * 4 and [q.fp8_dtype for q in bwd_qs] == [bwd] * 2
    assert len({id(q) for q in fwd_qs}) == 4
    # a preset gives both uses of a tensor the same spec: one quantizer makes both usages
    for role, state in ((Role.INPUT, fwd_state), (Role.WEIGHT, fwd_state), (Role.GRAD_OUTPUT, bwd_state)):
        first, second = role.uses
        assert state.operand(first, 1) is state.operand(second, 1) is state.quantizer(role, 1)
    # scaling state columns keep Transformer Engine's layout: 3 per GEMM forward, 2 backward
    assert fwd_state.slot(Role.WEIGHT, 1) == 4 and bwd_state.slot(Role.GRAD_OUTPUT, 1) == 2


def test_state_rejects_bad_roles_and_gemm_counts():
    state = MXFP8BlockScaling().make_state(forward=True)
    with pytest.raises(ValueError, match="role"):
        state.quantizer(Role.GRAD_OUTPUT)
    with pytest.raises(ValueError, match="gemm"):
        state.quantizer(Role.INPUT, 1)
    with pytest.raises(ValueError, match="num_gemms"):
        MXFP8BlockScaling().make_state(forward=True, num_gemms=0)


def test_current_scaling_settings_reach_every_quantizer():
    recipe = Float8CurrentScaling(use_power_2_scales=True, amax_epsilon=1e-3)
    for forward, roles in ((True, (Role.INPUT, Role.WEIGHT)), (False, (Role.GRAD_OUTPUT,))):
        for role in roles:
            q = recipe.make_state(forward=forward).quantizer(role)
            assert q.force_pow_2_scales is True and q.amax_epsilon == 1e-3
    # the epsilon is used: an all-zero tensor gets scale 448 / 1e-3, rounded down to a power of two
    q = recipe.make_state(forward=True).quantizer(Role.INPUT)
    t = q(torch.zeros(4, 4))
    assert t.qstorage.rowwise_scale_inv.item() == 1 / 262144.0  # 448000 -> 2^18


def test_block_and_mx_settings_reach_the_quantizers():
    state = Float8BlockScaling(use_f32_scales=True).make_state(forward=True)
    dims = {role: state.quantizer(role).block_scaling_dim for role in (Role.INPUT, Role.WEIGHT)}
    assert dims == {Role.INPUT: 1, Role.WEIGHT: 2}
    assert not state.quantizer(Role.WEIGHT).force_pow_2_scales
    assert Float8BlockScaling().make_state(forward=False).quantizer(Role.GRAD_OUTPUT).block_scaling_dim == 1
    assert MXFP8BlockScaling(scale_mode="floor").make_state(forward=False).quantizer(Role.GRAD_OUTPUT).scale_mode == "floor"


# ------------------------------------------------------------------------------ delayed scaling state
def spec_update(history, scale, algo, margin, fp8_max):
    """The update rule of NUMERICS.md on Python lists (history: rows of floats, row 0 first; every slot recorded)."""
    n = len(scale)
    history = [[v if math.isfinite(v) else 0.0 for v in row] for row in history]  # NaN/inf amaxes are dropped
    if algo == "max":
        amax = [max(row[i] for row in history) for i in range(n)]
    elif algo == "most_recent":
        amax = list(history[0])
    else:
        amax = algo(history)
    new_scale = []
    for a, s in zip(amax, scale):
        if not (a > 0 and math.isfinite(a)):
            new_scale.append(s)
            continue
        f32 = torch.float32  # the arithmetic is fp32, as in the state tensors
        sf = ((torch.tensor(fp8_max, dtype=f32) / torch.tensor(a, dtype=f32)) / 2**margin).item()
        new_scale.append(FLT_MAX if math.isinf(sf) else sf)
    rolled = history[1:] + [history[0]]
    rolled[0] = [NOT_RECORDED] * n
    return rolled, new_scale


def mean_of_two_most_recent(history):
    if isinstance(history, torch.Tensor):
        return (history[0] + history[-1]) / 2
    return [((torch.tensor(a) + torch.tensor(b)) / 2).item() for a, b in zip(history[0], history[-1])]


# amaxes seen per step by the three forward slots; powers of two keep fp32 and Python floats equal.
# They include 0 (keep the scale), inf and NaN (dropped from the history) and a tiny amax whose scale
# overflows.
AMAX_SEQUENCE = [
    (1.0, 2.0, 0.5), (4.0, 0.0, 0.25), (0.5, 8.0, 2.0), (2.0, 2.0, 2.0), (16.0, 0.125, 1.0),
    (0.25, float("inf"), 4.0), (1.0, 1.0, 1.0), (2.0**-140, 4.0, 0.5), (8.0, float("nan"), 0.5),
    (0.5, 0.5, 64.0), (1.0, 2.0, 0.0), (32.0, 0.25, 8.0),
]


@pytest.mark.parametrize("algo", ["max", "most_recent", mean_of_two_most_recent])
@pytest.mark.parametrize("margin", [0, 1])
def test_delayed_scaling_sequence_matches_the_spec_step_by_step(algo, margin):
    history_len = 4
    recipe = DelayedScaling(amax_history_len=history_len, amax_compute_algo=algo, margin=margin)
    state = recipe.make_state(forward=True)
    history = [[NOT_RECORDED] * 3] + [[0.0] * 3 for _ in range(history_len - 1)]
    scale = [1.0, 1.0, 1.0]
    for step, amaxes in enumerate(AMAX_SEQUENCE):
        for slot, a in enumerate(amaxes):
            x = torch.tensor([[a, -a / 2]])
            state.quantizers[slot](x)
            history[0][slot] = max(history[0][slot], a) if not math.isnan(a) else a
        state.update()
        history, scale = spec_update(history, scale, algo, margin, 448.0)
        got_history = state.amax_history.tolist()
        for row_got, row_want in zip(got_history, history):
            for g, w in zip(row_got, row_want):
                assert (math.isnan(g) and math.isnan(w)) or g == w, (step, got_history, history)
        assert state.scale.tolist() == pytest.approx(scale, rel=0, abs=0), (step, state.scale, scale)


def test_delayed_scale_of_a_known_sequence_by_hand():
    # history_len 2, "max": step 1 records 2 -> scale 448/2 = 224; step 2 records 8 -> max(2, 8) -> 56;
    # step 3 records 1 -> window is (8, 1) -> 56; step 4 records 1 -> window (1, 1) -> 448.
    state = DelayedScaling(amax_history_len=2).make_state(forward=True)
    got = []
    for a in (2.0, 8.0, 1.0, 1.0):
        state.quantizers[0](torch.tensor([a]))
        state.update()
        got.append(state.scale[0].item())
    assert got == [224.0, 56.0, 56.0, 448.0]


def test_backward_state_uses_the_e5m2_max_for_hybrid():
    state = DelayedScaling(amax_history_len=1).make_state(forward=False)
    state.quantizers[0](torch.tensor([2.0]))
    state.update()
    assert state.scale[0].item() == 57344.0 / 2


def test_custom_scaling_factor_algo_gets_amax_scale_max_and_recipe():
    seen = {}

    def half_of_default(amax, scale, fp8_max, recipe):
        seen["args"] = (amax.clone(), scale.clone(), fp8_max, recipe)
        return fp8_max / amax / 2

    recipe = DelayedScaling(amax_history_len=1, scaling_factor_compute_algo=half_of_default)
    state = recipe.make_state(forward=True)
    state.quantizers[1](torch.tensor([4.0]))
    for slot in (0, 2):
        state.quantizers[slot](torch.tensor([1.0]))
    state.update()
    assert state.scale.tolist() == [224.0, 56.0, 224.0]
    amax, scale, fp8_max, got_recipe = seen["args"]
    assert amax.tolist() == [1.0, 4.0, 1.0] and scale.tolist() == [1.0, 1.0, 1.0]
    assert fp8_max == 448.0 and got_recipe is recipe


def test_a_slot_that_recorded_nothing_keeps_history_and_scale():
    state = DelayedScaling(amax_history_len=3).make_state(forward=True)
    assert state.amax_history[0].tolist() == [NOT_RECORDED] * 3
    for slot in range(3):
        state.quantizers[slot](torch.tensor([2.0]))
    state.update()  # all slots: scale 224, history [[-1], [0], [2]]
    state.quantizers[0](torch.tensor([4.0]))  # slot 1 (a cached weight) and slot 2 record nothing
    state.update()
    assert state.scale.tolist() == [112.0, 224.0, 224.0]
    assert state.amax_history[:, 1].tolist() == [NOT_RECORDED, 0.0, 2.0]
    assert state.amax_history[:, 0].tolist() == [NOT_RECORDED, 2.0, 4.0]
    state.update()  # nothing recorded anywhere: nothing moves
    assert state.scale.tolist() == [112.0, 224.0, 224.0]
    assert state.amax_history[:, 0].tolist() == [NOT_RECORDED, 2.0, 4.0]
    state.quantizers[1](torch.tensor([float("nan")]))  # a NaN batch was recorded: the slot advances
    state.update()
    assert state.amax_history[:, 1].tolist() == [NOT_RECORDED, 2.0, 0.0]


def test_quantizers_see_scale_updates_in_place():
    state = DelayedScaling(amax_history_len=1).make_state(forward=True)
    q = state.quantizer(Role.INPUT)
    q(torch.tensor([4.0]))
    state.update()
    t = q(torch.tensor([4.0, 1.0]))
    assert state.scale.tolist() == [112.0, 1.0, 1.0]  # 448 / 4
    assert torch.equal(t.qstorage.rowwise_scale_inv, torch.ones(1) / torch.tensor([112.0]))
    assert t.qstorage.rowwise_data.float().tolist() == [448.0, 112.0]
