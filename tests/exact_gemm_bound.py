"""An independent fp64 reference of the exact CPU GEMM and its error bound (the contract of engine/ops/exact_gemm.py).

The decode is torch's own FP8 -> fp64 conversion times the fp64 tile scale (E8M0 code c: 2^(c - 127), 255: NaN),
rounded once to bf16 (the values are exact in fp32 first: an FP8 value times 2^-127..2^127 stays inside fp32's
range and precision, or overflows it). The GEMM output must then lie within

    |alpha| * (gamma_K * sum_k |a_k b_k| + K * 2^-149)        fp32 accumulation in any order (+ underflow)
    + 2^-24 * (|alpha * sum_k a_k b_k| + |bias|) + 2^-149     the fp32 alpha product and bias add
    + half an ulp of the output dtype                         the final rounding

of the fp64 value alpha * sum_k a_k b_k + bias, with gamma_K = K u / (1 - K u), u = 2^-24. NaN where the fp64 value
is NaN, the same infinity where it is infinite, and an infinity of the right sign allowed where it overflows; where
sum_k |a_k b_k| over the finite products passes fp32's range (a product or a partial sum may overflow), any infinity
or NaN is allowed too.

`flush=True` is the contract of oneDNN's bf16 GEMM (addmm with a bf16 output): subnormal operands read as zero and
results below fp32's normal range may flush, so the decodes lose their subnormals and each 2^-149 above becomes 2^-126.
"""

from __future__ import annotations

import torch

U = 2.0**-24
MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


def decode64(data: torch.Tensor, scale_inv: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """The exact bf16 value of FP8 (or bf16) `data` [rows, K] times its tile scales, as fp64."""
    values = data.to(torch.float64)
    if tile != (0, 0) and data.numel():
        if scale_inv.dtype == torch.uint8:
            codes = scale_inv.to(torch.float64)
            scales = torch.where(codes == 255, torch.nan, torch.exp2(codes - 127))
        else:
            scales = scale_inv.to(torch.float64)
        rows, k = data.shape
        scales = scales.repeat_interleave(tile[0], 0)[:rows].repeat_interleave(tile[1], 1)[:, :k]
        values = values * scales
    return values.to(torch.float32).to(torch.bfloat16).to(torch.float64)


def flushed(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x.abs() < torch.finfo(torch.float32).smallest_normal, 0.0, x)


def half_ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of `dtype` values at magnitude x (fp64), subnormal spacing below the normal range."""
    finfo = torch.finfo(dtype)
    _, e = torch.frexp(x.abs().clamp(min=finfo.smallest_normal))  # x = f * 2^e, f in [0.5, 1)
    return torch.exp2((e - 1 - MANTISSA[dtype]).to(torch.float64)) / 2


def violations(out: torch.Tensor, a64: torch.Tensor, b64: torch.Tensor, alpha: float, bias: torch.Tensor | None,
               out_dtype: torch.dtype, bias_dtype: torch.dtype, tiny: float = 2.0**-149) -> torch.Tensor:
    """Boolean [M, N]: where `out` breaks the contract against the fp64 decodes a64 [M, K], b64 [N, K]."""
    k = a64.shape[1]
    # elementwise products and plain sums, not a BLAS matmul (which may skip zeros: inf * 0 must be NaN)
    rows = max(1, 2**22 // max(1, b64.shape[0] * k))
    products = [a64[i:i + rows, None, :] * b64[None, :, :] for i in range(0, a64.shape[0], rows)]
    exact = torch.cat([p.sum(-1) for p in products]) if products else a64.new_zeros(0, b64.shape[0])
    mags = torch.cat([p.abs().sum(-1) for p in products]) if products else exact
    finite_mags = torch.cat([p.abs().nan_to_num(0.0, 0.0).sum(-1) for p in products]) if products else exact
    fp32_max = torch.finfo(torch.float32).max
    gamma = k * U / (1 - k * U)
    err = abs(alpha) * (gamma * mags + k * tiny)
    want = alpha * exact
    err = err + U * want.abs() + tiny
    if bias is not None:
        b = bias.to(bias_dtype).to(torch.float64)  # rounded to the GEMM dtype, as addmm's bias
        err = err + U * (want.abs() + b.abs()) + tiny
        want = want + b
    err = err + half_ulp(want.abs() + err, out_dtype)
    got = out.to(torch.float64)
    finite = want.isfinite() & ~mags.isnan()
    within = (got - want).abs() <= err
    may_overflow = finite & (want.abs() + err > torch.finfo(out_dtype).max)
    inf_ok = may_overflow & got.isinf() & (got.sign() == want.sign())
    # products or partial sums past fp32's range: an infinity (of either sign, or NaN from inf - inf) may come out
    overflowed = (finite_mags > fp32_max) & ~got.isfinite()
    ok = torch.where(finite, within | inf_ok | overflowed,
                     torch.where(want.isnan(), got.isnan(), (got == want) | overflowed))
    return ~ok


def check(out: torch.Tensor | None, a: torch.Tensor, sa: torch.Tensor, a_tile: tuple[int, int], b: torch.Tensor,
          sb: torch.Tensor, b_tile: tuple[int, int], bias: torch.Tensor | None, out_dtype: torch.dtype,
          flush: bool = False) -> str | None:
    """None when `out` (an exact_gemm result) meets the contract, else what is wrong."""
    if out is None:
        return "no result"
    m, n = a.shape[0], b.shape[0]
    if out.shape != (m, n) or out.dtype != out_dtype:
        return f"shape/dtype {tuple(out.shape)} {out.dtype}, expected {(m, n)} {out_dtype}"
    alpha = 1.0
    if a_tile == (0, 0):
        alpha = float(torch.tensor(sa.double().item() * sb.double().item()).float())
    bias_dtype = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
    a64, b64 = decode64(a, sa, a_tile), decode64(b, sb, b_tile)
    if flush:
        a64, b64 = flushed(a64), flushed(b64)
    bad = violations(out, a64, b64, alpha, bias, out_dtype, bias_dtype, 2.0**-126 if flush else 2.0**-149)
    if bad.any():
        i, j = (int(v) for v in bad.nonzero()[0])
        return f"{int(bad.sum())} outputs outside the fp32 bound, first [{i}, {j}] = {out[i, j].item()}"
    return None
