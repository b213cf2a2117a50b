"""A float64 model of engine's Linear, LayerNormLinear and LayerNormMLP, written from the formulas.

Nothing here comes from `engine` (nor from torch.nn.functional's norms and activations): the
norms, activations and linear maps are spelled out, so a bug in engine's own versions cannot
hide in the reference. Gradients come from torch autograd over these float64 formulas.

`module_spec` = the constructor arguments a test built the module with: kind ("linear",
"lnlinear", "mlp"), and for the norm modules normalization, eps, zero_centered_gamma, and
for the MLP activation.
"""

from __future__ import annotations

import math

import torch

Params = dict[str, torch.Tensor]


# ---------------------------------------------------------------------------- norms
def layer_norm(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor | None, eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(biased variance + eps) * gamma + beta over the last dim."""
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    out = (x - mean) / torch.sqrt(var + eps) * gamma
    return out if beta is None else out + beta


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * gamma over the last dim (no mean subtracted, no bias)."""
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * gamma


# ---------------------------------------------------------------------------- activations
def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def relu(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 0, x, torch.zeros_like(x))


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), sigmoid(x) = 1 / (1 + exp(-x))."""
    return x / (1.0 + torch.exp(-x))


def gated(act, x: torch.Tensor, swap_halves: bool = False) -> torch.Tensor:
    """act(first half of the last dim) * second half (Transformer Engine's order).

    `swap_halves=True` gates the second half instead: the mutant the tests must tell apart.
    """
    n = x.shape[-1] // 2
    gate, up = x[..., :n], x[..., n:]
    if swap_halves:
        gate, up = up, gate
    return act(gate) * up


def activation(name: str, x: torch.Tensor, swap_halves: bool = False) -> torch.Tensor:
    if name == "gelu":
        return gelu_tanh(x)
    if name == "relu":
        return relu(x)
    if name == "silu":
        return silu(x)
    if name == "swiglu":
        return gated(silu, x, swap_halves)
    if name == "geglu":
        return gated(gelu_tanh, x, swap_halves)
    raise ValueError(f"activation: no reference for {name!r}")


# ---------------------------------------------------------------------------- model
def affine(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b over the last dim."""
    out = x @ w.transpose(0, 1)
    return out if b is None else out + b


def norm(spec: dict, p: Params, x: torch.Tensor) -> torch.Tensor:
    gamma = p["layer_norm_weight"]
    if spec.get("zero_centered_gamma", False):
        gamma = 1.0 + gamma
    eps = spec.get("eps", 1e-5)
    if spec.get("normalization", "LayerNorm") == "LayerNorm":
        return layer_norm(x, gamma, p.get("layer_norm_bias"), eps)
    return rms_norm(x, gamma, eps)


def forward(spec: dict, p: Params, x: torch.Tensor, swap_halves: bool = False) -> torch.Tensor:
    """The module's output for input x and parameters p (its public parameter names)."""
    kind = spec["kind"]
    if kind == "linear":
        return affine(x, p["weight"], p.get("bias"))
    h = norm(spec, p, x)
    if kind == "lnlinear":
        return affine(h, p["weight"], p.get("bias"))
    hidden = activation(spec.get("activation", "gelu"), affine(h, p["fc1_weight"], p.get("fc1_bias")), swap_halves)
    return affine(hidden, p["fc2_weight"], p.get("fc2_bias"))


def output(spec: dict, params: Params, x: torch.Tensor, swap_halves: bool = False) -> torch.Tensor:
    """The output alone, in float64."""
    with torch.no_grad():
        return forward(spec, {n: t.double() for n, t in params.items()}, x.double(), swap_halves)


def forward_backward(
    spec: dict, params: Params, x: torch.Tensor, dy: torch.Tensor, swap_halves: bool = False
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(output, gradients) in float64; gradients of x ("x") and of every parameter, for upstream dy."""
    x64 = x.detach().double().requires_grad_(True)
    p64 = {name: t.detach().double().requires_grad_(True) for name, t in params.items()}
    out = forward(spec, p64, x64, swap_halves)
    names = ["x", *p64]
    grads = torch.autograd.grad(out, [x64, *p64.values()], dy.double())
    return out.detach(), dict(zip(names, grads))


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative Frobenius error ||got - want|| / ||want||, in float64."""
    got, want = got.detach().double(), want.detach().double()
    return ((got - want).norm() / want.norm()).item()
