"""The C++ weight-only GEMM of block-scaled float weights (engine.ops.native.block_linear: MX and NVFP4) against
the storages' own dequantize (the reference: engine.ops.reference / engine.ops.nvfp4), summed in float64.

Every inference config whose format runs the kernel (`EngineWeightFormat.native_block`: found by going through
`engine.inference.configs.CONFIGS`, not listed here) is tested at every instruction-set level the machine runs,
on quantized random weights and on raw random codes (every element code, E8M0 scales 0..254 and NaN, NVFP4 E4M3
scales including zero, subnormals and NaN): each weight is the reference's fp32 value, the sums are fp32 in any
order, so |y - ref| <= u_out * |ref| + (2K + 16) * 2^-24 * sum |x| |w| (test_inference_kernels.check), and an
output is NaN / inf exactly where the float64 reference is. K with tails (not a multiple of the vector or the
block), M = 1 and 17 (the GEMV and the row blocks of the GEMM). Without the C++ extension the formats warn once.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from engine.inference import configs as inference_configs
from engine.inference.engine_formats import EngineWeightFormat
from engine.inference.formats import format_of
from engine.ops import native
from test_inference_kernels import DTYPES, ISAS, check


def _block_configs() -> list[inference_configs.InferenceConfig]:
    """Every registered config (and each value of an element field) whose weight runs native.block_linear."""
    found = []
    for cls in inference_configs.CONFIGS.values():
        variants = [cls()]
        if any(f.name == "element" for f in dataclasses.fields(cls)):
            variants = [cls(element=e) for e in inference_configs.MX_ELEMENTS]
        for config in variants:
            fmt = format_of(config)
            if isinstance(fmt, EngineWeightFormat) and fmt.native_block() is not None:
                found.append(config)
    return found


CONFIGS = _block_configs()


@pytest.fixture(params=ISAS)
def isa(request):
    assert native.available(), native.why_unavailable()
    with native.use_isa(request.param):
        yield request.param


def test_every_block_format_is_found() -> None:
    names = {(type(c).__name__, getattr(c, "element", None)) for c in CONFIGS}
    assert names == {("MXWeightOnly", e) for e in inference_configs.MX_ELEMENTS} | {("NVFP4WeightOnly", None)}


def reference(fmt: EngineWeightFormat, parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    return fmt.from_parts(parts, shape, torch.float32).dequantize(torch.float32)


def check_nonfinite(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """NaN where the float64 reference is NaN, the same inf where it is inf, the bound elsewhere."""
    ref = x.double() @ w.double().t()
    bad = ~torch.isfinite(ref)
    assert torch.equal(y.isnan(), ref.isnan())
    assert torch.equal(y[ref.isinf()].double(), ref[ref.isinf()])
    rows = ~bad.any(dim=0)
    check(y[:, rows], x, w[rows].nan_to_num())


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name() if hasattr(c, "name") else repr(c))
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantized_weights_within_the_fp32_bound(isa: str, config, dtype: torch.dtype) -> None:
    fmt = format_of(config)
    gen = torch.Generator().manual_seed(7)
    for n, k in ((18, 100), (9, 257)):
        w = torch.randn(n, k, generator=gen) * torch.exp2(torch.randint(-6, 6, (n, 1), generator=gen).float())
        parts = fmt.to_parts(fmt.quantize(w))
        wref = reference(fmt, parts, (n, k))
        for m in (1, 17):
            x = torch.randn(m, k, generator=gen).to(dtype)
            y = fmt.linear(x, parts, (n, k), None)
            check(y, x, wref)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: repr(c))
def test_raw_codes_and_special_scales(isa: str, config) -> None:
    """Random bytes as codes (every element code; bits above a 6-bit code ignored), random scale codes: E8M0
    0..255 (0 the subnormal 2^-127, 255 NaN), NVFP4 E4M3 codes (zero, subnormals, NaN) with amax 0, tiny, huge."""
    fmt = format_of(config)
    element, block = fmt.native_block()
    gen = torch.Generator().manual_seed(11)
    for n, k in ((6, 96), (7, 75)):
        packed = -(-k // 2) if element == "E2M1" else k
        blocks = -(-k // block)
        data = torch.randint(0, 256, (n, packed), generator=gen, dtype=torch.uint8)
        if element == "E4M3":  # mostly finite codes, a few NaNs
            data[(data & 0x7F) == 0x7F] = 0x38
            data[0, 3] = 0x7F
        if fmt.scheme.tensor_scale:
            scales = torch.randint(0, 0x7F, (n, blocks), generator=gen, dtype=torch.uint8)  # finite E4M3, >= 0
            scales[1, 0], scales[2, -1] = 0x7F, 0  # NaN, zero
            scales[3, :] = torch.arange(blocks, dtype=torch.uint8) % 8  # subnormals
            amaxes = [torch.tensor([3.5]), torch.tensor([1e-30]), torch.tensor([3e38]), torch.tensor([0.0])]
        else:
            scales = torch.randint(90, 150, (n, blocks), generator=gen, dtype=torch.uint8)
            scales[1, 0], scales[2, -1], scales[3, 1], scales[4, 0] = 255, 0, 254, 1
            amaxes = [None]
        for amax in amaxes:
            parts = {"data": data, "scale_inv": scales.view(torch.float8_e4m3fn) if amax is not None else scales}
            if amax is not None:
                parts["amax"] = amax
            wref = reference(fmt, parts, (n, k))
            for m in (1, 17):
                x = torch.randn(m, k, generator=gen)
                check_nonfinite(fmt.linear(x, parts, (n, k), None), x, wref)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: repr(c))
def test_each_weight_is_the_reference_value(isa: str, config) -> None:
    """x = the identity: y[k, n] = 1 * w[n, k] + zeros, so every decoded weight is compared bit for bit with the
    reference's fp32 value, random finite codes and scales (NVFP4: zero and subnormal E4M3 ones), K with a tail."""
    fmt = format_of(config)
    element, block = fmt.native_block()
    gen = torch.Generator().manual_seed(13)
    n, k = 5, 83
    data = torch.randint(0, 256, (n, -(-k // 2) if element == "E2M1" else k), generator=gen, dtype=torch.uint8)
    if element == "E4M3":  # no NaN codes: 0 * NaN would spread one over its row of y
        data[(data & 0x7F) == 0x7F] = 0x38
    blocks = -(-k // block)
    if fmt.scheme.tensor_scale:
        scales = torch.randint(0, 0x7F, (n, blocks), generator=gen, dtype=torch.uint8)
        parts = {"data": data, "scale_inv": scales.view(torch.float8_e4m3fn), "amax": torch.tensor([5.75])}
    else:
        parts = {"data": data, "scale_inv": torch.randint(100, 140, (n, blocks), generator=gen, dtype=torch.uint8)}
    wref = reference(fmt, parts, (n, k))
    y = native.block_linear(torch.eye(k), data, parts["scale_inv"].view(torch.uint8), element, block,
                            parts.get("amax"), float(torch.tensor(1.0) / torch.tensor(2688.0)))
    assert bool(wref.isfinite().all())
    assert torch.equal(y.t(), wref)


def test_a_row_does_not_depend_on_m(isa: str) -> None:
    for config in CONFIGS:
        fmt = format_of(config)
        parts = fmt.to_parts(fmt.quantize(torch.randn(30, 200)))
        x = torch.randn(19, 200)
        y = fmt.linear(x, parts, (30, 200), None)
        assert torch.equal(torch.cat([fmt.linear(x[i:i + 1], parts, (30, 200), None) for i in range(19)]), y)


def test_bad_arguments_are_named() -> None:
    x = torch.randn(2, 64)
    data, scale = torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8)
    cases = [
        (ValueError, "element: expected one of", lambda: native.block_linear(x, data, scale, "E5M2", 32)),
        (ValueError, "block: expected 16 or 32", lambda: native.block_linear(x, data, scale, "E2M1", 8)),
        (ValueError, "block: expected 32 for a byte", lambda: native.block_linear(x, data, scale, "E4M3", 16)),
        (ValueError, "data: expected shape", lambda: native.block_linear(x, data, scale, "E4M3", 32)),
        (TypeError, "data: expected uint8", lambda: native.block_linear(x, data.to(torch.int8), scale, "E2M1", 32)),
        (ValueError, "scale: expected shape", lambda: native.block_linear(x, data, scale[:, :1], "E2M1", 32)),
        (TypeError, "amax: expected float32", lambda: native.block_linear(x, data, torch.zeros(4, 4, dtype=torch.uint8),
                                                                          "E2M1", 16, torch.ones(1).double())),
        (TypeError, "block: expected an int", lambda: native.block_linear(x, data, scale, "E2M1", 32.0)),
    ]
    for error, match, call in cases:
        with pytest.raises(error, match=match):
            call()


def test_without_the_extension_the_slow_path_warns_once(monkeypatch) -> None:
    """The decode-in-torch-ops path at small M is the project's kind of slow fallback: one warning, same values."""
    import engine.inference.engine_formats as engine_formats

    fmt = format_of(CONFIGS[0])
    parts = fmt.to_parts(fmt.quantize(torch.randn(8, 64)))
    x = torch.randn(2, 64)
    fast = fmt.linear(x, parts, (8, 64), None)
    engine_formats.warn_slow_once.cache_clear()
    monkeypatch.setattr(native, "available", lambda: False)
    with pytest.warns(RuntimeWarning, match="decoded in torch ops on every call"):
        slow = fmt.linear(x, parts, (8, 64), None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fmt.linear(x, parts, (8, 64), None)
    check(slow, x, reference(fmt, parts, (8, 64)))
    check(fast, x, reference(fmt, parts, (8, 64)))
