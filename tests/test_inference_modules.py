"""engine.quantize_ on LayerNormLinear and LayerNormMLP: norm -> the quantized GEMM -> activation -> GEMM, each
stage within its format's bound of a float64 reference written here (layer norm, the dequantized weights, tanh
GELU); bit-exact checkpoints; clear errors inside fp8_autocast."""

from __future__ import annotations

import math

import pytest
import safetensors.torch
import torch

import engine
from engine.inference.weight import QuantizedWeight
from test_inference import ALL_CONFIGS, BF16_U, FP32_U, assert_within, ids
from test_inference_saving import torch_round_trip

pytestmark = pytest.mark.filterwarnings("ignore:engine. NVFP4 quantization")

GELU_LIPSCHITZ = 1.13  # max |d/dz| of the tanh GELU is 1.1290
DYNAMIC = (engine.Int8DynamicActivationInt8Weight, engine.Float8DynamicActivationFloat8Weight)


def randomize_norm(m: torch.nn.Module) -> None:
    with torch.no_grad():
        m.layer_norm_weight.normal_(1.0, 0.2)
        if m.layer_norm_bias is not None:
            m.layer_norm_bias.normal_(0.0, 0.2)


def norm64(x: torch.Tensor, m: torch.nn.Module) -> torch.Tensor:
    """LayerNorm / RMSNorm over the last dim in float64."""
    x = x.double()
    gamma = m.layer_norm_weight.double()
    if m.normalization == "RMSNorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.eps) * gamma
    centered = x - x.mean(-1, keepdim=True)
    xhat = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + m.eps)
    return xhat * gamma + m.layer_norm_bias.double()


def gelu64(z: torch.Tensor) -> torch.Tensor:
    return 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))


def gemm_bound(config: object, a_abs: torch.Tensor, wd: torch.Tensor, bias: torch.Tensor | None,
               ref_abs: torch.Tensor) -> torch.Tensor:
    """|layer(a) - (a @ wd^T + b)| for activations with |a| <= a_abs [M, K] under `config`: the activation's own
    quantization (int8 per token: half a step of amax/127; E4M3: 2^-4 relative, 2^-10 * amax/448 absolute),
    fp32 accumulation in any order, and at most two roundings of the output (the GEMM's, then + bias)."""
    k = a_abs.shape[-1]
    w_abs = wd.abs()
    b_abs = 0 if bias is None else bias.double().abs()
    act_err = torch.zeros_like(ref_abs)
    if isinstance(config, engine.Int8DynamicActivationInt8Weight):
        step = a_abs.amax(1, keepdim=True) / 127
        act_err = step / 2 * 1.01 * w_abs.sum(1)[None, :]
    elif isinstance(config, engine.Float8DynamicActivationFloat8Weight):
        act_err = (2 ** -4 * a_abs + 2 ** -10 * 2 * a_abs.max() / 448) @ w_abs.t()
    absdot = (a_abs * 1.07) @ w_abs.t()  # quantized activations are within 7% of |a| (and the subnormal slack)
    return act_err + 1.01 * k * FP32_U * (absdot + act_err) + 2.1 * BF16_U * (ref_abs + act_err + b_abs) + 1e-30


def check_norm(ln_out: torch.Tensor, x: torch.Tensor, m: torch.nn.Module) -> None:
    """The module's bf16 norm output within one bf16 rounding (and fp32 arithmetic) of the float64 norm."""
    ref = norm64(x, m).reshape(ln_out.shape)
    slack = 2 ** -16 * (m.layer_norm_weight.double().abs() * 8 + (0 if m.layer_norm_bias is None
                                                                   else m.layer_norm_bias.double().abs()))
    assert_within(ln_out, ref, 1.01 * BF16_U * ref.abs() + slack, "norm")


