"""The backend dispatch: native on the CPU, forced choices, and a warned fallback to the reference."""

import warnings

import pytest
import torch

from engine.formats import E4M3 as E4M3_FORMAT
from engine.ops import backend, native, reference

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    monkeypatch.delenv("ENGINE_BACKEND", raising=False)
    backend._choose.cache_clear()
    yield
    backend._choose.cache_clear()


def test_cpu_tensors_use_the_native_kernels():
    assert native.available()
    assert backend.backend_for(CPU) is native


def nearest_e4m3_codes(v: torch.Tensor) -> torch.Tensor:
    """Brute force, from the format's bit layout alone: the E4M3 code of the value's sign nearest to it (ties
    to the even code), saturating at +-448."""
    codes = torch.arange(256)
    values = E4M3_FORMAT.decode(codes)
    finite = ~torch.isnan(values)
    codes, values = codes[finite], values[finite]
    negative = torch.signbit(v).reshape(-1, 1)
    v = v.double().clamp(-448, 448).reshape(-1, 1)
    dist = torch.where(negative == (codes >= 128), (v - values).abs(), float("inf"))
    best = dist.min(dim=1, keepdim=True).values
    candidates = torch.where(dist == best, codes, 1 << 20)
    even = torch.where(candidates % 2 == 0, candidates, 1 << 20).min(dim=1).values
    return torch.where(even < (1 << 20), even, candidates.min(dim=1).values).to(torch.uint8)


def test_engine_backend_forces_a_choice(monkeypatch):
    x = torch.randn(64, 130)
    want = nearest_e4m3_codes(x * 2.0).reshape(64, 130)
    for forced, module in (("reference", reference), ("native", native)):
        monkeypatch.setenv("ENGINE_BACKEND", forced)
        backend._choose.cache_clear()
        assert backend.backend_for(CPU) is module
        data, data_t, amax = backend.cast_transpose(x, torch.tensor([2.0]), torch.float8_e4m3fn)
        assert torch.equal(data.view(torch.uint8), want) and torch.equal(data_t.view(torch.uint8), want.t())
        assert amax.item() == x.abs().max().item()


def test_a_bad_engine_backend_names_the_variable(monkeypatch):
    monkeypatch.setenv("ENGINE_BACKEND", "cuda")
    with pytest.raises(ValueError, match="ENGINE_BACKEND"):
        backend.backend_for(CPU)


def test_without_native_kernels_the_reference_runs_with_one_warning(monkeypatch):
    monkeypatch.setattr(backend, "_native", lambda: None)
    with pytest.warns(RuntimeWarning, match="slow reference path"):
        assert backend.backend_for(CPU) is reference
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backend.backend_for(CPU) is reference  # decided once: no second warning
    monkeypatch.setenv("ENGINE_BACKEND", "native")
    with pytest.raises(RuntimeError, match="unavailable"):
        backend.backend_for(CPU)


class _Sub(torch.Tensor):
    """A tensor subclass (no __torch_dispatch__): its data would be readable, but it is refused too."""


@pytest.mark.parametrize("forced", [None, "reference", "native"])
def test_subclasses_and_meta_tensors_are_refused_whichever_backend_runs(monkeypatch, forced):
    if forced is not None:
        monkeypatch.setenv("ENGINE_BACKEND", forced)
    x = torch.randn(4, 64)
    e4m3 = torch.float8_e4m3fn
    for bad, what in ((x.to("meta"), "meta tensor"), (x.as_subclass(_Sub), "tensor subclass .*_Sub")):
        with pytest.raises(TypeError, match=f"^x: .*{what}"):
            backend.amax(bad)
        with pytest.raises(TypeError, match=f"^x2d: .*{what}"):
            backend.cast_transpose(bad, torch.ones(1), e4m3)
        with pytest.raises(TypeError, match=f"^scale: .*{what}"):
            backend.cast_transpose(x, bad[0, :1], e4m3)
        with pytest.raises(TypeError, match=f"^x2d: .*{what}"):
            backend.quantize_block(bad, e4m3, tile_rows=1, tile_cols=128)
        with pytest.raises(TypeError, match=f"^x: .*{what}"):
            backend.quantize_mxfp8(bad, e4m3)
        with pytest.raises(TypeError, match=f"^data: .*{what}"):
            backend.fp8_to_bf16(bad.to(e4m3))
    with pytest.raises(TypeError, match="^x: .*layout torch.sparse_coo"):
        backend.amax(x.to_sparse())
    # an nn.Parameter is a plain tensor
    assert backend.amax(torch.nn.Parameter(x)).item() == x.abs().max().item()
