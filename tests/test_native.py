"""The C++ kernels (engine.ops.native) against the reference (engine.ops.reference), bit for bit.

Every native function is compared with its reference counterpart on the raw bits of the
result: FP8 data as uint8 codes, fp32 scales as int32 bits, E8M0 codes exactly, NaN bits
included (every backend writes the canonical NaN of each format). Every instruction set the machine
runs is compared (`ISAS`: baseline, and avx2 / avx512 where the CPU has them). The extension must load here:
a broken build fails `test_extension_builds` (and everything else), it is never skipped.

`make install` builds the kernels; without that build, the first use builds them with torch's JIT loader
(1-4 min on a 2-core machine) and later runs load the cached build.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from engine.ops import native
from engine.ops import reference as ref

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = (E4M3, E5M2)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FLT_MAX = torch.finfo(torch.float32).max
NAN, INF = float("nan"), float("inf")
# /proc/cpuinfo flags of each x86-64 level (the old C++ module's AVX-512 set needs VBMI too)
LEVEL_FLAGS = {"avx2": ("avx2", "fma", "f16c", "bmi2"),
               "avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd")}


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split())


def isa_cap() -> str:
    """ENGINE_ISA as this test run sets it ('' when unset or auto)."""
    value = os.environ.get("ENGINE_ISA", "").strip().lower()
    return "" if value == "auto" else value


def kernel_levels() -> list[str]:
    """Every instruction-set level this machine (and ENGINE_ISA) runs: the FP8 kernel tests run at each."""
    return native.available_isas() if native.available() else ["baseline"]


# the kernel levels this run has: the CPU's, capped by ENGINE_ISA (avx2: a run that behaves like an AVX2 CPU)
ISAS = tuple(kernel_levels())


# The FP8 table's portable avx512 variant runs on AVX-512 CPUs without VBMI only (cast/fp8.h's fp8_table picks the
# hand-written kernels where VBMI is there): ENGINE_FP8_HAND_KERNELS=0 selects it, so every AVX-512 machine tests it.
PORTABLE_AVX512 = "avx512-portable"


def fp8_kernel_levels() -> list[str]:
    """kernel_levels(), plus the portable avx512 FP8 variant where avx512 runs."""
    levels = kernel_levels()
    return levels + [PORTABLE_AVX512] if "avx512" in levels else levels


@pytest.fixture(params=fp8_kernel_levels())
def isa(request, monkeypatch):
    assert native.available(), native.why_unavailable()
    level = request.param
    if level == PORTABLE_AVX512:
        monkeypatch.setenv("ENGINE_FP8_HAND_KERNELS", "0")
        level = "avx512"
    with native.use_isa(level):
        yield request.param


@pytest.mark.parametrize("value", ["2", "yes", ""])
def test_a_bad_engine_fp8_hand_kernels_is_a_value_error(monkeypatch, value):
    monkeypatch.setenv("ENGINE_FP8_HAND_KERNELS", value)
    with pytest.raises(ValueError, match=f"ENGINE_FP8_HAND_KERNELS: expected 0 or 1 \\(or unset\\), got '{value}'"):
        native.cast_transpose(torch.ones(4, 4), torch.tensor([1.0]), E4M3)


# ----------------------------------------------------------------------------- helpers
def assert_same(got: torch.Tensor | None, want: torch.Tensor | None, what: str = "") -> None:
    """Same dtype, shape and raw bits: FP8 codes as uint8, fp32 as int32, bf16 as int16.

    NaN bits are compared too: every backend writes the canonical NaN of each format
    (engine.ops.reference's docstring), whatever the sign and payload of the input NaN.
    """
    if want is None:
        assert got is None, f"{what}: expected None"
        return
    assert got is not None, f"{what}: missing"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if want.dtype in FP8:
        g, w = got.view(torch.uint8), want.view(torch.uint8)
    elif want.dtype == torch.float32:
        g, w = got.view(torch.int32), want.view(torch.int32)
    elif want.dtype == torch.bfloat16:
        g, w = got.view(torch.int16), want.view(torch.int16)
    else:
        g, w = got, want
    if not torch.equal(g, w):
        bad = (g != w).nonzero()[:5].tolist()
        pairs = [(tuple(i), g[tuple(i)].item(), w[tuple(i)].item()) for i in bad]
        raise AssertionError(f"{what}: {(g != w).sum().item()} values differ, e.g. (index, got, want) {pairs}")


def assert_all_same(got: tuple, want: tuple, what: str, input_dtype: torch.dtype | None = None) -> None:
    """assert_same on every output (`input_dtype` is only for the message)."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same(g, w, f"{what} [output {i}]")


def spread(shape, dtype, seed: int) -> torch.Tensor:
    """N(0, 1) times 2^U(-20, 20) (2^-10..2^10 for fp16, to stay finite): many tile scales."""
    g = torch.Generator().manual_seed(seed)
    span = 10 if dtype == torch.float16 else 20
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-span, span + 1, shape, generator=g).float())
    return x.to(dtype)


