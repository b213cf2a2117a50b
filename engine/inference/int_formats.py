"""Integer weight formats: int8 per channel (weight-only and with dynamic int8 activations), int4 groupwise.

Each format turns a 2D weight [N, K] into named plain tensors ("parts"; "data" is the main one),
knows the parts' shapes and dtypes (for checking a checkpoint), dequantizes, and runs
y[M, N] = x[M, K] @ W^T (+ bias) on the parts. Rounding is round-half-to-even everywhere
(`torch.round`).
"""

from __future__ import annotations

import torch

from engine.inference.configs import Int4WeightOnly

PartSpecs = dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]]
INT8_MAX = 127.0
FP32_TINY = torch.finfo(torch.float32).tiny
#: `_weight_int8pack_mm` reads K in blocks of 16 (other K crash it in torch 2.13)
PACK_MM_K = 16


def rowwise_int8(w: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [R, C], scale [R] in scale_dtype): scale = amax/127 per row (at least fp32's smallest normal, so
    an all-zero row gets a tiny scale, not 0), rounded to scale_dtype; q = round(w / scale) clamped to
    [-127, 127], with the stored (rounded) scale."""
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    scale = (amax / INT8_MAX).clamp_min(FP32_TINY).to(scale_dtype)
    q = torch.round(wf / scale.float().unsqueeze(1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


class Int8WeightOnlyFormat:
    """y = round_to(x.dtype)((x @ q^T)_fp32 * scale) + bias. With x in the scale's dtype (or fp32) and K a
    multiple of 16 this is torch's `_weight_int8pack_mm` (the same math up to the order of fp32 additions;
    other K crash that kernel: they run the formula as written)."""

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale = rowwise_int8(w, torch.bfloat16 if w.dtype == torch.bfloat16 else torch.float32)
        return {"data": q, "scale": scale}

    def part_specs(self, shape: tuple[int, int]) -> PartSpecs:
        n, k = shape
        return {"data": ((n, k), (torch.int8,)), "scale": ((n,), (torch.bfloat16, torch.float32))}

    def dequantize(self, parts: dict[str, torch.Tensor], shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        return (parts["data"].float() * parts["scale"].float().unsqueeze(1)).to(dtype)

    def linear(self, x: torch.Tensor, parts: dict[str, torch.Tensor], shape: tuple[int, int],
               bias: torch.Tensor | None) -> torch.Tensor:
        q, scale = parts["data"], parts["scale"]
        if (x.dtype == scale.dtype or x.dtype == torch.float32) and q.shape[1] % PACK_MM_K == 0:  # scale exact in x.dtype
            out = torch.ops.aten._weight_int8pack_mm(x.contiguous(), q, scale.to(x.dtype))
        else:
            out = ((x.float() @ q.float().t()) * scale.float()).to(x.dtype)
        return out if bias is None else out + bias.to(out.dtype)


class Int8DynamicFormat:
    """Per-token int8 x (scale amax/127 per row, fp32) times per-channel int8 W, accumulated exactly in int32
    (`torch._int_mm`, the same values as `out_dtype(aten.mm, int32, ...)`), then * sx * sw in fp32, rounded
    once to x.dtype, + bias."""

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale = rowwise_int8(w)
        return {"data": q, "scale": scale}

    def part_specs(self, shape: tuple[int, int]) -> PartSpecs:
        n, k = shape
        return {"data": ((n, k), (torch.int8,)), "scale": ((n,), (torch.float32,))}

    def dequantize(self, parts: dict[str, torch.Tensor], shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        return (parts["data"].float() * parts["scale"].unsqueeze(1)).to(dtype)

    def linear(self, x: torch.Tensor, parts: dict[str, torch.Tensor], shape: tuple[int, int],
               bias: torch.Tensor | None) -> torch.Tensor:
        xq, sx = rowwise_int8(x)
        acc = int32_mm(xq, parts["data"])
        out = (acc.float() * sx.unsqueeze(1) * parts["scale"].unsqueeze(0)).to(x.dtype)
        return out if bias is None else out + bias.to(out.dtype)


def int32_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a[M, K] @ b[N, K]^T for int8 operands, accumulated in int32 (exact for K < 2^17)."""
    return torch._int_mm(a, b.t())


