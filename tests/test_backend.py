"""The backend dispatch: native on the CPU, forced choices, and a warned fallback to the reference."""

import warnings

import pytest
import torch

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


def test_engine_backend_forces_a_choice(monkeypatch):
    monkeypatch.setenv("ENGINE_BACKEND", "reference")
    assert backend.backend_for(CPU) is reference
    x = torch.randn(64, 130)
    data, data_t, amax = backend.cast_transpose(x, torch.tensor([2.0]), torch.float8_e4m3fn)
    want = reference.cast_transpose(x, torch.tensor([2.0]), torch.float8_e4m3fn)
    assert torch.equal(data.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(amax, want[2])


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
