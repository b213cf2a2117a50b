"""Float8 block scaling quantizer: a scale per 1x128 (1D) or 128x128 (2D) tile."""

from __future__ import annotations

from typing import Any

import torch

from engine.ops import backend as ops
from engine.ops import reference as ref
from engine.tensors.storage import BUFFER_FIELDS
from engine.quantizers.base import Buffers, Quantizer, check_bool, check_epsilon, check_fp8_dtype, dtype_name
from engine.tensors.blockwise import Float8BlockwiseTensorStorage, check_block_scaling_dim


class Float8BlockQuantizer(Quantizer):
    """DeepSeek-V3-style tiles; power-of-2 scales by default (exact to apply and to invert)."""

    storage_class = Float8BlockwiseTensorStorage

    def __init__(
        self, fp8_dtype: torch.dtype, *, block_scaling_dim: int = 1, force_pow_2_scales: bool = True,
        amax_epsilon: float = 0.0, rowwise: bool = True, columnwise: bool = True, internal: bool = False,
    ) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise, internal=internal)
        self.fp8_dtype = check_fp8_dtype(fp8_dtype)
        self.block_scaling_dim = check_block_scaling_dim(block_scaling_dim)
        self.force_pow_2_scales = check_bool(force_pow_2_scales, "force_pow_2_scales")
        self.amax_epsilon = check_epsilon(amax_epsilon)

    def config(self) -> dict[str, Any]:
        return {"fp8_dtype": dtype_name(self.fp8_dtype), "block_scaling_dim": self.block_scaling_dim,
                "force_pow_2_scales": self.force_pow_2_scales, "amax_epsilon": self.amax_epsilon}

    def storage_kwargs(self) -> dict[str, Any]:
        return {"block_scaling_dim": self.block_scaling_dim}

    def compute_buffers(self, x: torch.Tensor, *, rowwise: bool, columnwise: bool) -> Buffers:
        x2d = ref.as_2d(x)
        opts = {"tile_cols": ref.BLOCK_128, "force_pow_2_scales": self.force_pow_2_scales,
                "amax_epsilon": self.amax_epsilon, "value_for_inf": ref.block_value_for_inf(x.dtype)}
        out: Buffers = dict.fromkeys(BUFFER_FIELDS)
        if self.block_scaling_dim == 2:
            data, scale_inv = ops.quantize_block(x2d, self.fp8_dtype, tile_rows=ref.BLOCK_128, **opts)
            if rowwise:
                out["rowwise_data"], out["rowwise_scale_inv"] = data.view(x.shape), scale_inv
            if columnwise:  # square tiles: the columnwise form is the exact transpose
                out["columnwise_data"], out["columnwise_scale_inv"] = data.t().contiguous(), scale_inv.t().contiguous()
            return out
        if rowwise:
            data, out["rowwise_scale_inv"] = ops.quantize_block(x2d, self.fp8_dtype, tile_rows=1, **opts)
            out["rowwise_data"] = data.view(x.shape)
        if columnwise:  # 1x128 tiles of the transposed tensor
            out["columnwise_data"], out["columnwise_scale_inv"] = ops.quantize_block(
                x2d.t(), self.fp8_dtype, tile_rows=1, **opts)
        return out