def inputs(k: int) -> torch.Tensor:
    torch.manual_seed(5)
    return (torch.randn(2, 3, k) * 3 + 0.5).bfloat16()


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=ids)
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear_is_norm_then_the_quantized_gemm(config: object, normalization: str) -> None:
    torch.manual_seed(0)
    m = engine.LayerNormLinear(64, 96, normalization=normalization, return_layernorm_output=True).bfloat16()
    randomize_norm(m)
    engine.quantize_(m, config)
    assert isinstance(m.weight, QuantizedWeight) and m.weight.config == config
    x = inputs(64)
    with torch.no_grad():
        y, ln_out = m(x)
    assert y.shape == (2, 3, 96) and y.dtype == torch.bfloat16
    check_norm(ln_out, x, m)
    a = ln_out.double().reshape(-1, 64)  # the GEMM's input, exactly
    wd = m.weight.dequantize(torch.float64)
    ref = a @ wd.t() + m.bias.double()
    assert_within(y, ref, gemm_bound(config, a.abs(), wd, m.bias, ref.abs()), f"LayerNormLinear {config!r}")


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=ids)
def test_layernorm_mlp_is_norm_gemm_gelu_gemm(config: object) -> None:
    """fc1 within its bound; the tanh GELU (Lipschitz 1.13) and its bf16 rounding carry that to fc2's input,
    whose error fc2 passes on through |W2| plus fc2's own bound."""
    torch.manual_seed(1)
    m = engine.LayerNormMLP(64, 128, return_layernorm_output=True).bfloat16()
    randomize_norm(m)
    engine.quantize_(m, config)
    assert isinstance(m.fc1_weight, QuantizedWeight) and isinstance(m.fc2_weight, QuantizedWeight)
    x = inputs(64)
    with torch.no_grad():
        y, ln_out = m(x)
    assert y.shape == (2, 3, 64) and y.dtype == torch.bfloat16
    check_norm(ln_out, x, m)
    a = ln_out.double().reshape(-1, 64)
    w1, w2 = m.fc1_weight.dequantize(torch.float64), m.fc2_weight.dequantize(torch.float64)
    z = a @ w1.t() + m.fc1_bias.double()
    e1 = gemm_bound(config, a.abs(), w1, m.fc1_bias, z.abs())
    h = gelu64(z)
    e_h = GELU_LIPSCHITZ * e1 + 1.01 * BF16_U * (h.abs() + GELU_LIPSCHITZ * e1) + 1e-6 * FP32_U
    ref = h @ w2.t() + m.fc2_bias.double()
    carried = e_h @ w2.abs().t()
    bound = carried + gemm_bound(config, h.abs() + e_h, w2, m.fc2_bias, ref.abs() + carried)
    assert_within(y, ref, bound, f"LayerNormMLP {config!r}")


def test_bounds_are_tight_enough_to_catch_a_wrong_weight() -> None:
    """The LayerNormLinear bound is no blanket: the output of the unquantized weight breaks int4's bound."""
    torch.manual_seed(0)
    m = engine.LayerNormLinear(64, 96, return_layernorm_output=True).bfloat16()
    plain_w = m.weight.detach().double()
    engine.quantize_(m, engine.Int4WeightOnly(group_size=64))
    with torch.no_grad():
        _, ln_out = m(inputs(64))
    a = ln_out.double().reshape(-1, 64)
    wd = m.weight.dequantize(torch.float64)
    ref = a @ wd.t() + m.bias.double()
    wrong = (a @ plain_w.t() + m.bias.double()).bfloat16().double()
    bound = gemm_bound(engine.Int4WeightOnly(group_size=64), a.abs(), wd, m.bias, ref.abs())
    assert not bool(((wrong - ref).abs() <= bound).all())


# ---------------------------------------------------------------------------- checkpoints
def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(engine.LayerNormLinear(64, 128), engine.LayerNormMLP(128, 256, normalization="RMSNorm",
                                                                                  activation="swiglu")).bfloat16()
    randomize_norm(m[0])
    return m


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=ids)
def test_round_trips_are_bit_exact(config: object, tmp_path) -> None:
    source = engine.quantize_(model(0), config)
    state = source.state_dict()
    assert all(type(v) is torch.Tensor for v in state.values())
    assert {"0.weight", "0.weight_qformat", "1.fc1_weight", "1.fc1_weight_qformat", "1.fc2_weight",
            "1.fc2_weight_qformat", "0.layer_norm_weight"} <= set(state)
    x = inputs(64)
    with torch.no_grad():
        expected = source(x)
    safetensors.torch.save_file(state, tmp_path / "q.safetensors")
    for loaded in (torch_round_trip(state), safetensors.torch.load_file(tmp_path / "q.safetensors")):
        target = engine.quantize_(model(1), config)
        target.load_state_dict(loaded)
        for module, name in ((0, "weight"), (1, "fc1_weight"), (1, "fc2_weight")):
            mine, theirs = getattr(target[module], name), getattr(source[module], name)
            assert isinstance(mine, QuantizedWeight) and set(mine.operands) == set(theirs.operands)
            for part, t in theirs.plain_parts().items():  # as saved (parts may hold a kernel's layout)
                assert torch.equal(mine.plain_parts()[part].view(torch.uint8), t.view(torch.uint8)), (name, part)
        with torch.no_grad():
            assert torch.equal(target(x), expected)


def test_plain_checkpoint_loads_into_a_quantized_model() -> None:
    """Plain weights (no record) are quantized with the model's config as they are copied in."""
    target = engine.quantize_(model(1), engine.Int8WeightOnly())
    target.load_state_dict(model(0).state_dict())
    reference = engine.quantize_(model(0), engine.Int8WeightOnly())
    for name in ("fc1_weight", "fc2_weight"):
        for part, t in getattr(reference[1], name).plain_parts().items():
            assert torch.equal(getattr(target[1], name).plain_parts()[part], t)


