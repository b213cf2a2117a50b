"""The quantizers by the names Transformer Engine gives them: one scheme and rule each.

Each is `Quantizer(scheme, rule)` with TE's constructor arguments; `config()` returns those
arguments, so a checkpoint's quantizer state is the same plain data it always was.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from engine.checks import check_bool
from engine.quantizers.base import Quantizer, dtype_name
from engine.quantizers.registry import name_quantizer
from engine.quantizers.rules import CurrentRule, DelayedRule, E8M0Rule
from engine.formats import FP8_DTYPES, MX_ELEMENTS, element_name, parse_element
from engine.schemes import Scheme, fp8_scheme, mx_scheme


class Float8Quantizer(Quantizer):
    """Delayed scaling: quantize with the given `scale`; record max(|x|) into `amax` (max with what is there).

    `scale` (finite, > 0) and `amax` (finite, >= 0) are the caller's tensors, typically
    views into a module's scaling state, read and written in place; the recipe updates
    `scale` from the amax history.
    """

    def __init__(
        self, scale: torch.Tensor, amax: torch.Tensor, fp8_dtype: torch.dtype, *,
        rowwise: bool = True, columnwise: bool = True, internal: bool = False, _check: bool = True,
    ) -> None:
        # _check=False is for scaling state that builds its own views (valid by construction, no host reads)
        super().__init__(fp8_scheme("tensor", fp8_dtype), DelayedRule(scale, amax, check=_check), rowwise=rowwise,
                         columnwise=columnwise, internal=internal)

    @property
    def scale(self) -> torch.Tensor:
        return self.rule.scale

    @property
    def amax(self) -> torch.Tensor:
        return self.rule.amax

    def record_amax(self, x: torch.Tensor, amax: torch.Tensor | None = None) -> None:
        """amax = max(amax, max|x|), in place (also used alone, for calibration)."""
        self.rule.record_amax(x, amax)

    def config(self) -> dict[str, Any]:
        return {"fp8_dtype": dtype_name(self.fp8_dtype)}


class _FromTheData(Quantizer):
    """Settings of the quantizers whose scales come from the data (CurrentRule)."""

    @property
    def force_pow_2_scales(self) -> bool:
        return self.scheme.scale.is_pow2

    @property
    def amax_epsilon(self) -> float:
        return self.rule.amax_epsilon


class Float8CurrentScalingQuantizer(_FromTheData):
    """Current scaling: the scale comes from this tensor's own amax (all-reduced over a group if given)."""

    def __init__(
        self, fp8_dtype: torch.dtype, *, force_pow_2_scales: bool = False, amax_epsilon: float = 0.0,
        amax_reduction_group: dist.ProcessGroup | None = None,
        rowwise: bool = True, columnwise: bool = True, internal: bool = False,
    ) -> None:
        pow2 = check_bool(force_pow_2_scales, "force_pow_2_scales")
        super().__init__(fp8_scheme("tensor", fp8_dtype, pow2=pow2), CurrentRule(amax_epsilon, amax_reduction_group),
                         rowwise=rowwise, columnwise=columnwise, internal=internal)

    @property
    def amax_reduction_group(self) -> dist.ProcessGroup | None:
        return self.rule.amax_reduction_group

    def config(self) -> dict[str, Any]:
        return {"fp8_dtype": dtype_name(self.fp8_dtype), "force_pow_2_scales": self.force_pow_2_scales,
                "amax_epsilon": self.amax_epsilon}


