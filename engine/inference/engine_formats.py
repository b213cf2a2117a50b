"""Weight formats built on engine's own quantizers: FP8 (weight-only and dynamic), MX and NVFP4 weight-only.

The weight is quantized by an engine quantizer (rowwise usage only: inference never reads W^T) into its
storage; a checkpoint holds the storage's buffers as parts ("data", "scale_inv", and NVFP4's "amax"), FP8
data as its bytes (uint8), as MX and NVFP4 codes are, so a checkpoint's `weight` key is never an FP8 tensor
without engine's own component keys (engine.Linear refuses those).

Per-row FP8 weight-only runs engine's C++ GEMV/GEMM at small M (`native.fp8_linear`: E4M3 decoded in registers,
fp32 sums, times the row's power-of-2 scale, rounded once; + bias); MX and NVFP4 weight-only likewise
(`native.block_linear`: each weight decoded in registers to the reference's fp32 value, element * block scale,
fp32 sums). Otherwise (larger M) the weight-only GEMMs decode the weight exactly into the compute dtype and run
one high-precision GEMM:
E4M3 times a power of two and MX elements times E8M0 are exact in bf16, so bf16 activations compute
in bf16 (fp32 accumulation); NVFP4's per-tensor factor amax/2688 is not a power of two, so NVFP4
computes in fp32. fp16 activations compute in fp32 (bf16 values need not fit fp16).
"""

from __future__ import annotations

import functools
import warnings

import torch

from engine.formats import element_name
from engine.gemm import general_gemm
from engine.ops import native
from engine.ops import quantize as qops
from engine.ops import reference as ref
from engine.inference.configs import Float8DynamicActivationFloat8Weight, MXWeightOnly
from engine.inference.weight_format import PartSpecs, WeightFormat, check_scales, rowwise
from engine.quantizers import Float8CurrentScalingQuantizer, Float8RowwiseQuantizer, MXQuantizer, NVFP4Quantizer
from engine.quantizers.base import Quantizer
from engine.schemes import Block, ScaleEncoding, Scheme
from engine.tensors.storage import QuantizedTensorBase

E4M3 = torch.float8_e4m3fn
MX_BLOCK = 32


