"""The output buffers of the C++ NVFP4 kernel (engine.ops.native.quantize_nvfp4's out_* arguments, and the idle
buffers it reuses for large data without them).

Given buffers are written and returned, with the bits of a call without them; wrong ones (shape, dtype, strides,
a usage not asked for, memory shared with x or with another output) get an error naming the argument, from the
Python wrapper and from the extension itself. Reused buffers: a result still held is never written again.
"""

from __future__ import annotations

import pytest
import torch

from engine import memory
from engine.ops import native
from tests.test_nvfp4_native import FIELDS, isa, mismatches  # noqa: F401 (isa: the fixture)

E4M3 = torch.float8_e4m3fn


def _input(m: int = 48, k: int = 130, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-6, 7, (m, k), generator=g).float())).bfloat16()


def _buffers(m: int, k: int) -> dict[str, torch.Tensor]:
    """Buffers of the right shapes, filled with a pattern the kernel must overwrite."""
    return {"out_row_data": torch.full((m, -(-k // 2)), 0xA5, dtype=torch.uint8),
            "out_row_scales": torch.full((m, -(-k // 16)), 0x5A, dtype=torch.uint8).view(E4M3),
            "out_col_data": torch.full((k, -(-m // 2)), 0xA5, dtype=torch.uint8),
            "out_col_scales": torch.full((k, -(-m // 16)), 0x5A, dtype=torch.uint8).view(E4M3)}


@pytest.mark.parametrize("rht", (False, True))
def test_given_buffers_are_written_and_returned_with_the_same_bits(isa, rht):  # noqa: F811
    for m, k in ((48, 130), (256, 260)):  # partial tiles; whole bands of the AVX-512 fast path
        x = _input(m, k)
        outs = _buffers(m, k)
        got = native.quantize_nvfp4(x, rht=rht, **outs)
        assert not mismatches(got, native.quantize_nvfp4(x, rht=rht))
        for field, name in (("rowwise_data", "out_row_data"), ("rowwise_scale_inv", "out_row_scales"),
                            ("columnwise_data", "out_col_data"), ("columnwise_scale_inv", "out_col_scales")):
            assert got[field].data_ptr() == outs[name].data_ptr(), field
            assert got[field].dtype == outs[name].dtype, field


def test_one_usage_takes_its_own_buffers():
    x = _input()
    outs = _buffers(*x.shape)
    row = native.quantize_nvfp4(x, columnwise=False, out_row_data=outs["out_row_data"])
    assert row["rowwise_data"].data_ptr() == outs["out_row_data"].data_ptr()
    assert not mismatches(row, native.quantize_nvfp4(x, columnwise=False))
    col = native.quantize_nvfp4(x, rowwise=False, out_col_scales=outs["out_col_scales"])
    assert col["columnwise_scale_inv"].data_ptr() == outs["out_col_scales"].data_ptr()
    assert not mismatches(col, native.quantize_nvfp4(x, rowwise=False))


def _bad(name: str, m: int, k: int) -> list[tuple[torch.Tensor, type, str]]:
    good = _buffers(m, k)[name]
    rows, cols = good.shape
    return [(torch.empty(rows, cols + 1, dtype=good.dtype), ValueError, f"{name}: expected shape"),
            (torch.empty(rows, cols, dtype=torch.float32), TypeError, f"{name}: expected dtype"),
            (torch.empty(cols, rows, dtype=good.dtype).t(), ValueError, f"{name}: expected a contiguous"),
            (good.to("meta"), TypeError, name)]


@pytest.mark.parametrize("name", ("out_row_data", "out_row_scales", "out_col_data", "out_col_scales"))
def test_wrong_buffers_are_refused_with_their_name(name):
    x = _input()
    for buffer, error, match in _bad(name, *x.shape):
        with pytest.raises(error, match=match):
            native.quantize_nvfp4(x, **{name: buffer})
    usage = "rowwise" if "row" in name else "columnwise"
    with pytest.raises(ValueError, match=f"{name}: given for a usage not asked for"):
        native.quantize_nvfp4(x, **{usage: False, name: _buffers(*x.shape)[name]})


def test_the_extension_checks_the_buffers_too():
    ext = native._ext()
    x = _input(32, 64)
    args = (x, True, True, False, False, None, None, None)
    with pytest.raises(ValueError, match=r"out_row_data: expected shape \[32, 32\]"):
        ext.quantize_nvfp4(*args, out_row_data=torch.empty(32, 33, dtype=torch.uint8))
    with pytest.raises(TypeError, match="out_col_scales: expected a uint8"):
        ext.quantize_nvfp4(*args, out_col_scales=torch.empty(64, 2, dtype=torch.int8))
    with pytest.raises(ValueError, match="out_col_data: expected a contiguous"):
        ext.quantize_nvfp4(*args, out_col_data=torch.empty(16, 64, dtype=torch.uint8).t())
    with pytest.raises(ValueError, match=r"out_row_scales: expected shape \[0, 0\]"):  # a usage not asked for
        ext.quantize_nvfp4(x, False, True, False, False, None, None, None,
                           out_row_scales=torch.empty(32, 4, dtype=torch.uint8))
    # memory shared with x, or with another output
    on_x = x.view(torch.uint8).view(-1)[: 32 * 32].view(32, 32)
    with pytest.raises(ValueError, match="out_row_data: shares memory with x"):
        ext.quantize_nvfp4(*args, out_row_data=on_x)
    shared = torch.empty(64 * 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="out_col_data and out_row_data: the same memory"):
        ext.quantize_nvfp4(*args, out_row_data=shared[: 32 * 32].view(32, 32), out_col_data=shared.view(64, 16))


def test_reused_buffers_are_never_the_ones_still_held(monkeypatch):
    """Without out_*: the data come from engine.memory.output_buffer (every size, with the threshold at 0), so a
    dropped result's buffers serve the next call and a held result keeps its bits."""
    monkeypatch.setattr(memory, "REUSED_OUTPUT_MIN_BYTES", 0)
    memory.release_free_memory()
    try:
        xs = [_input(seed=i) for i in range(3)]
        want = [native.quantize_nvfp4(x) for x in xs]
        first = native.quantize_nvfp4(xs[0])
        second = native.quantize_nvfp4(xs[1])  # `first` is held: other buffers
        for field in ("rowwise_data", "columnwise_data"):
            assert first[field].data_ptr() != second[field].data_ptr(), field
        address = second["rowwise_data"].data_ptr()
        del second
        third = native.quantize_nvfp4(xs[2])  # `second` dropped: its buffers again
        assert third["rowwise_data"].data_ptr() == address
        assert not mismatches(first, want[0]) and not mismatches(third, want[2])
    finally:
        memory.release_free_memory()
