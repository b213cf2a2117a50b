"""LayerNorm / RMSNorm as engine modules apply them (in high precision, before the FP8 GEMM)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.dtensor import like_input

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def check_normalization(normalization: str) -> str:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization: expected one of {NORMALIZATIONS}, got {normalization!r}")
    return normalization


def check_eps(eps: float) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"eps: expected a finite number > 0, got {eps!r}")
    return float(eps)


def normalize(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, normalization: str, eps: float,
    zero_centered_gamma: bool,
) -> torch.Tensor:
    """LayerNorm or RMSNorm over the last dim; with `zero_centered_gamma` the scale is (1 + weight)."""
    weight, bias = like_input(weight, x), like_input(bias, x)  # a DTensor x: plain parameters are replicated
    gamma = (1 + weight) if zero_centered_gamma else weight
    gamma = gamma.to(x.dtype)
    if normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), gamma, None if bias is None else bias.to(x.dtype), eps)
    return F.rms_norm(x, (x.shape[-1],), gamma, eps)


def norm_parameters(
    size: int, *, normalization: str, zero_centered_gamma: bool, dtype: torch.dtype, device: torch.device | str | None
) -> tuple[torch.nn.Parameter, torch.nn.Parameter | None]:
    """(weight, bias) of the norm; RMSNorm has no bias. Zero-centered gammas start at 0 (scale 1)."""
    fill = 0.0 if zero_centered_gamma else 1.0
    weight = torch.nn.Parameter(torch.full((size,), fill, dtype=dtype, device=device))
    bias = None
    if normalization == "LayerNorm":
        bias = torch.nn.Parameter(torch.zeros(size, dtype=dtype, device=device))
    return weight, bias


class NormalizedInput:
    """What LayerNormLinear and LayerNormMLP share: a norm on the input, and their output tuple."""

    def _init_norm(
        self, size: int, *, eps: float, normalization: str, zero_centered_gamma: bool,
        return_layernorm_output: bool, dtype: torch.dtype, device: torch.device | str | None,
    ) -> None:
        self.eps = check_eps(eps)
        self.normalization = check_normalization(normalization)
        self.zero_centered_gamma = zero_centered_gamma
        self.return_layernorm_output = return_layernorm_output
        self.layer_norm_weight, ln_bias = norm_parameters(
            size, normalization=normalization, zero_centered_gamma=zero_centered_gamma, dtype=dtype, device=device)
        self.register_parameter("layer_norm_bias", ln_bias)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        return normalize(x, self.layer_norm_weight, self.layer_norm_bias, normalization=self.normalization,
                         eps=self.eps, zero_centered_gamma=self.zero_centered_gamma)

    def _outputs(self, out: torch.Tensor, bias: torch.Tensor | None, ln_out: torch.Tensor):
        """out, plus the unadded bias (return_bias) and the norm's output (return_layernorm_output)."""
        outputs = (out,) + ((bias,) if self.return_bias else ()) + ((ln_out,) if self.return_layernorm_output else ())
        return outputs if len(outputs) > 1 else out
