"""MXFP8, MXFP4 and NVFP4 GEMMs on NVIDIA GPUs through torch's block-scaled `torch._scaled_mm` (cuBLASLt).

Which pairs: both operands MX with E8M0 scales per 1x32 along K and FP8 elements (not E5M2 x E5M2, which
cuBLASLt rejects), both MX E2M1, or both NVFP4. They take this path when the installed torch has the
dtypes (`float8_e8m0fnu`, `float4_e2m1fn_x2`) and the device is compute capability 10.x (B200 / B300:
torch's MX and NVFP4 GEMMs are for those); otherwise the CPU emulation (`engine.gemm.cpu`, exact bf16
decode and one GEMM) runs, with a one-time warning. MX E2M3 / E3M2 (FP6) and mixed element pairs have
no cuBLAS kernel: emulated.

The call (legacy `torch._scaled_mm`, which infers the recipe from the dtypes and scale sizes):
* A row-major `[M, K]`, B column-major (`b.t()` of a K-major `[N, K]`); FP4 data packed two per byte
  along K, viewed as `float4_e2m1fn_x2`. K is zero-padded to a multiple of 32 and N to one of 16
  (torch's checks: K bytes and both dims of B multiples of 16; MX blocks are 32 wide). Zero elements
  add nothing whatever their block's scale.
* Scales in the 128x4 blocked layout (`engine.gemm.swizzle`), as `float8_e8m0fnu` / `float8_e4m3fn`.
* fp32 output; NVFP4's per-tensor factor amax_a * amax_b / 2688^2 is applied to it as frexp mantissas
  and a power of two (`scales.times_nvfp4_factor`: no underflow for tiny amaxes), then the bias, then
  one rounding to out_dtype, as the emulation does. cuBLAS accumulates in fp32 in its own order: the
  result equals the emulation's within fp32 reassociation (K * 2^-24 * sum|a*b|).

Written for GPU users; verified on the CPU with `torch._scaled_mm` replaced by an independent fp64
emulator (tests/test_block_scaled_gemm.py), not on a GPU.
"""

from __future__ import annotations

import functools
import warnings

import torch

from engine.gemm import cpu
from engine.gemm.cuda import padded
from engine.gemm.operand import GemmOperand
from engine.gemm.scales import times_nvfp4_factor
from engine.gemm.swizzle import to_blocked
from engine.schemes import MX_BLOCK, ScaleEncoding

#: K is padded to a multiple of this (32 elements: MX's block, and 16 bytes of packed FP4)
K_MULTIPLE = 32
#: N (B's rows) is padded to a multiple of this (torch's check on both dims of B)
N_MULTIPLE = 16
#: compute capability major of the GPUs torch runs MX / NVFP4 GEMMs on (B200 = 10.0, B300 = 10.3)
BLOCK_SCALED_MAJOR = 10


def torch_has_block_scaled() -> bool:
    """The installed torch has the dtypes block-scaled `_scaled_mm` takes."""
    return hasattr(torch, "float8_e8m0fnu") and hasattr(torch, "float4_e2m1fn_x2") and hasattr(torch, "_scaled_mm")


