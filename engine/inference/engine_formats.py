"""Weight formats built on engine's own quantizers: FP8 (weight-only and dynamic), MX and NVFP4 weight-only.

The weight is quantized by an engine quantizer (rowwise usage only: inference never reads W^T) and
kept as its storage's plain buffers ("data", "scale_inv", and NVFP4's "amax"); FP8 data is kept as
its bytes (uint8), as MX and NVFP4 codes are, so a checkpoint's `weight` key is never an FP8 tensor
without engine's own component keys (engine.Linear refuses those).

Per-row FP8 weight-only runs engine's C++ GEMV/GEMM at small M (`native.fp8_linear`: E4M3 decoded in registers,
fp32 sums, times the row's power-of-2 scale, rounded once; + bias). Otherwise the weight-only GEMMs decode the
weight exactly into the compute dtype and run one high-precision GEMM:
E4M3 times a power of two and MX elements times E8M0 are exact in bf16, so bf16 activations compute
in bf16 (fp32 accumulation); NVFP4's per-tensor factor amax/2688 is not a power of two, so NVFP4
computes in fp32. fp16 activations compute in fp32 (bf16 values need not fit fp16).
"""

from __future__ import annotations

import torch

from engine.gemm import general_gemm
from engine.ops import native
from engine.ops import quantize as qops
from engine.ops import reference as ref
from engine.inference.configs import Float8DynamicActivationFloat8Weight, MXWeightOnly
from engine.inference.int_formats import PartSpecs, check_scales
from engine.quantizers import Float8CurrentScalingQuantizer, Float8RowwiseQuantizer, MXQuantizer, NVFP4Quantizer
from engine.quantizers.base import Quantizer
from engine.schemes import Block, ScaleEncoding
from engine.tensors.storage import QuantizedTensorBase, buffer_specs

E4M3 = torch.float8_e4m3fn
MX_BLOCK = 32
#: the part each storage field is saved as
STORAGE_PARTS = {"rowwise_data": "data", "rowwise_scale_inv": "scale_inv", "amax_rowwise": "amax"}


