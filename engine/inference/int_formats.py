"""Integer weight formats: int8 per channel (weight-only and with dynamic int8 activations), int4 groupwise.

Each format turns a 2D weight [N, K] into named plain tensors ("parts"; "data" is the main one),
knows the parts' shapes and dtypes (for checking a checkpoint), dequantizes, and runs
y[M, N] = x[M, K] @ W^T (+ bias) on the parts. Rounding is round-half-to-even everywhere
(`torch.round`).

The weight-only GEMMs run engine's C++ kernels (`engine.ops.native.int4_linear` / `int8_linear`,
csrc/kernels_wo_gemm*.cpp: the weight dequantized in registers, fp32 sums, AVX-512 or portable) when the
extension is built and M (the token count) is at most the format's `native_max_m` (for int4 with bf16 x:
`native_max_m_bf16`); above it, torch's op (int8) or the formula in torch ops (int4). The choice depends
on the shape (and x's dtype) only, never on an error.
"""

from __future__ import annotations

import platform

import torch

from engine.inference import int8_mm
from engine.inference.configs import Int4WeightOnly
from engine.ops import native

PartSpecs = dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]]
INT8_MAX = 127.0
FP32_TINY = torch.finfo(torch.float32).tiny
#: `_weight_int8pack_mm` reads K in blocks of 16 (other K crash it in torch 2.13)
PACK_MM_K = 16


def check_scales(t: torch.Tensor, part: str, what: str = "scales", *, positive: bool = True) -> None:
    """ValueError naming `part` unless every value of t is finite (and > 0 if `positive`); checked at load (syncs)."""
    tf = t.float()
    bad = ~(torch.isfinite(tf) & (tf > 0)) if positive else ~torch.isfinite(tf)
    if bool(bad.any()):
        raise ValueError(f"{part}: expected finite {what}{' > 0' if positive else ''}, got {tf[bad][:4].tolist()} "
                         f"({int(bad.sum())} of {t.numel()})")


