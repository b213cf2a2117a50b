"""How far a quantized module may be from the float64 model: a bound per tensor, from the element formats.

Every bound is on the relative Frobenius error ||module - reference|| / ||reference|| of one tensor (the output,
the input gradient, one parameter's gradient), the reference computed in float64 on the module's own weights
(tests/torch_reference.py).

One quantized use of a tensor T (a GEMM operand: fprop's input, dgrad's weight, ...) has relative RMS error
eps(use), from its quantizer's element format (m mantissa bits, largest value `max`, smallest subnormal `sub`)
and where its scale rule puts a block's amax A on the element grid: A / scale in [a_lo, a_hi] (`scale_window`;
delayed scaling: the tensor's amax times the scale the quantizer holds).

* Rounding in the normal range: the grid step at v is <= 2u|v|, u = 2^-(m+1). Rounding to nearest leaves an
  error uniform over one step: E[d^2] <= u^2 v^2 / 3. Stochastic rounding to the neighbours with probabilities
  p, 1 - p: E[d^2] = p (1 - p) step^2 <= u^2 v^2.
* Saturation: a rule that may put A above `max` (E8M0 "floor": a_hi = 2^(emax+1)) clips values by at most a
  fraction 1 - max / a_hi of them; the rounding term is replaced by the larger of the two.
* Below the smallest normal the step is `sub` (in element units), i.e. sub * A / a_lo at most in T's units:
  E[d^2] <= (sub A / a_lo)^2 / 12 (/ 4 when rounding stochastically). A block's amax is at most T's amax,
  and the crest factor c = amax(T) / rms(T) (measured on the float64 reference's T) turns that into a
  relative term (c sub / a_lo)^2 / 12. For FP8 elements it is negligible (sub / a_lo ~ 2^-17); for FP4/FP6
  (sub / a_lo = 1/6 for E2M1 under "rceil") it is the larger term on peaked tensors.

So eps(use)^2 = max(rounding, saturation^2) + subnormal. The RHT of NVFP4's wgrad operands is orthogonal (the
relative error of the transformed tensor is that of the product), and its crest factor is taken as T's.

The errors of the uses on a tensor's path add in squares (independent roundings; an error in fc1's output reaches
the MLP's output through GELU, whose slope is O(1), and its gradient through GELU's derivative: counted once
more), `PATHS` lists them per module and tensor. An FP8 primary weight is the reference itself in fprop, but the
dgrad GEMM reads its columnwise copy, quantized from the high-precision weight it was made from (or requantized
from the rowwise one): a weight use there also counts 2 eps(primary)^2. The bound is SAFETY * sqrt(sum of the
path's eps^2), and never below FP32_BOUND (fp32 GEMMs and norms: sums of <= 128 terms, 16 u_fp32).

The bound is an upper estimate on purpose: `python -m tests.conformance.test_conformance_modules` prints the
measured errors next to it (0.1-0.7 of it); each test also checks that the same comparison against a model
with a wrong weight falls outside it, so it can fail at every recipe.
"""

from __future__ import annotations

import math

import torch

import torch_reference as ref
from engine.formats import element_format
from engine.schemes import ScaleEncoding

SAFETY = 1.25
FP32_BOUND = 2.0**-20

#: per module kind and tensor, the quantized uses on its path: (gemm index, operand) with operand one of
#: fi/fw (fprop input/weight), dg/dw (dgrad grad_output/weight), wi/wg (wgrad input/grad_output);
#: "z" stands for fc1's output error (LayerNormMLP), "dz" for its gradient's
PATHS: dict[str, dict[str, tuple[str, ...]]] = {
    "linear": {"out": ("0fi", "0fw"), "x": ("0dg", "0dw"), "weight": ("0wg", "0wi"), "bias": ()},
    "lnlinear": {"out": ("0fi", "0fw"), "x": ("0dg", "0dw"), "weight": ("0wg", "0wi"), "bias": (),
                 "layer_norm_weight": ("0dg", "0dw"), "layer_norm_bias": ("0dg", "0dw")},
    "mlp": {"out": ("z", "1fi", "1fw"), "fc2_weight": ("z", "1wg", "1wi"), "fc2_bias": (),
            "fc1_bias": ("dz",), "fc1_weight": ("dz", "0wg", "0wi"), "x": ("dz", "0dg", "0dw"),
            "layer_norm_weight": ("dz", "0dg", "0dw"), "layer_norm_bias": ("dz", "0dg", "0dw")},
}
#: what "z" and "dz" stand for
COMPOSITE = {"z": ("0fi", "0fw"), "dz": ("z", "1dg", "1dw")}
#: which tensor of the trace each operand quantizes, and which of the recipe's operands it is
OPERAND_TENSOR = {"fi": "x", "wi": "x", "fw": "w", "dw": "w", "dg": "dy", "wg": "dy"}
OPERAND_NAME = {"fi": ("fprop", "input"), "fw": ("fprop", "weight"), "dg": ("dgrad", "grad_output"),
                "dw": ("dgrad", "weight"), "wi": ("wgrad", "input"), "wg": ("wgrad", "grad_output")}


