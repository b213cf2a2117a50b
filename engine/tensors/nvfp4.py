"""NVFP4TensorStorage: the NVFP4 buffers (E2M1 codes, E4M3 block scales) plus one fp32 amax per usage.

Layouts are `engine.schemes` "nvfp4" / "nvfp4_rht" and the numerics `engine.ops.nvfp4`. Beyond the
four buffers every storage has, NVFP4 keeps `amax_rowwise` and `amax_columnwise` ([1] fp32, as TE's
`amax` / `amax_columnwise`): each usage's values are `q * s_b * amax / 2688`. They travel with the
data everywhere the data goes (views, clones, saving for backward, checkpoints). Columnwise data of
an "nvfp4_rht" tensor holds the Hadamard-transformed transpose, so the value is dequantized from the
rowwise data when there is one, else by undoing the transform (H is orthonormal) in fp32.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.ops import nvfp4
from engine.ops import reference as ref
from engine.tensors.quantized import QuantizedTensor
from engine.tensors.storage import QuantizedTensorBase, check_dequantize_dtype, dims_2d

AMAX_FIELDS = ("amax_rowwise", "amax_columnwise")


class NVFP4TensorStorage(QuantizedTensorBase):
    """NVFP4 (TE's NVFP4BlockScaling): E2M1 per 16 with an E4M3 scale, and a per-tensor amax per usage."""

    layouts = ("nvfp4", "nvfp4_rht")
    extra_fields = AMAX_FIELDS

    def __init__(self, *, amax_rowwise: torch.Tensor | None = None, amax_columnwise: torch.Tensor | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.amax_rowwise = amax_rowwise
        self.amax_columnwise = amax_columnwise

    def buffers(self) -> dict[str, torch.Tensor | None]:
        return {**super().buffers(), "amax_rowwise": self.amax_rowwise, "amax_columnwise": self.amax_columnwise}

    def update_usage(self, rowwise_usage: bool | None = None, columnwise_usage: bool | None = None) -> None:
        super().update_usage(rowwise_usage, columnwise_usage)
        if not self.has_rowwise:
            self.amax_rowwise = None
        if not self.has_columnwise:
            self.amax_columnwise = None

    def prepare_for_saving(self) -> tuple[list[torch.Tensor | None], QuantizedTensorBase]:
        amaxes = [self.amax_rowwise, self.amax_columnwise]
        tensors, _ = super().prepare_for_saving()
        self.amax_rowwise = self.amax_columnwise = None
        return tensors + amaxes, self

    def restore_from_saved(self, tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        rest = super().restore_from_saved(tensors)
        if len(rest) < 2:
            raise ValueError(f"restore_from_saved: expected 6 tensors for an NVFP4 storage, got {len(tensors)}")
        self.amax_rowwise, self.amax_columnwise = rest[0], rest[1]
        return rest[2:]

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The value, from rowwise data when present, else from columnwise data (transform undone for RHT)."""
        dtype = self.nominal_dtype if dtype is None else check_dequantize_dtype(dtype)
        m, k = dims_2d(self.shape)
        if self.rowwise_data is not None:
            v = nvfp4.dequantize_2d(ref.as_2d(self.rowwise_data), self.rowwise_scale_inv, self.amax_rowwise, k)
            return v.to(dtype).reshape(self.shape)
        if self.columnwise_data is None:
            raise ValueError(f"dequantize: {type(self).__name__} holds no data (emptied by prepare_for_saving)")
        vt = nvfp4.dequantize_2d(self.columnwise_data, self.columnwise_scale_inv, self.amax_columnwise, m)
        if self.scheme.layout == "nvfp4_rht":  # y = xt @ blockdiag(H): xt = y @ blockdiag(H)^T
            h = nvfp4.hadamard_matrix(device=vt.device)
            vt = (vt.reshape(k, -1, nvfp4.NVFP4_BLOCK) @ h.t()).reshape(k, m)
        return vt.t().to(dtype).reshape(self.shape)

    def check_values(self) -> None:
        """ValueError naming the field unless each usage with data has what quantizing makes: an fp32 [1] amax
        >= 0 (or NaN), and E4M3 block scales >= 0 that hold the NaN code only when the amax is NaN (only a
        block with a NaN gets it, and that NaN is the tensor's amax too)."""
        for usage in ("rowwise", "columnwise"):
            a = getattr(self, f"amax_{usage}")
            if getattr(self, f"{usage}_data") is None:
                if a is not None:
                    raise ValueError(f"amax_{usage}: expected None, as {usage}_data is None; got {a!r:.100}")
                continue
            if not isinstance(a, torch.Tensor) or a.dtype != torch.float32 or tuple(a.shape) != (1,):
                got = a if not isinstance(a, torch.Tensor) else f"{a.dtype} {tuple(a.shape)}"
                raise ValueError(f"amax_{usage}: expected a float32 tensor of shape (1,), got {got}")
            if bool((a < 0).any()):
                raise ValueError(f"amax_{usage}: expected an amax >= 0, got {a.tolist()}")
            scales = getattr(self, f"{usage}_scale_inv").float()
            bad = scales < 0
            if not bool(torch.isnan(a).any()):
                bad |= torch.isnan(scales)
            if bool(bad.any()):
                raise ValueError(f"{usage}_scale_inv: expected E4M3 block scales >= 0 (the NaN code only with a NaN "
                                 f"amax, amax_{usage} = {a.item()}), got {scales[bad][:4].tolist()} "
                                 f"({int(bad.sum())} of {scales.numel()})")


class NVFP4Tensor(QuantizedTensor):
    """An NVFP4 value as a torch.Tensor (the storage above)."""

    storage_class = NVFP4TensorStorage
