"""The fused native building blocks of per-tensor scaling, bit for bit against independent code.

* `native.quantize_per_tensor`: current scaling (amax -> scale -> cast(s) -> scale_inv) or a
  given scale (delayed scaling) with the amax recorded into a state tensor, in one native
  call; compared with `engine.ops.reference.quantize_blocked` / `reference.amax` and, for the
  record, with `torch.maximum` (what delayed scaling recorded with before).
* `native.delayed_update`: delayed scaling's update, against the torch ops of
  `DelayedScalingState.update` (run through a callable algo, which takes the Python path).
* Both ISAs, random data and the edge cases (zeros, subnormals, +-max, saturation, inf, NaN
  of both signs and other payloads, odd shapes, empty tensors, views); bad arguments are
  refused in Python and again in C++; the generic path (`engine.ops.quantize`, the delayed
  rule, `DelayedScalingState.update`) runs no torch op and no host sync around the one call.
"""

from __future__ import annotations

import pytest
import torch

from engine.ops.reference import NOT_RECORDED
from torch.utils._python_dispatch import TorchDispatchMode

from engine.ops import native, registry
from engine.ops import quantize as qops
from engine.ops import reference as ref
from engine.quantizers import Float8CurrentScalingQuantizer, Float8Quantizer
from engine.recipes import DelayedScaling
from engine.schemes import fp8_scheme
from test_native import ISAS, assert_same, spread, with_specials

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = (E4M3, E5M2)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FLT_MAX = torch.finfo(torch.float32).max
NAN, INF = float("nan"), float("inf")


@pytest.fixture(params=ISAS)
def isa(request):
    assert native.available(), native.why_unavailable()
    with native.use_isa(request.param):
        yield request.param


def f32(*bits: int) -> torch.Tensor:
    """fp32 values from raw bit patterns (NaN payloads and signs as given)."""
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


# ---------------------------------------------------------------- per-tensor quantization
def reference_per_tensor(x, fp8, rowwise, columnwise, scale, pow2, eps):
    """(data, data_t, scale_inv, amax) from the generic reference, one usage at a time."""
    scheme = fp8_scheme("tensor", fp8, pow2=pow2)
    data, scale_inv = ref.quantize_blocked(x, scheme, scale=scale, amax_epsilon=eps)
    data_t, _ = ref.quantize_blocked(x, scheme, columnwise=True, scale=scale, amax_epsilon=eps)
    return (data if rowwise else None), (data_t if columnwise else None), scale_inv, ref.amax(x)


def check_per_tensor(x, fp8, *, scale=None, pow2=False, eps=0.0, usages=((True, True),), what=""):
    want_all = reference_per_tensor(x, fp8, True, True, scale, pow2, eps)
    for rowwise, columnwise in usages:
        got = native.quantize_per_tensor(x, fp8, rowwise=rowwise, columnwise=columnwise, scale=scale,
                                         force_pow_2_scales=pow2, amax_epsilon=eps)
        want = ((want_all[0] if rowwise else None), (want_all[1] if columnwise else None), *want_all[2:])
        for i, name in enumerate(("data", "data_t", "scale_inv", "amax")):
            assert_same(got[i], want[i], f"{what} {fp8} scale={scale} pow2={pow2} eps={eps} {rowwise}/{columnwise} "
                                         f"{name}")


SHAPES = [(1, 1), (3, 5), (16, 256), (7, 129), (130, 257), (300, 700), (2, 3, 70), (70,), ()]
USAGES = ((True, True), (True, False), (False, True), (False, False))


