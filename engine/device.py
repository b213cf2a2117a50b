"""What this machine can run: CUDA capability (torch.cuda and NVML) and the CPU emulation path.

FP8 GEMMs need compute capability 8.9+ (Ada, Hopper), FP8 block scaling 9.0+ (Hopper),
MXFP8 10.0+ (Blackwell). Without a GPU every recipe still runs through the CPU emulation
path, so the checks answer True with a reason that says so; they never raise.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

FP8_MIN_CAPABILITY = (8, 9)
BLOCK_SCALING_MIN_CAPABILITY = (9, 0)
MXFP8_MIN_CAPABILITY = (10, 0)


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    compute_capability: tuple[int, int]
    total_memory_bytes: int


@dataclass(frozen=True)
class DeviceInfo:
    torch_version: str
    cuda_available: bool
    cuda_reason: str
    nvml_available: bool
    nvml_reason: str
    driver_version: str | None
    gpus: list[GpuInfo] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _nvml_probe() -> tuple[bool, str, str | None, list[tuple[str, int]]]:
    """(ok, reason, driver version, [(name, total memory)]) from NVML; never raises."""
    try:
        import pynvml
    except ImportError as err:
        return False, f"nvidia-ml-py is not installed ({err})", None, []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        return False, f"NVML could not start: {err}", None, []
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        devices = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            devices.append((name.decode() if isinstance(name, bytes) else name,
                            int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)))
        return True, f"NVML sees {len(devices)} GPU(s)", driver.decode() if isinstance(driver, bytes) else driver, devices
    except pynvml.NVMLError as err:
        return False, f"NVML query failed: {err}", None, []
    finally:
        pynvml.nvmlShutdown()


def get_device_info() -> DeviceInfo:
    """torch and NVML's view of the GPUs (an empty list and the reasons when there are none)."""
    nvml_ok, nvml_reason, driver, nvml_devices = _nvml_probe()
    cuda = torch.cuda.is_available()
    gpus = []
    if cuda:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append(GpuInfo(i, props.name, (props.major, props.minor), int(props.total_memory)))
        cuda_reason = f"{len(gpus)} CUDA device(s)"
    else:
        built = torch.version.cuda
        cuda_reason = ("torch was built without CUDA" if built is None
                       else f"torch (CUDA {built}) finds no usable GPU")
    return DeviceInfo(torch.__version__, cuda, cuda_reason, nvml_ok, nvml_reason, driver, gpus)


def _check(min_capability: tuple[int, int], what: str, return_reason: bool) -> bool | tuple[bool, str]:
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        ok = cap >= min_capability
        need = ".".join(map(str, min_capability))
        reason = (f"{what} on GPU: compute capability {cap[0]}.{cap[1]} >= {need}" if ok
                  else f"{what} needs compute capability {need}+, this GPU has {cap[0]}.{cap[1]}")
    else:
        ok = True
        reason = f"no CUDA GPU ({get_device_info().cuda_reason}); {what} runs through the CPU emulation path"
    return (ok, reason) if return_reason else ok


def is_fp8_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """Per-tensor FP8 (delayed and current scaling)."""
    return _check(FP8_MIN_CAPABILITY, "FP8", return_reason)


def is_fp8_block_scaling_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """Float8 1x128 / 128x128 block scaling."""
    return _check(BLOCK_SCALING_MIN_CAPABILITY, "FP8 block scaling", return_reason)


def is_mxfp8_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """MXFP8 (E8M0 scales per 32 elements)."""
    return _check(MXFP8_MIN_CAPABILITY, "MXFP8", return_reason)


def format_device_info(info: DeviceInfo | None = None) -> str:
    """Human-readable report for `python -m engine info`."""
    info = get_device_info() if info is None else info
    lines = [f"torch {info.torch_version}",
             f"CUDA: {'yes' if info.cuda_available else 'no'} ({info.cuda_reason})",
             f"NVML: {'yes' if info.nvml_available else 'no'} ({info.nvml_reason})"]
    if info.driver_version:
        lines.append(f"driver: {info.driver_version}")
    for gpu in info.gpus:
        lines.append(f"GPU {gpu.index}: {gpu.name}, compute capability {gpu.compute_capability[0]}."
                     f"{gpu.compute_capability[1]}, {gpu.total_memory_bytes / 2**30:.1f} GiB")
    for label, check in (("FP8 (per-tensor)", is_fp8_available), ("FP8 block scaling", is_fp8_block_scaling_available),
                         ("MXFP8", is_mxfp8_available)):
        ok, reason = check(return_reason=True)
        lines.append(f"{label}: {'available' if ok else 'unavailable'} - {reason}")
    return "\n".join(lines)
