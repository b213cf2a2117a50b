"""Capability checks answer (with a reason) on a machine without a GPU, and fake GPUs are judged right."""

import subprocess
import sys

import pytest
import torch

from engine import device


def test_no_gpu_here_reports_cpu_emulation_with_a_reason():
    assert not torch.cuda.is_available()
    for check in (device.is_fp8_available, device.is_fp8_block_scaling_available, device.is_mxfp8_available):
        ok, reason = check(return_reason=True)
        assert ok is True and "CPU emulation" in reason and "no CUDA GPU" in reason
        assert check() is True


def test_device_info_without_nvml_library():
    info = device.get_device_info()
    assert info.torch_version == torch.__version__
    assert info.cuda_available is False and info.gpus == []
    assert info.nvml_available is False and "NVML" in info.nvml_reason
    assert info.as_dict()["gpus"] == []


@pytest.mark.parametrize("capability, fp8, block, mx", [
    ((8, 0), False, False, False), ((8, 9), True, False, False), ((9, 0), True, True, False),
    ((10, 0), True, True, True), ((12, 0), True, True, True),
])
def test_capability_thresholds(monkeypatch, capability, fp8, block, mx):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    got = (device.is_fp8_available(), device.is_fp8_block_scaling_available(), device.is_mxfp8_available())
    assert got == (fp8, block, mx)
    ok, reason = device.is_mxfp8_available(return_reason=True)
    assert f"{capability[0]}.{capability[1]}" in reason and ok is mx


def test_nvml_errors_are_reasons_not_crashes(monkeypatch):
    import pynvml

    def fail():
        raise pynvml.NVMLError_LibraryNotFound()

    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    ok, reason, driver, devices = device._nvml_probe()
    assert (ok, driver, devices) == (False, None, []) and reason.startswith("NVML could not start")


def test_info_command_prints_the_report():
    out = subprocess.run([sys.executable, "-m", "engine", "info"], capture_output=True, text=True, check=True).stdout
    assert "CUDA: no" in out and "MXFP8: available" in out and "NVML: no" in out
