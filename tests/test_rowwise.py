"""FP8 rowwise (axiswise) scaling: the scheme, its quantizer, its GEMMs and torchao's two rowwise recipes.

* The scale rule and cast against a brute force written from torchao's definition
  (`448 / clamp(amax, 1e-12)` in float64, rounded to fp32, then down to a power of two), with
  codes found by searching every FP8 code (tests/brute_force.py), for the reference and the
  native kernel, both usages, edge rows (zero, subnormal, +-max, inf, NaN, a scale just below 2^k).
* The GEMMs (fprop, dgrad, wgrad forms, and the per-row x per-tensor pairing of
  ROWWISE_WITH_GW_HP) against float64 on operands built so that the fp32 sum is exact.
* Each recipe through Linear / LayerNormLinear / LayerNormMLP: a few training steps track
  high precision; checkpoints restore recipe and FP8 weights; engine.convert runs it.
"""

from __future__ import annotations

import io
import math

import pytest
import torch

import brute_force as bf
import engine
from engine.gemm import general_gemm
from engine.ops import reference as ref
from engine.quantizers import Float8CurrentScalingQuantizer, Float8RowwiseQuantizer, quantizer_from_plain
from engine.recipes import Float8RowwiseScaling, Gemm, QuantizerSpec, Role, recipe_from_plain, recipe_to_plain
from engine.schemes import fp8_scheme
from engine.modules.saving import read_extra_state
from engine.tensors import Float8RowwiseTensor, QuantizedTensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12  # torchao.float8.float8_utils.EPS
RECIPES = {"rowwise": Float8RowwiseScaling(), "rowwise_gw_hp": Float8RowwiseScaling(high_precision_wgrad=True)}
FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


# ================================================================== the scale rule and cast, brute force
def brute_axiswise(x: torch.Tensor, element: str, *, columnwise: bool, eps: float = EPS,
                   pow2: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes as stored, scale_inv [rows, 1]) for one usage, from the definitions, in float64.

    Rows are those of the 2D view (rowwise) or of its transpose (columnwise, stored [K, M]).
    amax per row (NaN if the row has one); scale = fp32(fp8_max / max(amax, eps)) computed in
    float64 as torchao does; rounded down to 2^k by frexp; an inf or NaN amax gives scale 1.
    Each element: the nearest code (RNE, saturating) of fp32(x * scale).
    """
    m, k = bf.dims_2d(x.shape) if x.dim() else (1, 1)
    v = x.reshape(m, k).double()
    v = v.t() if columnwise else v
    a = v.abs()
    amax = torch.nan_to_num(a, nan=0.0, posinf=math.inf).amax(dim=1) if a.shape[1] else torch.zeros(a.shape[0],
                                                                                                     dtype=torch.float64)
    amax = torch.where(torch.isnan(a).any(dim=1), math.nan, amax)
    scale = (bf.fp8_max(element) / amax.clamp(min=eps)).float().double()
    if pow2:
        _, e = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), e - 1)
    scale = torch.where(torch.isfinite(amax), scale, 1.0)
    codes = bf.nearest_codes((v * scale[:, None]).float().double(), element)
    return codes, (1.0 / scale).float()[:, None]


def edge_rows(dtype: torch.dtype) -> torch.Tensor:
    """37 x 45: rows of very different magnitudes, and rows that are all zero, subnormal, +-max, inf, NaN,
    and one whose 448 / amax lies just below a power of two (where torchao's log2 would round up)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 45, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-12, 12, (37, 1),
                                                                                         generator=g)).double()
    x[1] = 0.0
    tiny = torch.finfo(dtype).tiny
    x[2] = torch.randn(45, generator=g).double() * tiny / 4  # subnormal in every dtype
    big = torch.finfo(dtype).max
    x[3, :4] = torch.tensor([big, -big, big, -big])
    x[4, 7] = math.inf
    x[5, 9] = -math.inf
    x[6, 11] = math.nan
    x[7, 0] = -0.0
    x[8] = x[8].clamp(-0.2, 0.2)
    x[8, 3] = 448 * 2.0**-11 * (1 + 2.0**-23)  # fp32: 448 / amax is the fp32 number just below 2^11

    return x.to(dtype)


def assert_codes(got: torch.Tensor, want: torch.Tensor, element: str, what: str) -> None:
    got = got.view(torch.uint8).long().reshape(want.shape)
    table = bf.fp8_table(element)
    bad = torch.where(want == 255, ~torch.isnan(table[got]), got != want)
    assert not bad.any(), f"{what}: {int(bad.sum())} codes differ, e.g. at {bad.nonzero()[:4].tolist()}"