class EngineWeightFormat(WeightFormat):
    """A weight held as one engine quantizer's rowwise storage; its parts are the storage's buffers ("data" as
    bytes, "scale_inv", and NVFP4's "amax")."""

    exact_bf16 = True  # the dequantized weight is exact in bf16

    def __init__(self, quantizer: Quantizer) -> None:
        self.quantizer = quantizer

    @property
    def scheme(self) -> Scheme:
        return self.quantizer.scheme

    @property
    def per_row(self) -> bool:
        """One power-of-2 scale per row (per-row FP8: its scale applies exactly in bf16)."""
        return self.scheme.rowwise_block == Block(1, 0)

    def quantize(self, w: torch.Tensor) -> QuantizedTensorBase:
        return self.quantizer.quantize_storage(w.detach())

    def to_parts(self, st: QuantizedTensorBase) -> dict[str, torch.Tensor]:
        data = st.rowwise_data
        parts = {"data": data.view(torch.uint8) if data.dtype == E4M3 else data,
                 "scale_inv": st.rowwise_scale_inv.contiguous()}
        if self.scheme.tensor_scale:
            parts["amax"] = st.amax_rowwise
        return parts

    def part_specs(self, shape: tuple[int, int]) -> PartSpecs:
        specs = self.scheme.buffer_specs(torch.Size(shape), rowwise=True, columnwise=False)
        saved = {"rowwise_data": torch.uint8} if self.scheme.data_dtype == E4M3 else {}  # FP8 data as bytes
        return {self.PARTS[name]: (tuple(size), (saved.get(name, dtype),)) for name, (size, dtype) in specs.items()}

    def from_parts(self, parts: dict[str, torch.Tensor], shape: tuple[int, int],
                   dtype: torch.dtype) -> QuantizedTensorBase:
        data = parts["data"]
        if self.scheme.data_dtype == E4M3:
            data = data.view(E4M3)
        extra = {"amax_rowwise": parts["amax"]} if "amax" in parts else {}
        return rowwise(self.scheme, shape, dtype, {"rowwise_data": data, "rowwise_scale_inv": parts["scale_inv"],
                                                   **extra})

    def decode(self, ops: dict[str, torch.Tensor], shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """The weight's value in `dtype` for the GEMM: per-row FP8 or MX as bf16 in two vector ops (`decode_bf16`,
        the storage's values without its fp32 detour), else the storage's dequantize."""
        if dtype == torch.bfloat16 and (self.per_row or self.scheme.scale is ScaleEncoding.E8M0):
            return self.decode_bf16(ops, shape)
        return self.from_parts(ops, shape, dtype).dequantize(dtype)

    def decode_bf16(self, ops: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        """Per-row FP8 or MX weights as bf16, exactly (an element times a power of two): the same values as the
        storage's `dequantize` (checked in the tests)."""
        n, k = shape
        data = ops["data"]
        if self.scheme.data_dtype == E4M3:
            values = qops.fp8_to_bf16(data.view(E4M3))  # engine's kernel: ~7x torch's cast here
        else:
            values = qops.elements_to_bf16(data, self.scheme, cols=k)
        scale = ops["scale_inv"]
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
    #: the same for MX and NVFP4 weights (`native.block_linear`: each weight decoded in registers to its fp32 value)
    native_max_m_block = 32

    def native_block(self) -> tuple[str, int] | None:
        """(element, block) of `native.block_linear` for MX (E8M0 scales) and NVFP4 weights in 1xB blocks along K,
        else None."""
        name = element_name(self.scheme.element).upper()
        block = self.scheme.stored_block(False)
        if name not in native.BLOCK_ELEMENTS or block.rows != 1 or block.cols not in (16, 32):
            return None
        if self.scheme.scale is ScaleEncoding.E8M0 and not self.scheme.tensor_scale:
            return name, block.cols
        if isinstance(self, NVFP4Format) and name == "E2M1" and block.cols == 16:
            return name, block.cols
        return None

    def linear(self, x: torch.Tensor, ops: dict[str, torch.Tensor], shape: tuple[int, int],
               bias: torch.Tensor | None) -> torch.Tensor:
        if self.per_row and x.shape[0] <= self.native_max_m and native.available():
            out = native.fp8_linear(x, ops["data"], ops["scale_inv"].view(-1))
            return out if bias is None else out + bias.to(out.dtype)
        block = self.native_block()
        if block is not None and x.shape[0] <= self.native_max_m_block and native.available():
            amax = ops.get("amax")
            factor = 0.0 if amax is None else float(_f32(1.0) / _f32(6.0 * self.scheme.tensor_scale_max))
            # with a bias: fp32 out, + bias in fp32, one rounding to x's dtype (as the decode-and-GEMM path)
            xin = x.contiguous() if bias is None else x.float().contiguous()
            out = native.block_linear(xin, ops["data"].view(torch.uint8), ops["scale_inv"].view(torch.uint8),
                                      block[0], block[1], amax, factor)
            return out if bias is None else (out + bias.float()).to(x.dtype)
        if not native.available():
            warn_slow_once(type(self).__name__)
        dtype = self.compute_dtype(x.dtype)
        w = self.decode(ops, shape, dtype)
        out = torch.nn.functional.linear(x.to(dtype), w, None if bias is None else bias.to(dtype))
        return out.to(x.dtype)


def _f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


@functools.lru_cache(maxsize=None)
def warn_slow_once(name: str) -> None:
    """The project's rule: a slow path announced once per process (here: MX / NVFP4 weights decoded in torch ops
    and one GEMM at small M, without engine's C++ kernels)."""
    warnings.warn(f"{name}: engine's C++ kernels are not available ({native.why_unavailable()}); the weight is "
                  f"decoded in torch ops on every call (slow). {native.INSTALL_HINT}", RuntimeWarning, stacklevel=3)


class NVFP4Format(EngineWeightFormat):
    exact_bf16 = False  # E2M1 * E4M3 * amax / 2688: not exact in bf16

    def check(self, st: QuantizedTensorBase, parts: dict[str, torch.Tensor]) -> None:
        """A finite amax, then the storage's checks: a weight with a NaN or inf is no inference checkpoint (its
        whole value would dequantize to NaN / inf), so the E4M3 NaN code that only a NaN block gets is refused too."""
        check_scales(parts["amax"], "amax", "amax", positive=False)
        super().check(st, parts)


class Float8DynamicFormat(EngineWeightFormat):
    """x quantized per call by a quantizer of the weight's kind; engine's exact FP8 GEMM (`general_gemm`)."""

    def __init__(self, weight_quantizer: Quantizer, input_quantizer: Quantizer) -> None:
        super().__init__(weight_quantizer)
        self.input_quantizer = input_quantizer

    def linear(self, x: torch.Tensor, ops: dict[str, torch.Tensor], shape: tuple[int, int],
               bias: torch.Tensor | None) -> torch.Tensor:
        xq = self.input_quantizer.quantize_storage(x.contiguous())
        return general_gemm(xq, self.from_parts(ops, shape, x.dtype), out_dtype=x.dtype,
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
