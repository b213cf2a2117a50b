"""Hardening of the C++ kernels: NaN bits.

* NaN bits: every scheme of `engine.ops.native` (both kernel sets) writes the canonical NaN
  of each format (FP8 0x7F, E8M0 0xFF, fp32 amax 0x7FC00000) for NaNs of either sign and
  any payload, as the reference does; the expected bits are derived here from where the
  NaNs were put, not from the code under test.
"""

from __future__ import annotations

import pytest
import torch

from engine.ops import native
from engine.ops import reference as ref

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = (E4M3, E5M2)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def codes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def f32_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def same_bits(got: tuple, want: tuple, what: str) -> None:
    """Raw bits of every output: FP8 and E8M0 as uint8, bf16 as int16, fp32 as int32 (NaN bits included)."""
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, f"{what} [{i}]"
            continue
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what} [{i}]: {g.dtype}{tuple(g.shape)} vs {w.dtype}{tuple(w.shape)}"
        view = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[w.element_size()]
        gb, wb = g.view(view), w.view(view)
        assert torch.equal(gb, wb), f"{what} [{i}]: {(gb != wb).sum().item()} values differ"


# ================================================================================= NaN bits
# NaNs of both signs with non-default payloads, quiet and signalling, as raw bits per dtype
NAN_BITS = {
    torch.float32: [0x7FC00000, 0xFFC00000, 0x7FC12345, 0xFFFFFFFF, 0x7F800001, 0xFF812345],
    torch.bfloat16: [0x7FC0, 0xFFC0, 0x7FC1, 0xFFFF, 0x7F81, 0xFF81],
    torch.float16: [0x7E00, 0xFE00, 0x7E01, 0xFFFF, 0x7C01, 0xFC01],
}


def with_nans(shape: tuple[int, int], dtype: torch.dtype, seed: int, count: int = 24) -> torch.Tensor:
    """N(0,1) * 2^U(-8, 8) with `count` NaNs (every kind of NAN_BITS in turn) at random places."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 9, shape, generator=g).float())).to(dtype)
    kinds = torch.tensor(NAN_BITS[dtype], dtype=torch.int64)
    kinds = kinds.to(torch.int32) if dtype == torch.float32 else kinds.to(torch.int16)
    where = torch.randperm(x.numel(), generator=g)[:count]
    x.view(-1).view(kinds.dtype)[where] = kinds[torch.arange(count) % len(kinds)]
    return x


def isas() -> list[str]:
    assert native.available(), native.why_unavailable()
    return native.available_isas()


@pytest.fixture(params=("portable", "avx512"))
def isa(request):
    """Each kernel set in turn, on one thread (small tensors: OpenMP threads on a busy
    2-core machine only add spin-waits)."""
    if request.param not in isas():
        pytest.skip("this CPU has no AVX-512")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with native.use_isa(request.param):
            yield request.param
    finally:
        torch.set_num_threads(threads)


def nan_blocks(nan: torch.Tensor, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Which MX blocks (the codes' shape) hold a NaN, and the same per element."""
    m, k = nan.shape
    if columnwise:
        blocks = torch.nn.functional.pad(nan, (0, 0, 0, -m % 32)).reshape(-1, 32, k).any(dim=1)
        return blocks, blocks.repeat_interleave(32, 0)[:m]
    blocks = torch.nn.functional.pad(nan, (0, -k % 32)).reshape(m, -1, 32).any(dim=2)
    return blocks, blocks.repeat_interleave(32, 1)[:, :k]


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_bits_are_canonical_in_every_scheme(isa, dtype):
    x = with_nans((96, 656), dtype, seed=DTYPES.index(dtype))  # 656 = 512 + 144: whole groups and tails
    nan = torch.isnan(x)
    assert nan.sum().item() == 24 and torch.signbit(x[nan]).any() and not torch.signbit(x[nan]).all()
    is_nan_code = lambda t, mask: torch.equal(codes(t)[mask], torch.full((int(mask.sum()),), 0x7F, dtype=torch.uint8))  # noqa: E731
    for fp8 in FP8:
        what = f"{isa} {dtype} {fp8}"
        # amax and per-tensor casts: flat (rowwise only), regions (+ transpose), any-sign scales
        got = native.amax(x)
        assert f32_bits(got).tolist() == [0x7FC00000], what
        same_bits((got,), (ref.amax(x),), f"{what} amax")
        for s, rw, cw in ((3.0, True, False), (3.0, True, True), (0.5, False, True), (-2.0, True, True)):
            scale = torch.tensor([s])
            got = native.cast_transpose(x, scale, fp8, rowwise=rw, columnwise=cw)
            assert f32_bits(got[2]).tolist() == [0x7FC00000], what
            assert got[0] is None or is_nan_code(got[0], nan), f"{what} scale {s} rowwise"
            assert got[1] is None or is_nan_code(got[1], nan.t()), f"{what} scale {s} columnwise"
            same_bits(got, ref.cast_transpose(x, scale, fp8, rowwise=rw, columnwise=cw), f"{what} scale {s}")
        # a NaN scale of either sign: every code is the canonical NaN
        for sbits in (0x7FC00000, 0xFFC00001, 0x7F800001):
            scale = torch.tensor([sbits], dtype=torch.int64).to(torch.int32).view(torch.float32)
            got = native.cast_transpose(x, scale, fp8)
            assert codes(got[0]).unique().tolist() == [0x7F] and codes(got[1]).unique().tolist() == [0x7F], what
            same_bits(got, ref.cast_transpose(x, scale, fp8), f"{what} NaN scale {sbits:#x}")
        # block scaling, 1x128 and 128x128, rowwise and on the transposed view (columnwise 1D)
        for tile_rows in (1, 128):
            for view, mask in ((x, nan), (x.t(), nan.t())):
                kw = {"tile_rows": tile_rows, "tile_cols": 128, "value_for_inf": ref.block_value_for_inf(dtype)}
                got = native.quantize_block(view, fp8, **kw)
                assert is_nan_code(got[0], mask), f"{what} block {tile_rows} {tuple(view.stride())}"
                same_bits(got, ref.quantize_block(view, fp8, **kw), f"{what} block {tile_rows}")
        # MXFP8: a block with a NaN has code 0xFF and is 0x7F throughout
        for mode in ("rceil", "floor"):
            for columnwise in (False, True):
                got = native.quantize_mxfp8(x, fp8, scale_mode=mode, columnwise=columnwise)
                blocks, elements = nan_blocks(nan, columnwise)
                assert torch.equal(got[1] == 0xFF, blocks), f"{what} {mode} col={columnwise} codes"
                assert is_nan_code(got[0], elements), f"{what} {mode} col={columnwise} data"
                same_bits(got, ref.quantize_mxfp8(x, fp8, scale_mode=mode, columnwise=columnwise),
                          f"{what} {mode} col={columnwise}")


def test_fp8_nan_codes_decode_to_the_canonical_bf16_nan(isa):
    for fp8, nan_codes in ((E4M3, [0x7F, 0xFF]), (E5M2, [0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF])):
        got = native.fp8_to_bf16(torch.tensor(nan_codes, dtype=torch.uint8).view(fp8))
        assert got.view(torch.int16).tolist() == [0x7FC0] * len(nan_codes)