@pytest.mark.parametrize("backend", ["reference", "native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_matches_the_brute_force_rule_both_usages(backend, dtype, fp8):
    element = bf.element_name(fp8)
    for x in (edge_rows(dtype), edge_rows(dtype)[:36].reshape(3, 12, 45)):
        if backend == "reference":
            scheme = fp8_scheme("axiswise", fp8, pow2=True)
            buffers = {}
            for usage in ("rowwise", "columnwise"):
                buffers[f"{usage}_data"], buffers[f"{usage}_scale_inv"] = ref.quantize_blocked(
                    x, scheme, columnwise=usage == "columnwise", amax_epsilon=EPS)
        else:
            buffers = Float8RowwiseQuantizer(fp8)(x).qstorage.buffers()
        m, k = bf.dims_2d(x.shape)
        for usage in ("rowwise", "columnwise"):
            codes, scale_inv = brute_axiswise(x, element, columnwise=usage == "columnwise")
            data, got_scale = buffers[f"{usage}_data"], buffers[f"{usage}_scale_inv"]
            assert tuple(data.shape) == (tuple(x.shape) if usage == "rowwise" else (k, m))
            assert got_scale.dtype == torch.float32 and tuple(got_scale.shape) == tuple(scale_inv.shape)
            assert torch.equal(got_scale.view(torch.int32), scale_inv.view(torch.int32)), usage
            assert_codes(data, codes, element, f"{usage} {dtype}")
        if dtype == torch.float32 and fp8 == E4M3:  # 448 / amax just below 2^11: rounded down (torchao's log2 rounds it up)
            assert buffers["rowwise_scale_inv"][8, 0] == 2.0**-10


def test_scale_rule_without_pow2_and_with_another_eps_matches_the_brute_force():
    x = edge_rows(torch.float32)
    x[9] = 1e-9  # below eps = 1e-6: clamped
    q = Float8RowwiseQuantizer(E4M3, force_pow_2_scales=False, amax_epsilon=1e-6)
    st = q(x).qstorage
    for usage in ("rowwise", "columnwise"):
        codes, scale_inv = brute_axiswise(x, "e4m3", columnwise=usage == "columnwise", eps=1e-6, pow2=False)
        # scale_inv is 1 / scale rounded to fp32 (the codes use the scale itself)
        assert torch.equal(getattr(st, f"{usage}_scale_inv").view(torch.int32), scale_inv.view(torch.int32))
        assert_codes(getattr(st, f"{usage}_data"), codes, "e4m3", usage)


@pytest.mark.parametrize("shape", [(3000, 7), (5, 5000), (1, 1), (0, 9), (9, 0), (257, 1031)])
def test_native_kernel_is_bitwise_the_reference_at_wide_tall_and_empty_shapes(shape):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g) * torch.exp2(torch.randint(-40, 40, shape, generator=g).float()))
    if x.numel() > 3:
        x.view(-1)[:3] = torch.tensor([math.nan, math.inf, -3e-42])
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        got = Float8RowwiseQuantizer(E4M3)(xd).qstorage
        scheme = got.scheme
        for usage in ("rowwise", "columnwise"):
            data, scale_inv = ref.quantize_blocked(xd, scheme, columnwise=usage == "columnwise", amax_epsilon=EPS)
            assert torch.equal(getattr(got, f"{usage}_data").view(torch.uint8), data.view(torch.uint8)), usage
            assert torch.equal(getattr(got, f"{usage}_scale_inv").view(torch.int32), scale_inv.view(torch.int32))


def test_quantizer_settings_survive_plain_data_and_a_pickle_round_trip():
    q = Float8RowwiseQuantizer(E4M3, columnwise=False)
    again = quantizer_from_plain(q.to_plain())
    assert type(again) is Float8RowwiseQuantizer and again.config() == q.config() == {
        "fp8_dtype": "float8_e4m3fn", "force_pow_2_scales": True, "amax_epsilon": EPS}
    t = q(torch.randn(6, 10))
    assert type(t) is Float8RowwiseTensor and t.qstorage.rowwise_scale_inv.shape == (6, 1)
    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)
    assert type(back) is Float8RowwiseTensor and torch.equal(back.dequantize(), t.dequantize())
    with pytest.raises(ValueError, match="amax_epsilon"):
        Float8RowwiseQuantizer(E4M3, amax_epsilon=-1.0)


