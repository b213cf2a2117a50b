"""Compressed optimizer states: each step's update stays within a per-element bound of the fp32 update from the
same prior states, the bound derived from the state format alone (docs/optim.md#the-bound); and where it breaks:
tiny second moments stored as plain v in E4M3 flush to 0, and their update becomes lr * m / eps.

The bound. A step makes m = b1*m0 + (1-b1)*g and v = b2*v0 + (1-b2)*g^2 (fp32 from the stored m0, v0), stores
them, and updates with the stored values: u = lr/bc1 * mq / (sq/sqrt(bc2) + eps). The format rounds an element
x of a block by at most E(x): half the gap between the two codes around x/absmax times absmax (int8), half an
E4M3 / E5M2 ulp at |x * scale| divided by the scale, scale = max / block amax (FP8), 2^-8 |x| (bf16), 2^-7 |x|
(bf16, stochastic). So |mq - m| <= E(m), and sq (sqrt(v) stored, or sqrt of stored v) lies in an interval of
the same kind; u lies between the extremes of the quotient over that box, which bounds |u - u_fp32| per element
(plus a few fp32 roundings).
"""

from __future__ import annotations

import math

import pytest
import torch

from engine import optim
from engine.optim import dynamic_map, formats
from engine.optim.formats import StateFormat

FORMATS = [n for n in formats.NAMES if n != "fp32"] + ["fp8:block1d_e4m3:plain_v", "int8:plain_v"]
FP8_BITS = {torch.float8_e4m3fn: (3, -6, 448.0), torch.float8_e5m2: (2, -14, 57344.0)}  # mantissa, min exp, max


def _block_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    flat = x.double().reshape(-1)
    pad = (-flat.numel()) % block
    blocks = torch.nn.functional.pad(flat, (0, pad)).reshape(-1, block)
    return blocks.abs().amax(dim=1).repeat_interleave(block)[: flat.numel()].reshape(x.shape)


def rounding_bound(fmt: StateFormat, x: torch.Tensor, signed: bool) -> torch.Tensor:
    """Per element, the most the format's rounding moves x (float64), from the format's definition."""
    x = x.double()
    if fmt.kind == "bf16":
        return x.abs() * (2.0 ** -7 if fmt.stochastic else 2.0 ** -8)  # an ulp or half an ulp of 8 significant bits
    amax = _block_amax(x, fmt.block)
    if fmt.kind == "int8":
        codes = (dynamic_map.signed_codes() if signed else dynamic_map.unsigned_codes()).double()
        n = torch.where(amax > 0, x / amax, 0.0).clamp(codes[0].item(), codes[-1].item())
        hi = torch.searchsorted(codes, n).clamp(1, len(codes) - 1)
        gap = codes[hi] - codes[hi - 1]
        return gap / 2 * amax * (1 + 2 ** -20) + x.abs() * 2 ** -22
    element = fmt.fp8_scheme.element
    mant, emin, fmax = FP8_BITS[element]
    if fmt.scheme.startswith("mx"):  # E8M0: 2^(floor(log2 amax) - emax of the element), as rceil does at most
        scale = 2.0 ** (math.floor(math.log2(fmax)) - torch.floor(torch.log2(amax.clamp_min(1e-300))))
        scale = scale / 2  # rceil may pick the next power down
    else:
        scale = torch.where(amax > 0, fmax / amax, 1.0)
    y = (x * scale).abs()
    exp = torch.floor(torch.log2(y.clamp_min(2.0 ** emin)))
    half_ulp = 2.0 ** (exp - mant - 1)
    return half_ulp / scale * (1 + 2 ** -20) + x.abs() * 2 ** -21


