"""engine.inference.int8_mm: the probes tell an exact int8 GEMM from one whose 16-bit pair sums saturate, and
`int32_mm` gives exact sums either way.

The saturating GEMM is modelled here as oneDNN runs int8 without VNNI (AVX2): the signed activations made
unsigned (q + 128), each pair of adjacent products summed into an int16 with saturation (vpmaddubsw), the pair
sums added in int32, minus 128 times the weight's sums (its compensation for the + 128).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import avx2_emulation
import engine
from engine.inference import int8_mm, int_formats

PROBES = (int8_mm.int_mm_exact, int8_mm.sign_split_exact, int8_mm.method, int8_mm.prepacked_exact)


@pytest.fixture
def fresh_probes():
    """The probes' once-per-process verdicts forgotten before and after the test (it swaps torch's GEMMs)."""
    for probe in PROBES:
        probe.cache_clear()
    yield
    for probe in PROBES:
        probe.cache_clear()


def saturating_sums(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ w [N, K]^T as int32, through saturating 16-bit pair sums of (a + 128) * w."""
    u, w = a.long() + 128, w.long()
    if a.shape[1] % 2:
        u, w = torch.nn.functional.pad(u, (0, 1)), torch.nn.functional.pad(w, (0, 1))
    pairs = (u[:, None, :] * w[None, :, :]).view(u.shape[0], w.shape[0], -1, 2).sum(-1).clamp(-32768, 32767)
    return (pairs.sum(-1) - 128 * w.sum(1)).to(torch.int32)


def exact(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return a.long() @ w.long().t()


def adversarial(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Positive activations near 127 against weights of both signs, half the rows all positive: pair sums past 16
    bits and int32 sums past 2^24."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randint(100, 128, (m, k), generator=gen, dtype=torch.int8)
    a[m // 2:] = -a[m // 2:]
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    w[: n // 2] = torch.randint(90, 128, (n // 2, k), generator=gen, dtype=torch.int8)
    return a, w


def test_the_model_saturates_on_adversarial_operands() -> None:
    """The saturating model is wrong on these operands and right on small ones: the probes below have work to do."""
    a, w = adversarial(6, 10, 700)
    assert not torch.equal(saturating_sums(a, w).long(), exact(a, w))
    small = torch.randint(-60, 1, (6, 700), dtype=torch.int8)
    assert torch.equal(saturating_sums(small, w).long(), exact(small, w))


def test_a_saturating_int_mm_is_replaced_by_its_sign_split_form(monkeypatch, fresh_probes) -> None:
    monkeypatch.setattr(torch, "_int_mm", lambda a, bt: saturating_sums(a, bt.t()))
    assert not int8_mm.int_mm_exact() and int8_mm.sign_split_exact()
    assert int8_mm.method() == "int_mm_sign_split"
    for m in (1, 3, 8):
        a, w = adversarial(m, 24, 4096, seed=m)
        want = exact(a, w)
        assert want.abs().max() > 2**24
        got = int8_mm.int32_mm(a, w)
        assert got.dtype == torch.int32 and torch.equal(got.long(), want)
        assert torch.equal(int_formats.int32_mm(a, w).long(), want)  # the old name


def test_the_layer_gives_the_formula_on_a_saturating_int_mm(monkeypatch, fresh_probes) -> None:
    monkeypatch.setattr(torch, "_int_mm", lambda a, bt: saturating_sums(a, bt.t()))
    monkeypatch.setattr(int_formats.Int8DynamicFormat, "onednn_min_elements", 1 << 40)  # plain weights
    gen = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(256, 12, bias=False)
    with torch.no_grad():
        lin.weight.copy_(1 + 0.05 * torch.rand(12, 256, generator=gen))
    x = 1 + 0.05 * torch.rand(3, 256, generator=gen)
    engine.quantize_(lin, engine.Int8DynamicActivationInt8Weight())
    q, sw = lin.weight.plain_parts()["data"], lin.weight.plain_parts()["scale"]
    xq, sx = int_formats.rowwise_int8(x)
    want = ((xq.double() @ q.double().t()).float() * sx.unsqueeze(1) * sw.unsqueeze(0))
    with torch.no_grad():
        assert torch.equal(lin(x), want)


def test_no_exact_int_mm_falls_back_to_float64_with_one_warning(monkeypatch, fresh_probes) -> None:
    monkeypatch.setattr(torch, "_int_mm", lambda a, bt: exact(a, bt.t()).mul(2).to(torch.int32))  # always off
    a, w = adversarial(4, 16, 1000)
    with pytest.warns(RuntimeWarning, match="fp64 matmul"):
        got = int8_mm.int32_mm(a, w)
    assert torch.equal(got.long(), exact(a, w)) and int8_mm.method() == "float64"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        int8_mm.int32_mm(a, w)  # once per process


def test_the_prepacked_probe_tells_saturating_sums(monkeypatch, fresh_probes) -> None:
    """oneDNN's prepacked GEMM returns the fp32 values of the sums of (x_biased - 128) * w."""
    monkeypatch.setattr(int8_mm, "prepack", lambda w: w)
    sums = {"exact": exact, "saturating": saturating_sums}
    for name, fn in sums.items():
        monkeypatch.setattr(int8_mm, "prepacked_sums",
                            lambda xb, w, n, fn=fn: fn((xb.to(torch.int16) - 128).to(torch.int8), w).float())
        int8_mm.prepacked_exact.cache_clear()
        assert int8_mm.prepacked_exact() == (name == "exact"), name


def test_the_probes_follow_the_cpu() -> None:
    """With VNNI (and oneDNN not capped) torch's int8 GEMMs are exact and run as they are; under the AVX2
    emulation neither is, and the sign-split form runs."""
    if avx2_emulation.emulated():
        assert (int8_mm.int_mm_exact(), int8_mm.prepacked_exact(), int8_mm.method()) == \
            (False, False, "int_mm_sign_split")
    elif {"avx512_vnni", "avx_vnni", "amx_int8"} & avx2_emulation.cpu_flags() and not os.environ.get("ONEDNN_MAX_CPU_ISA"):
        assert int8_mm.method() == "int_mm"
        assert not int_formats.onednn_available() or int8_mm.prepacked_exact()
    else:
        pytest.skip("neither a VNNI CPU nor the AVX2 emulation (test_int8_dynamic_is_the_int32_formula_without_vnni "
                    "runs it)")