def test_columnwise_data_cannot_be_derived_from_rowwise():
    t = Float8RowwiseQuantizer(E4M3, columnwise=False)(torch.randn(8, 16))
    with pytest.raises(ValueError, match="cannot be derived"):
        t.qstorage.update_usage(columnwise_usage=True)


# ============================================================================================ GEMMs
def exact_operand(rows: int, k: int, seed: int) -> torch.Tensor:
    """Integers in [-8, 8] times 2^r per row, r in [-2, 2]: every per-row and per-column power-of-2 scale
    quantizes them exactly in E4M3, and fp32 sums of their products are exact (multiples of 2^-4 below 2^24)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-8, 9, (rows, k), generator=g) * torch.exp2(torch.randint(-2, 3, (rows, 1), generator=g))
            ).float()


def exact64(q: QuantizedTensor, usage: str) -> torch.Tensor:
    """float64 value of one usage from its codes and scales (brute_force's code table), as stored."""
    st = q.qstorage
    data, scale = getattr(st, f"{usage}_data"), getattr(st, f"{usage}_scale_inv")
    values = bf.fp8_table(bf.element_name(data.dtype))[data.reshape(-1, data.shape[-1]).view(torch.uint8).long()]
    return values * scale.double().reshape(-1, 1)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_three_gemm_forms_are_exact_against_float64(out_dtype):
    x, w, dy = exact_operand(24, 96, 0), exact_operand(40, 96, 1), exact_operand(24, 40, 2)
    q = Float8RowwiseQuantizer(E4M3)
    xq, wq, dyq = q(x), q(w), q(dy)
    for name, qt, t in (("x", xq, x), ("w", wq, w), ("dy", dyq, dy)):  # the construction really is exact
        assert torch.equal(exact64(qt, "rowwise"), t.double()) and torch.equal(exact64(qt, "columnwise"), t.double().t())
    scales = xq.qstorage.rowwise_scale_inv.unique()
    assert len(scales) > 1  # the rows really have different scales
    bias = torch.randint(-4, 5, (40,)).float()
    cases = {
        "fprop": (general_gemm(xq, wq, out_dtype=out_dtype, bias=bias), x.double() @ w.double().t() + bias.double()),
        "dgrad": (general_gemm(dyq, wq, b_transposed=True, out_dtype=out_dtype), dy.double() @ w.double()),
        "wgrad": (general_gemm(dyq, xq, a_transposed=True, b_transposed=True, out_dtype=out_dtype),
                  dy.double().t() @ x.double()),
    }
    for name, (got, want) in cases.items():
        assert got.dtype == out_dtype and torch.equal(got, want.to(out_dtype)), name


def test_random_gemm_is_within_the_fp32_accumulation_bound():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(33, 130, generator=g) * torch.exp2(torch.randint(-20, 20, (33, 1), generator=g).float())
    w = torch.randn(17, 130, generator=g)
    q = Float8RowwiseQuantizer(E4M3)
    xq, wq = q(x), q(w)
    a, b = exact64(xq, "rowwise"), exact64(wq, "rowwise")
    got = general_gemm(xq, wq, out_dtype=torch.float32).double()
    bound = (130 + 2) * 2.0**-24 * (a.abs() @ b.abs().t())
    assert ((got - a @ b.t()).abs() <= bound).all()


@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "fp32"])
def test_per_row_by_per_tensor_gemm_as_rowwise_with_gw_hp_dgrad(pow2):
    """dgrad of ROWWISE_WITH_GW_HP: per-row dy against a per-tensor weight, both operand orders."""
    dy, w = exact_operand(24, 40, 2), exact_operand(40, 96, 1)
    dyq = Float8RowwiseQuantizer(E4M3)(dy)
    wq = Float8CurrentScalingQuantizer(E4M3, force_pow_2_scales=pow2, amax_epsilon=EPS)(w)
    a, b = exact64(dyq, "rowwise"), exact64(wq, "columnwise")  # b: w^T [96, 40] as the GEMM reads it
    got = general_gemm(dyq, wq, b_transposed=True, out_dtype=torch.float32)
    got_t = general_gemm(wq, dyq, a_transposed=True, out_dtype=torch.float32)  # (w^T @ dy^T) = dx^T
    want = a @ b.t()
    if pow2:  # every value exact in bf16: one GEMM, the exact sum
        assert torch.equal(got.double(), want) and torch.equal(got_t.double(), want.t())
    else:  # per-tensor fp32 scale: the scale product is applied in fp32 to the fp32 partial product
        bound = (40 + 4) * 2.0**-24 * (a.abs() @ b.abs().t())
        assert ((got.double() - want).abs() <= bound).all() and ((got_t.double() - want.t()).abs() <= bound.t()).all()