class Float8BlockQuantizer(_FromTheData):
    """DeepSeek-V3-style tiles, 1x128 (1D) or 128x128 (2D); power-of-2 scales by default (exact to apply)."""

    def __init__(
        self, fp8_dtype: torch.dtype, *, block_scaling_dim: int = 1, force_pow_2_scales: bool = True,
        amax_epsilon: float = 0.0, rowwise: bool = True, columnwise: bool = True, internal: bool = False,
    ) -> None:
        if block_scaling_dim not in (1, 2) or isinstance(block_scaling_dim, bool):
            raise ValueError(f"block_scaling_dim: expected 1 (1x128 tiles) or 2 (128x128 tiles), "
                             f"got {block_scaling_dim!r}")
        pow2 = check_bool(force_pow_2_scales, "force_pow_2_scales")
        super().__init__(fp8_scheme(f"block{block_scaling_dim}d", fp8_dtype, pow2=pow2), CurrentRule(amax_epsilon),
                         rowwise=rowwise, columnwise=columnwise, internal=internal)

    @property
    def block_scaling_dim(self) -> int:
        return self.scheme.block_scaling_dim

    def config(self) -> dict[str, Any]:
        return {"fp8_dtype": dtype_name(self.fp8_dtype), "block_scaling_dim": self.block_scaling_dim,
                "force_pow_2_scales": self.force_pow_2_scales, "amax_epsilon": self.amax_epsilon}


class MXQuantizer(Quantizer):
    """OCP MX: rowwise 1x32 and columnwise 32x1 blocks with E8M0 scales, each usage quantized from the input.

    `element`: "e2m1" (MXFP4), "e2m3" or "e3m2" (MXFP6), or an FP8 dtype / "e4m3" / "e5m2" (MXFP8);
    `scale_mode`: "rceil" (amax / max_elem rounded up to a power of two, NVIDIA's rule) or "floor"
    (the OCP spec's floor(log2 amax) - emax_elem). Makes `MXTensor`s.
    """

    def __init__(
        self, element: torch.dtype | str, *, scale_mode: str = "rceil",
        rowwise: bool = True, columnwise: bool = True, internal: bool = False,
    ) -> None:
        super().__init__(mx_scheme(parse_element(element)), E8M0Rule(scale_mode), rowwise=rowwise,
                         columnwise=columnwise, internal=internal)

    @property
    def element(self) -> str:
        """"e2m1", "e2m3", "e3m2", "e4m3" or "e5m2"."""
        return element_name(self.scheme.element)

    @property
    def scale_mode(self) -> str:
        return self.rule.scale_mode

    def config(self) -> dict[str, Any]:
        return {"element": self.element, "scale_mode": self.scale_mode}


class MXFP8Quantizer(MXQuantizer):
    """MXQuantizer with an FP8 element (Transformer Engine's name and arguments)."""

    def __init__(
        self, fp8_dtype: torch.dtype, *, scale_mode: str = "rceil",
        rowwise: bool = True, columnwise: bool = True, internal: bool = False,
    ) -> None:
        fp8_scheme("mx", fp8_dtype)  # a TypeError naming fp8_dtype for anything but E4M3 / E5M2
        super().__init__(fp8_dtype, scale_mode=scale_mode, rowwise=rowwise, columnwise=columnwise, internal=internal)

    def config(self) -> dict[str, Any]:
        return {"fp8_dtype": dtype_name(self.fp8_dtype), "scale_mode": self.scale_mode}


def fp8_schemes(*layouts: str, pow2: tuple[bool, ...] = (False, True)) -> list[Scheme]:
    """The registered FP8 schemes of these layouts (each FP8 element, each power-of-2 choice)."""
    return [fp8_scheme(layout, dtype, pow2=p) for layout in layouts for dtype in FP8_DTYPES for p in pow2]


# what a quantizer spec of each (rule, scheme) pair builds: Transformer Engine's class for it
name_quantizer(Float8Quantizer, "delayed", fp8_schemes("tensor", pow2=(False,)))
name_quantizer(Float8CurrentScalingQuantizer, "current", fp8_schemes("tensor"))
name_quantizer(Float8BlockQuantizer, "current", fp8_schemes("block1d", "block2d"))
name_quantizer(MXFP8Quantizer, "e8m0", [mx_scheme(dtype) for dtype in FP8_DTYPES])
name_quantizer(MXQuantizer, "e8m0", [mx_scheme(element) for element in MX_ELEMENTS])
