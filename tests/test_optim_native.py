"""The fused native Adam step (csrc/optim/) gives Adam.reference_step's bits - weights and every state byte, NaN
included - at every instruction-set level this machine runs, for every state format it takes; what it does not
take runs the reference with a warning."""

from __future__ import annotations

import warnings

import pytest
import torch

from engine import optim
from engine.ops import native
from engine.optim import native_step

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels did not build")

KERNEL_FORMATS = ["bf16", "bf16_sr", "fp8", "fp8_e5m2", "int8", "fp8:block1d_e4m3:plain_v", "int8:plain_v",
                  {"exp_avg": "fp32", "exp_avg_sq": "int8"}, {"exp_avg": "fp8_e5m2", "exp_avg_sq": "bf16"},
                  {"exp_avg": "fp32", "exp_avg_sq": "bf16"}, {"exp_avg": "bf16_sr", "exp_avg_sq": "int8"},
                  {"exp_avg": "fp32", "exp_avg_sq": "bf16_sr"}]
ISAS = native.available_isas() if native.available() else []


def gradients(shape, gen: torch.Generator, special: bool) -> torch.Tensor:
    g = torch.randn(shape, generator=gen) * 10.0 ** (-6 * torch.rand(shape, generator=gen))
    if special:
        flat = g.reshape(-1)
        flat[:300] = 0.0  # an all-zero block (scale 1, amax 0)
        flat[301] = 3e38  # overflows v
        flat[400] = 1e-30  # subnormal squares
        flat[-1] = -0.0
        flat[500] = float("nan")
        flat[501] = -float("nan")  # a NaN's sign and payload: every stored NaN is the quiet 0x7FC00000 / 0x7FC0
        flat[502] = torch.tensor(-1, dtype=torch.int32).view(torch.float32)  # 0xFFFFFFFF
    return g


def trajectory(state_dtype, fused: bool, isa: str, *, special: bool, cls=optim.AdamW, grad_dtype=torch.float32,
               **kw) -> list[torch.Tensor]:
    p = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)).to(grad_dtype).requires_grad_()  # partial blocks
    opt = cls([p], lr=1e-2, fused=fused, state_dtype=state_dtype, **kw)
    gen = torch.Generator().manual_seed(1)
    out = []
    with native.use_isa(isa):
        for _ in range(4):
            p.grad = gradients(p.shape, gen, special).to(grad_dtype)
            opt.step()
            state = opt.state[p]
            out += [p.detach().clone()] + [state[k].clone() for k in sorted(state) if k != "step"]
    return out


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("state_dtype", KERNEL_FORMATS, ids=str)
def test_fused_step_is_the_reference(state_dtype, isa):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the kernel runs: no fallback warning
        fused = trajectory(state_dtype, True, isa, special=False)
    assert same_bits(fused, trajectory(state_dtype, False, isa, special=False))


@pytest.mark.parametrize("state_dtype", ["fp8", "int8", "bf16", "bf16_sr"])
def test_fused_step_edge_cases_and_adam_options(state_dtype):
    """Zero blocks, overflowing and subnormal squares, -0.0; Adam's L2 decay with maximize; bf16 weights (an fp32
    master) and gradients."""
    for isa in ISAS:
        kw = dict(special=True, cls=optim.Adam, weight_decay=0.1, maximize=True, grad_dtype=torch.bfloat16)
        assert same_bits(trajectory(state_dtype, True, isa, **kw), trajectory(state_dtype, False, isa, **kw)), isa


@pytest.mark.parametrize("offset", [2**32 - 7, 2**34 - 6, 2**34 - 20, 2**64 - 9, 2**64 - 20])
def test_stochastic_bf16_states_random_bits_across_counter_carries(offset):
    """The kernel's random bytes of bf16_sr states follow engine.ops.nvfp4_sr.random_bits (the reference's) where
    the counter index carries into its high 32 bits, where the hashed word does, and where it wraps at 2^64 (an
    offset near each, a large seed; offsets that are multiples of 4 take the kernel's one-hash-per-4-bytes path, there
    with a carry inside one vector of hashed words, the others its per-byte path), and the counter ends where the reference's does."""
    for isa in ISAS:
        got = []
        for fused in (False, True):
            p = torch.randn(300, generator=torch.Generator().manual_seed(0)).requires_grad_()
            opt = optim.AdamW([p], lr=1e-2, fused=fused, state_dtype="bf16_sr")
            p.grad = torch.randn(300, generator=torch.Generator().manual_seed(1))
            opt.step()  # states made (their counter advanced by the zeros' encode)
            counter = opt.state[p]["state_counter"]
            counter.copy_(torch.tensor([(-1 << 62) + 12345, offset - (1 << 64 if offset >= 1 << 63 else 0)]))
            with native.use_isa(isa), warnings.catch_warnings():
                warnings.simplefilter("error")  # the kernel runs: no fallback warning
                for _ in range(2):
                    p.grad = torch.randn(300, generator=torch.Generator().manual_seed(2))
                    opt.step()
            state = opt.state[p]
            got.append([p.detach().clone()] + [state[k].clone() for k in sorted(state) if k != "step"])
        assert same_bits(*got), isa


