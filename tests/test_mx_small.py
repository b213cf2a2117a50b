"""MXFP4 / MXFP6 (E2M1, E2M3, E3M2 elements, E8M0 scales per 32): schemes, scale rules, the reference
quantize/dequantize, against the independent brute force of tests/mx_brute.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mx_brute
from engine.formats import E2M1, E2M3, E3M2
from engine.ops import reference as ref
from engine.schemes import SCHEMES, ScaleEncoding, mx_scheme

NAMES = ("e2m1", "e2m3", "e3m2")
SHAPES = [(70, 45), (2, 35, 33), (33, 1), (1, 64), (5, 0), (0, 3), ()]


def same_bytes(got: torch.Tensor, want: np.ndarray) -> bool:
    return got.dtype == torch.uint8 and tuple(got.shape) == tuple(want.shape) and np.array_equal(got.numpy(), want)


def test_schemes_are_registry_entries():
    assert {"mx_e2m1", "mx_e2m3", "mx_e3m2"} <= set(SCHEMES)
    fp4, fp6 = SCHEMES["mx_e2m1"], SCHEMES["mx_e3m2"]
    assert fp4.element is E2M1 and fp4.elements_per_byte == 2 and fp4.data_dtype == torch.uint8
    assert SCHEMES["mx_e2m3"].element is E2M3 and fp6.element is E3M2 and fp6.elements_per_byte == 1
    assert fp4.scale is ScaleEncoding.E8M0 and fp4.layout == "mx" and not fp4.derivable
    assert fp4.data_shape((4, 33), False) == (4, 17) and fp4.data_shape((4, 33), True) == (4, 17)
    assert fp6.data_shape((4, 33), True) == (4, 33)
    assert fp4.scale_shape((40, 33), False) == (40, 2) and fp4.scale_shape((40, 33), True) == (2, 33)
    assert mx_scheme("e2m1") is fp4 and mx_scheme(torch.float8_e4m3fn) is SCHEMES["mx_e4m3"]
    with pytest.raises(TypeError, match="element"):
        mx_scheme(torch.float16)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_quantize_matches_brute_force(name, mode, dtype):
    scheme = SCHEMES[f"mx_{name}"]
    for seed, shape in enumerate(SHAPES):
        x = mx_brute.edge_input(shape, dtype, seed)
        for columnwise in (False, True):
            data, scales = ref.quantize_blocked(x, scheme, columnwise=columnwise, scale_mode=mode)
            want_data, want_scales = mx_brute.quantize(x, name, mode, columnwise)
            what = f"{name} {mode} {dtype} {shape} columnwise={columnwise}"
            assert same_bytes(scales, want_scales), what
            assert same_bytes(data, want_data), what
            value = ref.dequantize_blocked(data, scales, scheme, shape=x.shape, columnwise=columnwise)
            exact = mx_brute.dequantize(want_data, want_scales, name, shape, columnwise)
            with np.errstate(over="ignore"):
                want = torch.from_numpy(np.asarray(exact, dtype=np.float64)).float()  # fp32: overflow -> inf
            assert torch.equal(value.isnan(), want.isnan()), what
            ok = ~want.isnan()
            assert torch.equal(value[ok], want[ok]), what


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_scale_rule_of_every_amax_binade_boundary(name, mode):
    """Each rule over amaxes at and around every power of two (and its product with max_elem), 0, subnormal,
    FLT_MAX, inf and NaN, against the brute-force rule."""
    top = mx_brute.SPEC[name][3]
    amaxes = [0.0, 1e-45, 1e-40, 1.2e-38, 3.4028234663852886e38, float("inf"), float("nan")]
    for e in range(-140, 128, 3):
        for base in (2.0 ** e, top * 2.0 ** e):
            with np.errstate(over="ignore"):
                v = np.float32(base)  # beyond FLT_MAX: inf
            amaxes += [float(v), float(np.nextafter(v, np.float32(np.inf))), float(np.nextafter(v, np.float32(0)))]
    amax = torch.tensor(amaxes, dtype=torch.float32)
    got = ref.SCALE_MODES[mode](amax, {"e2m1": E2M1, "e2m3": E2M3, "e3m2": E3M2}[name]).tolist()
    want = [mx_brute.scale_code(v, name, mode) for v in amax.tolist()]
    bad = [(a, g, w) for a, g, w in zip(amaxes, got, want) if g != w]
    assert not bad, bad[:8]


def test_nan_block_scale_is_255_and_elements_are_zero_codes():
    x = torch.ones(1, 32)
    x[0, 3] = float("nan")
    for mode in ("rceil", "floor"):
        data, scales = ref.quantize_blocked(x, SCHEMES["mx_e2m1"], scale_mode=mode)
        assert scales.tolist() == [[255]] and data.eq(0).all()
    x[0, 3] = float("inf")
    data, scales = ref.quantize_blocked(x, SCHEMES["mx_e2m1"], scale_mode="floor")
    assert scales.tolist() == [[255]] and data.eq(0).all()
    data, scales = ref.quantize_blocked(x, SCHEMES["mx_e2m1"], scale_mode="rceil")
    assert scales.tolist() == [[254]]  # inf -> the largest scale; inf saturates to 6 -> dequantizes to inf
    value = ref.dequantize_blocked(data, scales, SCHEMES["mx_e2m1"], shape=x.shape)
    assert value[0, 3] == float("inf") and value[0, 0] == 0


# ============================================================================ MXQuantizer / MXTensor
import io  # noqa: E402

from engine.quantizers import MXFP8Quantizer, MXQuantizer  # noqa: E402
from engine.tensors import MXTensor, MXTensorStorage  # noqa: E402
from engine.tensors.serialization import pop_components, rebuild_storage, to_components  # noqa: E402


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_mx_quantizer_makes_mx_tensors_with_both_usages(name, mode):
    x = mx_brute.edge_input((2, 35, 70), torch.bfloat16, seed=3)
    t = MXQuantizer(name, scale_mode=mode)(x)
    assert isinstance(t, MXTensor) and t.scheme.name == f"mx_{name}" and t.dtype == torch.bfloat16
    st = t.qstorage
    for usage, columnwise in (("rowwise", False), ("columnwise", True)):
        want_data, want_scales = mx_brute.quantize(x, name, mode, columnwise)
        assert same_bytes(getattr(st, f"{usage}_data"), want_data), usage
        assert same_bytes(getattr(st, f"{usage}_scale_inv"), want_scales), usage
    want = torch.from_numpy(mx_brute.dequantize(*mx_brute.quantize(x, name, mode, False), name, x.shape, False))
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        got = t.dequantize(dtype=dtype)
        assert got.dtype == dtype
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got[~want.isnan()], want.float().to(dtype)[~want.isnan()])
    t.update_usage(rowwise_usage=False)  # columnwise alone still dequantizes (to the columnwise blocks' value)
    want_col = torch.from_numpy(mx_brute.dequantize(*mx_brute.quantize(x, name, mode, True), name, x.shape, True))
    got = t.dequantize(dtype=torch.float64)
    assert torch.equal(got.isnan(), want_col.isnan()) and torch.equal(got[~got.isnan()], want_col.float().double()[~got.isnan()])
    with pytest.raises(ValueError, match="cannot be derived"):
        t.update_usage(rowwise_usage=True)


def test_mx_quantizer_arguments_and_the_mxfp8_preset():
    q = MXQuantizer("e3m2", scale_mode="floor", columnwise=False)
    assert q.element == "e3m2" and q.scale_mode == "floor" and q.config() == {"element": "e3m2", "scale_mode": "floor"}
    fp8 = MXFP8Quantizer(torch.float8_e4m3fn)
    assert isinstance(fp8, MXQuantizer) and fp8.element == "e4m3" and fp8.scheme is MXQuantizer("e4m3").scheme
    assert fp8.config() == {"fp8_dtype": "float8_e4m3fn", "scale_mode": "rceil"}  # checkpoints read as before
    with pytest.raises(TypeError, match="^element: "):
        MXQuantizer("e2m2")
    with pytest.raises(TypeError, match="^element: "):
        MXQuantizer(torch.float16)
    with pytest.raises(ValueError, match="^scale_mode: "):
        MXQuantizer("e2m1", scale_mode="round")
    with pytest.raises(TypeError, match="^fp8_dtype: "):
        MXFP8Quantizer("e2m1")


@pytest.mark.parametrize("name", NAMES)
def test_mx_tensor_saves_and_loads_with_weights_only(name):
    x = mx_brute.edge_input((40, 33), torch.float32, seed=4)
    t = MXQuantizer(name)(x)
    buf = io.BytesIO()
    torch.save({"t": t}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)["t"]
    assert isinstance(back, MXTensor) and back.quantizer.config() == t.quantizer.config()
    for field in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
        assert torch.equal(getattr(back.qstorage, field), getattr(t.qstorage, field)), field
    parts = to_components("w", t)
    assert set(parts) == {"w", "w_scale_inv", "w_columnwise_data", "w_columnwise_scale_inv", "w_quantization"}
    storage, saved = pop_components(dict(parts), "w")
    assert saved == {"class": "MXQuantizer", "config": {"element": name, "scale_mode": "rceil"}}
    assert torch.equal(storage.rowwise_data, t.qstorage.rowwise_data) and storage.scheme is t.scheme
    tensors, _ = t.prepare_for_saving()
    assert t.qstorage.rowwise_data is None
    t.restore_from_saved(tensors)
    assert torch.equal(t.dequantize(), back.dequantize())


def test_loading_checks_mx_small_buffers():
    x = torch.randn(40, 33)
    plain = MXQuantizer("e2m1")(x).qstorage.to_plain()
    bad_shape = {**plain, "rowwise_data": torch.zeros(40, 33, dtype=torch.uint8)}  # not packed
    with pytest.raises(ValueError, match=r"^rowwise_data: expected torch.uint8 of shape \(40, 17\)"):
        rebuild_storage(bad_shape)
    scales = plain["rowwise_scale_inv"].clone()
    scales[3, 0] = 255  # a NaN scale on a block whose codes are not all +0
    with pytest.raises(ValueError, match="^rowwise_scale_inv: E8M0 code 255"):
        rebuild_storage({**plain, "rowwise_scale_inv": scales})
    col = plain["columnwise_scale_inv"].clone()
    col[1, 32] = 255  # the last (odd) column's block: its byte's high nibble is padding
    with pytest.raises(ValueError, match="^columnwise_scale_inv: E8M0 code 255"):
        rebuild_storage({**plain, "columnwise_scale_inv": col})
    nan = x.clone()
    nan[0, 0] = float("nan")  # a real NaN block loads
    st = rebuild_storage(MXQuantizer("e2m1")(nan).qstorage.to_plain())
    assert isinstance(st, MXTensorStorage) and st.dequantize()[0, :32].isnan().all()


# ============================================================================ GEMM
from engine.gemm import general_gemm  # noqa: E402
from engine.ops import quantize as qops  # noqa: E402


def exact_value(t, columnwise: bool) -> torch.Tensor:
    """float64 value of one usage of an MX tensor, by the brute force (FP8 elements: engine's dequantize,
    which tests/test_tensors.py checks against its own brute force)."""
    st = t.qstorage
    name = st.scheme.name.removeprefix("mx_")
    usage = "columnwise" if columnwise else "rowwise"
    if name in mx_brute.SPEC:
        return torch.from_numpy(mx_brute.dequantize(getattr(st, f"{usage}_data").numpy(),
                                                    getattr(st, f"{usage}_scale_inv").numpy(), name, st.shape,
                                                    columnwise))
    return (st.replace(rowwise_data=None, rowwise_scale_inv=None) if columnwise else st).dequantize(torch.float64)


def check_gemm(got: torch.Tensor, exact: torch.Tensor, abs_a: torch.Tensor, abs_b: torch.Tensor, k: int) -> None:
    """|got - exact| within fp32 accumulation's bound K * 2^-24 * sum|a||b| (the elements and products are exact),
    plus half a unit of the output dtype's last place."""
    bound = k * 2.0**-24 * (abs_a @ abs_b.t())
    if got.dtype != torch.float32:
        bound = bound + exact.abs() * torch.finfo(got.dtype).eps / 2
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item()}, bound there {bound[err.argmax() // err.shape[1]].max()}"


@pytest.mark.parametrize("elements", [("e2m1", "e2m1"), ("e2m3", "e3m2"), ("e2m1", "e4m3"), ("e4m3", "e3m2")])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_gemms_on_mx_small_operands_match_an_fp64_reference(elements, out_dtype):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(48, 72, generator=gen) * torch.logspace(-3, 3, 72)  # K = 72: a partial last block
    w = torch.randn(40, 72, generator=gen)
    dy = torch.randn(48, 40, generator=gen)
    qx, qw = MXQuantizer(elements[0])(x), MXQuantizer(elements[1])(w)
    qdy = MXQuantizer(elements[1])(dy)
    bias = torch.randn(40, generator=gen)
    # fprop y = x W^T (+ bias), dgrad dx = dy W, wgrad dW = dy^T x
    cases = [
        (general_gemm(qx, qw, out_dtype=out_dtype), exact_value(qx, False), exact_value(qw, False)),
        (general_gemm(qdy, qw, b_transposed=True, out_dtype=out_dtype), exact_value(qdy, False),
         exact_value(qw, True).t()),
        (general_gemm(qdy, qx, a_transposed=True, b_transposed=True, out_dtype=out_dtype),
         exact_value(qdy, True).t(), exact_value(qx, True).t()),
    ]
    for got, a, b in cases:
        check_gemm(got, a @ b.t(), a.abs(), b.abs(), a.shape[1])
    with_bias = general_gemm(qx, qw, out_dtype=torch.float32, bias=bias)
    a, b = exact_value(qx, False), exact_value(qw, False)
    check_gemm(with_bias, a @ b.t() + bias.double(), a.abs(), b.abs(), a.shape[1] + 1)


def test_elements_to_bf16_op_checks_and_traces():
    scheme = SCHEMES["mx_e2m1"]
    data = torch.tensor([[0x21, 0x07]], dtype=torch.uint8)
    assert qops.elements_to_bf16(data, scheme, cols=3).tolist() == [[0.5, 1.0, 6.0]]
    with pytest.raises(ValueError, match="^cols: "):
        qops.elements_to_bf16(data, scheme, cols=5)
    with pytest.raises(TypeError, match="^data: "):
        qops.elements_to_bf16(data.float(), scheme, cols=3)
    with pytest.raises(TypeError, match="^scheme: "):
        qops.elements_to_bf16(data, SCHEMES["mx_e4m3"], cols=3)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = qops.elements_to_bf16(mode.from_tensor(data), scheme, cols=3)
    assert fake.shape == (1, 3) and fake.dtype == torch.bfloat16


# ============================================================================ C++ kernels
from engine.ops import native  # noqa: E402
from tests.test_native import ISAS  # noqa: E402

needs_native = pytest.mark.skipif(not native.available(), reason=f"C++ kernels unavailable: {native.why_unavailable()}")
# every instruction-set level this machine runs (the kernels are one source compiled per level)
ISAS = native.available_isas() if native.available() else ["baseline"]


def edge_cases(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    x = mx_brute.edge_input((70, 300), dtype, seed=11)
    big = torch.finfo(dtype).max
    specials = torch.tensor([0.0, -0.0, big, -big, 1e-40, -3e-45, 6.0, -6.0, 7.5, 28.0, 5.0, 3.0e38,
                             float("inf"), float("-inf"), float("nan"), -float("nan")]).to(dtype)
    mixed = specials.repeat(64 * 3)[: 64 * 40].reshape(64, 40)
    mixed[:, 32:] = 0.0  # all-zero rowwise blocks
    outlier = torch.full((64, 64), 1e-3, dtype=dtype)
    outlier[::33, ::17] = 1e4  # one outlier per block
    return {"edges": x, "specials": mixed, "outlier": outlier, "3d-partial": x[:69, :257].reshape(3, 23, 257),
            "tiny": torch.full((33, 33), 1e-39).to(dtype), "one": x[:1, :1], "empty-rows": x[:0], "empty-cols": x[:, :0],
            "transposed-view": x[:, :64].t()}


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_quantize_is_bitwise_the_reference(isa, dtype):
    bad = []
    with native.use_isa(isa):
        for case, x in edge_cases(dtype).items():
            for name in NAMES:
                scheme = SCHEMES[f"mx_{name}"]
                for mode in ("rceil", "floor"):
                    for rowwise, columnwise in ((True, True), (True, False), (False, True)):
                        got = native.quantize_mx_coded(x, scheme.element, scale_mode=mode, rowwise=rowwise,
                                                       columnwise=columnwise)
                        for i, (usage, wanted) in enumerate((("rowwise", rowwise), ("columnwise", columnwise))):
                            if not wanted:
                                if got[2 * i] is not None or got[2 * i + 1] is not None:
                                    bad.append(f"{case} {name} {mode}: {usage} not asked for, but returned")
                                continue
                            data, scales = ref.quantize_blocked(x, scheme, columnwise=usage == "columnwise",
                                                                scale_mode=mode)
                            if not (torch.equal(got[2 * i], data) and torch.equal(got[2 * i + 1], scales)):
                                bad.append(f"{case} {name} {mode} {usage}")
    assert not bad, bad[:10]


def fast_path_cases(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Finite inputs (no NaN or inf scale code: the kernels' finite path, not their general one) over whole 32-row
    strips wider than one 4096-column segment, partial segments and odd widths: every element format's rounding
    midpoints and neighbours in blocks of known scale, both signs and -0, subnormal inputs, all-zero blocks,
    values near the dtype's max, and E3M2's tiny-amax blocks."""
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(33, 4160, generator=g) * torch.exp2(torch.randint(-24, 24, (33, 4160), generator=g).float())
    wide[:, 64:128] = 0.0
    wide[7, 300:332] = -0.0
    wide[:, 1000:1100] *= 2.0 ** -130  # subnormal fp32 inputs (zeros in bf16), in blocks of tiny amax
    points = []
    for fmt in (E2M1, E2M3, E3M2):  # every code's value and the midpoints between neighbours, just above/below
        grid = fmt.decode(torch.arange(1 << (fmt.bits - 1))).double()
        mids = (grid[1:] + grid[:-1]) / 2
        for v in torch.cat([grid, mids]).tolist():
            points += [v, float(np.nextafter(np.float32(v), np.float32(0))), float(np.nextafter(np.float32(v), np.float32(99)))]
    pts = torch.tensor(points)
    reps = -(-64 * 544 // pts.numel())
    mid = pts.repeat(reps)[: 64 * 544].reshape(64, 544) * (torch.randint(0, 2, (64, 544), generator=g) * 2 - 1)
    mid[:, ::31] = 6.0  # each rowwise block holds 6 (E2M1's max); columns too (rows 0, 31, 62, ...)
    mid[::31, :] = 28.0
    scaled = mid * torch.exp2(torch.randint(-20, 20, (64, 1), generator=g).float())
    big = torch.finfo(dtype).max
    near_max = (torch.rand(40, 333, generator=g) * 2 - 1) * big
    tiny = torch.randn(64, 96, generator=g) * 2.0 ** -126  # amax below 2^-120: E3M2 falls back
    return {"wide": wide.to(dtype), "midpoints": mid.to(dtype), "scaled-midpoints": scaled.to(dtype),
            "near-max": near_max.to(dtype), "odd": wide[:, :777].to(dtype), "tiny": tiny.to(dtype)}


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_quantize_of_finite_inputs_is_bitwise_the_reference(isa, dtype):
    bad = []
    with native.use_isa(isa):
        for case, x in fast_path_cases(dtype).items():
            for name in NAMES:
                scheme = SCHEMES[f"mx_{name}"]
                for mode in ("rceil", "floor"):
                    got = native.quantize_mx_coded(x, scheme.element, scale_mode=mode)
                    for i, usage in enumerate(("rowwise", "columnwise")):
                        data, scales = ref.quantize_blocked(x, scheme, columnwise=usage == "columnwise", scale_mode=mode)
                        if not torch.equal(got[2 * i + 1], scales):
                            bad.append(f"{case} {name} {mode} {usage} scales")
                        if not torch.equal(got[2 * i], data):
                            where = (got[2 * i] != data).nonzero()[:3].tolist()
                            bad.append(f"{case} {name} {mode} {usage} data at {where}")
    assert not bad, bad[:10]


@needs_native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_quantize_of_one_usage_is_bitwise_the_reference(isa, dtype):
    """The kernels' cast loop is compiled apart for both usages, rowwise only and columnwise only: each, on finite
    inputs (the finite path), with both scale rules."""
    cases = fast_path_cases(dtype)
    bad = []
    with native.use_isa(isa):
        for case in ("midpoints", "odd"):
            x = cases[case]
            for name in NAMES:
                scheme = SCHEMES[f"mx_{name}"]
                for mode in ("rceil", "floor"):
                    for usage in ("rowwise", "columnwise"):
                        got = native.quantize_mx_coded(x, scheme.element, scale_mode=mode, rowwise=usage == "rowwise",
                                                       columnwise=usage == "columnwise")
                        i = 0 if usage == "rowwise" else 2
                        data, scales = ref.quantize_blocked(x, scheme, columnwise=usage == "columnwise", scale_mode=mode)
                        if not (torch.equal(got[i], data) and torch.equal(got[i + 1], scales)):
                            bad.append(f"{case} {name} {mode} {usage}")
    assert not bad, bad[:10]


@needs_native
def test_native_quantize_ignores_flush_denormal():
    x = torch.full((32, 32), 1e-39) * torch.linspace(0.5, 2, 32)  # fp32 subnormals, scaled into range
    want = ref.quantize_blocked(x, SCHEMES["mx_e2m3"], scale_mode="rceil")
    torch.set_flush_denormal(True)
    try:
        got = native.quantize_mx_coded(x, E2M3, columnwise=False)
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@needs_native
@pytest.mark.parametrize("isa", ISAS)
def test_native_decode_is_bitwise_the_reference(isa):
    codes = torch.randint(0, 256, (3, 5, 33), dtype=torch.uint8)
    for name, fmt in (("e2m1", E2M1), ("e2m3", E2M3), ("e3m2", E3M2)):
        for cols in ((65, 66) if name == "e2m1" else (33,)):
            with native.use_isa(isa):
                got = native.elements_to_bf16(codes, fmt, cols)
            want = ref.elements_to_bf16(codes, fmt, cols)
            assert got.shape == want.shape == (3, 5, cols) and torch.equal(got.view(torch.int16), want.view(torch.int16))


@needs_native
def test_native_functions_check_their_arguments():
    x = torch.randn(4, 64)
    with pytest.raises(TypeError, match="^x: "):
        native.quantize_mx_coded(x.double(), E2M1)
    with pytest.raises(TypeError, match="^element: "):
        native.quantize_mx_coded(x, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="^scale_mode: "):
        native.quantize_mx_coded(x, E2M1, scale_mode="up")
    with pytest.raises(TypeError, match="^data: "):
        native.elements_to_bf16(x, E2M1)
    with pytest.raises(ValueError, match="cols"):
        native.elements_to_bf16(torch.zeros(4, 8, dtype=torch.uint8), E2M1, 20)


def test_a_backend_without_the_coded_kernel_warns_once_and_runs_the_reference():
    """A backend module with MX kernels but no `quantize_mx_coded`: the reference runs, with one warning."""
    import types
    import warnings

    from engine.ops import registry
    from engine.schemes import get_scheme

    registry._warn_reference_once.cache_clear()
    scheme = get_scheme("mx_e2m1")
    x = torch.randn(8, 64)
    no_coded_kernel = types.SimpleNamespace()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, _ = registry.quantize_mx(no_coded_kernel, x, scheme, rowwise=True, columnwise=True, scale=None,
                                      amax_epsilon=0.0, scale_mode="rceil")
        registry.quantize_mx(no_coded_kernel, x, scheme, rowwise=True, columnwise=False, scale=None,
                             amax_epsilon=0.0, scale_mode="rceil")
    assert [str(w.message) for w in caught] == ["engine: no mx_e2m1 quantize kernel on cpu; the reference runs (slow)"]
    want, _ = registry.quantize_reference(x, scheme, rowwise=True, columnwise=True, scale_mode="rceil")
    assert all(torch.equal(got[f], want[f]) for f in registry.BUFFER_FIELDS)
