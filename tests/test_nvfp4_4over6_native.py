"""The C++ NVFP4 kernel with 4over6 (`engine.ops.native.quantize_nvfp4(four_over_six=True, ...)`) against the
reference, bit for bit (codes, E4M3 scales, amaxes; NaN bits included), at each kernel set the machine has
(baseline, avx2, avx512): on every input of TE's fixture (the near ties there pin the order of the fp32 operations)
and on the edge cases of tests/nvfp4_4over6_cases.py in each dtype under options reaching every value of every
option; across threads; and the refusals, by the wrapper and by the extension itself. The default (4over6 off)
keeps today's bits: tests/test_nvfp4_native.py.
"""

from __future__ import annotations

import pytest
import torch

from engine.ops import native, nvfp4
from tests.nvfp4_4over6_cases import DTYPES, OPTIONS, edge_inputs, fixture_cases, mismatches, quantize_kwargs
from tests.test_nvfp4_native import ISAS


@pytest.fixture(params=ISAS)
def isa(request):
    assert native.available(), native.why_unavailable()
    with native.use_isa(request.param):
        yield request.param


def compare(x: torch.Tensor, **kw) -> list[str]:
    return mismatches(native.quantize_nvfp4(x, **kw), nvfp4.quantize(x, **kw))


def test_te_fixture_inputs_match_the_reference_bitwise(isa):
    bad = [f"{name}: {b}" for name, x, kw in fixture_cases() for b in compare(x, **kw)]
    assert not bad, bad[:10]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_edge_cases_under_every_option_match_the_reference_bitwise(isa, dtype):
    bad = []
    for name, x in edge_inputs(dtype).items():
        for option in OPTIONS:
            bad += [f"{name} {option}: {b}" for b in compare(x, **quantize_kwargs(option))]
    assert not bad, bad[:10]


@pytest.fixture(scope="module")
def large():
    """(x, the reference's outputs with 1x16 blocks and 16x16 tiles): computed once for every kernel set."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(272, 1000, generator=g) * torch.exp2(torch.randint(-10, 10, (272, 1000), generator=g))).bfloat16()
    return x, {td: nvfp4.quantize(x, two_d=td, four_over_six=True, four_over_six_err_mode="MSE") for td in (False, True)}


def test_large_tensor_spans_threads_and_tiles(isa, large):
    """More tiles than threads, rows and columns not multiples of the 16 x 128 tile, on 1 and 2 threads."""
    x, want = large
    previous = torch.get_num_threads()
    bad = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for two_d, w in want.items():
                got = native.quantize_nvfp4(x, two_d=two_d, four_over_six=True, four_over_six_err_mode="MSE")
                bad += [f"{threads} threads, two_d={two_d}: {b}" for b in mismatches(got, w)]
    finally:
        torch.set_num_threads(previous)
    assert not bad, bad


def test_out_buffers_are_written():
    x = torch.randn(32, 48)
    bufs = dict(out_row_data=torch.empty(32, 24, dtype=torch.uint8),
                out_row_scales=torch.empty(32, 3, dtype=torch.float8_e4m3fn),
                out_col_data=torch.empty(48, 16, dtype=torch.uint8),
                out_col_scales=torch.empty(48, 2, dtype=torch.float8_e4m3fn))
    got = native.quantize_nvfp4(x, four_over_six=True, four_over_six_e4m3_max=256, **bufs)
    assert got["rowwise_data"].data_ptr() == bufs["out_row_data"].data_ptr()
    assert not mismatches(got, nvfp4.quantize(x, four_over_six=True, four_over_six_e4m3_max=256))


REFUSALS = [
    (dict(rht=True), ValueError, "four_over_six and rht"),
    (dict(counter=torch.tensor([1, 0])), ValueError, "four_over_six and stochastic rounding"),
    (dict(four_over_six_err_mode="mse"), ValueError, "four_over_six_err_mode: expected 'MAE' or 'MSE'"),
    (dict(four_over_six_e4m3_max=512), ValueError, "four_over_six_e4m3_max: expected 448 or 256"),
    (dict(four_over_six_e4m3_max=None), TypeError, "four_over_six_e4m3_max: expected a number"),
]


@pytest.mark.parametrize("kw, exc, match", REFUSALS, ids=[str(list(r[0]))[:30] for r in REFUSALS])
def test_the_wrapper_refuses_with_the_argument_named(kw, exc, match):
    with pytest.raises(exc, match=match):
        native.quantize_nvfp4(torch.randn(16, 32), four_over_six=True, **kw)


@pytest.mark.parametrize("kw, match", [
    (dict(four_over_six=True, four_over_six_err_mode="L2", four_over_six_e4m3_max=448.0), "four_over_six_err_mode"),
    (dict(four_over_six=True, four_over_six_err_mode="MAE", four_over_six_e4m3_max=300.0), "four_over_six_e4m3_max"),
    (dict(four_over_six=False, four_over_six_err_mode="MAE", four_over_six_e4m3_max=0.0), "four_over_six_e4m3_max"),
], ids=["err_mode", "e4m3_max", "e4m3_max-off"])
def test_the_extension_checks_its_arguments_too(kw, match):
    """The binding itself (what a caller past the wrapper reaches) refuses bad 4over6 values, RHT and a counter."""
    ext = native._ext()
    x = torch.randn(16, 32)
    args = (x, True, True, False, False, None, None, None)
    with pytest.raises(ValueError, match=match):
        ext.quantize_nvfp4(*args, **kw)
    with pytest.raises(ValueError, match="four_over_six and rht"):
        ext.quantize_nvfp4(x, False, True, False, True, None, None, None, four_over_six=True)
    with pytest.raises(ValueError, match="four_over_six and stochastic rounding"):
        ext.quantize_nvfp4(x, True, True, False, False, None, None, torch.tensor([1, 0]),
                           four_over_six=True)