class EngineWeightFormat:
    """A weight held as one engine quantizer's rowwise buffers."""

    exact_bf16 = True  # the dequantized weight is exact in bf16

    def __init__(self, quantizer: Quantizer) -> None:
        self.quantizer = quantizer

    @property
    def scheme(self):  # noqa: ANN201 - engine.schemes.Scheme
        return self.quantizer.scheme

    @property
    def per_row(self) -> bool:
        """One power-of-2 scale per row (per-row FP8: its scale applies exactly in bf16)."""
        return self.scheme.rowwise_block == Block(1, 0)

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        st = self.quantizer.quantize_storage(w.detach())
        return self.parts_of(st)

    def parts_of(self, st: QuantizedTensorBase) -> dict[str, torch.Tensor]:
        data = st.rowwise_data
        parts = {"data": data.view(torch.uint8) if data.dtype == E4M3 else data,
                 "scale_inv": st.rowwise_scale_inv.contiguous()}
        if self.scheme.tensor_scale:
            parts["amax"] = st.amax_rowwise
        return parts

    def part_specs(self, shape: tuple[int, int]) -> PartSpecs:
        specs = buffer_specs(self.scheme, torch.Size(shape), rowwise=True, columnwise=False)
        (dshape, ddtype), (sshape, sdtype) = specs["rowwise_data"], specs["rowwise_scale_inv"]
        out = {"data": (tuple(dshape), (torch.uint8 if ddtype == E4M3 else ddtype,)), "scale_inv": (tuple(sshape), (sdtype,))}
        if self.scheme.tensor_scale:
            out["amax"] = ((1,), (torch.float32,))
        return out

    def storage(self, parts: dict[str, torch.Tensor], shape: tuple[int, int], dtype: torch.dtype) -> QuantizedTensorBase:
        data = parts["data"]
        if self.scheme.data_dtype == E4M3:
            data = data.view(E4M3)
        extra = {"amax_rowwise": parts["amax"]} if "amax" in parts else {}
        return QuantizedTensorBase(scheme=self.scheme, shape=torch.Size(shape), nominal_dtype=dtype, rowwise_data=data,
                                   rowwise_scale_inv=parts["scale_inv"], **extra)

    def check_values(self, parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> None:
        """The storage's checks of its scales (at load), as ValueErrors naming the part."""
        try:
            self.storage(parts, shape, torch.float32).check_values()
        except ValueError as err:
            field, _, rest = str(err).partition(": ")
            raise ValueError(f"{STORAGE_PARTS.get(field, field)}: {rest}") from None

    def dequantize(self, parts: dict[str, torch.Tensor], shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        if dtype == torch.bfloat16 and (self.per_row or self.scheme.scale is ScaleEncoding.E8M0):
            # (fp32: the storage's NaN bits differ)
            return self.decode_bf16(parts, shape)
        return self.storage(parts, shape, dtype).dequantize(dtype)

    def decode_bf16(self, parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        """Per-row FP8 or MX weights as bf16, exactly (an element times a power of two), in two vector ops: the
        same values as the storage's `dequantize` (checked in the tests), without its fp32 detour."""
        n, k = shape
        data = parts["data"]
        if self.scheme.data_dtype == E4M3:
            values = qops.fp8_to_bf16(data.view(E4M3))  # engine's kernel: ~7x torch's cast here
        else:
            values = qops.elements_to_bf16(data, self.scheme, cols=k)
        scale = parts["scale_inv"]
        if self.per_row:
            return values * scale.to(torch.bfloat16)
        scale = ref.e8m0_to_float(scale).to(torch.bfloat16)  # 2^(code - 127), exact in bf16; NaN for 255
        if k % MX_BLOCK == 0:
            return (values.view(n, k // MX_BLOCK, MX_BLOCK) * scale.unsqueeze(2)).view(n, k)
        return values * scale.repeat_interleave(MX_BLOCK, dim=1)[:, :k]

    def compute_dtype(self, x_dtype: torch.dtype) -> torch.dtype:
        return x_dtype if x_dtype == torch.float32 or (x_dtype == torch.bfloat16 and self.exact_bf16) else torch.float32

    #: the largest M at which per-row E4M3 weights (Float8WeightOnly) run engine's C++ GEMV/GEMM (E4M3 decoded in
    #: registers, fp32 sums times the row scale); above it the decode-then-one-GEMM path is faster
    native_max_m = 32

    def linear(self, x: torch.Tensor, parts: dict[str, torch.Tensor], shape: tuple[int, int],
               bias: torch.Tensor | None) -> torch.Tensor:
        if self.per_row and x.shape[0] <= self.native_max_m and native.available():
            out = native.fp8_linear(x, parts["data"], parts["scale_inv"].view(-1))
            return out if bias is None else out + bias.to(out.dtype)
        dtype = self.compute_dtype(x.dtype)
        w = self.dequantize(parts, shape, dtype)
        out = torch.nn.functional.linear(x.to(dtype), w, None if bias is None else bias.to(dtype))
        return out.to(x.dtype)


class NVFP4Format(EngineWeightFormat):
    exact_bf16 = False  # E2M1 * E4M3 * amax / 2688: not exact in bf16

    def check_values(self, parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> None:
        """The storage's checks, and a finite amax: a weight with a NaN or inf is no inference checkpoint (its
        whole value would dequantize to NaN / inf), so the E4M3 NaN code that only a NaN block gets is refused too."""
        check_scales(parts["amax"], "amax", "amax", positive=False)
        super().check_values(parts, shape)


class Float8DynamicFormat(EngineWeightFormat):
    """x quantized per call by a quantizer of the weight's kind; engine's exact FP8 GEMM (`general_gemm`)."""

    def __init__(self, weight_quantizer: Quantizer, input_quantizer: Quantizer) -> None:
        super().__init__(weight_quantizer)
        self.input_quantizer = input_quantizer

    def linear(self, x: torch.Tensor, parts: dict[str, torch.Tensor], shape: tuple[int, int],
               bias: torch.Tensor | None) -> torch.Tensor:
        xq = self.input_quantizer.quantize_storage(x.contiguous())
        return general_gemm(xq, self.storage(parts, shape, x.dtype), out_dtype=x.dtype,
                             bias=None if bias is None else bias.to(x.dtype))


def float8_weight_only() -> EngineWeightFormat:
    return EngineWeightFormat(Float8RowwiseQuantizer(E4M3, columnwise=False, internal=True))


def float8_dynamic(config: Float8DynamicActivationFloat8Weight) -> Float8DynamicFormat:
    def make() -> Quantizer:
        if config.granularity == "row":
            return Float8RowwiseQuantizer(E4M3, columnwise=False, internal=True)
        return Float8CurrentScalingQuantizer(E4M3, columnwise=False, internal=True)

    return Float8DynamicFormat(make(), make())


def mx_weight_only(config: MXWeightOnly) -> EngineWeightFormat:
    return EngineWeightFormat(MXQuantizer(config.element, scale_mode=config.scale_mode, columnwise=False,
                                          internal=True))


def nvfp4_weight_only() -> NVFP4Format:
    return NVFP4Format(NVFP4Quantizer(columnwise=False, internal=True))
