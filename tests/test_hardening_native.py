"""Hardening of the C++ kernels: NaN bits, inputs they were not written for, and the build cache.

* NaN bits: every scheme of `engine.ops.native` (both kernel sets) writes the canonical NaN
  of each format (FP8 0x7F, E8M0 0xFF, fp32 amax 0x7FC00000) for NaNs of either sign and
  any payload, as the reference does; the expected bits are derived here from where the
  NaNs were put, not from the code under test.
* Bad inputs: DTensors (the backend, the native wrappers and the raw C++ functions; through
  `engine.Linear` under every recipe a DTensor runs on its local piece, see
  engine/distributed/dtensor_linear.py), meta, fake, sparse, nested, vmapped and
  negated tensors get a TypeError naming the argument; expanded (stride-0), overlapping
  and non-contiguous inputs give the reference's bits; stride-0, non-contiguous or
  aliasing output buffers get a ValueError. The cases run in two worker subprocesses (this
  file run as a script), which report one JSON line per case: a segfault fails the cases
  it hit instead of killing pytest.
* The build cache: two copies of the checkout started at once on a fresh
  TORCH_EXTENSIONS_DIR share ONE build (one real build, 30-60 s on 2 cores), announce it
  on stderr once, and load it afterwards in well under 2 s without a word.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.ops import native
from tests.test_native import ISAS
from engine.ops import reference as ref
from engine.schemes import fp8_scheme

REPO = Path(__file__).resolve().parents[1]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = (E4M3, E5M2)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FLT_MAX = torch.finfo(torch.float32).max


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


@pytest.fixture(params=ISAS)
def isa(request):
    """Each instruction set the machine runs in turn, on one thread (small tensors: OpenMP threads on a busy
    2-core machine only add spin-waits)."""
    assert request.param in isas()
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


# ==================================================================== inputs C++ was not written for
# Each case: (name, expected outcome, a regex the message must match, the call). Outcome
# "ok" means the call returned bits equal to the reference's (the call checks and returns
# True); otherwise the exception type. The calls run in the worker subprocesses only.
Case = tuple[str, str, str, Callable[[dict], object]]


def _dtensor_cases() -> list[Case]:
    cases: list[Case] = []

    def linear(recipe_name):
        def run(c):  # a DTensor through engine.Linear runs on its local piece: the plain tensor's bits
            import engine
            from engine import recipes

            lin = engine.Linear(64, 32)
            twin = engine.Linear(64, 32)
            twin.load_state_dict(lin.state_dict())
            with engine.fp8_autocast(recipe=getattr(recipes, recipe_name)()):
                got = lin(c["d"]).full_tensor()
            with engine.fp8_autocast(recipe=getattr(recipes, recipe_name)()):
                want = twin(c["x"])
            return torch.equal(got, want)
        return run

    for r in ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling"):
        cases.append((f"dtensor-linear-{r}", "ok", "", linear(r)))
    cases += _bad_tensor_cases("dtensor", "d", "d8", r"subclass")
    return cases


def _bad_tensor_cases(kind: str, key: str, key8: str, pattern: str) -> list[Case]:
    """Every entry point given the bad tensor c[key] (fp32 [16, 64]), c[key + "1"] (fp32 [1])
    or c[key8] (E4M3 [16, 64]): the backend, the native wrappers and the raw C++ functions,
    as input, scale and output."""
    key1 = key + "1"
    from_backend = [
        ("backend-amax", "x", lambda c: c["backend"].amax(c[key])),
        ("backend-cast_transpose", "x2d", lambda c: c["backend"].cast_transpose(c[key], c["one"], E4M3)),
        ("backend-cast_transpose-scale", "scale", lambda c: c["backend"].cast_transpose(c["x"], c[key1], E4M3)),
        ("backend-quantize_block", "x2d", lambda c: c["backend"].quantize_block(c[key], E4M3, tile_rows=1, tile_cols=128)),
        ("backend-quantize_mxfp8", "x", lambda c: c["backend"].quantize_mxfp8(c[key], E4M3)),
        ("backend-fp8_to_bf16", "data", lambda c: c["backend"].fp8_to_bf16(c[key8])),
    ]
    wrappers = [
        ("native-amax", "x", lambda c: native.amax(c[key])),
        ("native-amax-out", "out", lambda c: native.amax(c["x"], out=c[key1])),
        ("native-cast_transpose", "x2d", lambda c: native.cast_transpose(c[key], c["one"], E4M3)),
        ("native-cast_transpose-scale", "scale", lambda c: native.cast_transpose(c["x"], c[key1], E4M3)),
        ("native-cast_transpose-out", "out_data", lambda c: native.cast_transpose(c["x"], c["one"], E4M3, out_data=c[key8])),
        ("native-quantize_block", "x2d", lambda c: native.quantize_block(c[key], E4M3, tile_rows=1, tile_cols=128)),
        ("native-quantize_mxfp8", "x", lambda c: native.quantize_mxfp8(c[key], E4M3)),
        ("native-fp8_to_bf16", "data", lambda c: native.fp8_to_bf16(c[key8])),
        ("native-quantize_per_tensor", "x", lambda c: native.quantize_per_tensor(c[key], E4M3)),
        ("native-quantize_per_tensor-scale", "scale", lambda c: native.quantize_per_tensor(c["x"], E4M3, scale=c[key1])),
        ("native-quantize_per_tensor-record", "record_amax",
         lambda c: native.quantize_per_tensor(c["x"], E4M3, record_amax=c[key1])),
        ("native-quantize_per_tensor-out", "out_data", lambda c: native.quantize_per_tensor(c["x"], E4M3, out_data=c[key8])),
        ("native-delayed_update", "amax_history", lambda c: native.delayed_update(c[key], torch.ones(64), 448.0, 0, "max")),
        ("native-delayed_update-scale", "scale", lambda c: native.delayed_update(c["x"], c[key1], 448.0, 0, "max")),
    ]
    raw = [
        ("raw-amax", "x", lambda c: native._ext().amax(c[key], None)),
        ("raw-amax-out", "out", lambda c: native._ext().amax(c["x"], c[key1])),
        ("raw-cast_transpose", "x2d",
         lambda c: native._ext().cast_transpose(c[key], c["one"], 0, True, True, None, None, None)),
        ("raw-cast_transpose-scale", "scale",
         lambda c: native._ext().cast_transpose(c["x"], c[key1], 0, True, True, None, None, None)),
        ("raw-cast_transpose-out", "out_data",
         lambda c: native._ext().cast_transpose(c["x"], c["one"], 0, True, False, c[key8], None, None)),
        ("raw-quantize_per_tensor", "x",
         lambda c: native._ext().quantize_per_tensor(c[key], 0, True, True, None, False, 0.0, None)),
        ("raw-quantize_per_tensor-scale", "scale",
         lambda c: native._ext().quantize_per_tensor(c["x"], 0, True, True, c[key1], False, 0.0, None)),
        ("raw-quantize_per_tensor-record", "record_amax",
         lambda c: native._ext().quantize_per_tensor(c["x"], 0, True, True, None, False, 0.0, c[key1])),
        ("raw-quantize_per_tensor-out", "out_data",
         lambda c: native._ext().quantize_per_tensor(c["x"], 0, True, True, None, False, 0.0, None, c[key8])),
        ("raw-delayed_update", "amax_history",
         lambda c: native._ext().delayed_update(c[key], torch.ones(64), 448.0, 0, False, [])),
        ("raw-delayed_update-scale", "scale",
         lambda c: native._ext().delayed_update(c["x"].clone(), c[key1], 448.0, 0, False, [])),
        ("raw-quantize_block", "x2d",
         lambda c: native._ext().quantize_block(c[key], 0, 1, 128, True, 0.0, FLT_MAX, None, None)),
        ("raw-quantize_mxfp8", "x", lambda c: native._ext().quantize_mxfp8(c[key], 0, True, True, None, None)),
        ("raw-fp8_to_bf16", "data", lambda c: native._ext().fp8_to_bf16(c[key8], None)),
        ("raw-exact_gemm", "a", lambda c: native._ext().exact_gemm(
            c[key8], c["one"], 0, 0, c["x"].to(E4M3), c["one"], 0, 0, None, torch.bfloat16, True)),
        ("raw-exact_gemm-scale", "b", lambda c: native._ext().exact_gemm(
            c["x"].to(E4M3), c["one"], 0, 0, c["x"].to(E4M3), c[key1], 0, 0, None, torch.bfloat16, True)),
        ("raw-exact_gemm-bias", "bias", lambda c: native._ext().exact_gemm(
            c["x"].to(E4M3), c["one"], 0, 0, c["x"].to(E4M3), c["one"], 0, 0, c[key][0], torch.bfloat16, True)),
    ]
    cases = [(f"{kind}-{name}", "TypeError", rf"^{arg}: .*{pattern}", fn) for name, arg, fn in from_backend + wrappers]
    # C++ names the argument the same way; it sees no Python type, only the tensor's dispatch keys
    raw_pattern = {"dtensor": "subclass", "fake": "subclass", "meta": "meta"}.get(kind, pattern)
    cases += [(f"{kind}-{name}", "TypeError", rf"^{arg}: .*{raw_pattern}", fn) for name, arg, fn in raw]
    return cases


def _local_cases() -> list[Case]:
    cases: list[Case] = []

    def linear_on(key, recipe_name):
        def run(c):
            import engine
            from engine import recipes

            with engine.fp8_autocast(recipe=getattr(recipes, recipe_name)()):
                engine.Linear(64, 32)(c[key])
        return run

    for r in ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling"):
        cases.append((f"meta-linear-{r}", "TypeError", r"meta", linear_on("meta", r)))
    cases += _bad_tensor_cases("meta", "meta", "meta8", r"meta")
    cases += _bad_tensor_cases("fake", "fake", "fake8", r"FakeTensor")
    cases += _bad_tensor_cases("sparse", "sparse", "sparse8", r"layout")
    cases += [(n, o, p, f) for n, o, p, f in _bad_tensor_cases("subclass", "sub", "sub8", r"subclass")
              if not n.startswith("subclass-raw")]  # no __torch_dispatch__: C++ reads it as the plain tensor it is

    def inside_fake_mode(fn):
        def run(c):
            with c["fake_mode"]:
                return fn(c)
        return run

    def real_inside_fake_mode(c):
        with c["fake_mode"]:
            got = native._ext().cast_transpose(c["x"], c["two"], 0, True, True, None, None, None)
        same_bits(got, c["want_ct2"], "raw inside FakeTensorMode")
        return True

    cases += [
        ("fake-inside-mode-amax", "TypeError", r"^x: .*FakeTensor", inside_fake_mode(lambda c: native.amax(c["fake"]))),
        ("fake-inside-mode-raw-amax", "TypeError", r"^x: .*subclass",
         inside_fake_mode(lambda c: native._ext().amax(c["fake"], None))),
        # real tensors while a FakeTensorMode is active: the C++ outputs are still real
        ("real-inside-fake-mode-raw", "ok", "", real_inside_fake_mode),
        ("nested-native-amax", "TypeError", r"^x: .*nested", lambda c: native.amax(c["nested"])),
        ("nested-backend-quantize_mxfp8", "TypeError", r"^x: .*nested",
         lambda c: c["backend"].quantize_mxfp8(c["nested"], E4M3)),
        ("vmap-native-amax", "TypeError", r"^x: .*dispatch keys", lambda c: torch.func.vmap(native.amax)(c["x"])),
        ("vmap-backend-cast_transpose", "TypeError", r"^x2d: .*dispatch keys",
         lambda c: torch.func.vmap(lambda r: c["backend"].cast_transpose(r[None], c["one"], E4M3))(c["x"])),
        ("neg-view-native-amax", "TypeError", r"^x: .*dispatch keys", lambda c: native.amax(torch._neg_view(c["x"]))),
        ("not-a-tensor", "TypeError", r"^x2d: expected a torch.Tensor, got list",
         lambda c: c["backend"].quantize_block([[1.0]], E4M3, tile_rows=1, tile_cols=128)),
    ]

    # layouts the kernels handle: the reference's bits
    def agrees(make):
        @torch.no_grad()
        def run(c):
            x = make(c)
            one, two = c["one"], torch.tensor([2.0])
            kw = {"tile_rows": 1, "tile_cols": 128}
            pairs = [
                ((native.amax(x),), (ref.amax(x),)),
                (native.cast_transpose(x, two, E4M3), ref.cast_transpose(x, two, E4M3)),
                (native.cast_transpose(x, one, E5M2, columnwise=False), ref.cast_transpose(x, one, E5M2, columnwise=False)),
                (native.quantize_block(x, E4M3, **kw), ref.quantize_block(x, E4M3, **kw)),
                (native.quantize_block(x, E4M3, tile_rows=128, tile_cols=128),
                 ref.quantize_block(x, E4M3, tile_rows=128, tile_cols=128)),
                (native.quantize_mxfp8(x, E4M3), ref.quantize_mxfp8(x, E4M3)),
                (native.quantize_mxfp8(x, E4M3, columnwise=True), ref.quantize_mxfp8(x, E4M3, columnwise=True)),
                ((native.fp8_to_bf16(ref.cast_to_fp8(x, E4M3).t()),), (ref.cast_to_fp8(x, E4M3).t().to(torch.bfloat16),)),
                (native.quantize_per_tensor(x, E5M2, scale=two)[:2], ref.cast_transpose(x, two, E5M2)[:2]),
                (native.quantize_per_tensor(x, E4M3)[::2], ref.quantize_blocked(x, fp8_scheme("tensor", E4M3))),
            ]
            for got, want in pairs:
                same_bits(got, want, f"strides {tuple(x.stride())}")
            return True
        return run

    g = torch.Generator().manual_seed(0)
    rows = torch.randn(1, 192, generator=g).to(torch.bfloat16)
    cols = torch.randn(96, 1, generator=g)
    flat = torch.randn(96 * 192, generator=g)
    cases += [
        ("stride0-rows", "ok", "", agrees(lambda c: rows.expand(96, 192))),
        ("stride0-cols", "ok", "", agrees(lambda c: cols.expand(96, 192))),
        ("stride0-scalar", "ok", "", agrees(lambda c: flat[:1].reshape(1, 1).expand(64, 128))),
        ("overlapping-rows", "ok", "", agrees(lambda c: flat.as_strided((96, 192), (64, 1)))),
        ("non-contiguous-cols", "ok", "", agrees(lambda c: flat.reshape(96, 192)[:, ::3])),
        ("transposed", "ok", "", agrees(lambda c: flat.reshape(192, 96).t())),
        ("parameter", "ok", "", agrees(lambda c: torch.nn.Parameter(flat.reshape(96, 192).clone()))),
    ]

    # outputs the kernels cannot write: stride-0, non-contiguous, aliasing
    x = flat.reshape(96, 192)
    cases += [
        ("out-stride0", "ValueError", r"^out_data: .*contiguous",
         lambda c: native.cast_transpose(x, c["one"], E4M3, out_data=torch.empty(1, 192, dtype=E4M3).expand(96, 192))),
        ("raw-out-stride0", "ValueError", r"^out_data: .*contiguous",
         lambda c: native._ext().quantize_block(x, 0, 1, 128, True, 0.0, FLT_MAX,
                                               torch.empty(96, 1, dtype=E4M3).expand(96, 192), None)),
        ("out-non-contiguous", "ValueError", r"^out_data_t: .*contiguous",
         lambda c: native.cast_transpose(x, c["one"], E4M3, out_data_t=torch.empty(96, 192, dtype=E4M3).t())),
        ("mx-out-non-contiguous", "ValueError", r"^out_data: .*contiguous",
         lambda c: native.quantize_mxfp8(x, E4M3, out_data=torch.empty(192, 96, dtype=E4M3).t())),
        ("out-aliases-input", "ValueError", r"^out: shares memory with x",
         lambda c: native.amax(c["x"], out=c["x"].view(-1)[5:6])),
        ("outputs-alias-each-other", "ValueError", r"^out_data: shares memory with out_data_t",
         lambda c: (lambda buf: native.cast_transpose(c["square"], c["one"], E4M3, out_data=buf, out_data_t=buf))(
             torch.empty(64, 64, dtype=E4M3))),
        ("scale-not-one-element", "ValueError", r"^scale: expected a 1-element tensor",
         lambda c: native.cast_transpose(c["x"], torch.ones(2), E4M3)),
    ]
    return cases


GROUPS: dict[str, Callable[[], list[Case]]] = {"dtensor": _dtensor_cases, "local": _local_cases}


def _context(group: str) -> dict:
    """The tensors the cases of `group` use (in the worker)."""
    from engine.ops import backend

    backend._choose.cache_clear()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 64, generator=g)
    c = {"backend": backend, "x": x, "one": torch.ones(1), "two": torch.tensor([2.0]),
         "square": torch.randn(64, 64, generator=g),
         "want_ct2": ref.cast_transpose(x, torch.tensor([2.0]), E4M3)}
    if group == "dtensor":
        import torch.distributed as dist
        from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, distribute_tensor

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=0, world_size=1)
        mesh = DeviceMesh("cpu", [0])
        c["d"] = distribute_tensor(x.clone(), mesh, [Replicate()])
        c["d1"] = distribute_tensor(torch.ones(1), mesh, [Replicate()])
        c["d8"] = DTensor.from_local(x.to(E4M3), mesh, [Replicate()], run_check=False)
        return c
    from torch._subclasses.fake_tensor import FakeTensorMode

    class Sub(torch.Tensor):  # a subclass without __torch_dispatch__
        pass

    one = torch.ones(1)
    c["meta"], c["meta1"], c["meta8"] = x.to("meta"), one.to("meta"), x.to(E4M3).to("meta")
    c["fake_mode"] = mode = FakeTensorMode()
    with mode:
        c["fake"], c["fake1"], c["fake8"] = torch.randn(16, 64), torch.ones(1), torch.zeros(16, 64, dtype=E4M3)
    c["sparse"], c["sparse1"], c["sparse8"] = x.to_sparse(), one.to_sparse(), x.to_sparse().to(E4M3)
    c["sub"], c["sub1"], c["sub8"] = x.as_subclass(Sub), one.as_subclass(Sub), x.to(E4M3).as_subclass(Sub)
    c["nested"] = torch.nested.nested_tensor([torch.randn(2, 64), torch.randn(3, 64)])
    return c


def _worker(group: str) -> None:
    """Run the cases of `group`, one JSON line when each starts and one with its outcome."""
    torch.set_num_threads(1)
    assert native.available(), native.why_unavailable()
    c = _context(group)
    for name, _, _, fn in GROUPS[group]():
        print(json.dumps({"start": name}), flush=True)
        try:
            value = fn(c)
            outcome, message = ("ok" if value is True else f"returned {type(value).__name__}"), ""
        except Exception as exc:  # the outcome is what the test checks
            outcome, message = type(exc).__name__, str(exc).split("\n")[0]
        print(json.dumps({"case": name, "outcome": outcome, "message": message}), flush=True)
    print(json.dumps({"done": True}), flush=True)
    if group == "dtensor":
        import torch.distributed as dist

        dist.destroy_process_group()


@pytest.fixture(scope="module")
def bad_input_reports() -> dict[str, dict]:
    """Run both groups' workers at once; {case: report}, or a report of the crash."""
    assert native.available(), native.why_unavailable()  # build (if needed) before the workers load it
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("ENGINE_BACKEND", None)
    procs = {g: subprocess.Popen([sys.executable, __file__, "--worker", g], cwd=REPO, env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE) for g in GROUPS}
    reports: dict[str, dict] = {}
    for group, p in procs.items():
        out, err = p.communicate(timeout=600)
        started = None
        for line in out.splitlines():
            if not line.startswith("{"):
                continue
            rec = json.loads(line)
            if "start" in rec:
                started = rec["start"]
            elif "case" in rec:
                reports[rec["case"]] = rec
                started = None
        if p.returncode != 0:
            crash = {"outcome": f"worker died with exit code {p.returncode}", "message": err[-2000:]}
            if started is not None:
                reports[started] = dict(crash, outcome=crash["outcome"] + " in this case")
            reports[f"__{group}__"] = crash
    return reports


