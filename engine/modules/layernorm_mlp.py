"""LayerNormMLP: norm -> fc1 -> activation -> fc2, both GEMM sets in FP8 inside fp8_autocast."""

from __future__ import annotations

import torch

from engine.modules.activations import ACTIVATIONS, GATED, check_activation
from engine.modules.base import FP8Module
from engine.checks import check_params_dtype
from engine.modules.linear import InitMethod, check_features, check_input, check_layer_flags, linear_parameters
from engine.modules.dispatch import linear
from engine.modules.normalization import NormalizedInput


class LayerNormMLP(NormalizedInput, FP8Module):
    """The transformer MLP block. Gated activations (swiglu, geglu) make fc1 twice as wide."""

    num_gemms = 2
    weight_names = ("fc1_weight", "fc2_weight")
    gemm_names = ("fc1", "fc2")

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        bias: bool = True,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        zero_centered_gamma: bool = False,
        return_layernorm_output: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        return_bias: bool = False,
        fuse_wgrad_accumulation: bool = False,
        init_method: InitMethod | None = None,
        output_layer_init_method: InitMethod | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = check_features(hidden_size, "hidden_size")
        self.ffn_hidden_size = check_features(ffn_hidden_size, "ffn_hidden_size")
        self.activation = check_activation(activation)
        check_layer_flags(bias=bias, return_bias=return_bias, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                          zero_centered_gamma=zero_centered_gamma, return_layernorm_output=return_layernorm_output)
        self.return_bias = return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        dtype = check_params_dtype(params_dtype)
        self._init_norm(hidden_size, eps=eps, normalization=normalization, zero_centered_gamma=zero_centered_gamma,
                        return_layernorm_output=return_layernorm_output, dtype=dtype, device=device)
        fc1_out = ffn_hidden_size * (2 if activation in GATED else 1)
        self.fc1_weight, fc1_bias = linear_parameters(self, hidden_size, fc1_out, bias=bias, dtype=dtype,
                                                      device=device, init_method=init_method, gemm=0)
        self.register_parameter("fc1_bias", fc1_bias)
        self.fc2_weight, fc2_bias = linear_parameters(self, ffn_hidden_size, hidden_size, bias=bias, dtype=dtype,
                                                      device=device, init_method=output_layer_init_method, gemm=1)
        self.register_parameter("fc2_bias", fc2_bias)

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None):
        check_input(inp, self.hidden_size, type(self).__name__, is_first_microbatch,
                    weight=self.fc1_weight)
        fc1_args, fc2_args = self._prepare(inp.device, is_first_microbatch)
        ln_out = self._normalize(inp)
        self._calibrate(fc1_args, ln_out, self.fc1_weight)
        hidden = ACTIVATIONS[self.activation](linear(ln_out, self.fc1_weight, self.fc1_bias, fc1_args))
        self._calibrate(fc2_args, hidden, self.fc2_weight)
        out = linear(hidden, self.fc2_weight, None if self.return_bias else self.fc2_bias, fc2_args)
        return self._outputs(out, self.fc2_bias, ln_out)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
                f"activation={self.activation}, normalization={self.normalization}")