class Int4Format:
    """Groupwise asymmetric int4 in torch's packed CPU layout (`_convert_weight_to_int4pack_for_cpu`).

    Per group of g along K: scale = (max - min)/15 (at least bf16's smallest normal), zero = min + 8 * scale,
    both rounded to bf16; q = clamp(round((w - zero)/scale) + 8, 0, 15) with the stored values; the value is
    (q - 8) * scale + zero in fp32 (what `_weight_int4pack_mm_for_cpu` computes, checked in the tests).
    N is padded to a multiple of 16 (the kernel's unit; padded rows are zero and cut from the output);
    K must be a multiple of g.
    """

    N_UNIT = 16

    def __init__(self, config: Int4WeightOnly) -> None:
        self.group_size = config.group_size

    def padded_n(self, n: int) -> int:
        return -(-n // self.N_UNIT) * self.N_UNIT

    def check_shape(self, shape: tuple[int, int], name: str) -> None:
        if shape[1] % self.group_size:
            raise ValueError(f"group_size: {self.group_size} does not divide {name}'s in_features {shape[1]} "
                             f"(weight shape {tuple(shape)}); {_divisors(shape[1])}leave this layer out with module_filter")

    def codes_and_params(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q int32 [N, K] in [0, 15], scale bf16 [N, K/g], zero bf16 [N, K/g])."""
        n, k = w.shape
        g = w.float().reshape(n, k // self.group_size, self.group_size)
        lo, hi = g.amin(dim=2), g.amax(dim=2)
        scale = ((hi - lo) / 15.0).clamp_min(FP32_TINY).to(torch.bfloat16)
        zero = (lo + 8.0 * scale.float()).to(torch.bfloat16)
        q = torch.round((g - zero.float().unsqueeze(2)) / scale.float().unsqueeze(2)) + 8.0
        return q.clamp_(0.0, 15.0).to(torch.int32).reshape(n, k), scale, zero

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        self.check_shape(tuple(w.shape), "weight")
        q, scale, zero = self.codes_and_params(w)
        n, pad = w.shape[0], self.padded_n(w.shape[0]) - w.shape[0]
        if pad:
            q = torch.cat([q, q.new_full((pad, q.shape[1]), 8)])  # (8 - 8) * 1 + 0 = 0
            scale = torch.cat([scale, scale.new_ones((pad, scale.shape[1]))])
            zero = torch.cat([zero, zero.new_zeros((pad, zero.shape[1]))])
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        return {"data": packed, "scale_and_zero": torch.stack([scale.t(), zero.t()], dim=2).contiguous()}

    def part_specs(self, shape: tuple[int, int]) -> PartSpecs:
        n, k = shape
        npad = self.padded_n(n)
        return {"data": ((npad, k // 2), (torch.uint8,)),
                "scale_and_zero": ((k // self.group_size, npad, 2), (torch.bfloat16,))}

    def codes(self, packed: torch.Tensor, npad: int, k: int) -> torch.Tensor:
        """q int32 [npad, K] back from the packed layout: the packing is a fixed permutation of nibbles, found by
        packing the digits (base 16) of each element's own index."""
        index = torch.arange(npad * k, dtype=torch.int64)
        source = torch.zeros(npad * k, dtype=torch.int64)
        digits = max(1, -(-(npad * k - 1).bit_length() // 4))
        for d in range(digits):
            digit = ((index >> (4 * d)) & 15).to(torch.int32).reshape(npad, k)
            source |= _nibbles(torch.ops.aten._convert_weight_to_int4pack_for_cpu(digit, 2)).long() << (4 * d)
        q = torch.empty(npad * k, dtype=torch.int32)
        q[source] = _nibbles(packed)
        return q.reshape(npad, k)

    def dequantize(self, parts: dict[str, torch.Tensor], shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        n, k = shape
        sz = parts["scale_and_zero"]
        q = self.codes(parts["data"], sz.shape[1], k)[:n].float()
        scale = sz[:, :n, 0].float().t().repeat_interleave(self.group_size, dim=1)
        zero = sz[:, :n, 1].float().t().repeat_interleave(self.group_size, dim=1)
        return ((q - 8.0) * scale + zero).to(dtype)

    def linear(self, x: torch.Tensor, parts: dict[str, torch.Tensor], shape: tuple[int, int],
               bias: torch.Tensor | None) -> torch.Tensor:
        xc = x if x.dtype in (torch.bfloat16, torch.float32) else x.float()
        sz = parts["scale_and_zero"]
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(xc.contiguous(), parts["data"], self.group_size,
                                                         sz if xc.dtype == torch.bfloat16 else sz.float())
        out = out[:, : shape[0]].to(x.dtype)
        return out if bias is None else out + bias.to(out.dtype)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Each byte's low then high nibble, flattened."""
    flat = packed.reshape(-1)
    return torch.stack([flat & 15, flat >> 4], dim=1).reshape(-1).to(torch.int32)


def _divisors(k: int) -> str:
    from engine.inference.configs import INT4_GROUP_SIZES

    fits = [g for g in INT4_GROUP_SIZES if k % g == 0]
    return f"choose a group_size of {fits} or " if fits else ""
