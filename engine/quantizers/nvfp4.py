"""NVFP4Quantizer (TE's name): NVFP4 with TE's per-tensor options, making `NVFP4Tensor`s.

The numerics are `engine.ops.nvfp4`; `engine::quantize` runs them as it runs every scheme (the C++
kernel on the CPU, the Triton one on CUDA; elsewhere the reference, with a one-time warning). Options as TE's
quantizer has them: `with_rht` (columnwise data from the 16-point RHT of the transpose: inputs
and output gradients), `with_2d_quantization` (16x16 tiles: weights), `stochastic_rounding`
(gradients). Stochastic rounding draws its bits from `rng_counter`, an int64 `[2]` tensor
(seed, offset) that the quantizer reads and advances in place (the recipe state owns it, so
a run is reproducible and there is no global generator). `amax_reduction_group`: each usage's
amax is all-reduced (max) over the group before the scales are made, as current scaling does.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist

from engine.checks import check_bool
from engine.collectives import all_reduce_max
from engine.ops import nvfp4
from engine.ops import quantize as qops
from engine.ops import reference as ref
from engine.quantizers.base import Quantizer
from engine.quantizers.registry import RuleParams, name_quantizer, register_rule
from engine.quantizers.rules import Buffers, ScaleRule
from engine.schemes import SCHEMES, ScaleEncoding, Scheme


class NVFP4Params(RuleParams):
    """NVFP4's settings by Transformer Engine's names (the RHT is the scheme's, `nvfp4_rht_e2m1`, and so is
    4over6's bound E = 256, `nvfp4_e256_e2m1`)."""

    with_2d_quantization: bool = False
    stochastic_rounding: bool = False
    four_over_six: bool = False
    four_over_six_err_mode: Literal["MAE", "MSE"] = "MAE"


@register_rule("nvfp4", NVFP4Params)
class NVFP4Rule(ScaleRule):
    """Scales from the per-tensor amax (S_enc) and each block's (E4M3); optional 2D tiles and stochastic rounding."""

    @classmethod
    def fits(cls, scheme: Scheme) -> bool:  # E4M3 block scales under a tensor-level fp32 amax
        return scheme.tensor_scale and scheme.scale is ScaleEncoding.E4M3

    def __init__(self, *, two_d: bool = False, stochastic_rounding: bool = False,
                 rng_counter: torch.Tensor | None = None, amax_reduction_group: dist.ProcessGroup | None = None,
                 four_over_six: bool = False, four_over_six_err_mode: str = "MAE") -> None:
        self.two_d = check_bool(two_d, "with_2d_quantization")
        self.stochastic_rounding = check_bool(stochastic_rounding, "stochastic_rounding")
        self.four_over_six = check_bool(four_over_six, "four_over_six")
        if four_over_six_err_mode not in ("MAE", "MSE"):
            raise ValueError(f"four_over_six_err_mode: expected 'MAE' or 'MSE', got {four_over_six_err_mode!r}")
        self.four_over_six_err_mode = four_over_six_err_mode
        if self.four_over_six and self.stochastic_rounding:
            raise ValueError("four_over_six and stochastic_rounding: 4over6 picks each block's candidate by its error "
                             "against x, which stochastic rounding would not keep (Transformer Engine refuses the "
                             "pair too, and never applies 4over6 to gradients)")
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

    def check_scheme(self, scheme: Scheme) -> None:
        if self.four_over_six and scheme.columnwise_transform is not None:
            raise ValueError(f"four_over_six: 4over6 does not take the RHT (Transformer Engine refuses it), got "
                             f"{scheme.name}; quantize this operand without it (NVFP4BlockScaling(disable_rht=True))")
        if not self.four_over_six and scheme.tensor_scale_max != 448.0:
            raise ValueError(f"scheme: {scheme.name}'s bound E = {scheme.tensor_scale_max:g} is 4over6's; set "
                             "four_over_six=True")

    def config(self) -> dict[str, Any]:
        settings = {"with_2d_quantization": self.two_d, "stochastic_rounding": self.stochastic_rounding}
        if self.four_over_six:  # (only then: the records of plain NVFP4 quantizers stay as they were)
            settings.update(four_over_six=True, four_over_six_err_mode=self.four_over_six_err_mode)
        return settings

    def state(self) -> dict[str, torch.Tensor]:
        return {"rng_counter": self.rng_counter}

    def options(self) -> tuple[tuple[str, Any], ...]:
        """The kernel options of this rule's settings (`engine.ops.quantize.quantize`'s `options`)."""
        options = (("two_d", True),) if self.two_d else ()
        if self.four_over_six:
            options += (("four_over_six", True), ("four_over_six_err_mode", self.four_over_six_err_mode))
        return options

    def quantize(self, x: torch.Tensor, scheme: Scheme, *, rowwise: bool, columnwise: bool) -> Buffers:
        x2d = ref.as_2d(x)
        multiple = scheme.row_multiple(columnwise=True)
        if columnwise and x2d.shape[0] % multiple:
            raise ValueError(f"x: the transform of the columnwise usage mixes {multiple} tokens, so the token "
                             f"count (the product of the leading dims) must be a multiple of {multiple}, got "
                             f"{x2d.shape[0]} (shape {tuple(x.shape)}); append zero rows up to the next multiple, "
                             "as engine's layers do for their wgrad operands")
        amaxes = {}
        if self.amax_reduction_group is not None:
            found = [ref.amax(x2d) if rowwise else torch.zeros(1),
                     ref.amax(nvfp4.columnwise_input(x2d, scheme.columnwise_transform is not None))
                     if columnwise else torch.zeros(1)]
            all_reduce_max(found, self.amax_reduction_group)
            amaxes = {"amax_rowwise": found[0], "amax_columnwise": found[1]}
        buffers, _ = qops.quantize(x, scheme, rowwise=rowwise, columnwise=columnwise, options=self.options(),
                                   rng_counter=self.rng_counter if self.stochastic_rounding else None, **amaxes)
        return buffers

    def kernel_args(self) -> dict[str, Any] | None:
        if self.amax_reduction_group is not None:
            return None
        return {"rng_counter": self.rng_counter if self.stochastic_rounding else None, **dict(self.options())}


class NVFP4Quantizer(Quantizer):
    """NVFP4 for the usages asked: E2M1 per 16 with an E4M3 scale and a per-tensor fp32 amax; makes NVFP4Tensors."""

    def __init__(
        self, *, with_rht: bool = False, with_2d_quantization: bool = False, stochastic_rounding: bool = False,
        rng_counter: torch.Tensor | None = None, amax_reduction_group: dist.ProcessGroup | None = None,
        four_over_six: bool = False, four_over_six_err_mode: str = "MAE", four_over_six_e4m3_max: float = 448,
        rowwise: bool = True, columnwise: bool = True, internal: bool = False,
    ) -> None:
        rht = check_bool(with_rht, "with_rht")
        two_d = check_bool(with_2d_quantization, "with_2d_quantization")
        if rht and two_d:
            raise ValueError("with_rht and with_2d_quantization: TE applies the RHT to inputs and gradients and "
                             "16x16 tiles to weights, never both")
        if isinstance(four_over_six_e4m3_max, bool) or four_over_six_e4m3_max not in (448, 256):
            raise ValueError(f"four_over_six_e4m3_max: expected 448 or 256 (TE's nvfp4_4over6_e4m3_use_256), got "
                             f"{four_over_six_e4m3_max!r}")
        bound = four_over_six_e4m3_max if check_bool(four_over_six, "four_over_six") else 448  # (TE: else ignored)
        name = "nvfp4_rht_e2m1" if rht else ("nvfp4_e256_e2m1" if bound == 256 else "nvfp4_e2m1")
        super().__init__(SCHEMES[name],
                         NVFP4Rule(two_d=two_d, stochastic_rounding=stochastic_rounding, rng_counter=rng_counter,
                                   amax_reduction_group=amax_reduction_group, four_over_six=four_over_six,
                                   four_over_six_err_mode=four_over_six_err_mode),
                         rowwise=rowwise, columnwise=columnwise, internal=internal)

    @property
    def with_rht(self) -> bool:
        return self.scheme.columnwise_transform is not None

    @property
    def with_2d_quantization(self) -> bool:
        return self.rule.two_d

    @property
    def stochastic_rounding(self) -> bool:
        return self.rule.stochastic_rounding

    @property
    def amax_reduction_group(self) -> dist.ProcessGroup | None:
        return self.rule.amax_reduction_group

    @property
    def four_over_six(self) -> bool:
        return self.rule.four_over_six

    def config(self) -> dict[str, Any]:
        settings = {"with_rht": self.with_rht, **self.rule.config()}
        if self.four_over_six:
            settings["four_over_six_e4m3_max"] = int(self.scheme.tensor_scale_max)
        return settings


name_quantizer(NVFP4Quantizer, "nvfp4", (SCHEMES["nvfp4_e2m1"], SCHEMES["nvfp4_rht_e2m1"], SCHEMES["nvfp4_e256_e2m1"]))
