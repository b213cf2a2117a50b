"""The kernel registry and the custom ops.

* Every entry of `registry.KERNELS` is enrolled here by iterating the table: CPU entries run
  in-process, CUDA (Triton) entries under `TRITON_INTERPRET=1` in a subprocess on CPU
  tensors; each is compared bit for bit (NaN bits included; the exact GEMM: its decode bit for bit,
  its fp32 accumulation within a bound, see compare_exact_gemm) with the generic reference on
  random data and edge cases, for every scheme of its layout (per-tensor kernels with the
  amax they record, the delayed update on random histories with NaN/inf/zeros).
* `torch.library.opcheck` passes for each custom op.
* An op without a kernel runs the reference with one warning, so a scheme can land as data
  and its reference alone (a per-row scheme made up here goes through quantize, dequantize
  and the GEMM).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import exact_gemm_bound
from engine.gemm import general_gemm
from engine.ops import backend, registry
from engine.ops import quantize as qops
from engine.ops.reference import dequantize_blocked
from engine.formats import MX_ELEMENTS
from engine.schemes import BUFFER_FIELDS, SCHEMES, Block, ScaleEncoding, Scheme
from engine.tensors.storage import QuantizedTensorBase

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def edge_inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random data and the edge cases: zeros, subnormals, +-max, saturation, inf, NaN of both signs, odd shapes."""
    g = torch.Generator().manual_seed(0)
    big = torch.finfo(dtype).max
    x = (torch.randn(67, 130, generator=g) * torch.rand(67, 130, generator=g) * 600).to(dtype)
    flat = x.view(-1)
    flat[:8] = torch.tensor([0.0, -0.0, big, -big, 1e-40, -3e-45, float("inf"), float("-inf")]).to(dtype)
    nan_bits = {torch.float32: [0x7FC00000, -0x00400000, 0x7F800001], torch.bfloat16: [0x7FC0, -0x40, 0x7F81],
                torch.float16: [0x7E00, -0x200, 0x7C01]}[dtype]
    int_dtype = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
    flat[200:203] = torch.tensor(nan_bits, dtype=int_dtype).view(dtype)
    return {"random+edges": x, "zeros": torch.zeros(32, 64, dtype=dtype), "3d-odd": x[:63].reshape(3, 21, 130),
            "empty": torch.zeros(0, 64, dtype=dtype), "one-row": x[:1, :70]}


