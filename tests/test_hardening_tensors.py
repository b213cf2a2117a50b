"""Hardening of quantized tensors: optimizer steps on FP8 primary weights (single-tensor, foreach, fused; every
exported recipe), checkpoint validation at torch.load, Float8Quantizer state checks, dequantize's dtype. Loading an
FP8-weight checkpoint under another recipe is tests/conformance/test_conformance_saving.py's contract."""

from __future__ import annotations

import io
import math
import warnings

import pytest

from engine.schemes import get_scheme
from engine.tensors.storage import buffer_specs
import torch

import checkpoint_specs
import engine
from conftest import E4M3, E5M2, make_input, make_quantizer
from engine.formats import fp8_max, format_of
from engine.ops import reference as ref
from engine.quantizers import Float8Quantizer
from engine.recipes import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling
from engine.tensors import (
    Float8TensorStorage, MXFP8TensorStorage, QuantizedFallbackWarning,
    QuantizedTensor,
)
from engine.tensors import serialization

#: one recipe per FP8 weight storage `element_scale_inv` reads (per tensor, 128x128 blocks, MX): the FP8 rounding
#: bounds below are special to E4M3/E5M2; every exported recipe runs `test_optimizer_step_of_every_recipe...`
FP8_RECIPES = [DelayedScaling(), Float8CurrentScaling(), Float8BlockScaling(), MXFP8BlockScaling()]


def fp8_linear(recipe, seed: int = 0) -> engine.Linear:
    torch.manual_seed(seed)
    with engine.fp8_model_init(recipe=recipe):
        return engine.Linear(64, 32)


def element_scale_inv(storage) -> torch.Tensor:
    """The rowwise scale_inv of every element (the factor dequantization multiplies its FP8 code by)."""
    m, k = storage.shape[0], storage.shape[-1]
    sinv = storage.rowwise_scale_inv
    if isinstance(storage, Float8TensorStorage):
        return sinv.float().expand(m, k)
    if isinstance(storage, MXFP8TensorStorage):
        return ref.e8m0_to_float(sinv).repeat_interleave(32, 1)[:, :k]
    rows = 1 if storage.block_scaling_dim == 1 else 128
    return sinv.repeat_interleave(rows, 0)[:m].repeat_interleave(128, 1)[:, :k]