ALL_CASES = [case for group in GROUPS.values() for case in group()]


@pytest.mark.parametrize("name, outcome, pattern", [c[:3] for c in ALL_CASES], ids=[c[0] for c in ALL_CASES])
def test_bad_inputs_raise_and_never_crash(bad_input_reports, name, outcome, pattern):
    report = bad_input_reports.get(name)
    if report is None:
        crashed = [v for k, v in bad_input_reports.items() if k.startswith("__")]
        pytest.fail(f"{name}: no report (the worker crashed before it: {crashed})")
    assert report["outcome"] == outcome, report
    assert re.search(pattern, report["message"]), report


def test_case_list_covers_the_brief():
    names = [c[0] for c in ALL_CASES]
    assert len(names) == len(set(names))
    for r in ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling"):
        assert f"dtensor-linear-{r}" in names
    for kind in ("dtensor", "meta", "fake"):
        for fn in ("amax", "cast_transpose", "quantize_block", "quantize_mxfp8", "fp8_to_bf16"):
            for where in ("backend", "native", "raw"):
                assert f"{kind}-{where}-{fn}" in names, (kind, where, fn)
    assert {"stride0-rows", "stride0-cols", "out-stride0", "out-non-contiguous"} <= set(names)


# =========================================================================== the JIT fallback's cache
BUILD_LINE = re.compile(r"engine: building the C\+\+ kernels \(first use, 1-4 min\) into (\S+)")
WHY_LINE = re.compile(r"engine: engine\._native is (missing|stale \(.*\)); `make install` or "
                      r"`pip install --no-build-isolation -e \.` builds it at install")
