"""Float8RowwiseScaling against torchao 0.18's `Float8LinearConfig.from_recipe_name("rowwise")` (and
"rowwise_with_gw_hp") on the CPU, where torchao runs its own GEMMs (`torch._scaled_mm` on CPU).

Runs only where torchao is installed. What is compared, and why each bound:
* quantized operands: data and scales bit for bit (torchao's `hp_tensor_to_float8_dynamic`);
* a bf16 linear without bias: output, grad_input and grad_weight bit for bit (both sum the same
  exact FP8 products in fp32 and round once to bf16);
* with a bias, torchao rounds the product to bf16 and then adds the bias (a second rounding);
  engine adds it before its one rounding: torchao's output is checked to be exactly
  "engine's product + bias" and engine's within the two roundings' bound of it;
* an fp32 linear: torchao's CPU path returns its FP8 GEMMs rounded to bf16 (its rowwise branch
  asks `_scaled_mm` for bf16 output; its fp32 wgrad in ROWWISE_WITH_GW_HP is a plain fp32 mm),
  engine keeps fp32: torchao's values are engine's rounded to bf16, bit for bit;
* where the two rules differ by design (README / engine/quantizers/rowwise.py): a scale just
  below a power of two, which torchao's fp32 log2 rounds up.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

float8 = pytest.importorskip("torchao.float8")

import engine  # noqa: E402
from engine.quantizers import Float8RowwiseQuantizer  # noqa: E402
from engine.recipes import Float8RowwiseScaling  # noqa: E402

from torchao.float8.config import ScalingGranularity  # noqa: E402
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic  # noqa: E402
from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig  # noqa: E402

E4M3 = torch.float8_e4m3fn
RECIPES = {"rowwise": Float8RowwiseScaling(), "rowwise_with_gw_hp": Float8RowwiseScaling(high_precision_wgrad=True)}
U_BF16 = 2.0**-8  # bf16 unit roundoff (8 significant bits)


def torchao_quantize(x: torch.Tensor, axiswise_dim: int):
    return hp_tensor_to_float8_dynamic(x, E4M3, LinearMMConfig(), gemm_input_role=GemmInputRole.INPUT,
                                       scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=axiswise_dim,
                                       round_scales_to_power_of_2=True)


def inputs(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [4, 24, 96] with per-token magnitudes 2^-8..2^7, dy [4, 24, 80]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 24, 96, generator=g) * torch.exp2(torch.randint(-8, 8, (4, 24, 1), generator=g).float())
    return x.to(dtype), torch.randn(4, 24, 80, generator=g).to(dtype)


def run_both(name: str, dtype: torch.dtype, bias: bool, seed: int = 0):
    """(torchao's (y, dx, dw), engine's (y, dx, dw)) for one linear layer with the same weights and data."""
    torch.manual_seed(seed)
    base = torch.nn.Linear(96, 80, bias=bias).to(dtype)
    with torch.no_grad():  # magnitudes spread over output channels and over K: per-row, per-K and
        g = torch.Generator().manual_seed(seed + 1)  # per-tensor scales all differ
        spread = torch.exp2(torch.randint(-3, 4, (80, 1), generator=g) + torch.randint(-3, 4, (1, 96), generator=g))
        base.weight.mul_(spread.to(dtype))
    config = float8.Float8LinearConfig.from_recipe_name(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ao = float8.convert_to_float8_training(torch.nn.Sequential(copy.deepcopy(base)), config=config)[0]
    ours = engine.Linear(96, 80, bias=bias, params_dtype=dtype)
    ours.load_state_dict(base.state_dict())
    x, dy = inputs(dtype, seed)
    xa, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya = ao(xa)
    ya.backward(dy)
    with engine.fp8_autocast(recipe=RECIPES[name]):
        ye = ours(xe)
    ye.backward(dy)
    return (ya, xa.grad, ao.weight.grad), (ye, xe.grad, ours.weight.grad)


def test_quantized_operands_are_torchaos_bit_for_bit():
    x, _ = inputs(torch.bfloat16)
    x2d = x.reshape(-1, 96)
    ours = Float8RowwiseQuantizer(E4M3)(x2d).qstorage
    per_row, per_col = torchao_quantize(x2d, -1), torchao_quantize(x2d, 0)
    assert per_row._scale.shape == (96, 1) and per_col._scale.shape == (1, 96)
    assert torch.equal(ours.rowwise_data.view(torch.uint8), per_row._data.view(torch.uint8))
    assert torch.equal(1 / ours.rowwise_scale_inv, per_row._scale)
    assert torch.equal(ours.columnwise_data.t().view(torch.uint8), per_col._data.view(torch.uint8))
    assert torch.equal(1 / ours.columnwise_scale_inv.t(), per_col._scale)


@pytest.mark.parametrize("name", RECIPES)
def test_bf16_linear_output_and_grads_are_torchaos_bit_for_bit(name):
    theirs, ours = run_both(name, torch.bfloat16, bias=False)
    for what, a, b in zip(("output", "grad_input", "grad_weight"), theirs, ours):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), what


@pytest.mark.parametrize("name", RECIPES)
def test_bf16_linear_with_bias_differs_only_by_torchaos_second_rounding(name):
    (ya, *grads_a), (ye, *grads_e) = run_both(name, torch.bfloat16, bias=True)
    (_, _, _), (product, _, _) = run_both(name, torch.bfloat16, bias=False)  # engine's rounded product, no bias
    torch.manual_seed(0)  # the layer run_both built (the bias is drawn after the weight)
    bias = torch.nn.Linear(96, 80, bias=True).to(torch.bfloat16).bias.detach()
    assert torch.equal(ya.detach(), product.detach() + bias)  # torchao: round(product) + bias, rounded again
    bound = U_BF16 * (product.abs() + ya.abs() + ye.abs()).detach().float()
    assert ((ye - ya).detach().float().abs() <= bound).all()
    assert (ye != ya).any()  # the bound is needed: the second rounding does change some outputs
    for a, b in zip(grads_a, grads_e):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", RECIPES)
def test_fp32_linear_torchao_is_engine_rounded_to_bf16(name):
    theirs, ours = run_both(name, torch.float32, bias=False)
    for what, a, b in zip(("output", "grad_input", "grad_weight"), theirs, ours):
        if name == "rowwise_with_gw_hp" and what == "grad_weight":  # a plain fp32 GEMM on both sides
            assert torch.equal(a, b), what
        else:
            assert torch.equal(a, b.bfloat16().float()), what
            assert not torch.equal(a, b), what  # engine keeps the fp32 result


def test_a_scale_just_below_a_power_of_two_is_where_the_rules_differ():
    """448 / amax = 2^11 (1 - 2^-24): engine rounds down to 2^10; torchao's fp32 log2 rounds up to 2^11."""
    x = torch.full((2, 16), 0.1)
    x[0, 3] = 448 * 2.0**-11 * (1 + 2.0**-23)
    ours = Float8RowwiseQuantizer(E4M3)(x).qstorage
    theirs = torchao_quantize(x, -1)
    assert 1 / ours.rowwise_scale_inv[0, 0] == 2.0**10 and theirs._scale[0, 0] == 2.0**11
    assert torch.equal(1 / ours.rowwise_scale_inv[1], theirs._scale[1])  # the other row agrees