def rowwise_int8(w: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [R, C], scale [R] in scale_dtype): scale = amax/127 per row (at least fp32's smallest normal, so
    an all-zero row gets a tiny scale, not 0), rounded to scale_dtype; q = round(w / scale) clamped to
    [-127, 127], with the stored (rounded) scale."""
    wf = w.float()
    amax = wf.abs().amax(dim=1) if wf.shape[1] else wf.new_zeros(wf.shape[0])  # an empty row's amax is 0
    scale = (amax / INT8_MAX).clamp_min(FP32_TINY).to(scale_dtype)
    q = torch.round(wf / scale.float().unsqueeze(1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


class Int8WeightOnlyFormat:
    """y = round_to(x.dtype)((x @ q^T)_fp32 * scale) + bias. Small M: engine's C++ kernel; larger M, with x in
    the scale's dtype (or fp32) and K a multiple of 16: torch's `_weight_int8pack_mm` (the same math up to the
    order of fp32 additions; other K crash that kernel: they run the formula as written)."""

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale = rowwise_int8(w, torch.bfloat16 if w.dtype == torch.bfloat16 else torch.float32)
        return {"data": q, "scale": scale}

    def part_specs(self, shape: tuple[int, int]) -> PartSpecs:
        n, k = shape
        return {"data": ((n, k), (torch.int8,)), "scale": ((n,), (torch.bfloat16, torch.float32))}

    def check_values(self, parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> None:
        """The row scales are finite and > 0 (amax/127, at least fp32's smallest normal); at load."""
        check_scales(parts["scale"], "scale")

    def dequantize(self, parts: dict[str, torch.Tensor], shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        return (parts["data"].float() * parts["scale"].float().unsqueeze(1)).to(dtype)

    #: the largest M the C++ GEMV/GEMM runs (measured faster than torch's _weight_int8pack_mm up to there)
    native_max_m = 256

    def linear(self, x: torch.Tensor, parts: dict[str, torch.Tensor], shape: tuple[int, int],
               bias: torch.Tensor | None) -> torch.Tensor:
        q, scale = parts["data"], parts["scale"]
        if x.shape[0] <= self.native_max_m and native.available():
            out = native.int8_linear(x, q, scale)
        elif (x.dtype == scale.dtype or x.dtype == torch.float32) and q.shape[1] % PACK_MM_K == 0:  # scale exact in x.dtype
            out = torch.ops.aten._weight_int8pack_mm(x.contiguous(), q, scale.to(x.dtype))
        else:
            out = ((x.float() @ q.float().t()) * scale.float()).to(x.dtype)
        return out if bias is None else out + bias.to(out.dtype)


class Int8DynamicFormat:
    """Per-token int8 x (scale amax/127 per row, fp32) times per-channel int8 W, accumulated exactly in int32,
    then * sx * sw in fp32, rounded once to x.dtype, + bias.

    The int32 GEMM: for weights of at least `onednn_min_elements` where torch has oneDNN and its u8 x s8 GEMM
    gives exact sums (`int8_mm.prepacked_exact()`: with VNNI), that GEMM on the weight in oneDNN's prepacked
    layout (x as q + 128 with zero point 128: the same int32 sums, returned as their fp32 values); at 4096x4096
    it is 1.2x (M = 256) to 3-5x (M = 2-16) faster than `torch._int_mm`, which repacks the weight on every
    call, and 0.65x at M = 1. Otherwise `int8_mm.int32_mm`: `torch._int_mm` where it is exact, else its
    exact sign-split form (AVX2 CPUs), faster on small weights (oneDNN's call costs ~25 us more). Either way
    the bits are those of the formula above.
    """

    #: the least N * K held prepacked for oneDNN (measured: 1024x1024 ties at M >= 16 and loses at M = 1)
    onednn_min_elements = 1 << 21

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale = rowwise_int8(w)
        return {"data": q, "scale": scale}

    def part_specs(self, shape: tuple[int, int]) -> PartSpecs:
        n, k = shape
        return {"data": ((n, k), (torch.int8,)), "scale": ((n,), (torch.float32,))}

    def check_values(self, parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> None:
        """The row scales are finite and > 0 (amax/127, at least fp32's smallest normal); at load."""
        check_scales(parts["scale"], "scale")

    def prepare(self, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The parts the weight holds: "data" in oneDNN's prepacked layout (an opaque [K, N] tensor) where
        torch has oneDNN and it gives exact sums, else as saved. `plain` undoes it."""
        data = parts["data"]
        if type(data) is not torch.Tensor or data.is_mkldnn or data.numel() < self.onednn_min_elements \
                or not onednn_available() or not int8_mm.prepacked_exact():
            return parts  # already prepacked, small, not a plain tensor (a FakeTensor while tracing), or not exact
        return {**parts, "data": int8_mm.prepack(data)}

    def plain(self, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The parts as saved ("data" int8 [N, K])."""
        data = parts["data"]
        return {**parts, "data": data.to_dense().t().contiguous()} if data.is_mkldnn else parts

    def dequantize(self, parts: dict[str, torch.Tensor], shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        parts = self.plain(parts)
        return (parts["data"].float() * parts["scale"].unsqueeze(1)).to(dtype)

    def linear(self, x: torch.Tensor, parts: dict[str, torch.Tensor], shape: tuple[int, int],
               bias: torch.Tensor | None) -> torch.Tensor:
        data, sw = parts["data"], parts["scale"]
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


class Int4Format:
    """Groupwise asymmetric int4, two codes a byte along K.

    Per group of g along K: scale = (max - min)/15 (at least bf16's smallest normal), zero = min + 8 * scale,
    both rounded to bf16; q = clamp(round((w - zero)/scale) + 8, 0, 15) with the stored values; the value is
    (q - 8) * scale + zero in fp32. Parts: "data" uint8 [N16, K/2], byte [n, i] = q[n, 2i] | q[n, 2i+1] << 4
    (the low nibble first, as engine's packed E2M1), and "scale_and_zero" bf16 [Kg/g, N16, 2]. N is padded to
    N16, a multiple of 16 (padded rows are zero and cut from the output); K to Kg, a multiple of g, with zero
    columns (the last group's scale and zero see them; x gets zero columns at run time, so they add nothing,
    and dequantize cuts them).
    """

    N_UNIT = 16
    #: the largest M the C++ kernel runs, for bf16 x (its vdpbf16ps path) and for the other dtypes (fp32
    #: FMAs); bigger M: the fp32 formula in torch ops (dequantize, fp32 matmul), faster there
    native_max_m_bf16 = 256
    native_max_m = 64

    def __init__(self, config: Int4WeightOnly) -> None:
        self.group_size = config.group_size

    def padded_n(self, n: int) -> int:
        return -(-n // self.N_UNIT) * self.N_UNIT

    def padded_k(self, k: int) -> int:
        return -(-k // self.group_size) * self.group_size

    def codes_and_params(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q uint8 [N, K] in [0, 15], scale bf16 [N, K/g], zero bf16 [N, K/g])."""
        n, k = w.shape
        g = w.float().reshape(n, k // self.group_size, self.group_size)
        lo, hi = g.amin(dim=2), g.amax(dim=2)
        scale = ((hi - lo) / 15.0).clamp_min(FP32_TINY).to(torch.bfloat16)
        zero = (lo + 8.0 * scale.float()).to(torch.bfloat16)
        q = torch.round((g - zero.float().unsqueeze(2)) / scale.float().unsqueeze(2)) + 8.0
        return q.clamp_(0.0, 15.0).to(torch.uint8).reshape(n, k), scale, zero

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale, zero = self.codes_and_params(torch.nn.functional.pad(w, (0, self.padded_k(w.shape[1]) - w.shape[1])))
        n, pad = w.shape[0], self.padded_n(w.shape[0]) - w.shape[0]
        if pad:
            q = torch.cat([q, q.new_full((pad, q.shape[1]), 8)])  # (8 - 8) * 1 + 0 = 0
            scale = torch.cat([scale, scale.new_ones((pad, scale.shape[1]))])
            zero = torch.cat([zero, zero.new_zeros((pad, zero.shape[1]))])
        return {"data": pack_int4(q), "scale_and_zero": torch.stack([scale.t(), zero.t()], dim=2).contiguous()}

    def part_specs(self, shape: tuple[int, int]) -> PartSpecs:
        n, k = shape[0], self.padded_k(shape[1])
        npad = self.padded_n(n)
        return {"data": ((npad, k // 2), (torch.uint8,)),
                "scale_and_zero": ((k // self.group_size, npad, 2), (torch.bfloat16,))}

    def check_values(self, parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> None:
        """Each group's scale is finite and > 0 (at least bf16's smallest normal), its zero finite; at load."""
        sz = parts["scale_and_zero"]
        check_scales(sz[..., 0], "scale_and_zero", "scales ([..., 0])")
        check_scales(sz[..., 1], "scale_and_zero", "zeros ([..., 1])", positive=False)

    def dequantize(self, parts: dict[str, torch.Tensor], shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        n, k = shape
        sz = parts["scale_and_zero"]
        q = unpack_int4(parts["data"][:n]).float()
        scale = sz[:, :n, 0].float().t().repeat_interleave(self.group_size, dim=1)
        zero = sz[:, :n, 1].float().t().repeat_interleave(self.group_size, dim=1)
        return ((q - 8.0) * scale + zero)[:, :k].to(dtype)

    def linear(self, x: torch.Tensor, parts: dict[str, torch.Tensor], shape: tuple[int, int],
               bias: torch.Tensor | None) -> torch.Tensor:
        limit = self.native_max_m_bf16 if x.dtype == torch.bfloat16 else self.native_max_m
        if x.shape[1] % self.group_size:  # the weight's zero columns
            x = torch.nn.functional.pad(x, (0, self.padded_k(x.shape[1]) - x.shape[1]))
            shape = (shape[0], x.shape[1])
        if x.shape[0] <= limit and native.available():
            out = native.int4_linear(x, parts["data"], parts["scale_and_zero"], self.group_size, shape[0])
        else:
            out = (x.float() @ self.dequantize(parts, shape, torch.float32).t()).to(x.dtype)
        return out if bias is None else out + bias.to(out.dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes [R, K] (K even, values in [0, 15]) -> uint8 [R, K/2], q[:, 2i] in the low nibble of byte i."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [R, K/2] -> codes uint8 [R, K] (`pack_int4` undone)."""
    return torch.stack([packed & 15, packed >> 4], dim=2).reshape(packed.shape[0], 2 * packed.shape[1])
