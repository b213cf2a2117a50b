"""LayerNormLinear: a LayerNorm (or RMSNorm) followed by a Linear whose GEMMs run in FP8."""

from __future__ import annotations

import torch

from engine.modules.base import FP8Module
from engine.checks import check_params_dtype
from engine.modules.linear import InitMethod, check_features, check_input, check_layer_flags, linear_parameters
from engine.modules.dispatch import linear
from engine.modules.normalization import NormalizedInput


class LayerNormLinear(NormalizedInput, FP8Module):
    """norm(x) W^T + b. The norm runs in high precision; its output is quantized for the GEMM.

    `return_layernorm_output=True` also returns the norm's output (e.g. for a residual).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        bias: bool = True,
        normalization: str = "LayerNorm",
        zero_centered_gamma: bool = False,
        return_layernorm_output: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        return_bias: bool = False,
        fuse_wgrad_accumulation: bool = False,
        init_method: InitMethod | None = None,
    ) -> None:
        super().__init__()
        self.in_features = check_features(in_features, "in_features")
        self.out_features = check_features(out_features, "out_features")
        check_layer_flags(bias=bias, return_bias=return_bias, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                          zero_centered_gamma=zero_centered_gamma, return_layernorm_output=return_layernorm_output)
        self.return_bias = return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        dtype = check_params_dtype(params_dtype)
        self._init_norm(in_features, eps=eps, normalization=normalization, zero_centered_gamma=zero_centered_gamma,
                        return_layernorm_output=return_layernorm_output, dtype=dtype, device=device)
        self.weight, b = linear_parameters(self, in_features, out_features, bias=bias, dtype=dtype, device=device,
                                           init_method=init_method, gemm=0)
        self.register_parameter("bias", b)

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None):
        check_input(inp, self.in_features, type(self).__name__, is_first_microbatch,
                    weight=self.weight)
        (args,) = self._prepare(inp.device, is_first_microbatch)
        ln_out = self._normalize(inp)
        self._calibrate(args, ln_out, self.weight)
        out = linear(ln_out, self.weight, None if self.return_bias else self.bias, args)
        return self._outputs(out, self.bias, ln_out)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, normalization={self.normalization}, "
                f"eps={self.eps}, bias={self.bias is not None}")
