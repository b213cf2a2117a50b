"""engine.quantize_: each config's layer output within a bound its format implies, against references
computed here (float64 sums of the dequantized weight; the quantization rules written out again)."""

from __future__ import annotations

import pytest
import torch

import engine
import mx_brute
from engine.inference import int_formats
from engine.inference.weight import QuantizedWeight

BF16_U = 2.0 ** -8  # bf16 unit roundoff (half an ulp, relative)
FP32_U = 2.0 ** -24

ALL_CONFIGS = [
    engine.Int8WeightOnly(), engine.Int4WeightOnly(group_size=32), engine.Int4WeightOnly(group_size=64),
    engine.Int8DynamicActivationInt8Weight(), engine.Float8WeightOnly(),
    engine.Float8DynamicActivationFloat8Weight("tensor"), engine.Float8DynamicActivationFloat8Weight("row"),
    *[engine.MXWeightOnly(e) for e in ("e4m3", "e2m3", "e3m2", "e2m1")], engine.NVFP4WeightOnly(),
]


def ids(config: object) -> str:
    return repr(config).replace(" ", "")


def layer(cls: type, k: int, n: int, bias: bool = True, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return cls(k, n, bias=bias).bfloat16()


def fp64_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = x.double().reshape(-1, x.shape[-1]) @ w.double().t()
    return out if bias is None else out + bias.double()


def assert_within(y: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (y.double().reshape(ref.shape) - ref).abs()
    assert bool((err <= bound).all()), f"{what}: worst excess {(err - bound).max().item():.3g}"


def rounding_bound(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """One rounding of the output to out_dtype plus fp32 accumulation in any order (gamma_K * sum |x||w|)."""
    k = x.shape[-1]
    u = BF16_U if out_dtype == torch.bfloat16 else FP32_U
    absdot = x.double().abs().reshape(-1, k) @ w.double().abs().t()
    return u * ref.abs() * 1.01 + 1.01 * k * FP32_U * absdot + 1e-30


# ---------------------------------------------------------------------------- per format
@pytest.mark.parametrize("cls", [torch.nn.Linear, engine.Linear])
def test_int8_weight_only(cls: type) -> None:
    """scale = amax/127 rounded to bf16, q = round(w/scale) in [-127, 127]; |w - q*scale| <= scale/2; the
    layer computes (x @ q^T) * scale with fp32 accumulation, one rounding to bf16, then + bias."""
    m = layer(cls, 64, 48)
    w, b = m.weight.detach().clone(), m.bias.detach().clone()
    engine.quantize_(m, engine.Int8WeightOnly())
    scale = (w.float().abs().amax(1) / 127).bfloat16().double()
    q = torch.clamp(torch.round((w.double() / scale[:, None]).float().double()), -127, 127)
    deq = q * scale[:, None]
    assert torch.equal(m.weight.dequantize(torch.float64), deq)
    assert bool(((w.double() - deq).abs() <= scale[:, None] / 2 * (1 + 2 ** -7)).all())
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    y = m(x)
    assert y.shape == (2, 5, 48) and y.dtype == torch.bfloat16
    ref = fp64_linear(x, deq)
    yb = (y.double().reshape(-1, 48) - b.double())  # bias added after the rounding, in bf16
    assert_within(yb, ref, rounding_bound(x, deq, ref, torch.bfloat16) + BF16_U * (ref.abs() + b.double().abs()) * 2.02,
                  "int8 weight-only")


def test_int8_weight_only_odd_k_runs_the_formula() -> None:
    """K not a multiple of 16 would crash torch's _weight_int8pack_mm: above the native kernel's M the formula
    runs instead (bit for bit); at small M the native kernel (the same sums in another order)."""
    m = layer(torch.nn.Linear, 40, 24, bias=False)
    engine.quantize_(m, engine.Int8WeightOnly())
    fmt = m.weight.fmt
    x = torch.randn(fmt.native_max_m + 1, 40, dtype=torch.bfloat16)
    q, scale = m.weight.storage.rowwise_data, m.weight.storage.rowwise_scale_inv.view(-1)
    assert torch.equal(m(x), ((x.float() @ q.float().t()) * scale.float()).bfloat16())
    deq = m.weight.dequantize(torch.float64)
    ref = fp64_linear(x[:3], deq)
    assert_within(m(x[:3]), ref, rounding_bound(x[:3], deq, ref, torch.bfloat16), "int8 small M")


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_weight_only(group_size: int) -> None:
    """Per group: scale = (max-min)/15, zero = min + 8*scale (bf16); q = clamp(round((w - zero)/scale) + 8, 0, 15);
    value (q - 8)*scale + zero. N = 40 is padded to 48 for the kernel and cut back."""
    m = layer(torch.nn.Linear, 128, 40)
    w = m.weight.detach().double()
    engine.quantize_(m, engine.Int4WeightOnly(group_size=group_size))
    g = w.reshape(40, -1, group_size)
    lo, hi = g.amin(2), g.amax(2)
    scale = ((hi - lo) / 15).float().bfloat16().double()
    zero = (lo + 8 * scale).float().bfloat16().double()
    quotient = (g.float() - zero[..., None].float()) / scale[..., None].float()  # in fp32, as stated
    q = torch.clamp(torch.round(quotient.double()) + 8, 0, 15)
    deq = ((q - 8) * scale[..., None] + zero[..., None]).reshape(40, 128)
    assert torch.equal(m.weight.dequantize(torch.float64), deq.float().double())
    s = scale.repeat_interleave(group_size, 1)
    z = zero.repeat_interleave(group_size, 1)
    assert bool(((w - deq).abs() <= s / 2 + 2 ** -8 * (z.abs() + 8 * s) + 1e-7).all())
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    y = m(x).double() - m.bias.double()  # the bias is added after the GEMM's rounding, in bf16
    ref = fp64_linear(x, deq)
    bound = rounding_bound(x, deq, ref, torch.bfloat16) + BF16_U * (ref.abs() + m.bias.double().abs()) * 2.02
    assert_within(y, ref, bound, "int4")
    assert torch.equal(m(x[:1]), m(x)[:1])  # M = 1 (the GEMV) computes the same rows


@pytest.mark.parametrize("k", [100, 96])
def test_int4_pads_k_to_the_group(k: int) -> None:
    """K not a multiple of the group: the weight gets zero columns up to one (the last group's scale and zero
    see them), x zeros at run time; dequantize and the output are those of the padded weight, cut back to K."""
    m = layer(torch.nn.Linear, k, 40)
    w = torch.nn.functional.pad(m.weight.detach().double(), (0, 128 - k))
    engine.quantize_(m, engine.Int4WeightOnly(group_size=64))
    parts = m.weight.plain_parts()  # the kernel's layout, as saved; the storage is the [40, k] weight's
    assert parts["data"].shape == (48, 64) and parts["scale_and_zero"].shape == (2, 48, 2)
    assert m.weight.storage.rowwise_data.shape == (40, k // 2) and m.weight.storage.rowwise_scale_inv.shape == (40, 2, 2)
    g = w.reshape(40, 2, 64)
    scale = ((g.amax(2) - g.amin(2)) / 15).float().bfloat16().double()
    zero = (g.amin(2) + 8 * scale).float().bfloat16().double()
    q = torch.clamp(torch.round(((g.float() - zero[..., None].float()) / scale[..., None].float()).double()) + 8, 0, 15)
    deq = ((q - 8) * scale[..., None] + zero[..., None]).reshape(40, 128)[:, :k]
    assert torch.equal(m.weight.dequantize(torch.float64), deq.float().double())
    for rows in (1, 300):  # the C++ kernel and, above its M, the fp32 formula
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        y = m(x).double() - m.bias.double()
        ref = fp64_linear(x, deq)
        bound = rounding_bound(x, deq, ref, torch.bfloat16) + BF16_U * (ref.abs() + m.bias.double().abs()) * 2.02
        assert_within(y, ref, bound, f"int4, K = {k}, M = {rows}")
    other = layer(torch.nn.Linear, k, 40, seed=1)
    engine.quantize_(other, engine.Int4WeightOnly(group_size=64))
    other.load_state_dict(m.state_dict())  # the padded parts' shapes are checked at load
    assert torch.equal(other(x), m(x))


def test_int4_large_m_is_the_fp32_formula() -> None:
    """Above the native kernel's M: (x @ ((q - 8) * scale + zero)^T) in fp32, rounded once (bit for bit)."""
    m = layer(torch.nn.Linear, 64, 32, bias=False)
    engine.quantize_(m, engine.Int4WeightOnly(group_size=32))
    x = torch.randn(m.weight.fmt.native_max_m_bf16 + 1, 64, dtype=torch.bfloat16)
    assert torch.equal(m(x), (x.float() @ m.weight.dequantize(torch.float32).t()).bfloat16())


def test_int32_accumulation_is_exact() -> None:
    """The int8 GEMM's int32 sums equal an int64 matmul of the same values, past fp32's 2^24 (an fp32
    accumulation would round them), with u8 x s8 pair sums past 16 bits (oneDNN without VNNI saturates them:
    there int32_mm runs torch's GEMM on sign-split operands, engine/inference/int8_mm.py). They are
    `out_dtype(aten.mm, int32, ...)`'s too."""
    torch.manual_seed(0)
    a = torch.randint(100, 128, (8, 4096), dtype=torch.int8)
    b = torch.randint(-127, 128, (24, 4096), dtype=torch.int8)
    b[:12] = torch.randint(90, 128, (12, 4096), dtype=torch.int8)
    exact = a.long() @ b.long().t()
    assert exact.abs().max() > 2 ** 25
    acc = int_formats.int32_mm(a, b)
    assert acc.dtype == torch.int32 and torch.equal(acc.long(), exact)
    from torch._higher_order_ops.out_dtype import out_dtype

    assert torch.equal(out_dtype(torch.ops.aten.mm.default, torch.int32, a, b.t()).long(), exact)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_dynamic(dtype: torch.dtype) -> None:
    """x per token: sx = amax/127, xq = round(x/sx); W per channel likewise (fp32 scales);
    y = (xq @ wq^T) * sx * sw: exact integer sums, two fp32 products, one rounding, + bias."""
    torch.manual_seed(1)
    m = torch.nn.Linear(96, 32).to(dtype)
    w = m.weight.detach().double()
    engine.quantize_(m, engine.Int8DynamicActivationInt8Weight())
    x = torch.randn(2, 3, 96, dtype=dtype)
    x2 = x.reshape(-1, 96).double()
    sx = (x2.abs().amax(1) / 127).float().double()
    sw = (w.abs().amax(1) / 127).float().double()
    xq = torch.clamp(torch.round((x2 / sx[:, None]).float().double()), -127, 127)  # the fp32 quotient, rounded
    wq = torch.clamp(torch.round((w / sw[:, None]).float().double()), -127, 127)
    ref = (xq @ wq.t()) * sx[:, None] * sw[None, :]
    y = (m(x).double() - m.bias.double()).reshape(-1, 32)  # the bias is added after the rounding, in x.dtype
    u = BF16_U if dtype == torch.bfloat16 else FP32_U
    bound = (2 * u + 3 * FP32_U) * ref.abs() * 1.01 + u * m.bias.double().abs() * 2.02 + 1e-30
    assert_within(y, ref, bound, "int8 dynamic")


def test_float8_weight_only_is_exact_in_bf16() -> None:
    """Per-channel E4M3 with power-of-2 scales: the dequantized weight is exact in bf16, within E4M3's
    half ulp (2^-4 relative, 2^-10 * scale_inv below its normals) of w. The GEMM: engine's C++ kernel at small M
    (fp32 sums, one rounding, then + bias), one bf16 GEMM on the decoded weight above it."""
    m = layer(engine.Linear, 64, 32)
    w = m.weight.detach().double()
    engine.quantize_(m, engine.Float8WeightOnly())
    deq = m.weight.dequantize(torch.float64)
    assert torch.equal(m.weight.dequantize(torch.bfloat16).double(), deq)
    scale_inv = m.weight.storage.rowwise_scale_inv.double().reshape(-1, 1)
    assert torch.equal(torch.frexp(scale_inv)[0], torch.full_like(scale_inv, 0.5))  # powers of two
    assert bool(((w - deq).abs() <= 2 ** -4 * w.abs() + 2 ** -10 * scale_inv).all())
    for rows in (5, m.weight.fmt.native_max_m + 1):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        ref = fp64_linear(x, deq, m.bias)
        bound = rounding_bound(x, deq, ref, torch.bfloat16) + BF16_U * (ref.abs() + m.bias.double().abs()) * 2.02
        assert_within(m(x), ref, bound, f"fp8 weight-only, M = {rows}")


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_float8_dynamic(granularity: str) -> None:
    """x and W quantized to E4M3 (per tensor or per row, scales from engine's quantizers made here); the GEMM
    of the two dequantized operands within one bf16 rounding and fp32 accumulation."""
    from engine.quantizers import Float8CurrentScalingQuantizer, Float8RowwiseQuantizer

    m = layer(torch.nn.Linear, 64, 32)
    w = m.weight.detach().clone()
    engine.quantize_(m, engine.Float8DynamicActivationFloat8Weight(granularity))
    quantizer = (Float8RowwiseQuantizer if granularity == "row" else Float8CurrentScalingQuantizer)(
        torch.float8_e4m3fn, columnwise=False)
    x = torch.randn(6, 64, dtype=torch.bfloat16) * torch.linspace(0.1, 10, 6, dtype=torch.bfloat16)[:, None]
    xd, wd = quantizer(x).dequantize(torch.float64), quantizer(w).dequantize(torch.float64)
    assert torch.equal(m.weight.dequantize(torch.float64), wd)
    ref = fp64_linear(xd, wd, m.bias)
    bound = rounding_bound(xd, wd, ref, torch.bfloat16) + FP32_U * 64 * m.bias.double().abs()
    assert_within(m(x), ref, bound, f"fp8 dynamic {granularity}")


#: MX elements: (largest normal, its unbiased exponent, the non-negative grid values in code order)
MX_ELEMENTS = {
    "e4m3": (448.0, 8, torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double()),  # 0x7F: NaN
    **{name: (mx_brute.SPEC[name][3], mx_brute.SPEC[name][4], torch.from_numpy(mx_brute.grid(name)))
       for name in ("e2m3", "e3m2", "e2m1")},
}


def mx_expected(w: torch.Tensor, element: str, scale_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(E8M0 codes [N, K/32], dequantized weight in float64) by the OCP MX rules written out here: per 32-block,
    RCEIL: d = fp32(amax) * fp32(1/max_elem) rounded up to a power of two; FLOOR: floor(log2 amax) - emax_elem;
    each element w * 2^(127 - code) to the nearest grid value (ties to the even code), saturating."""
    top, emax, grid = MX_ELEMENTS[element]
    blocks = w.float().reshape(w.shape[0], -1, 32)
    amax = blocks.abs().amax(2)
    if scale_mode == "rceil":
        d = (amax * torch.tensor(1.0 / top, dtype=torch.float32)).double()
        mantissa, exponent = torch.frexp(d)
        ceil_log2 = torch.where(mantissa == 0.5, exponent - 1, exponent)
    else:
        ceil_log2 = torch.frexp(amax.double())[1] - 1 - emax  # floor(log2 amax) - emax
    codes = torch.where(amax == 0, 0, (ceil_log2 + 127).clamp(0, 254))
    scaled = (blocks * torch.exp2(127.0 - codes.float())[..., None]).double()
    dist = (scaled.abs().clamp(max=top)[..., None] - grid).abs()
    nearest = dist == dist.min(-1, keepdim=True).values
    even = nearest & (torch.arange(len(grid)) % 2 == 0)  # of two nearest (a tie), the even code
    index = torch.where(even.any(-1), even.int().argmax(-1), nearest.int().argmax(-1))
    values = grid[index] * torch.where(scaled < 0, -1.0, 1.0) * torch.exp2(codes.double() - 127)[..., None]
    return codes.to(torch.uint8), values.reshape(w.shape)


@pytest.mark.parametrize("scale_mode", ["rceil", "floor"])
@pytest.mark.parametrize("element", ["e4m3", "e2m3", "e3m2", "e2m1"])
def test_mx_weight_only(element: str, scale_mode: str) -> None:
    """The E8M0 scale codes and the decoded weight equal the OCP MX rules computed here (`mx_expected`), bit for
    bit; the decoded weight is exact in bf16; above the C++ kernel's M the layer is one bf16 GEMM of x with that
    weight (bit for bit), at small M (engine's GEMV/GEMM) within fp32 accumulation and one bf16 rounding."""
    m = layer(torch.nn.Linear, 64, 32)
    codes, expected = mx_expected(m.weight.detach(), element, scale_mode)
    engine.quantize_(m, engine.MXWeightOnly(element, scale_mode))
    assert torch.equal(m.weight.storage.rowwise_scale_inv, codes)
    deq = m.weight.dequantize(torch.float64)
    assert torch.equal(deq, expected)
    assert torch.equal(m.weight.dequantize(torch.bfloat16).double(), expected)
    x = torch.randn(2, 20, 64, dtype=torch.bfloat16)  # M = 40
    assert torch.equal(m(x), torch.nn.functional.linear(x, expected.bfloat16(), m.bias))
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    ref = fp64_linear(x, expected, m.bias)
    bound = rounding_bound(x, expected, ref, torch.bfloat16) + FP32_U * 64 * m.bias.double().abs() + BF16_U * ref.abs()
    assert_within(m(x), ref, bound, f"mx {element}")


def test_nvfp4_weight_only() -> None:
    """NVFP4 weights computed in fp32 (the per-tensor factor is not exact in bf16): within fp32 accumulation
    and one bf16 rounding of x @ W_deq^T; W_deq within E2M1's step of w per 16-block."""
    m = layer(torch.nn.Linear, 64, 32)
    w = m.weight.detach().double()
    engine.quantize_(m, engine.NVFP4WeightOnly())
    deq = m.weight.dequantize(torch.float64)
    amax = w.reshape(32, 4, 16).abs().amax(2, keepdim=True)
    assert bool(((w.reshape(32, 4, 16) - deq.reshape(32, 4, 16)).abs() <= amax / 6 * 1.07).all())  # half of 2 steps
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    ref = fp64_linear(x, deq, m.bias)
    bound = rounding_bound(x, deq, ref, torch.bfloat16) + FP32_U * 64 * m.bias.double().abs() + BF16_U * ref.abs()
    assert_within(m(x), ref, bound, "nvfp4")


# ---------------------------------------------------------------------------- the module side
def input_as_quantized(config: object, x: torch.Tensor) -> torch.Tensor:
    """x [M, K] in float64 as the config's GEMM sees it, by the rules written out here: unchanged for weight-only
    configs; per token int8 (sx = fp32(amax/127), round(fp32(x/sx)) in [-127, 127]); E4M3 per tensor
    (s = fp32(448/amax)) or per row (that s rounded down to a power of two), x*s in fp32 cast nearest-even."""
    x = x.float()
    if isinstance(config, engine.Int8DynamicActivationInt8Weight):
        sx = (x.abs().amax(1, keepdim=True).double() / 127).float()
        return torch.clamp(torch.round(x / sx), -127, 127).double() * sx.double()
    if isinstance(config, engine.Float8DynamicActivationFloat8Weight):
        amax = x.abs().amax() if config.granularity == "tensor" else x.abs().amax(1, keepdim=True)
        s = (448 / amax.double()).float()
        if config.granularity == "row":
            s = torch.exp2(torch.frexp(s)[1] - 1.0)
        return (x * s).clamp(-448, 448).to(torch.float8_e4m3fn).double() / s.double()
    return x.double()


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=ids)
@pytest.mark.parametrize("cls", [torch.nn.Linear, engine.Linear])
@pytest.mark.parametrize("bias", [True, False])
def test_every_config_runs_3d_with_and_without_bias(config: object, cls: type, bias: bool) -> None:
    """Any leading dims; a zero input gives exactly the bias; `x @ w.t()` and torch.matmul run the layer's GEMM
    (the output of the same weights in a layer without bias, bit for bit); the output is, within fp32
    accumulation and the bf16 roundings, x (as the config quantizes it, `input_as_quantized`) times the
    dequantized weight plus the bias, computed here in float64."""
    m = layer(cls, 64, 48, bias=bias)
    plain = m(torch.zeros(1, 64, dtype=torch.bfloat16))
    engine.quantize_(m, config)
    no_bias = engine.quantize_(layer(cls, 64, 48, bias=False), config)
    assert isinstance(m.weight, torch.nn.Parameter) and isinstance(m.weight, QuantizedWeight)
    assert not m.weight.requires_grad and m.weight.shape == (48, 64) and m.weight.dtype == torch.bfloat16
    deq = m.weight.dequantize(torch.float64)
    assert torch.equal(no_bias.weight.dequantize(torch.float64), deq)  # the same weights (same seed)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    y = m(x)
    assert y.shape == (2, 3, 48) and y.dtype == torch.bfloat16
    assert torch.equal(y.reshape(6, 48), m(x.reshape(6, 64)))
    assert torch.equal(m(torch.zeros(1, 64, dtype=torch.bfloat16)), plain)  # zero input: exactly the bias
    gemm = no_bias(x)
    assert torch.equal(x @ m.weight.t(), gemm) and torch.equal(torch.matmul(x, m.weight.t()), gemm)
    if not bias:
        assert torch.equal(y, gemm)
    xq = input_as_quantized(config, x.reshape(6, 64))
    for out, b in ((gemm, None), (y, m.bias)):
        ref = fp64_linear(xq, deq, b)
        bound = rounding_bound(xq, deq, ref, torch.bfloat16) + 4 * 64 * FP32_U * (xq.abs() @ deq.abs().t())
        if b is not None:  # the bias added in fp32 before the rounding, or in bf16 after it
            bound = bound + BF16_U * (ref.abs() + b.double().abs()) * 2.02
        assert_within(out, ref, bound, f"{config} {'with' if b is not None else 'without'} bias")


def test_repr_names_the_config_and_shape() -> None:
    m = layer(torch.nn.Linear, 64, 32)
    engine.quantize_(m, engine.Int4WeightOnly(group_size=64))
    text = repr(m.weight)
    assert "Int4WeightOnly(group_size=64)" in text and "shape=[32, 64]" in text and "bfloat16" in text


def test_module_filter_and_the_model_kinds() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), engine.Linear(64, 32),
                                torch.nn.Linear(32, 16)).bfloat16()
    seen = []

    def only_hidden(fqn: str, module: torch.nn.Module) -> bool:
        seen.append((fqn, type(module).__name__))
        return fqn != "3"

    engine.quantize_(model, engine.Int8WeightOnly(), module_filter=only_hidden)
    assert [fqn for fqn, _ in seen] == ["0", "2", "3"]
    assert isinstance(model[0].weight, QuantizedWeight) and isinstance(model[2].weight, QuantizedWeight)
    assert type(model[3].weight) is torch.nn.Parameter
    mha = torch.nn.MultiheadAttention(32, 4)
    engine.quantize_(mha, engine.Int8WeightOnly())  # its out_proj is read directly by F.multi_head_attention_forward
    assert type(mha.out_proj.weight) is torch.nn.Parameter


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="group_size"):
        engine.Int4WeightOnly(group_size=48)
    with pytest.raises(TypeError, match="group_size"):
        engine.Int4WeightOnly(group_size=True)
    with pytest.raises(ValueError, match="element"):
        engine.MXWeightOnly("e5m2")
    with pytest.raises(ValueError, match="granularity"):
        engine.Float8DynamicActivationFloat8Weight("block")
    m = torch.nn.Linear(96, 32)
    with pytest.raises(TypeError, match="config"):
        engine.quantize_(m, "int8")
    with pytest.raises(TypeError, match="module_filter"):
        engine.quantize_(m, engine.Int8WeightOnly(), module_filter=3)
    with pytest.raises(TypeError, match="weight: expected a float32, bfloat16 or float16"):
        QuantizedWeight.from_float(torch.ones(4, 4, dtype=torch.float64), engine.Int8WeightOnly())
    with pytest.raises(ValueError, match="weight: expected a 2D"):
        QuantizedWeight.from_float(torch.ones(4, 4, 4), engine.Int8WeightOnly())
    engine.quantize_(m, engine.Int8WeightOnly())
    with pytest.raises(ValueError, match="already quantized"):
        engine.quantize_(m, engine.Int8WeightOnly())
    with pytest.raises(ValueError, match="input: expected a last dim of 96"):
        m(torch.randn(2, 95))
    with pytest.raises(NotImplementedError, match="dequantize"):
        m.weight + 1


def test_small_gpt_keeps_its_loss() -> None:
    """The demo GPT (random init, a few AdamW steps on random bytes): every quantized config's loss stays near bf16."""
    from engine.train.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=64, n_layers=2, n_heads=4, seq_len=32))
    tokens = torch.randint(0, 256, (4, 33))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(3):
        model.loss(tokens).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        base = model.loss(tokens).item()
    state = model.state_dict()
    for config in (engine.Int8WeightOnly(), engine.Int4WeightOnly(group_size=32), engine.Float8WeightOnly(),
                   engine.Int8DynamicActivationInt8Weight(), engine.MXWeightOnly("e2m1")):
        q = GPT(GPTConfig(d_model=64, n_layers=2, n_heads=4, seq_len=32))
        q.load_state_dict(state)
        engine.quantize_(q, config)
        assert isinstance(q.head.weight, QuantizedWeight) and isinstance(q.blocks[0].attn.proj.weight, QuantizedWeight)
        with torch.no_grad():
            loss = q.loss(tokens).item()
        assert abs(loss - base) < 0.05 * base, (config, loss, base)


@pytest.mark.parametrize("config", [engine.Float8WeightOnly(), *[engine.MXWeightOnly(e) for e in
                                    ("e4m3", "e2m3", "e3m2", "e2m1")], engine.MXWeightOnly("e2m1", "floor")], ids=ids)
@pytest.mark.parametrize("k", [64, 80])
def test_fast_decode_equals_the_storage_dequantize(config: object, k: int) -> None:
    """The weight-only GEMMs decode FP8 / MX weights in two vector ops: the values of engine's storage dequantize
    (a partial last block when K is not a multiple of 32), NaN blocks included."""
    torch.manual_seed(3)
    w = torch.randn(24, k, dtype=torch.bfloat16) * torch.logspace(-3, 3, 24, dtype=torch.bfloat16)[:, None]
    w[5, 7] = float("nan")
    q = QuantizedWeight.from_float(w, config)
    for dtype in (torch.bfloat16, torch.float32):
        view = torch.int16 if dtype == torch.bfloat16 else torch.int32
        assert torch.equal(q.fmt.decode(q.operands, (24, k), dtype).view(view), q.storage.dequantize(dtype).view(view))
        assert torch.equal(q.dequantize(dtype).view(view), q.storage.dequantize(dtype).view(view))