BUILT_LINE = re.compile(r"engine: built the C\+\+ kernels in \d+\.\d s")
# copies of the checkout without an installed build (make install leaves engine/_native*.so in engine/)
NOT_BUILT = shutil.ignore_patterns("__pycache__", "_native*.so")


@pytest.fixture
def not_installed(monkeypatch):
    """As if engine._native were not installed (after `make install` it is, and would load instead)."""
    monkeypatch.setattr(native, "installed_build", lambda key: (None, f"{native.INSTALLED} is missing"))


def test_build_key_follows_the_sources_not_the_path(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(native.CSRC_DIR, a)
    shutil.copytree(native.CSRC_DIR, b)
    assert native.build_key(a) == native.build_key(b) == native.build_key()
    with open(sorted(b.rglob("*.h"))[-1], "a") as f:
        f.write("\n// a change\n")
    assert native.build_key(b) != native.build_key(a)


def test_build_messages_only_when_a_build_happens(monkeypatch, tmp_path, capsys, not_installed):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    built = types.ModuleType("built")
    compiled = []

    def compile_(name, folder, key):  # stands for torch's build: leaves a library behind
        compiled.append((name, folder, key))
        (folder / f"{name}.so").write_bytes(b"")
        return built

    monkeypatch.setattr(native, "_compile", compile_)
    monkeypatch.setattr(native, "_import_built", lambda name, folder: built)
    folder = tmp_path / f"engine_native_{native.build_key()}"
    assert native._build() is built
    err = capsys.readouterr().err.splitlines()
    assert compiled == [(folder.name, folder, native.build_key())]
    assert len(err) == 3 and BUILD_LINE.fullmatch(err[0]) and WHY_LINE.fullmatch(err[1]), err
    assert BUILT_LINE.fullmatch(err[2]), err
    assert BUILD_LINE.fullmatch(err[0]).group(1) == str(folder)
    assert native._build() is built  # a cache hit: the build's marker is there
    assert capsys.readouterr().err == "" and len(compiled) == 1


def test_a_failed_build_says_so_and_is_retried_next_time(monkeypatch, tmp_path, capsys, not_installed):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))

    def broken(name, folder, key):
        raise RuntimeError("c++: command not found")

    monkeypatch.setattr(native, "_compile", broken)
    with pytest.raises(RuntimeError, match="command not found"):
        native._build()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and BUILD_LINE.fullmatch(err[0]) and WHY_LINE.fullmatch(err[1]), err
    assert re.fullmatch(r"engine: building the C\+\+ kernels failed after \d+\.\d s", err[2]), err
    with pytest.raises(RuntimeError):  # no marker was left: the next process builds again
        native._build()


