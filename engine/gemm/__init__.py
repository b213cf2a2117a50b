"""general_gemm: out = op(A) @ op(B)^T on quantized (or high-precision) operands, fp32 accumulation.

`op(t)` is the 2D value of t (its rowwise data) or, with `*_transposed=True`, its
transpose (its columnwise data). The three GEMMs of a linear layer are then:

    fprop  y  = x  @ W^T   general_gemm(x, W)
    dgrad  dx = dy @ W     general_gemm(dy, W, b_transposed=True)
    wgrad  dW = dy^T @ x   general_gemm(dy, x, a_transposed=True, b_transposed=True)

Each operand asks its storage for what op reads (`gemm_operand`); the implementation comes
from `PAIRINGS`, keyed by the two operands' kinds - known from their schemes - and the
device (on CUDA: per-tensor FP8 through `torch._scaled_mm`, MXFP8 / MXFP4 / NVFP4 pairs through its
block-scaled form, `block_scaled`). A plain tensor is a legal operand (weight-only and unquantized operands): the
quantized side is dequantized exactly and the GEMM runs in fp32. A pairing without an
entry for CUDA runs the CPU emulation, with a warning.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor

from engine.gemm import block_scaled, cpu, cuda, mixed
from engine.gemm.operand import GemmOperand, as_matrix, gemm_operand
from engine.tensors.quantized import QuantizedTensor
from engine.tensors.storage import QuantizedTensorBase

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
Impl = Callable[[GemmOperand, GemmOperand, torch.dtype, "torch.Tensor | None"], torch.Tensor]

#: (kind of A, kind of B, device type) -> implementation; kinds: "tensor" (one scale each),
#: "pow2" (power-of-2 tile scales: block scaling's default, MXFP8's E8M0), "block" (fp32 tiles), "nvfp4"
#: (E4M3 scales per 16 and a per-tensor amax)
PAIRINGS: dict[tuple[str, str, str], Impl] = {
    ("tensor", "tensor", "cpu"): cpu.per_tensor,
    ("tensor", "tensor", "cuda"): cuda.scaled_mm,
    ("pow2", "pow2", "cpu"): cpu.pow2_tiles,
    ("pow2", "pow2", "cuda"): block_scaled.pow2_tiles,  # MXFP8 / MXFP4 on block-scaled _scaled_mm, else emulated
    ("block", "block", "cpu"): cpu.fp32_tiles,
    ("pow2", "block", "cpu"): cpu.fp32_tiles,
    ("block", "pow2", "cpu"): cpu.fp32_tiles,
    **{pair: mixed.tensor_by_tiles for tiles in ("pow2", "block")
       for pair in (("tensor", tiles, "cpu"), (tiles, "tensor", "cpu"))},
    ("nvfp4", "nvfp4", "cpu"): cpu.nvfp4,
    ("nvfp4", "nvfp4", "cuda"): block_scaled.nvfp4,
}

Operand = QuantizedTensor | QuantizedTensorBase | torch.Tensor


def pairing(a: GemmOperand, b: GemmOperand) -> Impl:
    """The implementation for this pair on its device (the CPU emulation where the device has none)."""
    device = a.data.device.type
    impl = PAIRINGS.get(("tensor" if a.per_tensor else a.kind, "tensor" if b.per_tensor else b.kind, device))
    if impl is None:
        impl = PAIRINGS.get((a.kind, b.kind, "cpu"))
        if impl is None:
            raise TypeError(f"general_gemm: cannot pair a {a.kind}-scaled operand with a {b.kind}-scaled one")
        warnings.warn(f"general_gemm: {a.kind} x {b.kind} GEMMs run through the emulation path on {device} (slow)",
                      RuntimeWarning, stacklevel=3)
    return impl


def _check_pair(a: GemmOperand, b: GemmOperand) -> None:
    if a.data.shape[1] != b.data.shape[1]:  # a.k, b.k
        raise ValueError(f"general_gemm: inner dims differ: A is [{a.rows}, {a.k}], B is [{b.rows}, {b.k}]")
    if a.per_tensor or b.per_tensor:
        return
    if a.tile_rows > 1 and b.tile_rows > 1:
        raise ValueError("general_gemm: 2D x 2D block-scaled GEMMs are not supported (one operand must be 1x128)")
    if a.tile_cols != b.tile_cols:
        raise TypeError(f"general_gemm: cannot pair tiles of {a.tile_cols} and {b.tile_cols} along K")


def _high_precision(a: Operand, b: Operand, a_transposed: bool, b_transposed: bool,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """A pairing with a plain operand: the quantized side dequantized exactly to fp32, one fp32 GEMM."""
    lhs, rhs = as_matrix(a, a_transposed, torch.float32, "a"), as_matrix(b, b_transposed, torch.float32, "b")
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"general_gemm: inner dims differ: A is {list(lhs.shape)}, B is {list(rhs.shape)}")
    if bias is not None and tuple(bias.shape) != (rhs.shape[0],):
        raise ValueError(f"bias: expected shape ({rhs.shape[0]},), got {tuple(bias.shape)}")
    result = lhs @ rhs.t()
    return result if bias is None else result + bias.float()


def general_gemm(
    a: Operand,
    b: Operand,
    *,
    a_transposed: bool = False,
    b_transposed: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """out[M, N] = op(a)[M, K] @ op(b)[N, K]^T (+ bias[N]); with `accumulate`, added into `out` (fp32)."""
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype: expected float32, bfloat16 or float16, got {out_dtype}")
    # is_high_precision(a) or is_high_precision(b), without two calls (a bare storage is no torch.Tensor)
    if (isinstance(a, torch.Tensor) and not isinstance(a, QuantizedTensor)) or \
            (isinstance(b, torch.Tensor) and not isinstance(b, QuantizedTensor)):
        result = _high_precision(a, b, a_transposed, b_transposed, bias)
    else:
        lhs = gemm_operand(a, transposed=a_transposed, name="a")
        rhs = gemm_operand(b, transposed=b_transposed, name="b")
        _check_pair(lhs, rhs)
        if bias is not None and tuple(bias.shape) != (rhs.rows,):
            raise ValueError(f"bias: expected shape ({rhs.rows},), got {tuple(bias.shape)}")
        if isinstance(lhs.data, FakeTensor) or isinstance(rhs.data, FakeTensor):  # tracing: only the shape
            result = lhs.data.new_empty((lhs.rows, rhs.rows), dtype=torch.float32 if accumulate else out_dtype)
        else:
            result = pairing(lhs, rhs)(lhs, rhs, torch.float32 if accumulate else out_dtype, bias)
    if accumulate:
        if out is None or out.dtype != torch.float32 or out.shape != result.shape:
            got = None if out is None else f"{out.dtype} {tuple(out.shape)}"
            raise ValueError(f"out: accumulate=True needs an fp32 out of shape {tuple(result.shape)}, got {got}")
        return out.add_(result)
    if result.dtype != out_dtype:
        result = result.to(out_dtype)
    return result if out is None else out.copy_(result)


__all__ = ["PAIRINGS", "GemmOperand", "general_gemm", "gemm_operand", "pairing"]