def rounding_bound(value: torch.Tensor, scale_inv: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Largest error of rounding `value` to nearest on the FP8 grid scaled by `scale_inv` (no saturation):
    half an ulp, i.e. |value| * 2^-(mantissa bits + 1) for normals, half the smallest subnormal step below."""
    fmt = format_of(fp8_dtype)
    return torch.maximum(value.abs() * 2.0 ** -(fmt.mantissa_bits + 1), scale_inv * fmt.min_subnormal / 2)


# ============================================================================ (6) optimizer steps
OPTIMIZERS = {
    "SGD": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "Adam": (torch.optim.Adam, {"lr": 0.01}),
    "AdamW": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}
MODES = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("recipe", FP8_RECIPES, ids=lambda r: r.name)
def test_optimizer_step_on_fp8_weights_matches_fp32_reference(recipe, opt_name, mode):
    opt_cls, hyper = OPTIMIZERS[opt_name]
    lin = fp8_linear(recipe)
    w, b = lin.weight, lin.bias
    assert isinstance(w, QuantizedTensor)
    before = w.dequantize().clone()
    w_ref = torch.nn.Parameter(before.clone())
    b_ref = torch.nn.Parameter(b.detach().clone())
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(w.shape, generator=g) * 0.5, torch.randn(b.shape, generator=g) * 0.5]
    w.grad, b.grad, w_ref.grad, b_ref.grad = grads[0].clone(), grads[1].clone(), grads[0].clone(), grads[1].clone()

    try:  # the reference first: only torch's own refusal of a mode on CPU skips
        opt_cls([w_ref, b_ref], **hyper, **MODES[mode]).step()
    except RuntimeError as err:
        pytest.skip(f"torch refuses {opt_name}({MODES[mode]}) on CPU: {err}")
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuantizedFallbackWarning)  # optimizer updates are not fallbacks
        opt_cls([w, b], **hyper, **MODES[mode]).step()

    assert isinstance(w, QuantizedTensor) and type(w.qstorage) is type(lin.weight.qstorage)
    assert torch.equal(b.detach(), b_ref.detach())  # the plain bias in the same lists: the same update
    got, want = w.dequantize(), w_ref.detach()
    assert not torch.equal(got, before), "the step left the FP8 weight unchanged"
    assert (got != before).float().mean() > 0.5
    fp8_dtype = w.fp8_dtype
    scale_inv = element_scale_inv(w.qstorage)
    tol = rounding_bound(want, scale_inv, fp8_dtype)
    # AdamW without `fused` writes the weight twice (decay with mul_, then addcdiv_): the value after the first
    # write is requantized too. Its scale is at most 2 * amax / fp8_max for a scale taken from the data (a power of
    # 2 rounded up, or exact), and the fixed scale for delayed scaling (that of the result).
    if opt_name == "AdamW" and mode != "fused":
        decayed = before * (1 - hyper["lr"] * hyper["weight_decay"])
        s1 = max(2 * decayed.abs().max().item() / fp8_max(fp8_dtype), scale_inv.max().item())
        first = rounding_bound(decayed, torch.full_like(decayed, s1), fp8_dtype)
        near = want.abs() + first + torch.finfo(torch.float32).eps * want.abs()  # + the fp32 add's rounding
        tol = rounding_bound(near, scale_inv, fp8_dtype) + (near - want.abs())
    err = (got - want).abs()
    assert bool((err <= tol).all()), f"max error {err.max().item()} over bound at {(err - tol).argmax().item()}"
    if not (opt_name == "AdamW" and mode != "fused"):
        # one write: the FP8 weight is exactly the weight quantizer's quantization of the fp32 result
        assert torch.equal(got, w.quantizer.quantize(want).dequantize())


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("recipe", [cls.__name__ for cls in checkpoint_specs.exported_recipe_classes()])
def test_optimizer_step_of_every_recipe_is_the_quantized_fp32_update(recipe, opt_name, mode):
    """Every recipe `engine.recipes` exports: the updated weight is the weight quantizer's quantization of what
    the optimizer computes on fp32 values. AdamW without `fused` writes twice (decay, then the Adam step), each
    write requantized: the reference decays and quantizes first, then runs the Adam step without decay."""
    opt_cls, hyper = OPTIMIZERS[opt_name]
    lin = fp8_linear(checkpoint_specs.make_recipe(recipe))
    w, b = lin.weight, lin.bias
    assert isinstance(w, QuantizedTensor)
    before, storage_type = w.dequantize().clone(), type(w.qstorage)
    two_writes = opt_name == "AdamW" and mode != "fused"
    decay = 1 - hyper["lr"] * hyper["weight_decay"] if two_writes else 1.0
    start = w.quantizer.quantize(before * decay).dequantize() if two_writes else before.clone()
    w_ref, b_ref = torch.nn.Parameter(start), torch.nn.Parameter(b.detach().clone())
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(w.shape, generator=g) * 0.5, torch.randn(b.shape, generator=g) * 0.5]
    w.grad, b.grad, w_ref.grad, b_ref.grad = grads[0].clone(), grads[1].clone(), grads[0].clone(), grads[1].clone()
    try:  # the reference first: only torch's own refusal of a mode on CPU skips
        opt_cls([w_ref, b_ref], **{**hyper, **({"weight_decay": 0.0} if two_writes else {})}, **MODES[mode]).step()
    except RuntimeError as err:
        pytest.skip(f"torch refuses {opt_name}({MODES[mode]}) on CPU: {err}")
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuantizedFallbackWarning)  # optimizer updates are not fallbacks
        opt_cls([w, b], **hyper, **MODES[mode]).step()
    assert isinstance(w, QuantizedTensor) and type(w.qstorage) is storage_type
    got = w.dequantize()
    assert (got != before).float().mean() > 0.3, "the step left the weight (nearly) unchanged"
    assert torch.equal(got, w.quantizer.quantize(w_ref.detach()).dequantize())


def test_foreach_update_of_quantized_tensor_without_quantizer_refuses_before_writing():
    q = make_quantizer("current_e4m3")(make_input((32, 64)))
    q.update_quantizer(None)
    plain = torch.zeros(4)
    before = q.dequantize().clone()
    with pytest.raises(ValueError, match=r"_foreach_add_.*self\[1\] is a Float8Tensor without a quantizer"):
        torch._foreach_add_([plain, q], [torch.ones(4), torch.ones(32, 64)])
    assert torch.equal(plain, torch.zeros(4)) and torch.equal(q.dequantize(), before)


def test_zeros_like_is_plain_and_silent(kind):
    t = make_quantizer(kind)(make_input((64, 128)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        z = torch.zeros_like(t)
        zb = torch.zeros_like(t, dtype=torch.bfloat16)
    assert type(z) is torch.Tensor and z.dtype == torch.float32 and z.shape == t.shape and not z.any()
    assert zb.dtype == torch.bfloat16


# ============================================================================ (3) checkpoint validation
STORAGE_KINDS = ["delayed_e4m3", "current_e5m2", "block1d", "block2d", "mx_rceil"]
FP32_SCALE_KINDS = ["delayed_e4m3", "current_e5m2", "block1d", "block2d"]


class _Tampered:
    """Pickles as the call a saved quantized tensor is, with a given (tampered) plain state."""

    def __init__(self, plain):
        self.plain = plain

    def __reduce__(self):
        return serialization.rebuild_quantized_tensor, (self.plain, False)


def saved_plain(kind: str, shape=(64, 256)) -> dict:
    """The plain state torch.save writes for a real quantized tensor (its __reduce_ex__ argument)."""
    t = make_quantizer(kind)(make_input(shape))
    plain = t.qstorage.to_plain()
    assert torch.equal(load(plain).dequantize(), t.dequantize())  # untampered, it loads
    return plain


def load(plain):
    buf = io.BytesIO()
    torch.save({"w": _Tampered(plain)}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)["w"]


@pytest.mark.parametrize("kind", STORAGE_KINDS)
@pytest.mark.parametrize("nominal", ["int32", "uint8", "float8_e4m3fn", "bool", "float64", "complex64"])
def test_load_rejects_non_float_nominal_dtype(kind, nominal):
    plain = saved_plain(kind)
    with pytest.raises(ValueError, match="nominal_dtype"):
        load({**plain, "nominal_dtype": nominal})


def _stride0(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)[:1].clone().expand(t.shape) if t.dim() else t


def _overlapping(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1).clone()
    return flat.as_strided(t.shape, (1,) * t.dim())


def _in_larger_storage(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1), t.reshape(-1)])[: t.numel()].view(t.shape)


def _offset(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1)[:1], t.reshape(-1)])[1:].view(t.shape)


TAMPERS = {"stride0": _stride0, "overlapping": _overlapping, "larger_storage": _in_larger_storage, "offset": _offset}
DENSITY_CASES = [
    (kind, field, name) for kind in STORAGE_KINDS for field in ("rowwise_data", "columnwise_data", "rowwise_scale_inv")
    for name in TAMPERS
    # a per-tensor scale has one element: dense whatever its strides
    if not (field == "rowwise_scale_inv" and kind in ("delayed_e4m3", "current_e5m2")
            and name in ("stride0", "overlapping"))
]


@pytest.mark.parametrize("kind, field, tamper", DENSITY_CASES, ids=["-".join(c) for c in DENSITY_CASES])
def test_load_rejects_buffers_that_are_not_dense(kind, field, tamper):
    plain = saved_plain(kind, (256, 384))  # every scale buffer of more than one element has two dims > 1
    with pytest.raises(ValueError, match=f"{field}: expected a dense tensor"):
        load({**plain, field: TAMPERS[tamper](plain[field])})


@pytest.mark.parametrize("kind", ["current_e4m3", "block2d", "mx_rceil"])
def test_small_file_claiming_a_huge_tensor_is_rejected_without_allocating(kind):
    """Every buffer a stride-0 expansion of one element: a tiny file that would stand for ~40 GB."""
    plain = saved_plain(kind)
    shape = (200_000, 200_000)
    specs = buffer_specs(get_scheme(plain["scheme"]), torch.Size(shape), rowwise=True, columnwise=True)
    huge = {name: torch.zeros(1, dtype=dt).expand(size) for name, (size, dt) in specs.items()}
    buf = io.BytesIO()
    torch.save({"w": _Tampered({**plain, "shape": list(shape), **huge})}, buf)
    assert buf.tell() < 20_000
    buf.seek(0)
    with pytest.raises(ValueError, match="expected a dense tensor"):
        torch.load(buf, weights_only=True)


def _other_shape(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros(t.shape[0] + 1, *t.shape[1:], dtype=t.dtype)


@pytest.mark.parametrize("kind", STORAGE_KINDS)
@pytest.mark.parametrize("field", ["rowwise_data", "columnwise_data", "rowwise_scale_inv", "columnwise_scale_inv"])
def test_load_rejects_buffers_disagreeing_with_the_declared_shape(kind, field):
    plain = saved_plain(kind)
    with pytest.raises(ValueError, match=field):
        load({**plain, field: _other_shape(plain[field])})



@pytest.mark.parametrize("kind", STORAGE_KINDS)
def test_load_rejects_rowwise_and_columnwise_of_different_shapes(kind):
    """Rowwise buffers of a real (32, 512) tensor, columnwise ones of a real (64, 256) tensor."""
    plain = saved_plain(kind)
    row = make_quantizer(kind)(make_input((32, 512))).qstorage
    tampered = {**plain, "shape": [32, 512], "rowwise_data": row.rowwise_data,
                "rowwise_scale_inv": row.rowwise_scale_inv}
    with pytest.raises(ValueError, match="columnwise_data: expected"):
        load(tampered)


@pytest.mark.parametrize("kind", STORAGE_KINDS)
@pytest.mark.parametrize("usage", ["rowwise", "columnwise"])
def test_load_rejects_a_scale_without_its_data(kind, usage):
    plain = saved_plain(kind)
    with pytest.raises(ValueError, match=f"{usage}_scale_inv: expected None"):
        load({**plain, f"{usage}_data": None})


@pytest.mark.parametrize("kind", FP32_SCALE_KINDS)
@pytest.mark.parametrize("field", ["rowwise_scale_inv", "columnwise_scale_inv"])
@pytest.mark.parametrize("bad", [0.0, -0.0, -1.0, math.inf, math.nan])
def test_load_rejects_fp32_scales_that_are_not_finite_and_positive(kind, field, bad):
    plain = saved_plain(kind)
    tampered = plain[field].clone()
    tampered.view(-1)[-1] = bad
    with pytest.raises(ValueError, match=f"{field}: expected finite scales > 0"):
        load({**plain, field: tampered})


def test_load_rejects_per_tensor_scales_that_differ_between_usages():
    plain = saved_plain("current_e4m3")
    with pytest.raises(ValueError, match="columnwise_scale_inv"):
        load({**plain, "columnwise_scale_inv": plain["columnwise_scale_inv"] * 2})


@pytest.mark.parametrize("usage", ["rowwise", "columnwise"])
@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_load_mx_nan_code_only_where_the_block_holds_a_nan(usage, mode):
    x = make_input((64, 96))
    x[5, 40] = float("nan")  # rowwise block (5, 1); columnwise block (0, 40)
    t = make_quantizer(f"mx_{mode}")(x)
    plain = t.qstorage.to_plain()
    codes = plain[f"{usage}_scale_inv"]
    nan_block = (5, 1) if usage == "rowwise" else (0, 40)
    assert codes[nan_block] == 255 and int((codes == 255).sum()) == 1  # what quantizing a NaN makes
    loaded = load(plain)  # a real NaN block loads
    assert torch.equal(loaded.qstorage.buffers()[f"{usage}_scale_inv"], codes)
    tampered = codes.clone()
    other = (6, 1) if usage == "rowwise" else (1, 40)
    tampered[other] = 255
    with pytest.raises(ValueError, match=f"{usage}_scale_inv: E8M0 code 255"):
        load({**plain, f"{usage}_scale_inv": tampered})


@pytest.mark.parametrize("field, bad", [
    ("scale", 0.0), ("scale", -2.0), ("scale", math.inf), ("scale", math.nan), ("scale", 1e-45),
    ("amax", -2.0), ("amax", math.inf), ("amax", math.nan),
])
def test_load_rejects_bad_float8_quantizer_state(field, bad):
    plain = saved_plain("delayed_e4m3")
    quantizer = {**plain["quantizer"], field: torch.tensor([bad])}
    with pytest.raises(ValueError, match=field):
        load({**plain, "quantizer": quantizer})


def test_load_rejects_a_quantizer_of_another_scheme():
    plain = saved_plain("current_e4m3")
    mx_state = make_quantizer("mx_rceil").to_plain()
    with pytest.raises(ValueError, match="quantizer: a MXFP8Quantizer .* cannot quantize into a tensor_e4m3 tensor"):
        load({**plain, "quantizer": mx_state})


def test_saving_a_buffer_view_writes_it_dense():
    """A storage whose buffer is a view into a larger tensor is saved compact, so it loads."""
    t = make_quantizer("mx_rceil")(make_input((64, 96)))
    st = t.qstorage
    big = torch.cat([st.rowwise_data.reshape(-1), st.rowwise_data.reshape(-1)])
    st.rowwise_data = big[st.rowwise_data.numel():].view(st.shape)
    loaded = load(st.to_plain())
    assert torch.equal(loaded.dequantize(), t.dequantize())


def test_load_to_meta_skips_only_the_value_checks():
    """map_location="meta" (reading shapes without data) still loads; the layout checks still run."""
    lin = fp8_linear(DelayedScaling())
    buf = io.BytesIO()
    torch.save({"weight": lin.weight.detach()}, buf)  # the pickled form (a state_dict holds component keys)
    buf.seek(0)
    weight = torch.load(buf, weights_only=True, map_location="meta")["weight"]
    assert type(weight) is type(lin.weight) and weight.is_meta and weight.qstorage.rowwise_data.is_meta
    plain = {**lin.weight.qstorage.to_plain(), "nominal_dtype": "int32"}
    buf = io.BytesIO()
    torch.save({"w": _Tampered(plain)}, buf)
    buf.seek(0)
    with pytest.raises(ValueError, match="nominal_dtype"):
        torch.load(buf, weights_only=True, map_location="meta")


# ============================================================================ (4) quantizer / dequantize arguments
@pytest.mark.parametrize("bad", [0.0, -0.0, -1.0, math.inf, -math.inf, math.nan, 1e-45, 2.0**-128])
def test_float8_quantizer_rejects_bad_scale(bad):
    """... and subnormal scales whose fp32 reciprocal (the data's scale_inv) is inf; 2^-127's is 2^127."""
    with pytest.raises(ValueError, match="scale"):
        Float8Quantizer(torch.tensor([bad]), torch.zeros(1), E4M3)
    assert Float8Quantizer(torch.tensor([2.0**-127]), torch.zeros(1), E4M3).scale.item() == 2.0**-127


@pytest.mark.parametrize("bad", [-2.0, -0.5, math.inf, math.nan])  # -1 is NOT_RECORDED: nothing recorded yet
def test_float8_quantizer_rejects_bad_amax(bad):
    with pytest.raises(ValueError, match="amax"):
        Float8Quantizer(torch.ones(1), torch.tensor([bad]), E5M2)


def test_float8_quantizer_accepts_zero_amax_and_small_scale():
    q = Float8Quantizer(torch.tensor([2.0**-20]), torch.zeros(1), E4M3)
    assert q.scale.item() == 2.0**-20


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.complex64,
                                   "float32", 3, torch.ones(1)], ids=str)
@pytest.mark.parametrize("internal", [False, True], ids=["tensor", "storage"])
def test_dequantize_rejects_non_float_dtype(kind, dtype, internal):
    t = make_quantizer(kind, internal=internal)(make_input((64, 128)))
    with pytest.raises(TypeError, match="dtype"):
        t.dequantize(dtype=dtype)
    if not internal:
        t.requires_grad_(True)  # the differentiable path checks too
        with pytest.raises(TypeError, match="dtype"):
            t.dequantize(dtype=dtype)


def test_to_non_float_dtype_is_a_cast_of_the_value(kind):
    t = make_quantizer(kind)(make_input((64, 128)) * 100)
    assert torch.equal(t.to(torch.int32), t.dequantize().to(torch.int32))
    assert torch.equal(t.double(), t.dequantize().double())
