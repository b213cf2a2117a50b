"""Capability checks answer (with a reason) on a machine without a GPU, and fake GPUs are judged right.

The tests that look at the real machine branch on torch.cuda.is_available(): without a GPU (here)
they assert the CPU-emulation answers, with one they check against torch.cuda's own report.
"""

import subprocess
import sys

import pytest
import torch

from engine import device


CHECKS = [(device.is_fp8_available, (8, 9)), (device.is_fp8_block_scaling_available, (9, 0)),
          (device.is_mxfp8_available, (10, 0))]


def assert_cpu_emulation_answers():
    for check, _ in CHECKS:
        ok, reason = check(return_reason=True)
        assert ok is True and "CPU emulation" in reason and "no CUDA GPU" in reason
        assert check() is True


def test_checks_answer_for_this_machine():
    if not torch.cuda.is_available():
        assert_cpu_emulation_answers()
        return
    major, minor = torch.cuda.get_device_capability()
    for check, minimum in CHECKS:
        ok, reason = check(return_reason=True)
        assert ok is ((major, minor) >= minimum) and f"{major}.{minor}" in reason
        assert check() is ok


def test_without_a_gpu_the_checks_report_cpu_emulation(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert_cpu_emulation_answers()


def test_device_info_matches_torch_cuda():
    info = device.get_device_info()
    assert info.torch_version == torch.__version__
    assert info.cuda_available is torch.cuda.is_available()
    count = torch.cuda.device_count() if info.cuda_available else 0
    assert [gpu.compute_capability for gpu in info.gpus] == [torch.cuda.get_device_capability(i) for i in range(count)]
    assert len(info.as_dict()["gpus"]) == count
    if info.nvml_available:
        assert isinstance(info.driver_version, str)
    else:
        assert "NVML" in info.nvml_reason and info.driver_version is None


def test_device_info_without_gpu_or_nvml(monkeypatch):
    import pynvml

    def fail():
        raise pynvml.NVMLError_LibraryNotFound()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    info = device.get_device_info()
    assert info.cuda_available is False and info.gpus == [] and info.as_dict()["gpus"] == []
    assert info.nvml_available is False and "NVML" in info.nvml_reason and info.driver_version is None


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
    if not torch.cuda.is_available():
        assert "CUDA: no" in out and "MXFP8: available" in out and "NVML: no" in out
        return
    mx = "available" if torch.cuda.get_device_capability() >= (10, 0) else "unavailable"
    assert "CUDA: yes" in out and f"MXFP8: {mx} -" in out and "NVML: " in out
