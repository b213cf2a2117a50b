"""`python -m engine info` names every recipe engine.recipes exports with where and how it runs, the CPU and
the kernels in use; `engine.is_nvfp4_available` answers as Transformer Engine's does (a bool, or (bool, reason))."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys

import pytest
import torch

import engine
from engine import device, machine
from engine.recipes import (
    DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Float8RowwiseScaling, MXFP4BlockScaling,
    MXFP4MixedBlockScaling, MXFP6BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling,
)

#: the recipe classes of this release, by hand: a listing derived from engine.recipes must hold them all
KNOWN = ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling", "Float8RowwiseScaling",
         "MXFP4BlockScaling", "MXFP4MixedBlockScaling", "MXFP6BlockScaling", "NVFP4BlockScaling", "OperandRecipe")


def exported_recipe_classes() -> set[str]:
    import engine.recipes as r

    return {n for n in r.__all__ if isinstance(getattr(r, n), type) and issubclass(getattr(r, n), r.Recipe)
            and n != "Recipe"}


def cpu_model_name() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


@pytest.fixture(scope="module")
def info_output() -> str:
    return subprocess.run([sys.executable, "-m", "engine", "info"], capture_output=True, text=True, check=True).stdout


def test_info_lists_every_exported_recipe_with_where_it_runs(info_output):
    assert set(KNOWN) <= exported_recipe_classes()
    lines = {line.split("(", 1)[1].split(")", 1)[0]: line for line in info_output.splitlines()
             if line.startswith("  ") and "(" in line}
    assert set(lines) == exported_recipe_classes()
    for name in exported_recipe_classes() - {"OperandRecipe", "CustomRecipe", "Debug"}:  # built around user parts: no preset to run
        cls = getattr(engine.recipes, name)
        assert lines[name].startswith(f"  {cls.name} ({name}): ")
        if not torch.cuda.is_available():
            assert "runs - emulated on the CPU (quantize: C++;" in lines[name], lines[name]


def test_info_names_the_cpu_and_the_kernels_in_use(info_output):
    from engine.ops import native

    model = cpu_model_name()
    if model is not None:
        assert f"CPU: {model}, " in info_output
    assert f"CPU kernels: C++ (csrc/), instruction set {native.isa()} (available here: " \
           f"{', '.join(native.available_isas())}" in info_output
    triton = (f"Triton: {importlib.metadata.version('triton')}: quantizes CUDA tensors"
              if importlib.util.find_spec("triton") else "Triton: not installed")
    assert triton in info_output
    assert "NVFP4: available" in info_output or torch.cuda.is_available()


def test_cpu_info_reads_model_and_features(tmp_path):
    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu sse2 avx2 fma avx512f avx512_vnni\n\n"
                    "processor\t: 1\nmodel name\t: Test CPU 9000\nflags\t\t: fpu\n")
    info = machine.cpu_info(str(fake))
    assert info.model == "Test CPU 9000" and info.features == ("avx2", "fma", "avx512f", "avx512_vnni")
    assert machine.cpu_info(str(tmp_path / "missing")).features == ()


def test_nvfp4_check_follows_transformer_engine(monkeypatch):
    assert engine.is_nvfp4_available is device.is_nvfp4_available
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ok, reason = engine.is_nvfp4_available(return_reason=True)
    assert ok is True and "no CUDA GPU" in reason and "CPU emulation" in reason
    assert engine.is_nvfp4_available() is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, want in (((9, 0), False), ((10, 0), True), ((12, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, c=capability: c)
        ok, reason = engine.is_nvfp4_available(return_reason=True)
        assert ok is want and engine.is_nvfp4_available() is want and f"{capability[0]}.{capability[1]}" in reason


@pytest.mark.parametrize("capability, want", [
    ((8, 0), {"delayed": None, "current": None, "block": "emulated", "mxfp8": "emulated", "rowwise": "emulated",
              "nvfp4": "emulated", "mxfp6": "emulated"}),
    ((8, 9), {"delayed": "native", "current": "native", "block": "emulated", "rowwise": "emulated"}),
    ((9, 0), {"delayed": "native", "current": "native", "block": "emulated", "mxfp8": "emulated",
              "nvfp4": "emulated", "mxfp4": "emulated"}),
    ((10, 0), {"delayed": "native", "block": "emulated", "mxfp8": "native", "mxfp4": "native",
               "mxfp4_mixed": "native", "nvfp4": "native", "mxfp6": "emulated", "rowwise": "emulated"}),
])
def test_where_recipes_run_on_a_gpu(monkeypatch, capability, want):
    """cuBLAS GEMMs for per-tensor FP8 from 8.9 and for MXFP8/MXFP4/NVFP4 at 10.x (engine.gemm's CUDA pairings);
    the rest (1x128 blocks, rows, MXFP6, and the MX/NVFP4 pairs below 10.x) emulated on the GPU; per-tensor FP8
    cannot run below 8.9 (torch._scaled_mm)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    recipes = {"delayed": DelayedScaling(), "current": Float8CurrentScaling(), "block": Float8BlockScaling(),
               "mxfp8": MXFP8BlockScaling(), "rowwise": Float8RowwiseScaling(), "mxfp4": MXFP4BlockScaling(),
               "mxfp4_mixed": MXFP4MixedBlockScaling(), "mxfp6": MXFP6BlockScaling(), "nvfp4": NVFP4BlockScaling()}
    for name, expected in want.items():
        ok, how = machine.recipe_support(recipes[name])
        if expected is None:
            assert not ok and "8.9+" in how, (name, how)
        else:
            assert ok and how.startswith("native on the GPU" if expected == "native" else "emulated on the GPU"), \
                (name, how)