def special_values(dtype: torch.dtype) -> list[float]:
    fi = torch.finfo(dtype)
    return [
        0.0, -0.0, NAN, -NAN, INF, -INF, fi.max, -fi.max, fi.tiny, -fi.tiny, fi.tiny / 4, -fi.tiny / 4,
        448.0, -448.0, 464.0, 480.0, -500.0, 57344.0, 61440.0, -6e4,
        1.0625, -1.1875, 2.0**-10, 3 * 2.0**-10, 2.0**-9, 2.0**-17, 3 * 2.0**-17, 2.0**-16,
    ]


def with_specials(x: torch.Tensor, seed: int, fraction: float = 0.01) -> torch.Tensor:
    """x with special values (NaN, inf, -0, subnormals, ties, +-max, ...) at random places."""
    x = x.clone()
    flat = x.view(-1)
    if flat.numel() == 0:
        return x
    g = torch.Generator().manual_seed(seed)
    vals = torch.tensor(special_values(x.dtype), dtype=torch.float32).to(x.dtype)
    count = max(1, int(flat.numel() * fraction))
    where = torch.randint(0, flat.numel(), (count,), generator=g)
    flat[where] = vals[torch.randint(0, len(vals), (count,), generator=g)]
    return x


def inputs(shape, dtype, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    x = spread(shape, dtype, seed)
    return [("spread", x), ("specials", with_specials(x, seed + 1))]


# ------------------------------------------------------------------------- the build
def test_extension_builds():
    assert native.available(), native.why_unavailable()
    assert native.why_unavailable() == ""
    assert native.isa() in native.ISA_ORDER


def test_the_best_isa_of_the_cpu_is_used():
    """Every level the CPU's flags allow (up to ENGINE_ISA) is available, and the highest one runs."""
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags to say what this CPU has")
    want = ["baseline"] + [isa for isa in ("avx2", "avx512") if set(LEVEL_FLAGS[isa]) <= flags]
    if isa_cap():
        want = [isa for isa in want if native.ISA_ORDER.index(isa) <= native.ISA_ORDER.index(isa_cap())]
    assert native.available_isas() == want
    assert native.isa() == want[-1]


def test_engine_isa_caps_the_kernels_for_the_whole_process():
    """ENGINE_ISA=avx2 makes a process run (and list) only the kernels an AVX2 CPU runs; asking for more is a
    ValueError naming the cap."""
    import avx2_emulation

    got = avx2_emulation.run("""
        import json
        from engine.ops import native
        try:
            with native.use_isa("avx512"):
                refused = ""
        except ValueError as err:
            refused = str(err)
        with native.use_isa("auto"):
            auto = native.isa()
        print(json.dumps([native.isa(), native.available_isas(), auto, refused]))
    """)
    isa, isas, auto, refused = got
    want = ["baseline", "avx2"]
    assert (isa, isas, auto) == (want[-1], want, want[-1])
    assert "ENGINE_ISA=avx2" in refused


@pytest.mark.parametrize("value, message", [
    ("avx3", "ENGINE_ISA: expected one of baseline, avx2, avx512 or auto, got 'avx3'"),
    ("portable", "ENGINE_ISA: expected one of baseline, avx2, avx512 or auto, got 'portable'"),
    ("avx512", "ENGINE_ISA=avx512: this machine runs baseline, avx2 (its CPU or this build has no avx512 kernels)")])
def test_a_bad_engine_isa_is_a_value_error_at_first_use(monkeypatch, value, message):
    """An unknown value, or a level the machine lacks (here: an AVX2 CPU), is a ValueError at the first kernel
    call, every call, never a silent fallback."""
    class Avx2Only:  # what a build on a CPU without AVX-512 reports
        def available_isas(self):
            return ["baseline", "avx2"]

        def set_isa(self, name):
            raise AssertionError(f"set_isa({name!r}) past the CPU")

    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_error", None)
    monkeypatch.setattr(native, "_isa_cap", None)
    monkeypatch.setattr(native, "_build", Avx2Only)
    monkeypatch.setenv("ENGINE_ISA", value)
    for _ in range(2):
        with pytest.raises(ValueError, match=re.escape(message)):
            native.amax(torch.ones(3))
    monkeypatch.delenv("ENGINE_ISA")
    assert native.available() and native.available_isas() == ["baseline", "avx2"]


def test_a_failed_build_is_reported_not_raised(monkeypatch):
    def broken_build():
        raise RuntimeError("Error building extension 'engine_native': c++: command not found")

    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_error", None)
    monkeypatch.setattr(native, "_build", broken_build)
    assert native.available() is False
    reason = native.why_unavailable()
    assert "engine_native" in reason and "command not found" in reason
    with pytest.raises(RuntimeError, match="unavailable"):
        native.amax(torch.ones(3))


def test_missing_sources_are_reported(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_error", None)
    monkeypatch.setattr(native, "CSRC_DIR", tmp_path)
    assert native.available() is False
    assert "not found" in native.why_unavailable()


# ------------------------------------------------------------------------ the FP8 cast
def fp32_patterns() -> torch.Tensor:
    """fp32 bit patterns: a stride through all 2^32, and every FP8 rounding boundary +-2 ulp."""
    strided = torch.arange(0, 1 << 32, 4093, dtype=torch.int64)
    edges = []
    for dt in FP8:
        codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(dt).float()  # every finite non-negative value
        mids = (codes[:-1].double() + codes[1:].double()) / 2
        points = torch.cat([codes.double(), mids, torch.tensor([ref.fp8_max(dt) * 1.0625, 2.0**-10, 2.0**-17])])
        bits = points.float().view(torch.int32).to(torch.int64)
        edges.append((bits[:, None] + torch.arange(-2, 3)).reshape(-1))
    allbits = torch.cat([strided, *edges])
    allbits = torch.cat([allbits, allbits | (1 << 31)])  # both signs
    return (allbits & 0xFFFFFFFF).to(torch.int64).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("fp8", FP8)
def test_cast_of_fp32_bit_patterns(isa, fp8):
    x = fp32_patterns()
    x = torch.cat([x, torch.zeros(-x.numel() % 64)]).reshape(-1, 64)
    one = torch.ones(1)
    got, _, _ = native.cast_transpose(x, one, fp8, columnwise=False)
    assert_same(got, ref.cast_to_fp8(x, fp8), f"{isa} {fp8}")


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("fp8", FP8)
def test_cast_of_every_16_bit_input(isa, dtype, fp8):
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype).reshape(256, 256)
    for s in (1.0, 3.0, 2.0**-7):
        scale = torch.tensor([s])
        got = native.cast_transpose(x, scale, fp8)
        assert_all_same(got, ref.cast_transpose(x, scale, fp8), f"{isa} {dtype} {fp8} scale {s}", dtype)


# --------------------------------------------------------------------------------- amax
AMAX_CASES = [(), (0,), (5, 0), (1,), (3, 5), (7, 129), (130, 257), (2, 3, 70), (300, 700)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_amax(isa, dtype):
    for shape in AMAX_CASES:
        for name, x in inputs(shape, dtype, seed=len(shape)):
            assert_same(native.amax(x), ref.amax(x), f"{isa} {dtype} {shape} {name}")
    x = spread((130, 257), dtype, 5)
    for view in (x.t(), x[:, 3:200], x[::2], x.t()[5:]):
        assert_same(native.amax(view), ref.amax(view), f"{isa} {dtype} view {tuple(view.shape)}")
    for v in (-0.0, NAN, -NAN, INF, -INF, -torch.finfo(dtype).max):
        x = torch.zeros(1000, dtype=dtype)
        x[777] = v
        assert_same(native.amax(x), ref.amax(x), f"{isa} {dtype} one {v}")


def test_amax_of_other_dtypes_follows_the_reference():
    for x in (torch.tensor([1.0, -3.0], dtype=torch.float64), torch.tensor([2, -7])):
        assert_same(native.amax(x), ref.amax(x), str(x.dtype))


# ----------------------------------------------------------------------- cast transpose
SHAPES_2D = [(1, 1), (3, 5), (7, 129), (64, 64), (130, 257), (255, 384), (300, 700), (70, 2100)]
USAGES = [(True, True), (True, False), (False, True), (False, False)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", FP8)
def test_cast_transpose(isa, dtype, fp8):
    for shape in SHAPES_2D:
        for name, x in inputs(shape, dtype, seed=shape[0]):
            for s in (1.0, 3.0, 0.7, 2.0**-12, 2.0**12):
                scale = torch.tensor([s])
                for rw, cw in USAGES:
                    got = native.cast_transpose(x, scale, fp8, rowwise=rw, columnwise=cw)
                    want = ref.cast_transpose(x, scale, fp8, rowwise=rw, columnwise=cw)
                    assert_all_same(got, want, f"{isa} {dtype} {fp8} {shape} {name} scale {s} {rw}/{cw}", dtype)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_cast_of_a_large_tensor(isa, dtype):
    # 8M elements: big enough per thread for the streaming (cache-bypassing) stores
    x = with_specials(spread((4096, 2048), dtype, 7), 8, fraction=0.001)
    scale = torch.tensor([0.375])
    got = native.cast_transpose(x, scale, E4M3, columnwise=False)
    assert_all_same(got, ref.cast_transpose(x, scale, E4M3, columnwise=False), f"{isa} {dtype} 4096x2048")


@pytest.mark.parametrize("dtype", DTYPES)
def test_cast_transpose_of_views(isa, dtype):
    x = with_specials(spread((200, 300), dtype, 3), 4)
    scale = torch.tensor([5.0])
    for view in (x.t(), x[:, 7:250], x[10:150, :64], x[::3]):
        got = native.cast_transpose(view, scale, E4M3)
        assert_all_same(got, ref.cast_transpose(view, scale, E4M3), f"{isa} {dtype} view {tuple(view.stride())}", dtype)


@pytest.mark.parametrize("fp8", FP8)
def test_cast_transpose_with_unusual_scales(isa, fp8):
    """Scales that are NaN, infinite, zero, negative or subnormal: torch's product x * scale rules."""
    for dtype in DTYPES:
        x = with_specials(spread((70, 130), dtype, 9), 10, fraction=0.05)
        for s in (NAN, -NAN, INF, -INF, 0.0, -0.0, -3.0, -2.0**-5, 1e-40, FLT_MAX, -FLT_MAX):
            scale = torch.tensor([s])
            for rw, cw in USAGES:
                got = native.cast_transpose(x, scale, fp8, rowwise=rw, columnwise=cw)
                want = ref.cast_transpose(x, scale, fp8, rowwise=rw, columnwise=cw)
                assert_all_same(got, want, f"{isa} {dtype} {fp8} scale {s} {rw}/{cw}", dtype)


def test_cast_transpose_reads_its_scale_in_cpp(isa, monkeypatch):
    """The 1-element scale tensor goes to C++ as it is: no float(scale) (a host sync on a GPU) on the way."""
    x = spread((16, 256), torch.bfloat16, 3)
    want = ref.cast_transpose(x, torch.tensor([0.375]), E4M3)

    def no_sync(*args):
        raise AssertionError("the scale was read in Python")

    for method in ("__float__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, method, no_sync)
    got = native.cast_transpose(x, torch.tensor([0.375]), E4M3)
    monkeypatch.undo()
    assert_all_same(got, want, f"{isa} scale read in C++")


# ------------------------------------------------------------------------ block scaling
BLOCK_SHAPES = [(1, 1), (3, 5), (7, 129), (130, 257), (255, 384), (1000, 1000), (130, 2100)]
SCALE_OPTIONS = [  # (force_pow_2_scales, amax_epsilon)
    (True, 0.0), (False, 0.0), (True, 1e-3), (False, 2.0**-30),
]


def block_kwargs(dtype, tile_rows, pow2, eps, value_for_inf=None):
    return {"tile_rows": tile_rows, "tile_cols": 128, "force_pow_2_scales": pow2, "amax_epsilon": eps,
            "value_for_inf": ref.block_value_for_inf(dtype) if value_for_inf is None else value_for_inf}


@pytest.mark.parametrize("tile_rows", (1, 128))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", FP8)
def test_quantize_block(isa, tile_rows, dtype, fp8):
    for shape in BLOCK_SHAPES:
        big = shape[0] * shape[1] > 100_000
        for name, x in inputs(shape, dtype, seed=shape[1]):
            for pow2, eps in SCALE_OPTIONS[:1] if big else SCALE_OPTIONS:
                kw = block_kwargs(dtype, tile_rows, pow2, eps)
                for view_name, view in (("x", x), ("x.t()", x.t())):
                    got = native.quantize_block(view, fp8, **kw)
                    want = ref.quantize_block(view, fp8, **kw)
                    assert_all_same(got, want, f"{isa} {dtype} {fp8} {shape} {name} {view_name} {kw}", dtype)


def edge_tiles(dtype: torch.dtype) -> torch.Tensor:
    """256 x 384: each 1x128 / 128x128 tile of the top rows holds one kind of edge case."""
    fi = torch.finfo(dtype)
    x = spread((256, 384), dtype, 21)
    x[:, :128] = 0.0  # all zeros
    x[:128, 128:256] = -0.0
    x[128:, 128:256] = spread((128, 128), dtype, 22) * 0 + fi.tiny / 2  # subnormal inputs
    x[5, 300] = fi.max  # one huge outlier in a tile
    x[6, 130] = INF
    x[200, 10] = -INF
    x[7, 260] = NAN
    x[9, :] = fi.tiny  # the smallest normal: amax so small that fp8_max / amax may overflow
    x[10, 128:] = -fi.max
    x[11, :128] = 1e-40 if dtype != torch.float16 else 6e-8  # scale fp8_max / 1e-40 overflows fp32
    return x


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_block_edge_tiles(isa, dtype):
    x = edge_tiles(dtype)
    for fp8 in FP8:
        for tile_rows in (1, 128):
            for pow2, eps in SCALE_OPTIONS:
                for vfi in (None, FLT_MAX):
                    kw = block_kwargs(dtype, tile_rows, pow2, eps, vfi)
                    for view_name, view in (("x", x), ("x.t()", x.t())):
                        got = native.quantize_block(view, fp8, **kw)
                        want = ref.quantize_block(view, fp8, **kw)
                        assert_all_same(got, want, f"{isa} {dtype} {fp8} {view_name} {kw}", dtype)


def test_quantize_block_scale_overflow_uses_value_for_inf(isa):
    # amax 1e-40 (an fp32 subnormal): 448 / amax is inf in fp32, so the scale is value_for_inf
    x = torch.full((1, 128), 1e-40)
    for vfi, pow2 in ((FLT_MAX, False), (FLT_MAX, True), (torch.finfo(torch.bfloat16).max, False), (1e30, True)):
        kw = block_kwargs(torch.float32, 1, pow2, 0.0, vfi)
        data, sinv = native.quantize_block(x, E4M3, **kw)
        assert_all_same((data, sinv), ref.quantize_block(x, E4M3, **kw), f"{isa} vfi {vfi}")
        expected = torch.tensor([vfi], dtype=torch.float32)
        if pow2:
            expected = (expected.view(torch.int32) & -(1 << 23)).view(torch.float32)
        assert sinv.item() == (1.0 / expected).item()


def test_quantize_block_unusual_value_for_inf(isa):
    x = edge_tiles(torch.float32)
    for vfi in (0.0, -1.0, 1e-45, INF):
        kw = block_kwargs(torch.float32, 1, False, 0.0, vfi)
        for view in (x, x.t()):
            assert_all_same(native.quantize_block(view, E4M3, **kw), ref.quantize_block(view, E4M3, **kw), f"{vfi}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_block_and_mxfp8_of_views(isa, dtype):
    x = with_specials(spread((200, 1300), dtype, 35), 36)
    for view in (x[:, 5:1200], x[7:, :640].t(), x[::2, :300], x[:64, 3:].t()[:, :64]):
        for tile_rows in (1, 128):
            kw = block_kwargs(dtype, tile_rows, True, 0.0)
            got = native.quantize_block(view, E4M3, **kw)
            want = ref.quantize_block(view, E4M3, **kw)
            assert_all_same(got, want, f"{isa} {dtype} {tile_rows} view {tuple(view.stride())}", dtype)
        for col in (False, True):
            got = native.quantize_mxfp8(view, E4M3, columnwise=col)
            want = ref.quantize_mxfp8(view, E4M3, columnwise=col)
            assert_all_same(got, want, f"{isa} {dtype} mx col={col} view {tuple(view.stride())}", dtype)


def test_quantize_block_other_tile_shapes(isa):
    x = with_specials(spread((300, 500), torch.bfloat16, 31), 32)
    for tr, tc in ((2, 64), (3, 100), (128, 256), (64, 32), (1, 1)):
        kw = {"tile_rows": tr, "tile_cols": tc}
        for view in (x, x.t()):
            got = native.quantize_block(view, E4M3, **kw)
            assert_all_same(got, ref.quantize_block(view, E4M3, **kw), f"{isa} tiles {tr}x{tc} {tuple(view.stride())}")


def test_quantize_block_tiles_taller_than_a_panel_on_a_transposed_view(isa):
    """Tiles of more than 1024 rows on a column-major view: wider than one panel of the transposed kernels
    (they once wrote past their per-panel arrays)."""
    x = with_specials(spread((96, 2100), torch.bfloat16, 37), 38)
    for tr, tc in ((1025, 32), (2048, 128), (4096, 64)):
        kw = {"tile_rows": tr, "tile_cols": tc}
        got = native.quantize_block(x.t(), E4M3, **kw)
        assert_all_same(got, ref.quantize_block(x.t(), E4M3, **kw), f"{isa} tiles {tr}x{tc}")


# ---------------------------------------------------------------------------------- MXFP8
MX_SHAPES = [(32, 32), (64, 96), (96, 1024), (32, 544), (2, 64, 64), (1, 32), (3, 5), (33, 65), (45, 1000)]


@pytest.mark.parametrize("mode", ("rceil", "floor"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8", FP8)
def test_quantize_mxfp8(isa, mode, dtype, fp8):
    for shape in MX_SHAPES:
        for name, x in inputs(shape, dtype, seed=shape[-1]):
            for col in (False, True):
                got = native.quantize_mxfp8(x, fp8, scale_mode=mode, columnwise=col)
                want = ref.quantize_mxfp8(x, fp8, scale_mode=mode, columnwise=col)
                assert_all_same(got, want, f"{isa} {dtype} {fp8} {mode} {shape} {name} col={col}", dtype)


def edge_blocks(dtype: torch.dtype) -> torch.Tensor:
    """64 x 640: blocks of zeros, NaN, +-inf, one outlier, subnormals, tiny and huge amaxes."""
    fi = torch.finfo(dtype)
    x = spread((64, 640), dtype, 41)
    x[:32, :32] = 0.0
    x[32:, :32] = -0.0
    x[3, 40] = NAN  # a NaN block (code 255): every element becomes the positive NaN
    x[4, 70] = -NAN
    x[4, 71] = -5.0
    x[35, 100] = INF
    x[36, 140] = -INF
    x[0, 200] = fi.max  # one huge outlier
    x[1, 224:256] = fi.tiny / 2  # subnormal inputs
    x[2, 256:288] = fi.tiny  # tiny amax: code near 0
    x[40:64, 300] = fi.max  # huge amax
    x[5, 320:352] = -fi.max
    x[6, 352:384] = 448.0
    x[7, 384:416] = 448.0 * 2.0**-130 if dtype == torch.float32 else fi.tiny  # subnormal d = amax / 448
    return x


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_mxfp8_edge_blocks(isa, dtype):
    x = edge_blocks(dtype)
    for fp8 in FP8:
        for mode in ("rceil", "floor"):
            for col in (False, True):
                got = native.quantize_mxfp8(x, fp8, scale_mode=mode, columnwise=col)
                want = ref.quantize_mxfp8(x, fp8, scale_mode=mode, columnwise=col)
                assert_all_same(got, want, f"{isa} {dtype} {fp8} {mode} col={col}", dtype)


def test_negative_nan_is_the_canonical_positive_nan(isa):
    # torch's own fp16 -> fp32 keeps a NaN's sign in its vector loop but not in its scalar
    # one (short tensors, tails); the FP8 NaN is 0x7F either way, for every length
    for n in (1, 7, 64 * 64 + 3):
        x = torch.full((1, n), -NAN, dtype=torch.float16)
        got = native.cast_transpose(x, torch.ones(1), E4M3)
        assert got[0].view(torch.uint8).unique().tolist() == [0x7F]
        assert got[1].view(torch.uint8).unique().tolist() == [0x7F]
        assert got[2].view(torch.int32).tolist() == [0x7FC00000]
        assert_all_same(got, ref.cast_transpose(x, torch.ones(1), E4M3), f"fp16 -NaN x{n}")


def test_mxfp8_nan_block_is_all_positive_nan(isa):
    x = torch.full((1, 32), -2.0)
    x[0, 3] = -NAN
    data, codes = native.quantize_mxfp8(x, E4M3)
    assert codes.tolist() == [[255]]
    assert data.view(torch.uint8).unique().tolist() == [0x7F]


def test_mxfp8_argument_errors(isa):
    with pytest.raises(ValueError, match="scale_mode"):
        native.quantize_mxfp8(torch.ones(32, 32), E4M3, scale_mode="nearest")
    with pytest.raises(TypeError):
        native.quantize_mxfp8(torch.ones(32, 32, dtype=torch.float64), E4M3)
    with pytest.raises(TypeError):
        native.quantize_mxfp8(torch.ones(32, 32), torch.bfloat16)


@pytest.mark.parametrize("rowwise,columnwise", [(True, True), (True, False), (False, True)])
def test_both_usages_in_one_call_match_the_reference(isa, rowwise, columnwise):
    """`quantize_block_usages` / `quantize_mxfp8_usages` (what the modules call) give each asked usage the
    reference's bits, None for the other: odd shapes, a 3D x, edge values in a block."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 45, 70, generator=g).to(torch.bfloat16)
    x[0, 0, :4] = torch.tensor([INF, -0.0, 1e-40, -FLT_MAX]).to(torch.bfloat16)
    x2d = x.reshape(-1, 70)
    check_block_usages(x2d, (1, 128), rowwise, columnwise, isa)
    got = native.quantize_mxfp8_usages(x, E5M2, scale_mode="floor", rowwise=rowwise, columnwise=columnwise)
    want = (ref.quantize_mxfp8(x, E5M2, scale_mode="floor") if rowwise else (None, None)) + \
        (ref.quantize_mxfp8(x, E5M2, scale_mode="floor", columnwise=True) if columnwise else (None, None))
    for g_t, w_t, name in zip(got, want, ("row data", "row codes", "col data", "col codes")):
        assert_same(g_t, w_t, f"mxfp8 {isa} {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(33, 1100), (64, 544)])
def test_mxfp8_both_usages_across_column_chunks(isa, dtype, shape):
    """Both MXFP8 usages from one read of x (work units of 32 rows x 512 columns): the reference's bits where the
    columns span several units and the last one is partial, rows past a whole block, NaN, inf and signed zeros."""
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-6, 7, shape, generator=g).float())).to(dtype)
    x[0, 500:505] = torch.tensor([float("nan"), INF, -INF, -0.0, 0.0]).to(dtype)
    x[-1, -1] = float("nan")
    for fp8 in (E4M3, E5M2):
        got = native.quantize_mxfp8_usages(x, fp8, rowwise=True, columnwise=True)
        want = ref.quantize_mxfp8(x, fp8) + ref.quantize_mxfp8(x, fp8, columnwise=True)
        for g_t, w_t, name in zip(got, want, ("row data", "row codes", "col data", "col codes")):
            assert_same(g_t, w_t, f"mxfp8 {isa} {dtype} {fp8} {shape} {name}")


def check_block_usages(x2d: torch.Tensor, tile: tuple[int, int], rowwise: bool, columnwise: bool, isa: str) -> None:
    got = native.quantize_block_usages(x2d, E4M3, tile_rows=tile[0], tile_cols=tile[1], rowwise=rowwise,
                                       columnwise=columnwise)
    want = (ref.quantize_block(x2d, E4M3, tile_rows=tile[0], tile_cols=tile[1]) if rowwise else (None, None)) + \
        (ref.quantize_block(x2d.t(), E4M3, tile_rows=tile[0], tile_cols=tile[1]) if columnwise else (None, None))
    for g_t, w_t, name in zip(got, want, ("row data", "row scale_inv", "col data", "col scale_inv")):
        assert_same(g_t, w_t, f"block {tile} {isa} {name}")


@pytest.mark.parametrize("shape", [(135, 70), (300, 520), (64, 128), (1, 200), (0, 128), (200, 0)])
@pytest.mark.parametrize("tile", [(128, 128), (32, 32)])
def test_square_tiles_both_usages(isa, shape, tile):
    """Square tiles take the columnwise usage as the rowwise one transposed (a byte transpose of whole and partial
    64 x 64 pieces): the reference's bits for x2d^T, edge values in."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    if x.numel():
        x.view(-1)[:4] = torch.tensor([INF, -0.0, 1e-40, -FLT_MAX]).to(torch.bfloat16)
        x[-1, -1] = float("nan")
    check_block_usages(x, tile, True, True, isa)


def test_square_tiles_fill_the_given_columnwise_buffer(isa):
    """The pooled output buffers of large tensors (`memory.output_buffer`) reach the transpose: filled and returned,
    and one of the wrong shape is refused by name."""
    x = torch.randn(130, 200, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    row, col = torch.empty(130, 200, dtype=E4M3), torch.empty(200, 130, dtype=E4M3)
    got = native._ext().quantize_block_usages(x, 0, 128, 128, True, 0.0, FLT_MAX, True, True, row, col)
    assert got[0] is row and got[2] is col
    assert_same(col, ref.quantize_block(x.t(), E4M3, tile_rows=128, tile_cols=128)[0], f"{isa} given buffer")
    with pytest.raises(ValueError, match="out_col_data"):
        native._ext().quantize_block_usages(x, 0, 128, 128, True, 0.0, FLT_MAX, True, True, None, row)


def test_both_usages_argument_errors(isa):
    with pytest.raises(ValueError, match="x2d"):
        native.quantize_block_usages(torch.ones(32), E4M3, tile_rows=1, tile_cols=32, rowwise=True, columnwise=True)
    with pytest.raises(ValueError, match="scale_mode"):
        native.quantize_mxfp8_usages(torch.ones(32, 32), E4M3, scale_mode="up", rowwise=True, columnwise=False)
    with pytest.raises(TypeError):
        native.quantize_mxfp8_usages(torch.ones(32, 32), torch.bfloat16, rowwise=True, columnwise=True)


# ---------------------------------------------------------------------------- fp8 -> bf16
@pytest.mark.parametrize("fp8", FP8)
def test_fp8_to_bf16_every_code(isa, fp8):
    codes = torch.arange(256, dtype=torch.uint8).view(fp8)
    assert_same(native.fp8_to_bf16(codes), ref.fp8_to_bf16(codes), f"{isa} {fp8}")
    big = codes[torch.randint(0, 256, (37, 1001), generator=torch.Generator().manual_seed(0))]
    assert_same(native.fp8_to_bf16(big), ref.fp8_to_bf16(big), f"{isa} {fp8} 37x1001")
    assert_same(native.fp8_to_bf16(big.t()), ref.fp8_to_bf16(big.t()), f"{isa} {fp8} transposed")


def test_fp8_to_bf16_of_other_dtypes_follows_the_reference():
    x = torch.tensor([1.0, -2.5, 1e-3])
    assert_same(native.fp8_to_bf16(x), ref.fp8_to_bf16(x), "fp32 input")


# ------------------------------------------------------------------------- out= buffers
def test_preallocated_outputs_are_filled_and_returned(isa):
    x = with_specials(spread((130, 257), torch.bfloat16, 51), 52)
    scale = torch.tensor([2.0])
    d, dt_, am = torch.empty(130, 257, dtype=E4M3), torch.empty(257, 130, dtype=E4M3), torch.empty(1)
    got = native.cast_transpose(x, scale, E4M3, out_data=d, out_data_t=dt_, out_amax=am)
    assert got[0] is d and got[1] is dt_ and got[2] is am
    assert_all_same(got, ref.cast_transpose(x, scale, E4M3), "cast_transpose out=")

    kw = block_kwargs(torch.bfloat16, 1, True, 0.0)
    d2, s2 = torch.empty(257, 130, dtype=E4M3), torch.empty(257, 2)
    got = native.quantize_block(x.t(), E4M3, **kw, out_data=d2, out_scale_inv=s2)
    assert got[0] is d2 and got[1] is s2
    assert_all_same(got, ref.quantize_block(x.t(), E4M3, **kw), "quantize_block out=")

    x3 = spread((2, 32, 64), torch.float32, 53)
    d3, c3 = torch.empty(2, 32, 64, dtype=E5M2), torch.empty(2, 64, dtype=torch.uint8)
    got = native.quantize_mxfp8(x3, E5M2, columnwise=True, out_data=d3, out_scale=c3)
    assert got[0] is d3 and got[1] is c3
    assert_all_same(got, ref.quantize_mxfp8(x3, E5M2, columnwise=True), "quantize_mxfp8 out=")

    codes = torch.randint(0, 256, (3, 70), dtype=torch.uint8).view(E4M3)
    b = torch.empty(3, 70, dtype=torch.bfloat16)
    assert native.fp8_to_bf16(codes, out=b) is b
    assert_same(b, ref.fp8_to_bf16(codes), "fp8_to_bf16 out=")
    assert native.amax(x, out=am) is am
    assert_same(am, ref.amax(x), "amax out=")


def test_wrong_output_buffers_raise(isa):
    x = torch.ones(8, 16)
    scale = torch.ones(1)
    with pytest.raises(ValueError, match="shape"):
        native.cast_transpose(x, scale, E4M3, out_data=torch.empty(16, 8, dtype=E4M3))
    with pytest.raises(ValueError, match="dtype"):
        native.cast_transpose(x, scale, E4M3, out_data=torch.empty(8, 16, dtype=E5M2))
    with pytest.raises(ValueError, match="contiguous"):
        native.cast_transpose(x, scale, E4M3, out_data_t=torch.empty(8, 16, dtype=E4M3).t())
    with pytest.raises(ValueError, match="shape"):
        native.quantize_block(x, E4M3, tile_rows=1, tile_cols=128, out_scale_inv=torch.empty(8, 2))
    with pytest.raises(ValueError, match="shape"):
        native.quantize_mxfp8(x, E4M3, out_data=torch.empty(16, 8, dtype=E4M3))
    with pytest.raises(TypeError):
        native.cast_transpose(x.double(), scale, E4M3)
    with pytest.raises(TypeError):
        native.cast_transpose(x, scale, torch.float16)


# ------------------------------------------------------------ environment independence
def test_results_do_not_depend_on_threads_or_flush_denormal(isa):
    x = with_specials(spread((300, 700), torch.float32, 61), 62)
    x[5, :] = 1e-39  # fp32 subnormals: flush-to-zero would change them

    def run():
        kw = block_kwargs(torch.float32, 1, False, 0.0)
        return (*native.cast_transpose(x, torch.tensor([2.0**100]), E4M3), *native.quantize_block(x, E5M2, **kw),
                *native.quantize_block(x.t(), E4M3, **kw), *native.quantize_mxfp8(x[:, :640], E4M3))

    baseline = run()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert_all_same(run(), baseline, "one thread")
    finally:
        torch.set_num_threads(threads)
    try:
        torch.set_flush_denormal(True)
        assert_all_same(run(), baseline, "flush_denormal")
    finally:
        torch.set_flush_denormal(False)
    assert_same(native.amax(x), ref.amax(x), "amax")
