"""Shared helpers for the quantizer / quantized-tensor tests.

`make_quantizer(kind, ...)` builds one of the quantizer kinds the tests parametrize over;
`reference_buffers(kind, x, ...)` computes the four buffers with `engine.ops.reference`
called directly (never through the quantizer); `brute_dequantize` dequantizes buffers with
the independent tests/brute_force.py; `expected_layout` is the README's buffer layout table
written out by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

import brute_force
from engine.ops import reference as ref
from engine.quantizers import Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer, MXFP8Quantizer

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
USAGES = {"row": (True, False), "col": (False, True), "both": (True, True)}

# the scale a delayed-scaling quantizer is built with (not a power of 2, so 1/scale is inexact)
DELAYED_SCALE = 3.0

KINDS = ("delayed_e4m3", "delayed_e5m2", "current_e4m3", "current_e5m2",
         "block1d", "block2d", "mx_rceil", "mx_floor")
PER_TENSOR = ("delayed_e4m3", "delayed_e5m2", "current_e4m3", "current_e5m2")
MX = ("mx_rceil", "mx_floor")

# shapes per kind: 2D and 3D; partial 128-tiles for block scaling, multiples of 32 for MX
SHAPES = {
    "per_tensor": [(17, 33), (3, 70, 130)],
    "block": [(130, 257), (3, 70, 130)],
    "mx": [(64, 96), (2, 32, 64)],
}


def family(kind: str) -> str:
    if kind in PER_TENSOR:
        return "per_tensor"
    return "mx" if kind in MX else "block"


def kind_shapes(kind: str) -> list[tuple[int, ...]]:
    return SHAPES[family(kind)]


def make_quantizer(kind: str, *, rowwise: bool = True, columnwise: bool = True, internal: bool = False,
                   scale: float = DELAYED_SCALE):
    usage = {"rowwise": rowwise, "columnwise": columnwise, "internal": internal}
    if kind.startswith("delayed"):
        dt = E4M3 if kind.endswith("e4m3") else E5M2
        return Float8Quantizer(torch.tensor([scale]), torch.zeros(1), dt, **usage)
    if kind.startswith("current"):
        return Float8CurrentScalingQuantizer(E4M3 if kind.endswith("e4m3") else E5M2, **usage)
    if kind == "block1d":
        return Float8BlockQuantizer(E4M3, block_scaling_dim=1, **usage)
    if kind == "block2d":
        return Float8BlockQuantizer(E4M3, block_scaling_dim=2, **usage)
    return MXFP8Quantizer(E4M3, scale_mode=kind.removeprefix("mx_"), **usage)


def make_input(shape, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """Random values spread over 2^-8 .. 2^8 times N(0,1): tiles/blocks get different scales.

    The largest magnitude stays far below fp16's max, so the tensor is exact in every dtype's range.
    """
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g)
    exps = torch.randint(-8, 9, shape, generator=g).float()
    return (base * torch.exp2(exps)).to(dtype)


def reference_buffers(kind: str, x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = True,
                      scale: float = DELAYED_SCALE) -> dict[str, torch.Tensor | None]:
    """The four buffers, computed with engine.ops.reference directly."""
    out: dict[str, torch.Tensor | None] = dict.fromkeys(FIELDS)
    m, k = math.prod(x.shape[:-1]), x.shape[-1]
    if kind in PER_TENSOR:
        dt = E4M3 if kind.endswith("e4m3") else E5M2
        if kind.startswith("delayed"):
            s = torch.tensor([scale])
            data, sinv = ref.quantize_per_tensor(x, s, dt), ref.reciprocal(s)
        else:
            data, sinv, _ = ref.quantize_current_scaling(x, dt)
        if rowwise:
            out["rowwise_data"], out["rowwise_scale_inv"] = data, sinv
        if columnwise:
            out["columnwise_data"], out["columnwise_scale_inv"] = data.reshape(m, k).t().contiguous(), sinv
        return out
    if kind in ("block1d", "block2d"):
        fn = ref.quantize_block_1d if kind == "block1d" else ref.quantize_block_2d
        if rowwise:
            d, s = fn(x, E4M3)
            out["rowwise_data"], out["rowwise_scale_inv"] = d.reshape(x.shape), s
        if columnwise:
            out["columnwise_data"], out["columnwise_scale_inv"] = fn(x, E4M3, columnwise=True)
        return out
    mode = kind.removeprefix("mx_")
    if rowwise:
        out["rowwise_data"], out["rowwise_scale_inv"] = ref.quantize_mxfp8(x, E4M3, scale_mode=mode)
    if columnwise:
        out["columnwise_data"], out["columnwise_scale_inv"] = ref.quantize_mxfp8(
            x, E4M3, scale_mode=mode, columnwise=True)
    return out


#: the README layout of each kind's buffers, and the scale rule brute_force checks it against
KIND_LAYOUT = {**dict.fromkeys(PER_TENSOR, "tensor"), "block1d": "block1d", "block2d": "block2d",
               **dict.fromkeys(MX, "mx")}
KIND_RULE = {"delayed_e4m3": "delayed", "delayed_e5m2": "delayed", "current_e4m3": "current",
             "current_e5m2": "current", "block1d": "current_pow2", "block2d": "current_pow2",
             "mx_rceil": "rceil", "mx_floor": "floor"}


def brute_dequantize(kind: str, buffers: dict, shape, dtype: torch.dtype, *, from_columnwise: bool = False):
    """One usage of `buffers` dequantized by tests/brute_force.py (exact, then fp32, then `dtype`)."""
    usage = "columnwise" if from_columnwise else "rowwise"
    exact = brute_force.dequantize(buffers[f"{usage}_data"], buffers[f"{usage}_scale_inv"], layout=KIND_LAYOUT[kind],
                                   shape=tuple(shape), columnwise=from_columnwise)
    return brute_force.as_dtype(exact, dtype)


def special_input(shape, dtype=torch.float32, seed: int = 0, *, nonfinite: bool = False) -> torch.Tensor:
    """`make_input` with edge values written into it: signed zeros, subnormals of `dtype`, +-max of
    `dtype`, values at and beyond the FP8 maxima, a zero row; with `nonfinite`, +-inf and NaN too.

    The specials sit in the first rows and columns, so blocks elsewhere keep ordinary values.
    """
    x = make_input(shape, torch.float32, seed).to(dtype)
    x2d = x.view(-1, shape[-1])
    fi = torch.finfo(dtype)
    tiny_sub = fi.smallest_normal * fi.eps  # the smallest subnormal: 2^-(mantissa bits) of the smallest normal
    specials = [0.0, -0.0, tiny_sub, -tiny_sub, fi.smallest_normal / 3, -fi.smallest_normal * 0.75,
                fi.max, -fi.max, 448.0, -464.0, 480.0, 57344.0, -61440.0, 1e-3, 2.0 ** -10]
    if nonfinite:
        specials += [math.inf, -math.inf, math.nan]
    k = shape[-1]
    for n, v in enumerate(specials):
        x2d[(n * 5) % x2d.shape[0], (n * 37) % k] = v
    x2d[min(3, x2d.shape[0] - 1)] = 0.0  # a zero row: blocks of all zeros
    return x


def expected_layout(kind: str, shape, fp8_dtype: torch.dtype = E4M3, *, rowwise: bool = True,
                    columnwise: bool = True) -> dict[str, tuple[tuple[int, ...], torch.dtype] | None]:
    """README's "Layouts of the quantized buffers" table: (shape, dtype) of each buffer, None when absent."""
    m, k = math.prod(shape[:-1]), shape[-1]
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    fam = family(kind)
    if fam == "per_tensor":
        row = ((tuple(shape), fp8_dtype), ((1,), torch.float32))
        col = (((k, m), fp8_dtype), ((1,), torch.float32))
    elif kind == "block1d":
        row = ((tuple(shape), fp8_dtype), ((m, cdiv(k, 128)), torch.float32))
        col = (((k, m), fp8_dtype), ((k, cdiv(m, 128)), torch.float32))
    elif kind == "block2d":
        row = ((tuple(shape), fp8_dtype), ((cdiv(m, 128), cdiv(k, 128)), torch.float32))
        col = (((k, m), fp8_dtype), ((cdiv(k, 128), cdiv(m, 128)), torch.float32))
    else:
        row = ((tuple(shape), fp8_dtype), ((m, k // 32), torch.uint8))
        col = ((tuple(shape), fp8_dtype), ((m // 32, k), torch.uint8))
    return {
        "rowwise_data": row[0] if rowwise else None, "rowwise_scale_inv": row[1] if rowwise else None,
        "columnwise_data": col[0] if columnwise else None, "columnwise_scale_inv": col[1] if columnwise else None,
    }


def kind_fp8_dtype(kind: str) -> torch.dtype:
    return E5M2 if kind.endswith("e5m2") else E4M3


def bits(t: torch.Tensor | None) -> torch.Tensor | None:
    """The raw bytes of a buffer (FP8 data as uint8 codes; fp32 scales as int32 bits)."""
    if t is None:
        return None
    if t.dtype in (E4M3, E5M2):
        return t.view(torch.uint8)
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    return t


def storage_of(t):
    return getattr(t, "qstorage", t)


def assert_buffers_equal(got: dict, want: dict) -> None:
    """Bit-for-bit equality of buffer dicts (same dtype, shape and bytes; None where None)."""
    for name in FIELDS:
        g, w = got[name], want[name]
        if w is None:
            assert g is None, f"{name}: expected None, got {type(g).__name__}"
            continue
        assert g is not None, f"{name}: missing"
        assert g.dtype == w.dtype, f"{name}: dtype {g.dtype} != {w.dtype}"
        assert g.shape == w.shape, f"{name}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        assert torch.equal(bits(g), bits(w)), f"{name}: bits differ"


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture()
def fresh_dynamo():
    """torch.compile tests: Dynamo's caches and counters empty before and after (graphs and breaks counted per test)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def perturb_norms(module: torch.nn.Module) -> torch.nn.Module:
    """Move a module's norm parameters (layer_norm_weight / _bias) off their initial 1 and 0 by 0.3 * N(0, 1), so a
    norm that ignores gamma or beta shows (torch's default generator: seed before)."""
    with torch.no_grad():
        for name in ("layer_norm_weight", "layer_norm_bias"):
            p = getattr(module, name, None)
            if p is not None:
                p.add_(0.3 * torch.randn(p.shape))
    return module


@pytest.fixture(autouse=True)
def _thread_count_kept():
    """Every test ends with torch's thread count as it found it: the distributed tests compare one process with
    ranks that start at the environment's count, and a sum's order (so its last bits) follows the thread count."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
