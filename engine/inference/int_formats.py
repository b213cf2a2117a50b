"""Integer weight formats: int8 per channel (weight-only and with dynamic int8 activations), int4 groupwise.

Each weight is a storage of an integer scheme (`engine.schemes`: "channel_int8" / "channel_int8_bf16", one
scale per output channel; "group<g>_int4_bf16_asym", a scale and zero point per group of g along K), quantized
by the scheme's reference (`engine.ops.int_elements`: rounding half to even, scales from each block). A
checkpoint holds the parts torch-style: int8 "data" [N, K] and "scale" [N]; int4 "data" uint8 [N16, Kg/2] and
"scale_and_zero" bf16 [Kg/g, N16, 2], the layout the int4 kernel reads (`Int4Format`).

The weight-only GEMMs run engine's C++ kernels (`engine.ops.native.int4_linear` / `int8_linear`,
csrc/inference/wo_gemm_kernels.cpp: the weight dequantized in registers, fp32 sums, one source compiled per
instruction set) when the extension is built and M (the token count) is at most the format's `native_max_m` (for int4 with bf16 x:
`native_max_m_bf16`); above it, torch's op (int8) or the formula in torch ops (int4). The choice depends
on the shape (and x's dtype) only, never on an error.
"""

from __future__ import annotations

import platform

import torch

from engine.formats import INT4
from engine.inference import int8_mm
from engine.inference.configs import Int4WeightOnly
from engine.inference.weight_format import PartSpecs, WeightFormat, rowwise
from engine.ops import int_elements, native
from engine.schemes import Scheme, int4_group_scheme, int8_channel_scheme
from engine.tensors.storage import QuantizedTensorBase

#: `_weight_int8pack_mm` reads K in blocks of 16 (other K crash it in torch 2.13)
PACK_MM_K = 16