LOAD_SCRIPT = """
import json, sys
import engine
from engine.ops import native
ok = native.available()
print(json.dumps({"ok": ok, "why": native.why_unavailable()[-3000:], "seconds": native.build_seconds,
                  "engine": engine.__file__, "dir": str(native.build_directory()) if ok else None}))
"""


def _run_loads(copies: list[Path], ext_dir: Path) -> list[tuple[dict, str]]:
    """Load the extension from each copy at once (one process each): [(report, stderr)]."""
    procs = []
    for copy in copies:
        env = dict(os.environ, PYTHONPATH=str(copy), TORCH_EXTENSIONS_DIR=str(ext_dir))
        env.pop("ENGINE_NATIVE_VERBOSE", None)
        procs.append(subprocess.Popen([sys.executable, "-c", LOAD_SCRIPT], cwd=copy, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-3000:]
        results.append((json.loads(out.strip().splitlines()[-1]), err))
    return results


@pytest.fixture(scope="module")
def two_checkouts(tmp_path_factory):
    """Two copies of the checkout load the extension at once on a fresh TORCH_EXTENSIONS_DIR
    (where a killed build left torch's lock file behind), then once more each."""
    root = tmp_path_factory.mktemp("checkouts")
    copies = []
    for name in ("a", "b"):
        for part in ("engine", "csrc"):
            shutil.copytree(REPO / part, root / name / part, ignore=NOT_BUILT)
        copies.append(root / name)
    ext_dir = root / "torch_extensions"
    stale = ext_dir / f"engine_native_{native.build_key()}"
    stale.mkdir(parents=True)
    (stale / "lock").write_text("")  # torch's baton from a build that was killed
    first = _run_loads(copies, ext_dir)
    libraries = sorted(ext_dir.glob("*/*.so"))
    stat_before = [(p, p.stat().st_ino, p.stat().st_mtime_ns) for p in libraries]
    second = _run_loads(copies, ext_dir)
    stat_after = [(p, p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(ext_dir.glob("*/*.so"))]
    return {"copies": copies, "ext_dir": ext_dir, "first": first, "second": second,
            "stat_before": stat_before, "stat_after": stat_after}


def test_two_checkouts_started_together_share_one_build(two_checkouts):
    first = two_checkouts["first"]
    for (report, err), copy in zip(first, two_checkouts["copies"]):
        assert report["ok"], report["why"]
        assert report["engine"].startswith(str(copy)), report["engine"]
    stderr = "\n".join(err for _, err in first)
    builds = BUILD_LINE.findall(stderr)
    assert len(builds) == 1, stderr  # ONE build for both processes
    assert len(BUILT_LINE.findall(stderr)) == 1 and len(WHY_LINE.findall(stderr)) == 1, stderr
    assert builds[0] == first[0][0]["dir"] == first[1][0]["dir"]
    assert Path(builds[0]).parent == two_checkouts["ext_dir"]
    assert len(two_checkouts["stat_before"]) == 1  # one library, in one engine_native_<key> folder


def test_later_loads_are_fast_silent_and_do_not_rewrite_the_library(two_checkouts):
    for report, err in two_checkouts["second"]:
        assert report["ok"], report["why"]
        assert report["seconds"] < 2.0, report
        assert "engine:" not in err, err
    assert two_checkouts["stat_after"] == two_checkouts["stat_before"]


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    _worker(sys.argv[2])


def test_exact_gemm_names_bad_shapes_tiles_and_dtypes():
    """The C++ GEMM checks what Python would: each mistake is a ValueError/TypeError naming the argument."""
    ext, one = native._ext(), torch.ones(1)
    a, b = torch.zeros(4, 64).to(E4M3), torch.zeros(8, 64).to(E4M3)
    codes_a, codes_b = torch.zeros(4, 2, dtype=torch.uint8), torch.zeros(8, 2, dtype=torch.uint8)
    bad = [
        (ValueError, "inner dims", lambda: ext.exact_gemm(a, one, 0, 0, torch.zeros(8, 32).to(E4M3), one, 0, 0,
                                                          None, torch.bfloat16, True)),
        (TypeError, "^a: .*float8", lambda: ext.exact_gemm(a.view(torch.uint8), one, 0, 0, b, one, 0, 0, None,
                                                           torch.bfloat16, True)),
        (ValueError, "^a: .*tile sizes", lambda: ext.exact_gemm(a, codes_a, 1, 0, b, codes_b, 1, 32, None,
                                                                torch.bfloat16, True)),
        (ValueError, "^b: .*tile scales of shape", lambda: ext.exact_gemm(a, codes_a, 1, 32, b, codes_a, 1, 32,
                                                                          None, torch.bfloat16, True)),
        (ValueError, "per-tensor", lambda: ext.exact_gemm(a, one, 0, 0, b, codes_b, 1, 32, None, torch.bfloat16, True)),
        (ValueError, "^bias: .*shape", lambda: ext.exact_gemm(a, one, 0, 0, b, one, 0, 0, torch.zeros(4),
                                                              torch.bfloat16, True)),
        (TypeError, "^out_dtype", lambda: ext.exact_gemm(a, one, 0, 0, b, one, 0, 0, None, torch.int32, True)),
        (ValueError, "^a: .*1-element", lambda: ext.exact_gemm(a, torch.ones(2), 0, 0, b, one, 0, 0, None,
                                                               torch.bfloat16, True)),
    ]
    for error, pattern, call in bad:
        with pytest.raises(error, match=pattern):
            call()