def adam_update_bound(fmt: StateFormat, m: torch.Tensor, v: torch.Tensor, c: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(u_fp32, bound on |u - u_fp32|) per element, in float64."""
    em = rounding_bound(fmt, m, signed=True)
    s = v.sqrt()
    if fmt.stores_sqrt(True):
        es = rounding_bound(fmt, s, signed=False)
        s_lo, s_hi = (s - es).clamp_min(0), s + es
    else:
        ev = rounding_bound(fmt, v, signed=False)
        s_lo, s_hi = (v - ev).clamp_min(0).sqrt(), (v + ev).sqrt()
    denom = s * c["inv_bc2_sqrt"] + c["eps"]
    u = c["step_size"] * m / denom
    corners = [c["step_size"] * (m + dm) / (sv * c["inv_bc2_sqrt"] + c["eps"])
               for dm in (-em, em) for sv in (s_lo, s_hi)]
    dev = torch.stack([(k - u).abs() for k in corners]).amax(dim=0)
    return u, dev


def grads(shape, generator) -> torch.Tensor:
    """Gradients over 5 decades of magnitude, so every block holds large and small values."""
    mag = 10.0 ** (-5 * torch.rand(shape, generator=generator))
    return torch.randn(shape, generator=generator) * mag


@pytest.mark.parametrize("name", FORMATS)
def test_adamw_step_within_the_format_bound(name):
    fmt = formats.parse(name)
    p = torch.randn(3, 300, generator=torch.Generator().manual_seed(0)).requires_grad_()
    opt = optim.AdamW([p], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, state_dtype=fmt)
    gen = torch.Generator().manual_seed(1)
    group = opt.param_groups[0]
    for step in range(1, 21):
        p.grad = grads(p.shape, gen)
        state = opt.state[p]
        if state:
            m0, v0 = opt.load(state, group, "exp_avg").double(), opt.load(state, group, "exp_avg_sq").double()
        else:
            m0 = v0 = torch.zeros(p.shape, dtype=torch.float64)
        w0 = p.detach().clone()
        opt.step()
        c = opt.scalars(group, float(step))
        g = p.grad.double()
        m = m0 * c["beta1"] + g * c["one_minus_beta1"]
        v = v0 * c["beta2"] + g * g * c["one_minus_beta2"]
        u, dev = adam_update_bound(fmt, m, v, c)
        decayed = (w0 * c["decay"]).double()
        got = decayed - p.detach().double()  # the update as applied
        slack = u.abs() * 2 ** -20 + decayed.abs() * 2 ** -23  # fp32 roundings of the quotient and the subtraction
        assert ((got - u).abs() <= dev + slack).all(), (name, step, ((got - u).abs() - dev - slack).max())
        assert (dev > 0).any() or fmt.kind == "fp32"


@pytest.mark.parametrize("name", [n for n in FORMATS if "plain_v" not in n])
def test_sgd_momentum_within_the_format_bound(name):
    fmt = formats.parse(name)
    p = torch.randn(3, 200, generator=torch.Generator().manual_seed(0)).requires_grad_()
    opt = optim.SGD([p], lr=1e-2, momentum=0.9, nesterov=True, state_dtype=fmt)
    gen = torch.Generator().manual_seed(2)
    for step in range(20):
        p.grad = grads(p.shape, gen)
        state = opt.state[p]
        g = p.grad.double()
        b0 = opt.load(state, opt.param_groups[0], "momentum_buffer").double() if "momentum_buffer" in state else None
        w0 = p.detach().double()
        opt.step()
        b = g if b0 is None else b0 * 0.9 + g
        u = 1e-2 * (g + 0.9 * b)
        dev = 1e-2 * 0.9 * rounding_bound(fmt, b, signed=True)
        got = w0 - p.detach().double()
        assert ((got - u).abs() <= dev + u.abs() * 2 ** -20 + w0.abs() * 2 ** -23).all(), (name, step)


def test_where_the_bound_breaks_tiny_second_moments_in_plain_e4m3():
    """A block whose gradients span 10^4 in magnitude has second moments spanning 10^8: plain v in E4M3 (about
    2^17.8 between its max and its least subnormal) flushes the small ones to 0, so their update is
    lr * m / eps, thousands of times the fp32 update; stored as sqrt(v) (10^4 apart) E4M3 keeps them within
    its relative bound (an E4M3 half ulp, 2^-4, on m and on sqrt(v))."""
    g = torch.full((1, 128), 1e-4)
    g[0, 0] = 1.0
    errors = {}
    for name in ("fp8:block1d_e4m3:plain_v", "fp8"):
        p = torch.zeros(1, 128, requires_grad=True)
        fp32 = torch.zeros(1, 128, requires_grad=True)
        opt = optim.Adam([p], lr=1e-3, state_dtype=name)
        ref = optim.Adam([fp32], lr=1e-3)
        p.grad, fp32.grad = g.clone(), g.clone()
        opt.step(), ref.step()
        errors[name] = ((p - fp32).abs() / fp32.abs()).detach()
    assert errors["fp8"].max() <= 2 * 2 ** -4 + 2 ** -20
    assert errors["fp8:block1d_e4m3:plain_v"][0, 1:].min() > 1000  # lr * m / eps against lr * m / sqrt(v)
    assert errors["fp8:block1d_e4m3:plain_v"][0, 0] <= 2 * 2 ** -4  # the block's largest element is fine


@pytest.mark.parametrize("name", ["fp8", "fp8_e5m2", "fp8_mx", "int8"])
def test_decode_is_codes_times_block_scales(name):
    """The reference decode against brute force: each element's code value times its block's scale."""
    fmt = formats.NAMES[name]
    x = grads((3, 100), torch.Generator().manual_seed(5)).float()
    data, scale = formats.encode(fmt, x, signed=True)
    flat = data.reshape(-1)
    want = torch.empty(flat.numel())
    for i in range(flat.numel()):
        b = i // fmt.block
        if fmt.kind == "int8":
            want[i] = dynamic_map.signed_codes()[int(flat[i])] * scale[b]
        elif fmt.scheme.startswith("mx"):
            want[i] = flat[i].float() * 2.0 ** (int(scale[b]) - 127)
        else:
            want[i] = flat[i].float() * scale[b]
    assert torch.equal(formats.decode(fmt, data, scale, signed=True).reshape(-1), want)
    assert (rounding_bound(fmt, x, True) >= (want.reshape(x.shape) - x).abs()).all()