def scale_window(quantizer, amax: float) -> tuple[float, float]:
    """[a_lo, a_hi]: where the quantizer's scale rule puts the amax of a block on its element grid (`amax`: the
    tensor's, for a rule that is given its scale)."""
    fmt = element_format(quantizer.scheme.element)
    encoding = quantizer.scheme.scale
    given = getattr(quantizer.rule, "scale", None)
    if isinstance(given, torch.Tensor):  # delayed scaling: the scale it holds (1 before one was learned)
        a = amax * float(given.reshape(-1)[0])
        return min(a, fmt.max), min(a, fmt.max)
    if encoding is ScaleEncoding.E4M3:  # NVFP4: amax / 6 as an E4M3 block scale, rounded to nearest (<= 2^-4)
        return fmt.max / (1 + 2.0**-4), fmt.max / (1 - 2.0**-4)
    if encoding is ScaleEncoding.E8M0 and getattr(quantizer.rule, "scale_mode", "rceil") == "floor":
        return 2.0**fmt.max_exponent, 2.0 ** (fmt.max_exponent + 1)
    # fp32 from the data (current scaling: exact), power-of-2 rounded up, E8M0 rceil
    return fmt.max / 2, fmt.max


def use_error(quantizer, t: torch.Tensor) -> float:
    """eps of one quantized use of `t` (quantizer None: high precision, 0)."""
    if quantizer is None:
        return 0.0
    t = t.detach().double()
    amax = t.abs().max().item()
    crest = amax / max(t.square().mean().sqrt().item(), 1e-300)
    fmt = element_format(quantizer.scheme.element)
    stochastic = bool(getattr(quantizer.rule, "stochastic_rounding", False))
    a_lo, a_hi = scale_window(quantizer, amax)
    if a_lo == 0:
        return 1.0  # every value rounds to 0
    u = 2.0 ** -(fmt.mantissa_bits + 1)
    rounding = u**2 if stochastic else u**2 / 3
    saturation = max(0.0, 1 - fmt.max / a_hi)
    subnormal = (crest * fmt.min_subnormal / a_lo) ** 2 / (4 if stochastic else 12)
    return math.sqrt(max(rounding, saturation**2) + subnormal)


def trace(spec: dict, params: dict[str, torch.Tensor], x: torch.Tensor, dy: torch.Tensor) -> dict[str, torch.Tensor]:
    """The float64 reference's GEMM operands: per GEMM g, "g.x" (its input), "g.w" (weight), "g.dy" (the gradient
    of its output), from tests/torch_reference.py's formulas."""
    p = {n: t.detach().double() for n, t in params.items()}
    x, dy = x.detach().double(), dy.detach().double()
    kind = spec["kind"]
    if kind == "linear":
        return {"0.x": x, "0.w": p["weight"], "0.dy": dy}
    h = ref.norm(spec, p, x)
    if kind == "lnlinear":
        return {"0.x": h, "0.w": p["weight"], "0.dy": dy}
    z = ref.affine(h, p["fc1_weight"], p.get("fc1_bias")).requires_grad_(True)
    a = ref.activation(spec.get("activation", "gelu"), z)
    (dz,) = torch.autograd.grad(a, z, dy @ p["fc2_weight"])
    return {"0.x": h, "0.w": p["fc1_weight"], "0.dy": dz, "1.x": a.detach(), "1.w": p["fc2_weight"], "1.dy": dy}


def operand_errors(module, spec: dict, tensors: dict[str, torch.Tensor], primary: bool) -> dict[str, float]:
    """eps^2 of every use on the paths ("0fi", ..., and "z", "dz"), from the module's recipe states."""
    from engine.recipes import Gemm, Role

    out: dict[str, float] = {}
    gemms = 2 if spec["kind"] == "mlp" else 1
    for g in range(gemms):
        fprop_weight = module._fwd_state.operand((Gemm.FPROP, Role.WEIGHT), g)
        for short, (gemm, role) in OPERAND_NAME.items():
            state = module._bwd_state if role == "grad_output" else module._fwd_state
            q = state.operand((Gemm(gemm), Role(role)), g)
            t = tensors[f"{g}.{OPERAND_TENSOR[short]}"]
            e2 = use_error(q, t) ** 2
            if primary and short == "dw":
                e2 += 2 * use_error(fprop_weight, t) ** 2
            out[f"{g}{short}"] = e2
    for name, parts in COMPOSITE.items():  # in order: "dz" reads "z"
        if all(p in out for p in parts):
            out[name] = sum(out[p] for p in parts)
    return out


def bounds(module, spec: dict, params: dict[str, torch.Tensor], x: torch.Tensor, dy: torch.Tensor,
           primary: bool) -> dict[str, float]:
    """The bound of every tensor ("out", "x", each parameter) for a module that ran under its recipe."""
    errors = operand_errors(module, spec, trace(spec, params, x, dy), primary)
    return {name: max(FP32_BOUND, SAFETY * math.sqrt(sum(errors[u] for u in uses)))
            for name, uses in PATHS[spec["kind"]].items()}