def test_what_the_kernel_does_not_take_runs_the_reference_with_a_warning():
    p = torch.randn(300, requires_grad=True)
    opt = optim.AdamW([p], fused=True, state_dtype="fp8_mx")
    assert "1x128" in native_step.why_not(opt, opt.param_groups[0], p, {})
    p.grad = torch.randn(300)
    with pytest.warns(UserWarning, match="reference step"):
        opt.step()


@pytest.mark.parametrize("state_dtype", ["int8", "fp8", "bf16"])
def test_fused_step_on_ties(state_dtype):
    """With beta1 = 0 the first moment is the gradient itself, so gradients placed exactly on the int8 map's
    decision points (times a power of 2), and on halfway points of FP8 and bf16, test the ties' direction."""
    from engine.optim import dynamic_map

    mids = dynamic_map.midpoints(True)
    g = torch.cat([mids * 2.0, torch.tensor([2.0]), -mids * 2.0, torch.tensor([-2.0]),
                   1.0 + torch.arange(256) * 2.0 ** -9])  # bf16 / FP8 halfway values too
    for isa in ISAS:
        got = []
        for fused in (False, True):
            p = torch.zeros(g.numel(), requires_grad=True)
            opt = optim.AdamW([p], lr=1e-2, betas=(0.0, 0.999), fused=fused, state_dtype=state_dtype)
            p.grad = g.clone()
            with native.use_isa(isa):
                opt.step()
            got.append([p.detach().clone()] + [opt.state[p][k].clone() for k in sorted(opt.state[p]) if k != "step"])
        assert same_bits(*got), isa


def test_int8_codes_at_the_search_tables_bucket_edges():
    """The kernel finds an int8 code by a bucket table over the top bits of |value| (csrc/optim/adam.h) and one
    probe: values on every bucket edge, one ulp either side, both signs, below the table's range and NaN, through
    both maps (betas (0, 0): m = g and sqrt(v) = |g| exactly, each block's absmax 1.0 exactly), give the codes of
    torch.bucketize in the reference."""
    edge_bits = 0x32800000 + (torch.arange(0, 3329, dtype=torch.int64) << 16)
    bits = torch.cat([edge_bits - 1, edge_bits, edge_bits + 1]).to(torch.int32)
    mags = bits.view(torch.float32).clamp(max=1.0)
    g = torch.cat([mags, -mags, torch.tensor([1e-30, -1e-30, 2.0**-27, 0.0, -0.0, float("nan")])])
    int8_codes_are_the_references(g)


def test_int8_codes_around_every_decision_point_and_binade_edge():
    """At AVX-512 the kernel computes an int8 code from the map's runs of equal steps (csrc/optim/adam.h: a region
    per run, found from the value's binade and one comparison, then a linear index with a margin, and a compare
    with the decision point where the margin leaves two candidates): values 0-3 ulps either side of every decision
    point of both maps and of every binade edge, both signs, and random values over 10 decades (betas (0, 0): m = g
    and sqrt(v) = |g| exactly, each block's absmax 1.0) give the codes of torch.bucketize in the reference."""
    from engine.optim import dynamic_map

    mids = torch.cat([dynamic_map.midpoints(True), dynamic_map.midpoints(False)])
    edges = (torch.arange(96, 128, dtype=torch.int32) << 23).view(torch.float32)
    base = torch.cat([mids.abs(), edges]).view(torch.int32)
    mags = (base[:, None] + torch.arange(-3, 4, dtype=torch.int32)[None, :]).reshape(-1).view(torch.float32)
    gen = torch.Generator().manual_seed(5)
    rand = 10.0 ** (-10 * torch.rand(20000, generator=gen))
    mags = torch.cat([mags, rand]).clamp(max=1.0)
    g = torch.cat([mags, -mags, torch.tensor([0.0, -0.0, float("nan")])])
    int8_codes_are_the_references(g)


def int8_codes_are_the_references(g: torch.Tensor) -> None:
    """One int8 AdamW step on gradient values `g` (padded to whole 256-blocks, each block's absmax 1.0, so the values
    are the map's inputs as they are; betas (0, 0): m = g and sqrt(v) = |g| exactly): the fused kernel's parameter and
    states at every level are the reference's bits."""
    g = torch.cat([g, torch.ones((-g.numel()) % 256)]).reshape(-1, 256)
    g[:, 0] = 1.0
    g = g.reshape(-1)
    for isa in ISAS:
        got = []
        for fused in (False, True):
            p = torch.zeros(g.numel(), requires_grad=True)
            opt = optim.AdamW([p], lr=1e-2, betas=(0.0, 0.0), fused=fused, state_dtype="int8")
            p.grad = g.clone()
            with native.use_isa(isa):
                opt.step()
            got.append([p.detach().clone()] + [opt.state[p][k].clone() for k in sorted(opt.state[p]) if k != "step"])
        assert same_bits(*got), isa