def test_pairing_per_row_with_128_wide_tiles_is_refused():
    from engine.quantizers import Float8BlockQuantizer

    xq = Float8RowwiseQuantizer(E4M3)(torch.randn(8, 256))
    wq = Float8BlockQuantizer(E4M3)(torch.randn(16, 256))
    with pytest.raises(TypeError, match="cannot pair tiles"):
        general_gemm(xq, wq)


# ========================================================================================= recipes
def test_operand_maps_are_torchaos():
    spec = QuantizerSpec(layout="axiswise", element="e4m3", pow2=True, amax_epsilon=EPS)
    plain = Float8RowwiseScaling().operands()
    assert set(plain.values()) == {spec} and len(plain) == 6
    gw_hp = Float8RowwiseScaling(high_precision_wgrad=True).operands()
    assert gw_hp[Gemm.FPROP, Role.INPUT] == gw_hp[Gemm.FPROP, Role.WEIGHT] == gw_hp[Gemm.DGRAD, Role.GRAD_OUTPUT] == spec
    assert gw_hp[Gemm.DGRAD, Role.WEIGHT] == QuantizerSpec(layout="tensor", element="e4m3", pow2=True, amax_epsilon=EPS)
    assert gw_hp[Gemm.WGRAD, Role.INPUT] is None and gw_hp[Gemm.WGRAD, Role.GRAD_OUTPUT] is None
    assert Float8RowwiseScaling(fp8_format="HYBRID").operands()[Gemm.WGRAD, Role.GRAD_OUTPUT].element == "e5m2"
    for recipe in RECIPES.values():
        assert recipe_from_plain(recipe_to_plain(recipe)) == recipe
    assert engine.recipes.RECIPES["rowwise"] is Float8RowwiseScaling


def test_which_dim_each_linear_operand_is_scaled_along():
    """fprop: x per token, W per output channel; dgrad: dy per token, W per K; wgrad: dy per N, x per K."""
    state = Float8RowwiseScaling().make_state(forward=True)
    x, w = torch.randn(12, 64), torch.randn(48, 64)
    xq, wq = state.quantizer(Role.INPUT)(x).qstorage, state.quantizer(Role.WEIGHT)(w).qstorage
    assert xq.rowwise_scale_inv.shape == (12, 1) and xq.columnwise_scale_inv.shape == (64, 1)
    assert wq.rowwise_scale_inv.shape == (48, 1) and wq.columnwise_scale_inv.shape == (64, 1)
    per_token = 448 / x.abs().amax(1)
    assert torch.equal(xq.rowwise_scale_inv.flatten(), 1 / torch.exp2(torch.floor(torch.log2(per_token))))
    per_k = 448 / w.abs().amax(0)
    assert torch.equal(wq.columnwise_scale_inv.flatten(), 1 / torch.exp2(torch.floor(torch.log2(per_k))))


def teacher_task(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 32, generator=g)
    return x, torch.tanh(x @ torch.randn(32, 16, generator=g)) * 3


def train_linear(recipe, steps: int = 8) -> list[float]:
    torch.manual_seed(0)
    lin = engine.Linear(32, 16)
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    x, target = teacher_task()
    losses = []
    for _ in range(steps):
        with engine.fp8_autocast(enabled=recipe is not None, recipe=recipe):
            loss = (lin(x) - target).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", RECIPES)