def device_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device; (0, 0) for any other device."""
    if device.type != "cuda":
        return (0, 0)
    return torch.cuda.get_device_capability(device)


def unsupported_reason(device: torch.device) -> str | None:
    """Why block-scaled `_scaled_mm` cannot run on `device` (None: it can)."""
    if not torch_has_block_scaled():
        return f"torch {torch.__version__} has no float8_e8m0fnu / float4_e2m1fn_x2"
    major, minor = device_capability(device)
    if major != BLOCK_SCALED_MAJOR:
        return f"the device is compute capability {major}.{minor}, block-scaled GEMMs need {BLOCK_SCALED_MAJOR}.x"
    return None


def mx_kind(a: GemmOperand, b: GemmOperand) -> str | None:
    """"mxfp8" or "mxfp4" when the pair has a cuBLAS MX kernel, else None (FP6, mixed elements, other tiles)."""
    for t in (a, b):
        if t.per_tensor or t.encoding is not ScaleEncoding.E8M0 or t.tile != (1, MX_BLOCK):
            return None
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    if a.data.dtype in fp8 and b.data.dtype in fp8:
        return None if a.data.dtype == b.data.dtype == torch.float8_e5m2 else "mxfp8"
    if a.stored_codes is not None and b.stored_codes is not None:
        return "mxfp4"
    return None


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _operands(a: GemmOperand, b: GemmOperand, fp4: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [M, K'] row-major, B [K', N'] column-major) zero-padded as `_scaled_mm` wants (module doc)."""
    k, n = _round_up(a.k, K_MULTIPLE), _round_up(b.rows, N_MULTIPLE)
    if not fp4:
        return padded(a.data, a.rows, k), padded(b.data, n, k).t()
    lhs, rhs = padded(a.codes, a.rows, k // 2), padded(b.codes, n, k // 2)
    return lhs.view(torch.float4_e2m1fn_x2), rhs.view(torch.float4_e2m1fn_x2).t()


def _scales(t: GemmOperand, dtype: torch.dtype) -> torch.Tensor:
    """The operand's per-row block scales (uint8 E8M0 codes or E4M3) in the blocked layout, as `dtype`."""
    return to_blocked(t.scale_inv.view(torch.uint8)).view(dtype)


def _finish(y: torch.Tensor, n: int, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    out = y[:, :n]
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def mx_gemm(a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """MXFP8 x MXFP8 or MXFP4 x MXFP4 through block-scaled `torch._scaled_mm` (the pair must pass `mx_kind`)."""
    kind = mx_kind(a, b)
    if kind is None:
        raise TypeError(f"mx_gemm: expected an MXFP8 or MXFP4 pair, got {a.kind} ({a.data.dtype}) and "
                        f"{b.kind} ({b.data.dtype}) operands")
    lhs, rhs = _operands(a, b, fp4=kind == "mxfp4")
    e8m0 = torch.float8_e8m0fnu
    y = torch._scaled_mm(lhs, rhs, _scales(a, e8m0), _scales(b, e8m0), out_dtype=torch.float32)
    return _finish(y, b.rows, out_dtype, bias)


def nvfp4_gemm(a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """NVFP4 x NVFP4 through block-scaled `torch._scaled_mm`, then the per-tensor factor on the fp32 result."""
    if a.kind != "nvfp4" or b.kind != "nvfp4" or a.stored_codes is None or b.stored_codes is None:
        raise TypeError(f"nvfp4_gemm: expected two NVFP4 operands, got {a.kind} and {b.kind}")
    lhs, rhs = _operands(a, b, fp4=True)
    e4m3 = torch.float8_e4m3fn
    y = torch._scaled_mm(lhs, rhs, _scales(a, e4m3), _scales(b, e4m3), out_dtype=torch.float32)
    return _finish(times_nvfp4_factor(y, a, b), b.rows, out_dtype, bias)


@functools.lru_cache(maxsize=None)
def _warn_emulation_once(pair: str, device_type: str, reason: str) -> None:
    """One warning per (pair, device type, reason): the GEMM runs through the CPU emulation on the device."""
    warnings.warn(f"general_gemm: {pair} GEMMs on {device_type} run through the emulation path ({reason}; slow)",
                  RuntimeWarning, stacklevel=4)


def pow2_tiles(a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """Power-of-2 tile pairs on CUDA: MXFP8 / MXFP4 pairs on `mx_gemm` where it runs, the rest emulated."""
    kind = mx_kind(a, b)
    reason = "no cuBLAS kernel for this pair" if kind is None else unsupported_reason(a.data.device)
    if reason is None:
        return mx_gemm(a, b, out_dtype, bias)
    _warn_emulation_once(kind or "pow2 x pow2", a.data.device.type, reason)
    return cpu.pow2_tiles(a, b, out_dtype, bias)


def nvfp4(a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """NVFP4 pairs on CUDA: `nvfp4_gemm` where it runs, else the emulation."""
    reason = unsupported_reason(a.data.device)
    if reason is None:
        return nvfp4_gemm(a, b, out_dtype, bias)
    _warn_emulation_once("nvfp4", a.data.device.type, reason)
    return cpu.nvfp4(a, b, out_dtype, bias)