def rowwise_int8(w: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [R, C], scale [R] in scale_dtype): the "channel_int8" scheme's reference (`engine.ops.int_elements`):
    scale = amax/127 per row (at least fp32's smallest normal), rounded to scale_dtype; q = round(w / scale)
    clamped to [-127, 127], with the stored scale."""
    q, scale = int_elements.quantize(w, int8_channel_scheme(scale_dtype))
    return q, scale.view(-1)


class Int8Format(WeightFormat):
    """int8 per output channel: parts "data" int8 [N, K] and "scale" [N] (the storage's [N, 1] scale_inv)."""

    PARTS = {"rowwise_data": "data", "rowwise_scale_inv": "scale"}
    #: the scale dtypes a checkpoint may hold
    scale_dtypes: tuple[torch.dtype, ...] = (torch.float32,)

    def scheme_for(self, dtype: torch.dtype) -> Scheme:
        """The scheme a weight of `dtype` is quantized to (fp32 scales)."""
        return int8_channel_scheme(torch.float32)

    def quantize(self, w: torch.Tensor) -> QuantizedTensorBase:
        scheme = self.scheme_for(w.dtype)
        q, scale = int_elements.quantize(w, scheme)
        return rowwise(scheme, tuple(w.shape), w.dtype, {"rowwise_data": q, "rowwise_scale_inv": scale})

    def to_parts(self, st: QuantizedTensorBase) -> dict[str, torch.Tensor]:
        return {"data": st.rowwise_data, "scale": st.rowwise_scale_inv.view(-1)}

    def part_specs(self, shape: tuple[int, int]) -> PartSpecs:
        n, k = shape
        return {"data": ((n, k), (torch.int8,)), "scale": ((n,), self.scale_dtypes)}

    def from_parts(self, parts: dict[str, torch.Tensor], shape: tuple[int, int],
                   dtype: torch.dtype) -> QuantizedTensorBase:
        scale = parts["scale"]
        return rowwise(int8_channel_scheme(scale.dtype), shape, dtype,
                       {"rowwise_data": parts["data"], "rowwise_scale_inv": scale.view(-1, 1)})


class Int8WeightOnlyFormat(Int8Format):
    """y = round_to(x.dtype)((x @ q^T)_fp32 * scale) + bias, the scale in the weight's dtype for a bf16 weight (fp32
    otherwise). Small M: engine's C++ kernel; larger M, with x in the scale's dtype (or fp32) and K a multiple of
    16: torch's `_weight_int8pack_mm` (the same math up to the order of fp32 additions; other K crash that
    kernel: they run the formula as written)."""

    scale_dtypes = (torch.bfloat16, torch.float32)
    #: the largest M the C++ GEMV/GEMM runs (measured faster than torch's _weight_int8pack_mm up to there)
    native_max_m = 256

    def scheme_for(self, dtype: torch.dtype) -> Scheme:
        return int8_channel_scheme(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)

    def linear(self, x: torch.Tensor, ops: dict[str, torch.Tensor], shape: tuple[int, int],
               bias: torch.Tensor | None) -> torch.Tensor:
        q, scale = ops["data"], ops["scale"]
        if x.shape[0] <= self.native_max_m and native.available():
            out = native.int8_linear(x, q, scale)
        elif (x.dtype == scale.dtype or x.dtype == torch.float32) and q.shape[1] % PACK_MM_K == 0:  # scale exact in x.dtype
            out = torch.ops.aten._weight_int8pack_mm(x.contiguous(), q, scale.to(x.dtype))
        else:
            out = ((x.float() @ q.float().t()) * scale.float()).to(x.dtype)
        return out if bias is None else out + bias.to(out.dtype)


class Int8DynamicFormat(Int8Format):
    """Per-token int8 x (the same "channel_int8" scheme: scale amax/127 per row, fp32) times per-channel int8 W,
    accumulated exactly in int32, then * sx * sw in fp32, rounded once to x.dtype, + bias.

    The int32 GEMM: for weights of at least `onednn_min_elements` where torch has oneDNN and its u8 x s8 GEMM
    gives exact sums (`int8_mm.prepacked_exact()`: with VNNI), that GEMM on a copy of the weight in oneDNN's
    prepacked layout, made once (`prepare`; the weight then keeps no plain int8 [N, K] beside it: `held`, and
    the storage's data is read back from the prepacked copy when asked, `restored`) (x as q + 128 with zero
    point 128: the same int32 sums, returned as their fp32 values); at 4096x4096 it is 1.2x (M = 256) to 3-5x
    (M = 2-16) faster than `torch._int_mm`, which repacks the weight on every call, and 0.65x at M = 1.
    Otherwise `int8_mm.int32_mm`: `torch._int_mm` where it is exact, else its exact sign-split form (AVX2
    CPUs), faster on small weights (oneDNN's call costs ~25 us more). Either way the bits are those of the
    formula above.
    """

    #: the least N * K held prepacked for oneDNN (measured: 1024x1024 ties at M >= 16 and loses at M = 1)
    onednn_min_elements = 1 << 21

    def prepare(self, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """"data" in oneDNN's prepacked layout (an opaque [K, N] tensor) where torch has oneDNN and it gives exact
        sums, else the parts as they are."""
        data = parts["data"]
        if type(data) is not torch.Tensor or data.numel() < self.onednn_min_elements \
                or not onednn_available() or not int8_mm.prepacked_exact():
            return dict(parts)  # small, not a plain tensor (a FakeTensor while tracing), or not exact
        return {**parts, "data": int8_mm.prepack(data)}

    def held(self, st: QuantizedTensorBase, operands: dict[str, torch.Tensor]) -> QuantizedTensorBase:
        return st.replace(rowwise_data=None) if operands["data"].is_mkldnn else st

    def restored(self, st: QuantizedTensorBase, operands: dict[str, torch.Tensor]) -> QuantizedTensorBase:
        data = operands["data"]
        return st.replace(rowwise_data=data.to_dense().t().contiguous()) if st.rowwise_data is None else st

    def linear(self, x: torch.Tensor, ops: dict[str, torch.Tensor], shape: tuple[int, int],
               bias: torch.Tensor | None) -> torch.Tensor:
        data, sw = ops["data"], ops["scale"]
        if data.is_mkldnn:  # prepared: native is built where this runs (prepare needs oneDNN, the CPU)
            xq, sx = native.int8_quantize_rows(x, biased=True)
            out = native.int8_rescale(int8_mm.prepacked_sums(xq, data, shape[0]), sx, sw, x.dtype)
        elif native.available():  # the same bits, one pass each for the quantize and the rescale
            xq, sx = native.int8_quantize_rows(x)
            out = native.int8_rescale(int32_mm(xq, data), sx, sw, x.dtype)
        else:
            xq, sx = rowwise_int8(x)
            acc = int32_mm(xq, data)
            out = (acc.float() * sx.unsqueeze(1) * sw.unsqueeze(0)).to(x.dtype)
        return out if bias is None else out + bias.to(out.dtype)


def onednn_available() -> bool:
    """Whether this is an x86 torch with oneDNN's int8 linear (`torch.ops.onednn.qlinear_prepack`; the
    path is measured and tested on x86 only) and the C++ glue is built."""
    return platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkldnn.is_available() \
        and hasattr(torch.ops.onednn, "qlinear_prepack") and native.available()


#: a[M, K] @ b[N, K]^T for int8 operands in [-127, 127] as exact int32 sums (for K < 2^17): engine.inference.int8_mm
int32_mm = int8_mm.int32_mm


class Int4Format(WeightFormat):
    """Groupwise asymmetric int4 (the "group<g>_int4_bf16_asym" scheme: per group of g along K, scale = (max -
    min)/15 and zero = min + 8 * scale in bf16, codes round((w - zero)/scale) in [-8, 7]; the value is code *
    scale + zero in fp32), stored two codes a byte along K, low nibble first, as code + 8.

    Its parts are the layout the C++ kernel reads: "data" uint8 [N16, Kg/2] and "scale_and_zero" bf16
    [Kg/g, N16, 2]. N is padded to N16, a multiple of 16, with rows of code 0, scale 1 and zero 0 (cut from the
    output); K to Kg, a multiple of g, with the codes of zeros (the last group's scale and zero see them, as the
    storage's partial last group does; x gets zero columns at run time, so they add nothing). The storage's
    buffers are views of these parts ([:N] and [:, :N] of them), so they share its memory.
    """

    PARTS = {"rowwise_data": "data", "rowwise_scale_inv": "scale_and_zero"}
    N_UNIT = 16
    #: the largest M the C++ kernel runs, for bf16 x (its vdpbf16ps path) and for the other dtypes (fp32
    #: FMAs); bigger M: the fp32 formula in torch ops (dequantize, fp32 matmul), faster there
    native_max_m_bf16 = 256
    native_max_m = 64

    def __init__(self, config: Int4WeightOnly) -> None:
        self.group_size = config.group_size
        self.scheme = int4_group_scheme(config.group_size)

    def padded_n(self, n: int) -> int:
        return -(-n // self.N_UNIT) * self.N_UNIT

    def padded_k(self, k: int) -> int:
        return -(-k // self.group_size) * self.group_size

    def quantize(self, w: torch.Tensor) -> QuantizedTensorBase:
        data, scale_inv = int_elements.quantize(w, self.scheme)
        return rowwise(self.scheme, tuple(w.shape), w.dtype, {"rowwise_data": data, "rowwise_scale_inv": scale_inv})

    def to_parts(self, st: QuantizedTensorBase) -> dict[str, torch.Tensor]:
        n, k = st.shape
        npad, kpad = self.padded_n(n), self.padded_k(k)
        data, sz = st.rowwise_data, st.rowwise_scale_inv  # [N, ceil(K/2)], [N, Kg/g, 2]
        if kpad != k:  # the codes of zeros up to Kg, under the last group's scale and zero
            pad = int_elements.encode(torch.zeros(n, kpad - k), sz[:, -1:, 0].float(), sz[:, -1:, 1].float(), INT4)
            data = int_elements.store(torch.cat([int_elements.load(data, INT4, k), pad], dim=1), INT4)
        if npad != n:  # rows of code 0 (byte 0x88), scale 1, zero 0
            data = torch.cat([data, data.new_full((npad - n, kpad // 2), 0x88)])
            filler = torch.tensor([1.0, 0.0], dtype=sz.dtype).expand(npad - n, sz.shape[1], 2)
            sz = torch.cat([sz, filler])
        return {"data": data.contiguous(), "scale_and_zero": sz.transpose(0, 1).contiguous()}

    def part_specs(self, shape: tuple[int, int]) -> PartSpecs:
        n, k = shape[0], self.padded_k(shape[1])
        npad = self.padded_n(n)
        return {"data": ((npad, k // 2), (torch.uint8,)),
                "scale_and_zero": ((k // self.group_size, npad, 2), (torch.bfloat16,))}

    def from_parts(self, parts: dict[str, torch.Tensor], shape: tuple[int, int],
                   dtype: torch.dtype) -> QuantizedTensorBase:
        n, k = shape
        return rowwise(self.scheme, shape, dtype, {"rowwise_data": parts["data"][:n, : -(-k // 2)],
                                                   "rowwise_scale_inv": parts["scale_and_zero"][:, :n].transpose(0, 1)})

    def check(self, st: QuantizedTensorBase, parts: dict[str, torch.Tensor]) -> None:
        """The storage's checks (finite scales > 0, finite zeros), then the padding: what `to_parts` makes (rows of
        code 0, scale 1, zero 0; the codes of zeros up to Kg), so a loaded weight saves as it was read."""
        super().check(st, parts)
        for part, t in self.to_parts(st).items():
            if not torch.equal(t.view(torch.uint8), parts[part].view(torch.uint8)):
                n, k = st.shape
                raise ValueError(f"{part}: the padding (rows from {n} to {self.padded_n(n)}, columns from {k} to "
                                 f"{self.padded_k(k)}) holds values Int4WeightOnly never makes there")

    def linear(self, x: torch.Tensor, ops: dict[str, torch.Tensor], shape: tuple[int, int],
               bias: torch.Tensor | None) -> torch.Tensor:
        limit = self.native_max_m_bf16 if x.dtype == torch.bfloat16 else self.native_max_m
        if x.shape[1] % self.group_size:  # the weight's zero columns
            x = torch.nn.functional.pad(x, (0, self.padded_k(x.shape[1]) - x.shape[1]))
        n, kpad = shape[0], x.shape[1]
        if x.shape[0] <= limit and native.available():
            out = native.int4_linear(x, ops["data"], ops["scale_and_zero"], self.group_size, n)
        else:  # the value of the weight padded to Kg, in fp32
            w = self.from_parts(ops, (n, kpad), torch.float32).dequantize(torch.float32)
            out = (x.float() @ w.t()).to(x.dtype)
        return out if bias is None else out + bias.to(out.dtype)
