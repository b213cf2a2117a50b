"""MXFP8 quantizer: E8M0 shared scales per 32 elements (RCEIL by default, or the OCP FLOOR rule)."""

from __future__ import annotations

from typing import Any

import torch

from engine.ops import backend as ops
from engine.ops import reference as ref
from engine.tensors.storage import BUFFER_FIELDS
from engine.quantizers.base import Buffers, Quantizer, check_fp8_dtype, dtype_name
from engine.tensors.mxfp8 import MXFP8TensorStorage


class MXFP8Quantizer(Quantizer):
    """Rowwise 1x32 and columnwise 32x1 blocks, each quantized from the high-precision input."""

    storage_class = MXFP8TensorStorage

    def __init__(
        self, fp8_dtype: torch.dtype, *, scale_mode: str = "rceil",
        rowwise: bool = True, columnwise: bool = True, internal: bool = False,
    ) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise, internal=internal)
        self.fp8_dtype = check_fp8_dtype(fp8_dtype)
        if scale_mode not in ref.SCALE_MODES:
            raise ValueError(f"scale_mode: expected one of {sorted(ref.SCALE_MODES)}, got {scale_mode!r}")
        self.scale_mode = scale_mode

    def config(self) -> dict[str, Any]:
        return {"fp8_dtype": dtype_name(self.fp8_dtype), "scale_mode": self.scale_mode}

    def compute_buffers(self, x: torch.Tensor, *, rowwise: bool, columnwise: bool) -> Buffers:
        out: Buffers = dict.fromkeys(BUFFER_FIELDS)
        if rowwise:
            out["rowwise_data"], out["rowwise_scale_inv"] = ops.quantize_mxfp8(x, self.fp8_dtype, scale_mode=self.scale_mode)
        if columnwise:
            out["columnwise_data"], out["columnwise_scale_inv"] = ops.quantize_mxfp8(
                x, self.fp8_dtype, scale_mode=self.scale_mode, columnwise=True)
        return out