@pytest.mark.parametrize("dtype", DTYPES)
def test_current_scaling_matches_the_reference(isa, dtype):
    rules = ((False, 0.0), (True, 0.0), (False, 1e-3), (True, 2.0**-30))
    for shape in SHAPES:
        x = spread(shape, dtype, seed=len(shape) + sum(shape))
        big = x.numel() > 50_000  # the reference is slow: one rule each
        for name, v in (("spread", x), ("specials", with_specials(x, 7, fraction=0.02)))[big:]:
            for i, fp8 in enumerate(FP8):
                for pow2, eps in rules[i::2] if big else rules:
                    check_per_tensor(v, fp8, pow2=pow2, eps=eps, usages=USAGES if shape == (7, 129) else USAGES[:2],
                                     what=f"{isa} {dtype} {shape} {name}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_given_scales_match_the_reference(isa, dtype):
    """Delayed scaling: any 1-element scale, NaN payloads, inf, zeros, negatives and subnormals included."""
    x = with_specials(spread((70, 130), dtype, 9), 10, fraction=0.05)
    scales = [torch.tensor([s]) for s in (1.0, 3.0, 0.7, 2.0**-12, 2.0**12, 1e-40, FLT_MAX, 0.0, -0.0, -3.0, INF,
                                          -INF)]
    scales += [f32(b) for b in (0x7FC00000, 0xFFC00000, 0x7FC12345, 0x7F800001)]  # NaN scales: 1/NaN keeps bits
    for scale in scales:
        for fp8 in FP8:
            check_per_tensor(x, fp8, scale=scale, usages=USAGES, what=f"{isa} {dtype}")
            check_per_tensor(x.t(), fp8, scale=scale, what=f"{isa} {dtype} x.t()")


@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_tensors(isa, dtype):
    fi = torch.finfo(dtype)
    cases = {
        "zeros": torch.zeros(32, 64, dtype=dtype),
        "neg zeros": torch.full((5, 7), -0.0, dtype=dtype),
        "subnormals": torch.full((4, 33), fi.tiny / 4, dtype=dtype),
        "+-max": torch.tensor([[fi.max, -fi.max, 1.0]], dtype=dtype),
        "tiny amax": torch.full((3, 3), fi.tiny, dtype=dtype),  # fp8_max / amax may overflow: FLT_MAX
        "saturating": torch.tensor([[448.0, 464.0, -480.0, 57344.0, 61440.0, -6e4]], dtype=dtype),
        "inf": torch.tensor([[1.0, INF, -2.0]], dtype=dtype),
        "-inf": torch.tensor([[-INF, 3.0]], dtype=dtype),
        "nan": torch.tensor([[1.0, NAN, -2.0]], dtype=dtype),
        "-nan": torch.tensor([[-NAN] * 5], dtype=dtype),
        "empty rows": torch.zeros(0, 64, dtype=dtype),
        "empty cols": torch.zeros(64, 0, dtype=dtype),
        "empty 1d": torch.zeros(0, dtype=dtype),
        "empty 3d": torch.zeros(2, 0, 5, dtype=dtype),
        "scalar": torch.tensor(-3.5, dtype=dtype),
    }
    for name, x in cases.items():
        for fp8 in FP8:
            for eps in (0.0, 1e-3):
                check_per_tensor(x, fp8, eps=eps, usages=USAGES, what=f"{isa} {dtype} {name}")
            check_per_tensor(x, fp8, scale=torch.tensor([3.0]), usages=USAGES[:1], what=f"{isa} {dtype} {name}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_views_match_the_reference(isa, dtype):
    x = with_specials(spread((200, 300), dtype, 3), 4)
    x3 = with_specials(spread((4, 50, 70), dtype, 5), 6)
    views = {"x.t()": x.t(), "cols": x[:, 7:250], "rows": x[10:150, :64], "strided": x[::3], "3d sliced": x3[:, 3:40],
             "3d permuted": x3.permute(1, 0, 2), "1d strided": x[0, ::2], "expanded": x[:1, :64].expand(40, 64)}
    for name, v in views.items():
        check_per_tensor(v, E4M3, usages=USAGES[:3], what=f"{isa} {dtype} {name}")
        check_per_tensor(v, E5M2, scale=torch.tensor([0.375]), usages=USAGES[:1], what=f"{isa} {dtype} {name}")


def test_large_tensor_on_every_thread(isa):
    x = with_specials(spread((1024, 2100), torch.bfloat16, 11), 12, fraction=0.0005)
    check_per_tensor(x, E4M3, usages=USAGES[:3], what=f"{isa} 1024x2100")
    check_per_tensor(x, E5M2, scale=torch.tensor([0.375]), usages=USAGES[:2], what=f"{isa} 1024x2100")


# A previously recorded amax and this tensor's amax: NaN of any payload, inf, zeros of both signs.
RECORDED = [f32(b) for b in (0x00000000, 0x80000000, 0x3A83126F, 0x42C80000, 0x7149F2CA, 0x7F7FFFFF, 0x7F800000,
                              0x7FC00000, 0xFFC00000, 0x7FC12345, 0x7F800001)]


def test_record_amax_is_torch_maximum(isa):
    """max(recorded, amax) in place, as `torch.maximum` gives it (NaN if either is NaN, the canonical NaN)."""
    inputs = {"random": spread((17, 33), torch.bfloat16, 1), "with nan": with_specials(spread((17, 33),
              torch.float32, 2), 3, fraction=0.3), "zeros": torch.zeros(4, 4), "empty": torch.zeros(0, 8),
              "inf": torch.tensor([[INF, 1.0]], dtype=torch.float16)}
    for name, x in inputs.items():
        for start in RECORDED:
            for scale in (None, torch.tensor([2.0])):
                state = start.clone()
                _, _, _, amax = native.quantize_per_tensor(x, E4M3, scale=scale, record_amax=state)
                assert_same(amax, ref.amax(x), f"{isa} {name} amax")
                assert_same(state, torch.maximum(start, ref.amax(x)), f"{isa} {name} recorded into {start.item()}")


def test_record_into_a_view_of_a_history_row(isa):
    history = torch.zeros(4, 3)
    history[0] = torch.tensor([5.0, 0.5, NAN])
    x = torch.full((8, 8), 2.0)
    for slot in range(3):
        native.quantize_per_tensor(x, E4M3, scale=torch.ones(1), record_amax=history[0, slot:slot + 1])
    assert_same(history[0], torch.tensor([5.0, 2.0, NAN]), "row 0")
    assert (history[1:] == 0).all()


def test_preallocated_outputs_are_filled_and_returned(isa):
    x = with_specials(spread((130, 257), torch.bfloat16, 51), 52)
    d, dt, si, am = (torch.empty(130, 257, dtype=E4M3), torch.empty(257, 130, dtype=E4M3), torch.empty(1),
                     torch.empty(1))
    got = native.quantize_per_tensor(x, E4M3, out_data=d, out_data_t=dt, out_scale_inv=si, out_amax=am)
    assert got[0] is d and got[1] is dt and got[2] is si and got[3] is am
    for g, w in zip(got, reference_per_tensor(x, E4M3, True, True, None, False, 0.0)):
        assert_same(g, w, "out=")


def test_results_do_not_depend_on_threads_or_flush_denormal(isa):
    x = with_specials(spread((300, 700), torch.float32, 61), 62)
    x[5, :] = 1e-39  # fp32 subnormals: flush-to-zero would change them
    x[6, :3] = 1e-45
    want = reference_per_tensor(x, E4M3, True, True, None, False, 0.0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        torch.set_flush_denormal(True)
        got = native.quantize_per_tensor(x, E4M3)
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
    for g, w in zip(got, want):
        assert_same(g, w, "one thread, flush_denormal")


# ------------------------------------------------------------------------ bad arguments
def test_bad_arguments_are_refused_in_python():
    x = torch.ones(8, 16)
    cases = [
        (TypeError, "^x: ", lambda: native.quantize_per_tensor(x.double(), E4M3)),
        (TypeError, "^x: .*meta", lambda: native.quantize_per_tensor(x.to("meta"), E4M3)),
        (TypeError, "fp8_dtype", lambda: native.quantize_per_tensor(x, torch.bfloat16)),
        (ValueError, "^scale: .*1-element", lambda: native.quantize_per_tensor(x, E4M3, scale=torch.ones(2))),
        (TypeError, "^scale: .*meta", lambda: native.quantize_per_tensor(x, E4M3, scale=torch.ones(1, device="meta"))),
        (TypeError, "^record_amax: .*float32", lambda: native.quantize_per_tensor(
            x, E4M3, record_amax=torch.zeros(1, dtype=torch.float64))),
        (ValueError, "^record_amax: .*1-element", lambda: native.quantize_per_tensor(
            x, E4M3, record_amax=torch.zeros(2))),
        (TypeError, "^record_amax: .*sparse", lambda: native.quantize_per_tensor(
            x, E4M3, record_amax=torch.zeros(1).to_sparse())),
        (TypeError, "^out_amax: .*meta", lambda: native.quantize_per_tensor(
            x, E4M3, out_amax=torch.empty(1, device="meta"))),
    ]
    for error, match, call in cases:
        with pytest.raises(error, match=match):
            call()


def test_bad_arguments_are_refused_in_cpp():
    """The raw extension function checks for itself: dtypes, shapes, aliasing, kinds."""
    ext = native._ext()
    x = torch.ones(8, 16)

    def call(x=x, kind=0, scale=None, record=None, out_data=None, out_data_t=None, out_scale_inv=None, out_amax=None):
        return ext.quantize_per_tensor(x, kind, True, True, scale, False, 0.0, record, out_data, out_data_t,
                                       out_scale_inv, out_amax)

    shared = torch.empty(1)
    cases = [
        (TypeError, "x: expected dtype", dict(x=x.double())),
        (ValueError, "fp8 kind", dict(kind=2)),
        (TypeError, "scale: expected dtype float32", dict(scale=torch.ones(1, dtype=torch.float64))),
        (ValueError, "scale: expected a 1-element", dict(scale=torch.ones(3))),
        (TypeError, "record_amax: expected dtype float32", dict(record=torch.zeros(1, dtype=torch.float16))),
        (ValueError, "record_amax: expected a 1-element", dict(record=torch.zeros(0))),
        (ValueError, "out_data: expected shape", dict(out_data=torch.empty(16, 8, dtype=E4M3))),
        (ValueError, "out_data_t: expected dtype", dict(out_data_t=torch.empty(16, 8, dtype=E5M2))),
        (ValueError, "shares memory", dict(out_scale_inv=shared, out_amax=shared)),
        (ValueError, "shares memory", dict(record=shared, out_amax=shared)),
        (ValueError, "shares memory", dict(record=x.view(-1)[:1])),
    ]
    for error, match, kwargs in cases:
        with pytest.raises(error, match=match):
            call(**kwargs)
    with pytest.raises(TypeError, match="scale: expected dtype float32"):
        ext.cast_transpose(x, torch.ones(1, dtype=torch.float64), 0, True, True)


# --------------------------------------------------------------- the generic path, wired
class CountOps(TorchDispatchMode):
    """Counts the torch ops that run (a native call's own work is invisible to it)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_per_tensor_quantize_on_the_cpu_is_one_native_call_without_torch_ops_or_syncs(monkeypatch):
    """Current and delayed scaling (with its record) through the generic path: no torch op, no float(tensor)."""
    x = spread((16, 256), torch.bfloat16, 0)
    history = torch.zeros(4, 3)
    delayed = Float8Quantizer(torch.tensor([4.0]), history[0, 1:2], E4M3)
    current = Float8CurrentScalingQuantizer(E4M3)

    def no_sync(*args):
        raise AssertionError("a host sync")

    for method in ("__float__", "__bool__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, method, no_sync)
    with CountOps() as counted:
        buffers, amax = qops.quantize(x, current.scheme, rowwise=True, columnwise=True)
        rule_buffers = delayed.rule.quantize(x, delayed.scheme, rowwise=True, columnwise=True)
    monkeypatch.undo()
    assert counted.ops == []
    want = reference_per_tensor(x, E4M3, True, True, None, False, 0.0)
    for field, w in zip(("rowwise_data", "columnwise_data", "rowwise_scale_inv"), want):
        assert_same(buffers[field], w, f"current {field}")
    assert buffers["columnwise_scale_inv"] is buffers["rowwise_scale_inv"]
    assert_same(amax, want[3], "current amax")
    want = reference_per_tensor(x, E4M3, True, True, torch.tensor([4.0]), False, 0.0)
    for field, w in zip(("rowwise_data", "columnwise_data", "rowwise_scale_inv"), want):
        assert_same(rule_buffers[field], w, f"delayed {field}")
    assert_same(history[0], torch.cat([torch.zeros(1), want[3], torch.zeros(1)]), "recorded amax")


def test_generic_record_amax_matches_torch_maximum_on_every_path(monkeypatch):
    """record_amax through qops.quantize: native (eager), the reference backend, and the traced op."""
    x = with_specials(spread((17, 33), torch.float32, 4), 5, fraction=0.05)
    scheme = fp8_scheme("tensor", E5M2)
    for start in RECORDED:
        want = torch.maximum(start, ref.amax(x))
        got = start.clone()
        qops.quantize(x, scheme, rowwise=True, columnwise=False, scale=torch.tensor([2.0]), record_amax=got)
        assert_same(got, want, "native")
        got = start.clone()
        qops.registry.REFERENCE["quantize"](x, scheme, rowwise=True, columnwise=False, scale=torch.tensor([2.0]),
                                           amax_epsilon=0.0, scale_mode="rceil", record_amax=got)
        assert_same(got, want, "reference")
        got = start.clone()
        monkeypatch.setattr(qops, "traced", lambda x: True)  # the custom-op path torch.compile takes
        qops.quantize(x, scheme, rowwise=True, columnwise=False, scale=torch.tensor([2.0]), record_amax=got)
        monkeypatch.undo()
        assert_same(got, want, "traced")


def test_generic_record_amax_arguments():
    x = torch.ones(4, 4)
    with pytest.raises(ValueError, match="record_amax: only per-tensor"):
        qops.quantize(x, fp8_scheme("mx", E4M3), rowwise=True, columnwise=False, record_amax=torch.zeros(1))
    with pytest.raises(TypeError, match="record_amax: expected a 1-element float32"):
        qops.quantize(x, fp8_scheme("tensor", E4M3), rowwise=True, columnwise=False,
                      record_amax=torch.zeros(2))


# --------------------------------------------------------------------- delayed update
def random_state(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A history with random amaxes over many binades, and the edge cases: NaN/inf/-inf/zeros/-0 in row 0,
    NaN (several payloads) and -0 in older rows, tiny and huge amaxes; scales random, one NaN, one inf."""
    g = torch.Generator().manual_seed(seed)
    history = torch.rand(rows, cols, generator=g) * torch.exp2(torch.randint(-140, 128, (rows, cols), generator=g)
                                                               .float())
    history[torch.rand(rows, cols, generator=g) < 0.1] = 0.0
    history[torch.rand(rows, cols, generator=g) < 0.05] = -0.0
    specials = f32(0x7FC00000, 0xFFC00000, 0x7FC12345, 0x7F800001, 0x7F800000, 0xFF800000, 0x00000001, 0x7F7FFFFF)
    row0 = torch.randint(0, len(specials), (cols,), generator=g)
    use = torch.rand(cols, generator=g) < 0.5
    history[0] = torch.where(use, specials[row0], history[0])
    if rows > 2:
        nan_rows = torch.randint(1, rows, (cols,), generator=g)
        some = torch.rand(cols, generator=g) < 0.2
        for j in torch.nonzero(some).flatten().tolist():
            history[nan_rows[j], j] = specials[j % 4]
    scale = torch.rand(cols, generator=g) * torch.exp2(torch.randint(-20, 20, (cols,), generator=g).float())
    if cols > 4:
        scale[3], scale[4] = specials[2], INF
    return history, scale


def python_update(history, scale, *, algo, margin, held, forward):
    """DelayedScalingState.update's own torch ops: a callable algo (the same math as the built-in one) takes them."""
    callable_algo = (lambda h: h.max(dim=0).values) if algo == "max" else (lambda h: h[0].clone())
    slots = history.shape[1]
    recipe = DelayedScaling(amax_history_len=history.shape[0], margin=margin, amax_compute_algo=callable_algo)
    per_gemm = 3 if forward else 2
    state = recipe.make_state(forward=forward, num_gemms=slots // per_gemm)
    state.amax_history.copy_(history)
    state.scale.copy_(scale)
    state.update()
    return state


def mark_held(history, held):
    """Slots that recorded nothing since the last update: row 0 holds NOT_RECORDED."""
    history = history.clone()
    history[0, held] = NOT_RECORDED
    return history


DELAYED_CASES = [(rows, forward, gemms) for rows in (1, 2, 3, 16, 1024) for forward, gemms in ((True, 1), (False, 4))]


@pytest.mark.parametrize("rows,forward,gemms", DELAYED_CASES)
def test_delayed_update_matches_the_python_update(rows, forward, gemms):
    slots = (3 if forward else 2) * gemms
    for seed in range(4):
        for algo in ("max", "most_recent"):
            for margin in (0, 3, 126):
                for held in ([], [1], [0, slots - 1, -2]):
                    history, scale = random_state(rows, slots, seed * 7 + rows)
                    history = mark_held(history, held)
                    want = python_update(history, scale, algo=algo, margin=margin, held=held, forward=forward)
                    what = f"rows={rows} slots={slots} seed={seed} {algo} margin={margin} held={held}"
                    # the native kernel itself, and the recipe state wired to it
                    for isa in ISAS:
                        with native.use_isa(isa):
                            h, s = history.clone(), scale.clone()
                            native.delayed_update(h, s, want.fp8_max, margin, algo, held)
                            assert_same(h, want.amax_history, f"{what} history")
                            assert_same(s, want.scale, f"{what} scale")
                    recipe = DelayedScaling(amax_history_len=rows, margin=margin, amax_compute_algo=algo)
                    state = recipe.make_state(forward=forward, num_gemms=gemms)
                    state.amax_history.copy_(history)
                    state.scale.copy_(scale)
                    state.update()
                    assert_same(state.amax_history, want.amax_history, f"{what} state history")
                    assert_same(state.scale, want.scale, f"{what} state scale")
                    # the registry's reference (forced backend, other devices)
                    h, s = history.clone(), scale.clone()
                    registry.delayed_update_reference(h, s, want.fp8_max, margin, algo, held)
                    assert_same(h, want.amax_history, f"{what} reference history")
                    assert_same(s, want.scale, f"{what} reference scale")


@pytest.mark.parametrize("rows", (1, 2, 17, 1024))
def test_delayed_update_of_zeros_of_both_signs(rows):
    """Without NaN the max does not depend on the order of the rows, except between +0 and -0: the first wins."""
    g = torch.Generator().manual_seed(rows)
    signs = torch.randint(0, 2, (rows, 6), generator=g).bool()
    history = torch.where(signs, torch.tensor(-0.0), torch.tensor(0.0))
    history[:, 4] = -torch.rand(rows, generator=g)  # negative values (not amaxes, but the bits must agree)
    history[rows // 2, 4] = -0.0
    history[-1, 5] = 2.0**-149  # a subnormal amax: the scale overflows to FLT_MAX
    scale = torch.full((6,), 3.0)
    for algo in ("max", "most_recent"):
        want = python_update(history, scale, algo=algo, margin=0, held=[], forward=True)
        for isa in ISAS:
            with native.use_isa(isa):
                h, s = history.clone(), scale.clone()
                native.delayed_update(h, s, 448.0, 0, algo)
                assert_same(h, want.amax_history, f"{algo} {isa} history")
                assert_same(s, want.scale, f"{algo} {isa} scale")


def test_delayed_update_of_a_known_sequence_by_hand():
    """448 / amax by hand: L = 3, slot 1 held once, an inf batch dropped, an unrecorded slot left alone."""
    history = torch.zeros(3, 2)
    scale = torch.ones(2)
    history[0] = torch.tensor([2.0, 4.0])
    native.delayed_update(history, scale, 448.0, 0, "max")
    assert scale.tolist() == [224.0, 112.0] and history.tolist() == [[-1, -1], [0, 0], [2, 4]]
    history[0] = torch.tensor([INF, 8.0])
    native.delayed_update(history, scale, 448.0, 1, "max", [1])
    assert scale.tolist() == [112.0, 112.0]  # slot 0: amax 2 (inf dropped), margin 1; slot 1 held
    assert history.tolist() == [[-1, 8], [2, 0], [0, 4]]
    native.delayed_update(history, scale, 448.0, 0, "most_recent")
    assert scale.tolist() == [112.0, 56.0]  # slot 0: nothing recorded, kept; slot 1: 448 / 8
    assert history.tolist() == [[-1, -1], [2, 4], [0, 8]]


def test_update_on_the_cpu_runs_no_torch_ops():
    state = DelayedScaling().make_state(forward=True)
    state.amax_history[0] = torch.tensor([1.0, 2.0, 3.0])
    with CountOps() as counted:
        state.update()
    assert counted.ops == []
    assert_same(state.scale, torch.tensor([448.0, 224.0, 448.0 / 3]), "448 / amax")


def test_delayed_update_arguments_are_refused_in_python_and_cpp():
    h, s = torch.zeros(4, 3), torch.ones(3)
    cases = [
        (TypeError, "^amax_history: .*float32", lambda: native.delayed_update(h.double(), s, 448.0, 0, "max")),
        (TypeError, "^scale: .*meta", lambda: native.delayed_update(h, s.to("meta"), 448.0, 0, "max")),
        (ValueError, "^amax_history: must be contiguous", lambda: native.delayed_update(h.t(), s[:4], 448.0, 0, "max")),
        (ValueError, "^scale: expected shape", lambda: native.delayed_update(h, torch.ones(4), 448.0, 0, "max")),
        (ValueError, "^amax_history: expected shape", lambda: native.delayed_update(h[0], s, 448.0, 0, "max")),
        (ValueError, "^algo", lambda: native.delayed_update(h, s, 448.0, 0, "mean")),
        (ValueError, "^margin", lambda: native.delayed_update(h, s, 448.0, 127, "max")),
        (ValueError, "^margin", lambda: native.delayed_update(h, s, 448.0, True, "max")),
        (ValueError, "^fp8_max", lambda: native.delayed_update(h, s, INF, 0, "max")),
        (ValueError, "^held", lambda: native.delayed_update(h, s, 448.0, 0, "max", [3])),
        (ValueError, "^held", lambda: qops.delayed_update(h, s, 448.0, 0, "max", [-4])),
        (ValueError, "^algo", lambda: qops.delayed_update(h, s, 448.0, 0, "mean")),
        (TypeError, "^scale: .*float32", lambda: qops.delayed_update(h, s.half(), 448.0, 0, "max")),
    ]
    for error, match, call in cases:
        with pytest.raises(error, match=match):
            call()
    ext = native._ext()
    cpp_cases = [
        (TypeError, "amax_history: expected dtype float32", (h.double(), s, 448.0, 0, False, [])),
        (ValueError, "amax_history: expected shape", (torch.zeros(0, 3), s, 448.0, 0, False, [])),
        (ValueError, "scale: expected shape", (h, torch.ones(2), 448.0, 0, False, [])),
        (ValueError, "contiguous", (torch.zeros(3, 4).t(), s, 448.0, 0, False, [])),
        (ValueError, "margin", (h, s, 448.0, -1, False, [])),
        (ValueError, "held: slot 3 out of range", (h, s, 448.0, 0, False, [3])),
        (ValueError, "shares memory", (h, h[1], 448.0, 0, False, [])),
    ]
    for error, match, args in cpp_cases:
        with pytest.raises(error, match=match):
            ext.delayed_update(*args)
