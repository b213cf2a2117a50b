"""Recipes as operand maps: a high-precision wgrad, weight-only, and mixed element pairings through a Linear.

Expected values are float64 computations on the operands' exact (dequantized) values, made
with the quantizers a spec names, called directly.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

import engine
from engine.recipes import OperandRecipe, QuantizerSpec, recipe_from_plain, recipe_to_plain

E4M3 = QuantizerSpec(layout="tensor", element="e4m3")
E5M2 = QuantizerSpec(layout="tensor", element="e5m2")
MX = QuantizerSpec(layout="mx", element="e4m3", scaling="e8m0")


def fp32_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|error| of an fp32-accumulated a @ b^T: (K + 2) * 2^-24 * |a| @ |b|^T."""
    return (a.shape[1] + 2) * 2.0**-24 * (a.abs() @ b.abs().t())


def run(recipe, x, dy, seed=0):
    torch.manual_seed(seed)
    lin = engine.Linear(x.shape[1], dy.shape[1], bias=False)
    x = x.clone().requires_grad_()
    with engine.fp8_autocast(recipe=recipe):
        y = lin(x)
    y.backward(dy)
    return lin, x, y


def dq(spec: QuantizerSpec, t: torch.Tensor, usage: str) -> torch.Tensor:
    """fp64 value of t as one use of `spec` reads it (rowwise or columnwise data)."""
    q = spec.make()
    q.set_usage(rowwise=usage == "rowwise", columnwise=usage == "columnwise")
    return q(t.detach()).dequantize(torch.float64)


def test_high_precision_wgrad_is_the_plain_product_while_fprop_and_dgrad_are_fp8():
    recipe = OperandRecipe(operands={"fprop_input": E4M3, "fprop_weight": E4M3, "dgrad_grad_output": E5M2,
                                     "dgrad_weight": E4M3})
    x, dy = torch.randn(32, 64), torch.randn(32, 48)
    lin, xg, y = run(recipe, x, dy)
    w = lin.weight.detach()
    want_y = dq(E4M3, x, "rowwise") @ dq(E4M3, w, "rowwise").t()
    assert ((y.double() - want_y).abs() <= fp32_bound(dq(E4M3, x, "rowwise"), dq(E4M3, w, "rowwise"))).all()
    want_dw = dy.double().t() @ x.double()  # wgrad untouched by quantization
    assert ((lin.weight.grad.double() - want_dw).abs() <= fp32_bound(dy.double().t(), x.double().t())).all()
    want_dx = dq(E5M2, dy, "rowwise") @ dq(E4M3, w, "columnwise")
    assert ((xg.grad.double() - want_dx).abs() <= fp32_bound(dq(E5M2, dy, "rowwise"), dq(E4M3, w, "columnwise").t())).all()
    assert not torch.allclose(y.double(), x.double() @ w.double().t(), rtol=0, atol=1e-6)  # fprop really is FP8


def test_weight_only_quantizes_the_weight_alone():
    recipe = OperandRecipe(operands={"fprop_weight": MX, "dgrad_weight": MX})
    x, dy = torch.randn(16, 64), torch.randn(16, 32)
    lin, xg, y = run(recipe, x, dy)
    w_row = dq(MX, lin.weight, "rowwise")
    assert ((y.double() - x.double() @ w_row.t()).abs() <= fp32_bound(x.double(), w_row)).all()
    w_col = dq(MX, lin.weight, "columnwise")  # x's shape, 32x1 blocks: dgrad reads it as is
    assert ((xg.grad.double() - dy.double() @ w_col).abs() <= fp32_bound(dy.double(), w_col.t())).all()
    assert torch.allclose(lin.weight.grad.double(), dy.double().t() @ x.double(), rtol=1e-5, atol=1e-5)


def test_mixed_elements_per_operand():
    """E5M2 activations against an E4M3 weight: each operand has its own element format."""
    recipe = OperandRecipe(operands={"fprop_input": E5M2, "fprop_weight": E4M3})
    x, dy = torch.randn(16, 64), torch.randn(16, 32)
    lin, _, y = run(recipe, x, dy)
    xv, wv = dq(E5M2, x, "rowwise"), dq(E4M3, lin.weight, "rowwise")
    assert ((y.double() - xv @ wv.t()).abs() <= fp32_bound(xv, wv)).all()


def test_separate_specs_for_the_two_uses_of_one_tensor():
    """The input quantized twice: E4M3 per tensor for fprop, MX for wgrad (paired with an MX gradient)."""
    recipe = OperandRecipe(operands={"fprop_input": E4M3, "fprop_weight": E4M3, "wgrad_input": MX,
                                     "wgrad_grad_output": MX})
    x, dy = torch.randn(64, 64), torch.randn(64, 32)
    lin, _, _ = run(recipe, x, dy)
    a, b = dq(MX, dy, "columnwise").t(), dq(MX, x, "columnwise").t()
    assert ((lin.weight.grad.double() - a @ b.t()).abs() <= fp32_bound(a, b)).all()


def test_operand_recipes_validate_and_round_trip_through_plain_data():
    with pytest.raises(ValidationError, match="unknown operands"):
        OperandRecipe(operands={"fprop_outptu": E4M3})
    with pytest.raises(ValidationError, match="delayed"):
        OperandRecipe(operands={"fprop_input": QuantizerSpec(layout="tensor", scaling="delayed")})
    with pytest.raises(ValidationError, match="scaling"):
        QuantizerSpec(layout="mx", scaling="current")
    recipe = OperandRecipe(operands={"fprop_input": E4M3, "dgrad_weight": None, "wgrad_input": MX})
    assert recipe_from_plain(recipe_to_plain(recipe)) == recipe


def test_a_wrong_spec_is_caught_by_the_checks_above():
    """The same comparison with the weight's spec swapped (E5M2 instead of E4M3) must fail."""
    recipe = OperandRecipe(operands={"fprop_input": E4M3, "fprop_weight": E4M3})
    x, dy = torch.randn(32, 64), torch.randn(32, 48)
    lin, _, y = run(recipe, x, dy)
    wrong = dq(E4M3, x, "rowwise") @ dq(E5M2, lin.weight, "rowwise").t()
    assert not ((y.double() - wrong).abs() <= fp32_bound(dq(E4M3, x, "rowwise"), dq(E5M2, lin.weight, "rowwise"))).all()