# ---------------------------------------------------------------------------- errors and filters
@pytest.mark.parametrize("make", [lambda: engine.Linear(64, 32), lambda: engine.LayerNormLinear(64, 32),
                                  lambda: engine.LayerNormMLP(64, 128)], ids=["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_inside_fp8_autocast_is_a_clear_error(make) -> None:
    m = engine.quantize_(make().bfloat16(), engine.Int8WeightOnly())
    first = m.weight_names[0]
    with pytest.raises(TypeError, match=rf"{type(m).__name__}\.{first}: a QuantizedWeight \(Int8WeightOnly\(\)\) from "
                                        r"engine.quantize_ is for inference outside fp8_autocast"):
        with engine.fp8_autocast():
            m(torch.randn(2, 64, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=rf"{type(m).__name__}\.{first}: .* got a forward while calibrating"):
        with engine.fp8_autocast(enabled=False, calibrating=True):
            m(torch.randn(2, 64, dtype=torch.bfloat16))
    with engine.fp8_autocast(enabled=False):
        assert m(torch.randn(2, 64, dtype=torch.bfloat16)).shape[-1] == (32 if first == "weight" else 64)


def test_module_filter_sees_each_module_once_and_errors_name_the_weight() -> None:
    m = torch.nn.Sequential(engine.LayerNormLinear(64, 128), engine.LayerNormMLP(128, 96)).bfloat16()
    seen = []
    engine.quantize_(m, engine.Int8WeightOnly(), module_filter=lambda fqn, mod: seen.append(fqn) or fqn == "1")
    assert seen == ["0", "1"]
    assert type(m[0].weight) is torch.nn.Parameter
    assert isinstance(m[1].fc1_weight, QuantizedWeight) and isinstance(m[1].fc2_weight, QuantizedWeight)
    with pytest.raises(ValueError, match=r"1\.fc1_weight: already quantized with Int8WeightOnly\(\)"):
        engine.quantize_(m, engine.Int8WeightOnly())
    fresh = torch.nn.Sequential(engine.LayerNormMLP(64, 96)).bfloat16()  # fc2's K = 96: padded to the group
    engine.quantize_(fresh, engine.Int4WeightOnly(group_size=64))
    assert fresh[0].fc2_weight.plain_parts()["data"].shape == (64, 64)


def test_demo_gpt_quantizes_every_linear_weight() -> None:
    from engine.inference.quantize import linear_weight_bytes
    from engine.train.model import GPT, GPTConfig

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(d_model=64, n_layers=2, n_heads=4, seq_len=32))
    plain_bytes = linear_weight_bytes(gpt)
    engine.quantize_(gpt, engine.Int8WeightOnly())
    block = gpt.blocks[0]
    for w in (block.attn.qkv.weight, block.attn.proj.weight, block.mlp.fc1_weight, block.mlp.fc2_weight, gpt.head.weight):
        assert isinstance(w, QuantizedWeight)
    assert plain_bytes == 2 * sum(p.numel() for n, p in gpt.named_parameters() if n.endswith("weight")
                                  and p.dim() == 2 and "emb" not in n)
    assert linear_weight_bytes(gpt) < 0.6 * plain_bytes


def test_fp8_primary_weights_are_quantized_from_their_value() -> None:
    """A LayerNormMLP made under fp8_model_init holds FP8 weights: quantize_ starts from their dequantized value."""
    torch.manual_seed(2)
    with engine.fp8_model_init():
        fp8 = engine.LayerNormMLP(64, 128, params_dtype=torch.bfloat16)
    plain = engine.LayerNormMLP(64, 128, params_dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            theirs = getattr(fp8, name)
            p.copy_(theirs.dequantize() if name.endswith("fc1_weight") or name.endswith("fc2_weight") else theirs)
    for m in (fp8, plain):
        engine.quantize_(m, engine.Int8WeightOnly())
    x = inputs(64)
    for name in ("fc1_weight", "fc2_weight"):
        for part, t in getattr(plain, name).plain_parts().items():
            assert torch.equal(getattr(fp8, name).plain_parts()[part], t), (name, part)
    with torch.no_grad():
        assert torch.equal(fp8(x), plain(x))


def test_quantized_demo_gpt_checkpoint_round_trip() -> None:
    """A whole quantized demo GPT saves as plain tensors and loads into another one quantized the same way."""
    import copy

    from engine.train.model import GPT, GPTConfig

    config = GPTConfig(d_model=64, n_layers=1, n_heads=2, seq_len=16)
    torch.manual_seed(0)
    source = engine.quantize_(GPT(config), engine.Int4WeightOnly(group_size=32))
    torch.manual_seed(1)
    target = engine.quantize_(GPT(config), engine.Int4WeightOnly(group_size=32))
    target.load_state_dict(torch_round_trip(source.state_dict()))
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        expected = source(tokens)
        assert torch.equal(target(tokens), expected)
        assert torch.equal(copy.deepcopy(source)(tokens), expected)