def test_training_steps_track_high_precision(name):
    want, got = train_linear(None), train_linear(RECIPES[name])
    assert got[-1] < 0.7 * got[0]  # it learns
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 0.02 * b, (step, a, b)
    assert got != want  # and it really ran in FP8


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
def test_norm_modules_run_and_their_grads_track_high_precision(kind, name):
    torch.manual_seed(0)
    mod = engine.LayerNormLinear(64, 48) if kind == "LayerNormLinear" else engine.LayerNormMLP(64, 96)
    x = torch.randn(2, 16, 64)
    grads = {}
    for fp8 in (False, True):
        xi = x.clone().requires_grad_()
        with engine.fp8_autocast(enabled=fp8, recipe=RECIPES[name]):
            y = mod(xi)
        y.pow(2).mean().backward()
        grads[fp8] = [xi.grad] + [p.grad.clone() for p in mod.parameters()]
        mod.zero_grad()
    for a, b in zip(grads[True], grads[False]):
        assert torch.linalg.vector_norm(a - b) <= 0.1 * torch.linalg.vector_norm(b)


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("fp8_weights", [False, True], ids=["hp_weights", "fp8_weights"])
def test_checkpoint_restores_recipe_and_weights_exactly(name, fp8_weights):
    recipe = RECIPES[name]

    def make(seed):
        torch.manual_seed(seed)
        with engine.fp8_model_init(enabled=fp8_weights, recipe=recipe):
            return engine.Linear(64, 32)

    src = make(0)
    x = torch.randn(8, 64)
    with engine.fp8_autocast(recipe=recipe):
        src(x).sum().backward()
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert recipe_from_plain(read_extra_state(state["_extra_state"])["recipe"]) == recipe  # the recipe is saved
    dst = make(1)
    dst.load_state_dict(state, strict=True)
    if fp8_weights:
        assert type(dst.weight) is Float8RowwiseTensor
        for field in FIELDS:
            a, b = getattr(src.weight.qstorage, field), getattr(dst.weight.qstorage, field)
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), field
    with engine.fp8_autocast(recipe=recipe):
        assert torch.equal(dst(x), src(x))
    other = make(2)
    other.load_state_dict(state, strict=True)
    with pytest.warns(UserWarning, match=f"under Float8RowwiseScaling.*high_precision_wgrad={recipe.high_precision_wgrad}"):
        with engine.fp8_autocast(recipe=engine.recipes.Float8CurrentScaling()):
            other(x)


@pytest.mark.parametrize("name", RECIPES)
def test_convert_runs_a_torch_model_under_the_recipe(name):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    ref_model = torch.nn.Sequential(*[torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)])
    ref_model.load_state_dict(model.state_dict())
    engine.convert(model, keep_output_head=False)
    assert all(type(m) is engine.Linear for m in (model[0], model[2]))
    x = torch.randn(4, 8, 32)
    with engine.fp8_autocast(recipe=RECIPES[name]):
        y = model(x)
    y.pow(2).mean().backward()
    ref_model(x).pow(2).mean().backward()
    want = ref_model(x)
    # E4M3 keeps 4 significant bits (relative error <= 2^-4 per operand): 10% of the norm is ~3x the rms error
    assert torch.linalg.vector_norm(y - want) <= 0.1 * torch.linalg.vector_norm(want)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.linalg.vector_norm(p.grad - q.grad) <= 0.15 * torch.linalg.vector_norm(q.grad)


@pytest.mark.parametrize("name", RECIPES)
def test_empty_batch(name):
    lin = engine.Linear(16, 8)
    x = torch.zeros(0, 16, requires_grad=True)
    with engine.fp8_autocast(recipe=RECIPES[name]):
        y = lin(x)
    y.sum().backward()
    assert y.shape == (0, 8) and torch.equal(lin.weight.grad, torch.zeros(8, 16))


def test_per_tensor_by_mxfp8_pairs_exactly_too():
    """The per-tensor x tiles pairing is general: a power-of-2 per-tensor operand against E8M0 blocks."""
    from engine.quantizers import MXFP8Quantizer

    x, w = exact_operand(16, 64, 5), exact_operand(24, 64, 6)
    xq = Float8CurrentScalingQuantizer(E4M3, force_pow_2_scales=True)(x)
    wq = MXFP8Quantizer(E4M3)(w)
    assert torch.equal(xq.dequantize(), x) and torch.equal(wq.dequantize(), w)  # exact operands
    assert torch.equal(general_gemm(xq, wq, out_dtype=torch.float32).double(), x.double() @ w.double().t())


@pytest.mark.parametrize("name", RECIPES)
def test_torch_compile_gives_eager_bits(name):
    torch.manual_seed(0)
    model = torch.nn.Sequential(engine.Linear(64, 64), engine.Linear(64, 32))
    x = torch.randn(4, 8, 64)
    results = []
    for step in (model, torch.compile(model, fullgraph=True)):
        with engine.fp8_autocast(recipe=RECIPES[name]):
            y = step(x)
        y.pow(2).sum().backward()
        results.append([y.detach()] + [p.grad.clone() for p in model.parameters()])
        model.zero_grad()
    for a, b in zip(*results):
        assert torch.equal(a, b)