def bits(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def delayed_states() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Amax histories [L, n] and scales [n]: random, with NaN/inf/zeros in row 0 and NaN in older rows."""
    g = torch.Generator().manual_seed(0)
    states = []
    for rows, cols in ((1, 3), (2, 1), (16, 5), (1024, 3)):
        history = torch.rand(rows, cols, generator=g) * torch.exp2(torch.randint(-130, 120, (rows, cols), generator=g)
                                                                   .float())
        history[0, : min(cols, 3)] = torch.tensor([float("nan"), float("inf"), 0.0])[: min(cols, 3)]
        if rows > 2:
            history[rows // 2, 0] = float("nan")
        scale = torch.rand(cols, generator=g) * 100
        states.append((f"{rows}x{cols}", history, scale))
    return states


def compare_delayed_update(fn) -> list[str]:
    bad = []
    for name, history, scale in delayed_states():
        for algo in ("max", "most_recent"):
            for margin in (0, 2):
                for held in ([], [0]):
                    got, want = (history.clone(), scale.clone()), (history.clone(), scale.clone())
                    fn(*got, 448.0, margin, algo, held)
                    registry.REFERENCE["delayed_update"](*want, 448.0, margin, algo, held)
                    if not (same_bits(got[0], want[0]) and same_bits(got[1], want[1])):
                        bad.append(f"delayed_update {name} {algo} margin={margin} held={held}")
    return bad


def gemm_operands(rows: int, k: int, tile: tuple[int, int], element: torch.dtype, e8m0: bool, g: torch.Generator):
    """FP8 data [rows, K] over every code (NaN, E5M2 inf, subnormals) and its scales: [1] per tensor, else one
    power-of-2 scale per tile (E8M0 codes with 0, 254 and 255 among them, or fp32 powers of two)."""
    data = torch.randint(0, 256, (rows, k), generator=g, dtype=torch.uint8)
    data.view(-1)[: min(256, rows * k)] = torch.arange(min(256, rows * k), dtype=torch.uint8)
    if tile == (0, 0):
        return data.view(element), torch.rand(1, generator=g) * 4 + 0.01
    grid = (-(-rows // tile[0]), -(-k // tile[1]))
    codes = torch.randint(110, 140, grid, generator=g, dtype=torch.uint8)
    codes.view(-1)[:3] = torch.tensor([0, 254, 255], dtype=torch.uint8)[: codes.numel()]
    scales = codes if e8m0 else torch.exp2(codes.float() - 127)
    return data.view(element), scales


def compare_exact_gemm(fn, addmm: bool) -> list[str]:
    """The exact GEMM over per-tensor and power-of-2 tile pairs: odd and empty shapes, transposed (strided)
    data and scales, a bias, every output dtype, scale products out of fp32's normal range (None).

    Not bitwise (the fp32 accumulation order is unspecified: addmm's or the small kernel's): each result, and
    the torch-op reference's, within the fp32 bound of an independent fp64 reference (tests/exact_gemm_bound.py).
    The decode is bitwise: A @ I is A's decoded value exactly, for every finite code and E8M0 scale.
    `addmm`: fn runs addmm (below avx512), whose bf16 GEMM flushes subnormals where it is native (bf16
    hardware), as the reference's does; elsewhere a bf16 output comes from the fp32 GEMM, which keeps them."""
    from engine.ops.exact_gemm import native_bf16_gemm

    g, bad = torch.Generator().manual_seed(0), []
    cases = [((0, 0), (0, 0), 16, 37, 40), ((1, 32), (1, 32), 9, 21, 70), ((1, 128), (128, 128), 5, 130, 260),
             ((32, 1), (32, 1), 40, 33, 64), ((1, 32), (1, 32), 0, 3, 32), ((1, 32), (1, 32), 3, 4, 0)]
    for a_tile, b_tile, m, n, k in cases:
        for element in (torch.float8_e4m3fn, torch.float8_e5m2):
            for e8m0 in (True, False):
                a, sa = gemm_operands(m, k, a_tile, element, e8m0, g)
                b, sb = gemm_operands(n, k, b_tile, element, e8m0, g)
                if a_tile == (32, 1):  # stored in x's shape, read transposed: strided data and scales
                    a, sa = a.t().contiguous().t(), sa.t().contiguous().t()
                if a_tile == (1, 128):  # decoded 4/6-bit element values arrive as bf16 data
                    a = a.to(torch.bfloat16)
                if a_tile == (1, 32) and m == 9:  # extreme codes: A's values round into bf16's subnormals
                    sa.fill_(0 if e8m0 else 2.0**-127)
                    sb.fill_(227 if e8m0 else 2.0**100)
                for out_dtype in (torch.bfloat16, torch.float32, torch.float16):
                    for bias in (None, torch.randn(n, generator=g).to(out_dtype)):
                        args = (a, sa, a_tile, b, sb, b_tile, bias, out_dtype)
                        for who, f, onednn in (("kernel", fn, addmm), ("reference", registry.REFERENCE["exact_gemm"], True)):
                            flush = onednn and out_dtype == torch.bfloat16 and native_bf16_gemm()
                            why = exact_gemm_bound.check(f(*args), *args, flush=flush)
                            if why:
                                bad.append(f"exact_gemm {who} {a_tile}x{b_tile} {m}x{n}x{k} {element} e8m0={e8m0} "
                                           f"{out_dtype}: {why}")
    for element in (torch.float8_e4m3fn, torch.float8_e5m2):  # B = I: the output is A's decoded value itself
        codes = torch.arange(256, dtype=torch.uint8).view(element)
        finite = codes[codes.float().isfinite()]
        a = finite[torch.randint(0, finite.numel(), (64, 96), generator=g)]
        sa = torch.randint(0, 255, (64, 3), generator=g, dtype=torch.uint8)  # every code but NaN, 0 and 254 too
        sa[0, :2] = torch.tensor([0, 254], dtype=torch.uint8)
        eye, ones = torch.eye(96).to(element), torch.full((96, 3), 127, dtype=torch.uint8)
        args = (a, sa, (1, 32), eye, ones, (1, 32), None, torch.float32)
        decoded = exact_gemm_bound.decode64(a, sa, (1, 32)).float()
        infs = decoded.isinf().sum(1, keepdim=True)  # an inf (overflow) times B's zeros: NaN but at its own column
        want = torch.where((infs == 0) | ((infs == 1) & decoded.isinf()), decoded, torch.nan)
        assert want.isfinite().all(1).sum() > 32 and (decoded.abs() < 2.0**-126).any()  # subnormals among them
        if not all(torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
                   for got in (fn(*args), registry.REFERENCE["exact_gemm"](*args))):
            bad.append(f"exact_gemm: A @ I differs from A's decoded value ({element})")
    tiny = torch.tensor([1e-30]), torch.tensor([1e-20])
    a, _ = gemm_operands(4, 16, (0, 0), torch.float8_e4m3fn, True, g)
    for sa, sb in (tiny, (torch.tensor([1e30]), torch.tensor([1e20])), (torch.tensor([0.0]), torch.tensor([1.0]))):
        if fn(a, sa, (0, 0), a, sb, (0, 0), None, torch.float32) is not None:
            bad.append(f"exact_gemm: scale product {sa.item()} * {sb.item()} not normal, but no None")
    return bad


def compare_nvfp4(fn, layout: str, x: torch.Tensor, what: str, *, matrix: bool = True) -> list[str]:
    """An NVFP4 kernel against the reference for each option: 2D tiles, stochastic rounding (the same bits and
    the counter advanced alike), given amaxes, one usage or both. The RHT needs M % 16 == 0: both refuse others.
    `matrix=False`: the default options only (both usages, 1x16 blocks, RNE, x's own amaxes)."""
    bad = []
    scheme = next(s for s in SCHEMES.values() if s.layout == layout)
    rht = scheme.columnwise_transform is not None
    # a scheme with 4over6's bound E = 256 is quantized with 4over6 (which refuses stochastic rounding)
    four_over_six = {"four_over_six": True} if scheme.tensor_scale_max != 448.0 else {}
    m = x.reshape(-1, x.shape[-1]).shape[0] if x.dim() > 1 else 1
    if rht and m % 16 and m > 16:  # the RHT runs on the whole 16-token groups of x too
        bad += compare_nvfp4(fn, layout, x.reshape(m, -1)[: m // 16 * 16], f"{what} (first {m // 16 * 16} rows)",
                             matrix=matrix)
    for two_d in ((False,) if rht or not matrix else (False, True)):
        for sr in (False, True) if matrix and not four_over_six else (False,):
            for given in (None, (torch.tensor([3.5]), torch.tensor([1e-30]))) if matrix else (None,):
                for rowwise, columnwise in ((True, True), (True, False), (False, True)) if matrix else ((True, True),):
                    counters = [torch.tensor([2**40 + 7, 2**32 - 100]) if sr else None for _ in range(2)]
                    opts = dict(rowwise=rowwise, columnwise=columnwise, two_d=two_d,
                                amax_rowwise=None if given is None else given[0],
                                amax_columnwise=None if given is None else given[1], **four_over_six)
                    label = f"{scheme.name} {what} two_d={two_d} sr={sr} given={given is not None} " \
                            f"usages={rowwise, columnwise}"
                    if rht and columnwise and m % 16:
                        for f, c in ((fn, counters[0]), (registry.REFERENCE["quantize"], counters[1])):
                            with pytest.raises(ValueError, match="multiple of 16"):
                                f(x, scheme, rng_counter=c, **opts)
                        continue
                    got, _ = fn(x, scheme, rng_counter=counters[0], **opts)
                    want, _ = registry.REFERENCE["quantize"](x, scheme, rng_counter=counters[1], **opts)
                    for field in scheme.fields:
                        if not same_bits(got[field], want[field]):
                            bad.append(f"{label} {field}")
                    if sr and not torch.equal(counters[0], counters[1]):
                        bad.append(f"{label} counter")
    return bad


def compare_entry(op: str, layout: str, fn) -> list[str]:
    """Mismatches between a registered kernel and the reference, over every scheme of its layout."""
    if op == "delayed_update":
        return compare_delayed_update(fn)
    if op == "exact_gemm":
        from engine.ops import native

        return compare_exact_gemm(fn, native.isa() == "baseline")
    bad = []
    recorded = iter([None, 0.0, 5.0, float("nan"), 1e30] * 1000)  # per-tensor kernels record max(state, amax)
    for dtype in DTYPES:
        for name, x in edge_inputs(dtype).items():
            if op == "amax":
                if not same_bits(fn(x), registry.REFERENCE["amax"](x)):
                    bad.append(f"amax {dtype} {name}")
                continue
            if op == "elements_to_bf16":  # every byte of MX E2M1 / E2M3 / E3M2 codes (high bits ignored)
                codes = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
                for fmt in MX_ELEMENTS.values():
                    for cols in ((127, 128) if fmt.bits == 4 else (64,)):
                        got, want = fn(codes, fmt, cols), registry.REFERENCE["elements_to_bf16"](codes, fmt, cols)
                        if not (got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
                                and torch.equal(got.view(torch.int16), want.view(torch.int16))):
                            bad.append(f"elements_to_bf16 {fmt.name} cols={cols}")
                continue
            if op == "fp8_to_bf16":
                for element in (torch.float8_e4m3fn, torch.float8_e5m2):
                    codes = torch.arange(256, dtype=torch.uint8).view(element)
                    if not same_bits(fn(codes), registry.REFERENCE["fp8_to_bf16"](codes)):
                        bad.append(f"fp8_to_bf16 {element}")
                continue
            if any(s.tensor_scale for s in SCHEMES.values() if s.layout == layout):
                bad += compare_nvfp4(fn, layout, x, f"{dtype} {name}")
                continue
            for scheme in (s for s in SCHEMES.values() if s.layout == layout):
                for scale in ([None, torch.tensor([3.0])] if layout == "tensor" else [None]):
                    for rule in ({"amax_epsilon": 0.0, "scale_mode": "rceil"}, {"amax_epsilon": 1e-3, "scale_mode": "floor"}):
                        start = next(recorded) if layout == "tensor" else None
                        if start is not None:
                            got_state, want_state = torch.tensor([start]), torch.tensor([start])
                            rule = {**rule, "record_amax": got_state}
                        got, _ = fn(x, scheme, rowwise=True, columnwise=True, scale=scale, **rule)
                        if start is not None:
                            rule = {**rule, "record_amax": want_state}
                        want, _ = registry.quantize_reference(x, scheme, rowwise=True, columnwise=True, scale=scale,
                                                              **rule)
                        for field in BUFFER_FIELDS:
                            if not same_bits(got[field], want[field]):
                                bad.append(f"{scheme.name} {dtype} {name} scale={scale} {rule} {field}")
                        if start is not None and not same_bits(got_state, want_state):
                            bad.append(f"{scheme.name} {dtype} {name} scale={scale} {rule} recorded amax")
    return bad


@pytest.mark.parametrize("key", [k for k in registry.KERNELS if k[2] == "cpu"], ids=lambda k: "-".join(k))
def test_every_cpu_kernel_matches_the_reference_bitwise(key):
    entry = registry.KERNELS[key]
    module, why = backend.module(entry.backend)
    assert module is not None, why
    bad = compare_entry(key[0], key[1], functools.partial(entry.fn, module))
    assert not bad, bad[:10]


def test_exact_gemm_meets_its_contract_on_every_isa():
    """The decode (a table, then the scale multiply) has a version per ISA; so has the GEMM (addmm
    or, below its threshold, the small kernel at avx2 and avx512)."""
    from engine.ops import native

    for isa in native.available_isas():
        with native.use_isa(isa):
            bad = compare_exact_gemm(native.exact_gemm, isa == "baseline")
        assert not bad, (isa, bad[:5])


def _worker() -> None:
    """Run under TRITON_INTERPRET=1: every CUDA entry on CPU tensors; print mismatches as JSON."""
    torch.set_num_threads(1)
    from engine.ops import triton as triton_kernels

    out = {}
    for (op, layout, device), entry in registry.KERNELS.items():
        if device == "cuda":
            assert entry.backend == "triton"
            fn = functools.partial(entry.fn, triton_kernels)
            if any(s.tensor_scale for s in SCHEMES.values() if s.layout == layout):  # interpreted NVFP4 costs ~0.3 s a call: every option on a small input, the
                # defaults on each dtype's edge input (tests/test_triton_nvfp4.py has the targeted edge cases)
                key = "-".join((op, layout, device))
                out[key] = compare_nvfp4(fn, layout, edge_inputs(torch.bfloat16)["one-row"], "bf16 one-row")
                for dtype in DTYPES:
                    out[key] += compare_nvfp4(fn, layout, edge_inputs(dtype)["random+edges"], f"{dtype} random+edges",
                                              matrix=False)
                continue
            out["-".join((op, layout, device))] = compare_entry(op, layout, fn)
    print(json.dumps(out))


def test_every_cuda_kernel_matches_the_reference_bitwise_under_the_triton_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__, "--worker"], env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(results) == {"-".join(k) for k in registry.KERNELS if k[2] == "cuda"}
    assert not any(results.values()), {k: v[:5] for k, v in results.items() if v}


# ------------------------------------------------------------------------------------------- opcheck
@pytest.mark.parametrize("scheme", ["tensor_e4m3", "tensor_e5m2_pow2", "block1d_e4m3_pow2", "block2d_e4m3",
                                    "mx_e4m3", "mx_e5m2", "mx_e2m1", "axiswise_e4m3", "nvfp4_e2m1", "nvfp4_rht_e2m1"])
def test_opcheck_quantize(scheme):
    """engine::quantize's schema, fake kernel and registration, with every argument family: a per-tensor scale,
    given tensor-level amaxes, a stochastic-rounding counter it advances (mutated), a rule's options."""
    x = torch.randn(48, 160)
    two_level = SCHEMES[scheme].tensor_scale
    scale = torch.tensor([2.0]) if SCHEMES[scheme].rowwise_block.is_tensor else None
    for rowwise, columnwise in ((True, True), (True, False), (False, True)):
        if two_level:
            for given, counter, options in ((None, None, "[]"), (torch.tensor([3.5]), torch.tensor([7, 0]),
                                                                 '[["two_d", true]]' if "rht" not in scheme else "[]")):
                torch.library.opcheck(qops.quantize_op, (x, scheme, rowwise, columnwise, None, 0.0, "rceil", given,
                                                         given, counter, options))
        else:
            torch.library.opcheck(qops.quantize_op, (x, scheme, rowwise, columnwise, scale, 0.0, "rceil", None,
                                                     None, None, "[]"))


def test_opcheck_amax_and_fp8_to_bf16():
    torch.library.opcheck(qops.amax_op, (torch.randn(33, 70),))
    # test_schema perturbs its inputs arithmetically, which FP8 tensors do not support
    torch.library.opcheck(qops.fp8_to_bf16_op, (torch.randn(33, 70).to(torch.float8_e4m3fn),),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


# ------------------------------------------------------------------------- fallback and a new scheme
@pytest.fixture()
def fresh_registry():
    registry._resolve.cache_clear()
    yield
    registry._resolve.cache_clear()


def test_a_missing_kernel_runs_the_reference_with_one_warning(monkeypatch, fresh_registry):
    monkeypatch.delenv("ENGINE_BACKEND", raising=False)
    monkeypatch.delitem(registry.KERNELS, ("quantize", "mx", "cpu"))
    x = edge_inputs(torch.float32)["random+edges"]
    scheme = SCHEMES["mx_e4m3"]
    with pytest.warns(RuntimeWarning, match="no quantize kernel for the mx layout"):
        got, _ = qops.quantize(x, scheme, rowwise=True, columnwise=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qops.quantize(x, scheme, rowwise=True, columnwise=False)  # decided once: no second warning
    want, _ = registry.quantize_reference(x, scheme, rowwise=True, columnwise=True, scale=None, amax_epsilon=0.0,
                                          scale_mode="rceil")
    assert all(same_bits(got[f], want[f]) for f in BUFFER_FIELDS)


def test_an_unavailable_backend_falls_back_per_op_and_forcing_it_is_an_error(monkeypatch, fresh_registry):
    monkeypatch.delenv("ENGINE_BACKEND", raising=False)
    monkeypatch.setattr(backend, "module", lambda name: (None, "no compiler") if name == "native" else (backend.reference, ""))
    with pytest.warns(RuntimeWarning, match="native kernels are unavailable"):
        assert registry.kernel("amax", registry.ANY, "cpu") is registry.REFERENCE["amax"]
    monkeypatch.setenv("ENGINE_BACKEND", "native")
    with pytest.raises(RuntimeError, match="ENGINE_BACKEND=native"):
        registry.kernel("amax", registry.ANY, "cpu")


ROW_SCHEME = Scheme("row", torch.float8_e4m3fn, ScaleEncoding.FP32_POW2, Block(1, 0), Block(0, 1), True)


def test_a_new_scheme_lands_as_data_and_its_reference(monkeypatch, fresh_registry):
    """Per-row power-of-2 scales: a registry entry and the generic reference are all it takes."""
    monkeypatch.setitem(SCHEMES, ROW_SCHEME.name, ROW_SCHEME)
    x, w = torch.randn(24, 96) * torch.arange(1, 25)[:, None], torch.randn(40, 96)
    with pytest.warns(RuntimeWarning, match="reference runs"):
        xb, _ = qops.quantize(x, ROW_SCHEME, rowwise=True, columnwise=True)
        wb, _ = qops.quantize(w, ROW_SCHEME, rowwise=True, columnwise=False)
    assert xb["rowwise_scale_inv"].shape == (24, 1) and xb["columnwise_scale_inv"].shape == (96, 1)
    xs = QuantizedTensorBase(scheme=ROW_SCHEME, shape=x.shape, nominal_dtype=x.dtype, **xb)
    ws = QuantizedTensorBase(scheme=ROW_SCHEME, shape=w.shape, nominal_dtype=w.dtype, **wb)
    # each row's largest |x| lands on E4M3's top binade: the per-row scale is 448 / amax, rounded down to 2^k
    row_max = xs.rowwise_data.float().abs().amax(1)
    assert ((row_max >= 224) & (row_max <= 448)).all()
    value = dequantize_blocked(xs.rowwise_data, xs.rowwise_scale_inv, ROW_SCHEME, shape=x.shape)
    # E4M3 rounding: half an ulp (2^-4 relative) for normals, half the smallest subnormal step (2^-10) below
    assert ((value - x).abs() <= 2.0**-4 * x.abs() + 2.0**-10 * xs.rowwise_scale_inv).all()
    got = general_gemm(xs, ws, out_dtype=torch.float32)
    want = xs.dequantize(torch.float64) @ ws.dequantize(torch.float64).t()
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
