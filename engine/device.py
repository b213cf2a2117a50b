"""What this machine can run: CUDA capability (torch.cuda and NVML) and the CPU emulation path.

The checks are Transformer Engine 2.x's: `is_fp8_available(return_reason=False)` and its siblings
return a bool, and with `return_reason=True` a `(bool, reason)` pair. (TE's older
`FP8GlobalStateManager.is_fp8_available()` always returned the pair; a pair by default here would
make `if engine.is_fp8_available():` true even when the answer is False.) On a GPU they answer TE's
question - does this GPU run the recipe family natively: per-tensor FP8 from compute capability 8.9
(Ada, Hopper), FP8 block scaling from 9.0 (Hopper), MXFP8 and NVFP4 from 10.0 (Blackwell). Without a
GPU every recipe runs, emulated on the CPU (exact decode to bf16, fp32 GEMMs: correct bits, not FP8
speed), so they answer True and the reason says "no CUDA GPU ... CPU emulation". They never raise.
`engine.machine` (and `python -m engine info`) says for every recipe where and how it runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

FP8_MIN_CAPABILITY = (8, 9)
BLOCK_SCALING_MIN_CAPABILITY = (9, 0)
MXFP8_MIN_CAPABILITY = (10, 0)
NVFP4_MIN_CAPABILITY = (10, 0)


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
    """Per-tensor FP8 (delayed and current scaling): a bool, or (bool, reason) with `return_reason=True`.
    True without a GPU: the recipes run emulated on the CPU (the reason says so)."""
    return _check(FP8_MIN_CAPABILITY, "FP8", return_reason)


def is_fp8_block_scaling_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """Float8 1x128 / 128x128 block scaling."""
    return _check(BLOCK_SCALING_MIN_CAPABILITY, "FP8 block scaling", return_reason)


def is_mxfp8_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """MXFP8 (E8M0 scales per 32 elements)."""
    return _check(MXFP8_MIN_CAPABILITY, "MXFP8", return_reason)


def is_nvfp4_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """NVFP4 (E2M1 elements, E4M3 scales per 16, a per-tensor amax)."""
    return _check(NVFP4_MIN_CAPABILITY, "NVFP4", return_reason)


def format_device_info(info: DeviceInfo | None = None) -> str:
    """Human-readable GPU report: torch, CUDA and NVML, the capability checks. `python -m engine info` prints it
    followed by the CPU, its kernels and every recipe with where and how it runs (`engine.machine.format_info`)."""
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
                         ("MXFP8", is_mxfp8_available), ("NVFP4", is_nvfp4_available)):
        ok, reason = check(return_reason=True)
        lines.append(f"{label}: {'available' if ok else 'unavailable'} - {reason}")
    return "\n".join(lines)
