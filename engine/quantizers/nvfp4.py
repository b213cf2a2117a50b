"""NVFP4Quantizer (TE's name): NVFP4 with TE's per-tensor options, making `NVFP4Tensor`s.

The numerics are `engine.ops.nvfp4`; the registry's kernel runs them (the C++ kernel on the CPU,
the Triton one on CUDA; elsewhere the reference, with a one-time warning). Options as TE's
quantizer has them: `with_rht` (columnwise data from the 16-point RHT of the transpose: inputs
and output gradients), `with_2d_quantization` (16x16 tiles: weights), `stochastic_rounding`
(gradients). Stochastic rounding draws its bits from `rng_counter`, an int64 `[2]` tensor
(seed, offset) that the quantizer reads and advances in place (the recipe state owns it, so
a run is reproducible and there is no global generator). `amax_reduction_group`: each usage's
amax is all-reduced (max) over the group before the scales are made, as current scaling does.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

from engine.checks import check_bool
from engine.collectives import all_reduce_max
from engine.ops import backend, nvfp4, registry
from engine.ops import reference as ref
from engine.quantizers.base import Quantizer
from engine.quantizers.registry import RuleParams, name_quantizer, register_rule
from engine.quantizers.rules import Buffers, ScaleRule
from engine.schemes import SCHEMES, Scheme


class NVFP4Params(RuleParams):
    """NVFP4's settings by Transformer Engine's names (the RHT is the scheme's: `nvfp4_rht_e2m1`)."""

    with_2d_quantization: bool = False
    stochastic_rounding: bool = False


@register_rule("nvfp4", NVFP4Params)
class NVFP4Rule(ScaleRule):
    """Scales from the per-tensor amax (S_enc) and each block's (E4M3); optional 2D tiles and stochastic rounding."""

    layouts = ("nvfp4", "nvfp4_rht")

    def __init__(self, *, two_d: bool = False, stochastic_rounding: bool = False,
                 rng_counter: torch.Tensor | None = None, amax_reduction_group: dist.ProcessGroup | None = None) -> None:
        self.two_d = check_bool(two_d, "with_2d_quantization")
        self.stochastic_rounding = check_bool(stochastic_rounding, "stochastic_rounding")
        if rng_counter is None:
            rng_counter = torch.zeros(2, dtype=torch.int64)
        if not isinstance(rng_counter, torch.Tensor) or rng_counter.dtype != torch.int64 or \
                tuple(rng_counter.shape) != (2,):
            raise TypeError(f"rng_counter: expected an int64 tensor of shape (2,) holding (seed, offset), "
                            f"got {rng_counter!r}")
        if not rng_counter.is_meta and int(rng_counter[1]) < 0:  # read once, at construction (as a load checks it)
            raise ValueError(f"rng_counter: the offset (element 1, the random elements already drawn) must be "
                             f">= 0, got {int(rng_counter[1])}")
        self.rng_counter = rng_counter
        self.amax_reduction_group = amax_reduction_group

    @classmethod
    def from_config(cls, *, with_2d_quantization: bool = False, **settings: Any) -> NVFP4Rule:
        return cls(two_d=with_2d_quantization, **settings)

    def config(self) -> dict[str, Any]:
        return {"with_2d_quantization": self.two_d, "stochastic_rounding": self.stochastic_rounding}

    def state(self) -> dict[str, torch.Tensor]:
        return {"rng_counter": self.rng_counter}

    def quantize(self, x: torch.Tensor, scheme: Scheme, *, rowwise: bool, columnwise: bool) -> Buffers:
        rht = scheme.layout == "nvfp4_rht"
        x2d = ref.as_2d(x)
        m = x2d.shape[0]
        if rht and columnwise and m % nvfp4.NVFP4_BLOCK:
            raise ValueError(f"x: the RHT of the columnwise usage mixes {nvfp4.NVFP4_BLOCK} tokens, so the token "
                             f"count (the product of the leading dims) must be a multiple of {nvfp4.NVFP4_BLOCK}, "
                             f"got {m} (shape {tuple(x.shape)}); append zero rows up to the next multiple, as "
                             f"engine's layers do for their wgrad operands")
        amaxes = None
        if self.amax_reduction_group is not None:
            amaxes = [ref.amax(x2d) if rowwise else torch.zeros(1),
                      ref.amax(nvfp4.columnwise_input(x2d, rht)) if columnwise else torch.zeros(1)]
            all_reduce_max(amaxes, self.amax_reduction_group)
        out, _ = _kernel(scheme.layout, x)(
            x, scheme, rowwise=rowwise, columnwise=columnwise, two_d=self.two_d,
            rng_counter=self.rng_counter if self.stochastic_rounding else None,
            amax=None if amaxes is None else amaxes[0], amax_t=None if amaxes is None else amaxes[1])
        if rowwise:
            out["rowwise_data"] = out["rowwise_data"].reshape(scheme.data_shape(x.shape, False))
        return out


def _kernel(layout: str, x: torch.Tensor) -> Callable[..., registry.Result]:
    """The registry's NVFP4 quantize for x's device: the C++ kernel on the CPU, the Triton one on CUDA (the
    reference, with the registry's one-time warning, on a device with neither). FakeTensors (torch.compile's
    custom ops tracing) take the reference: torch ops, which make the shapes without reading data."""
    if isinstance(x, FakeTensor):
        return registry.quantize_nvfp4_reference
    return registry.kernel("quantize", layout, x.device.type)


class NVFP4Quantizer(Quantizer):
    """NVFP4 for the usages asked: E2M1 per 16 with an E4M3 scale and a per-tensor fp32 amax; makes NVFP4Tensors."""

    def __init__(
        self, *, with_rht: bool = False, with_2d_quantization: bool = False, stochastic_rounding: bool = False,
        rng_counter: torch.Tensor | None = None, amax_reduction_group: dist.ProcessGroup | None = None,
        rowwise: bool = True, columnwise: bool = True, internal: bool = False,
    ) -> None:
        rht = check_bool(with_rht, "with_rht")
        two_d = check_bool(with_2d_quantization, "with_2d_quantization")
        if rht and two_d:
            raise ValueError("with_rht and with_2d_quantization: TE applies the RHT to inputs and gradients and "
                             "16x16 tiles to weights, never both")
        super().__init__(SCHEMES["nvfp4_rht_e2m1" if rht else "nvfp4_e2m1"],
                         NVFP4Rule(two_d=two_d, stochastic_rounding=stochastic_rounding, rng_counter=rng_counter,
                                   amax_reduction_group=amax_reduction_group),
                         rowwise=rowwise, columnwise=columnwise, internal=internal)

    @property
    def with_rht(self) -> bool:
        return self.scheme.layout == "nvfp4_rht"

    @property
    def columnwise_row_multiple(self) -> int:
        return nvfp4.NVFP4_BLOCK if self.with_rht else 1

    @property
    def with_2d_quantization(self) -> bool:
        return self.rule.two_d

    @property
    def stochastic_rounding(self) -> bool:
        return self.rule.stochastic_rounding

    @property
    def amax_reduction_group(self) -> dist.ProcessGroup | None:
        return self.rule.amax_reduction_group

    def config(self) -> dict[str, Any]:
        return {"with_rht": self.with_rht, **self.rule.config()}


name_quantizer(NVFP4Quantizer, "nvfp4", (SCHEMES["nvfp4_e2m1"], SCHEMES["nvfp4_rht_e2m1"]))
