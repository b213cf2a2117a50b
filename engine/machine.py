"""What runs on this machine: the CPU, the kernels that quantize, and where each recipe's GEMMs run.

`python -m engine info` prints this after the GPU report of `engine.device`. Every recipe class
`engine.recipes` exports is listed (`recipe_classes`), so a new recipe shows up without an edit here.

Without a GPU every recipe runs, emulated on the CPU: its operands are quantized by the C++ kernels
(csrc/, at the best instruction set of the CPU - baseline, avx2 or avx512 - chosen at load time) or,
for a layout without one, the plain-PyTorch reference; its GEMMs decode both operands exactly to bf16
and sum in fp32. With a GPU a recipe's GEMMs run on cuBLAS where engine has a kernel for its operands
at this compute capability (per-tensor FP8 from 8.9; MXFP8, MXFP4 and NVFP4 at 10.x), are emulated on
the GPU otherwise (1x128 / 128x128 blocks, rowwise, MXFP6), and per-tensor FP8 below 8.9 cannot run.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
from dataclasses import dataclass

import torch

from engine import device, recipes
from engine.formats import element_name
from engine.schemes import ScaleEncoding, get_scheme
from engine.recipes import CustomRecipe, Debug, OperandRecipe, QuantizerSpec, Recipe

#: CPU features the kernels here look at (/proc/cpuinfo names): the avx2 kernels (x86-64-v3) need AVX2, FMA, F16C
#: and BMI2; the avx512 ones (x86-64-v4) F, BW, DQ, VL, CD; NVFP4's fast path VBMI2; bf16 weight-only GEMMs
#: AVX512-BF16; oneDNN's int8 GEMM VNNI or AMX
CPU_FEATURES = ("avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd",
                "avx512vbmi", "avx512_vbmi2", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
#: element formats with a cuBLAS block-scaled GEMM (torch._scaled_mm) on compute capability 10.x
CUBLAS_BLOCK_ELEMENTS = ("e4m3", "e5m2", "e2m1")


@dataclass(frozen=True)
class CpuInfo:
    model: str
    threads: int
    features: tuple[str, ...]  # those of CPU_FEATURES it has (empty where /proc/cpuinfo cannot be read)


def cpu_info(cpuinfo_path: str = "/proc/cpuinfo") -> CpuInfo:
    """The CPU's model name, torch's thread count and its features of CPU_FEATURES (Linux /proc/cpuinfo;
    elsewhere platform.processor() and no features)."""
    model, flags = "", set()
    try:
        with open(cpuinfo_path, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return CpuInfo(model or platform.processor() or platform.machine() or "unknown",
                   torch.get_num_threads(), tuple(f for f in CPU_FEATURES if f in flags))


def native_kernels() -> tuple[str | None, str]:
    """(the instruction set the C++ kernels run - 'baseline', 'avx2' or 'avx512' -, a description) or (None, why
    they are unavailable). Loads the kernels (the JIT fallback builds them), as the first quantization would."""
    from engine.ops import native

    if not native.available():
        return None, f"unavailable, quantization runs the reference ({native.why_unavailable()})"
    isa = native.isa()
    cap = native.isa_cap()
    capped = f"; {native.ISA_ENV}={cap} caps them" if cap is not None else ""
    return isa, (f"C++ (csrc/), instruction set {isa} (available here: {', '.join(native.available_isas())}"
                 f"{capped}; {native.loaded_from()})")


def triton_status() -> str:
    """Whether Triton is installed and what it runs here (the quantize kernels of CUDA tensors)."""
    if importlib.util.find_spec("triton") is None:
        return "not installed: CUDA tensors cannot be quantized (CPU tensors do not need it)"
    version = importlib.metadata.version("triton")
    if torch.cuda.is_available():
        return f"{version}: quantizes CUDA tensors"
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    return f"{version}: quantizes CUDA tensors; no GPU here" + (" (TRITON_INTERPRET=1: it runs interpreted)"
                                                                 if interpret else ", so unused")


# ------------------------------------------------------------------ recipes
def recipe_classes() -> list[type[Recipe]]:
    """Every recipe class engine.recipes exports (its `__all__`), the base class left out."""
    found = [getattr(recipes, name) for name in recipes.__all__]
    return [cls for cls in found if isinstance(cls, type) and issubclass(cls, Recipe) and cls is not Recipe]


def _specs(recipe: Recipe) -> list[QuantizerSpec]:
    return [spec for spec in recipe.operands().values() if spec is not None]


def _quantize_kernel(spec: QuantizerSpec, isa: str | None) -> str:
    """Which kernel quantizes a CPU operand of this spec: the C++ one of the registry, or the reference."""
    from engine.ops import backend, registry

    forced = backend.forced_backend()
    if forced == "reference" or isa is None or ("quantize", get_scheme(spec.scheme).layout, "cpu") not in registry.KERNELS:
        return "reference"
    return "C++"


def _gpu_gemm(spec: QuantizerSpec, capability: tuple[int, int]) -> str | None:
    """'cuBLAS' or 'emulated' for a GPU GEMM operand of this spec; None where it cannot run (per-tensor FP8
    below compute capability 8.9)."""
    scheme = get_scheme(spec.scheme)
    if scheme.rowwise_block.is_tensor:
        return "cuBLAS" if capability >= device.FP8_MIN_CAPABILITY else None
    from engine.gemm.block_scaled import BLOCK_SCALED_MAJOR, torch_has_block_scaled

    # cuBLAS's block-scaled GEMMs: E8M0 scales per 32 (MX) or E4M3 scales per 16 under a tensor scale (NVFP4)
    block_scaled = scheme.scale is ScaleEncoding.E8M0 or scheme.tensor_scale
    native = (block_scaled and element_name(scheme.element) in CUBLAS_BLOCK_ELEMENTS
              and capability[0] == BLOCK_SCALED_MAJOR and torch_has_block_scaled())
    return "cuBLAS" if native else "emulated"


def recipe_support(recipe: Recipe) -> tuple[bool, str]:
    """(whether `recipe` runs on this machine, how): emulated on the CPU without a GPU; with one, on cuBLAS
    where engine has a GEMM for its operands at this compute capability, else emulated on the GPU."""
    specs = _specs(recipe)
    if not specs:
        return True, "nothing quantized: high precision"
    if not torch.cuda.is_available():
        isa = native_kernels()[0]
        kernels = sorted({_quantize_kernel(spec, isa) for spec in specs})
        return True, f"emulated on the CPU (quantize: {' and '.join(kernels)}; GEMMs: exact bf16 decode, fp32 sums)"
    major, minor = torch.cuda.get_device_capability()
    where = {_gpu_gemm(spec, (major, minor)) for spec in specs}
    if None in where:
        need = ".".join(map(str, device.FP8_MIN_CAPABILITY))
        return False, f"its per-tensor FP8 GEMMs need compute capability {need}+, this GPU has {major}.{minor}"
    cap = f"compute capability {major}.{minor}"
    if where == {"cuBLAS"}:
        return True, f"native on the GPU (cuBLAS FP8/FP4 GEMMs on {cap}; Triton quantizes)"
    if where == {"emulated"}:
        return True, f"emulated on the GPU (no GEMM kernel for its operands on {cap}; Triton quantizes)"
    return True, f"on the GPU, partly native (cuBLAS on {cap}) and partly emulated; Triton quantizes"


def recipe_lines() -> list[str]:
    """One line per exported recipe class: its name, class, whether it runs here and how."""
    lines = []
    for cls in recipe_classes():
        if cls is OperandRecipe:
            lines.append(f"  {cls.name} ({cls.__name__}): any map of the operands to the schemes above; runs where "
                         "each of its operands' schemes does")
            continue
        if cls is CustomRecipe:
            lines.append(f"  {cls.name} ({cls.__name__}): the quantizers a factory returns per module, GEMM and "
                         "operand; runs where each of their schemes does (not under torch.compile)")
            continue
        if cls is Debug:
            lines.append(f"  {cls.name} ({cls.__name__}): another recipe with per-GEMM debug switches; runs where the "
                         "recipe it wraps does")
            continue
        ok, how = recipe_support(cls())
        lines.append(f"  {cls.name} ({cls.__name__}): {'runs' if ok else 'cannot run'} - {how}")
    return lines


def format_info() -> str:
    """What `python -m engine info` prints: the GPU report of `engine.device`, then `format_machine()`."""
    return device.format_device_info() + "\n" + format_machine()


def format_machine() -> str:
    """The CPU, kernel and recipe part of `python -m engine info`."""
    kernels = native_kernels()[1]
    cpu = cpu_info()
    forced = os.environ.get("ENGINE_BACKEND")
    lines = [f"CPU: {cpu.model}, {cpu.threads} thread(s) for torch; features: {', '.join(cpu.features) or 'unknown'}",
             f"CPU kernels: {kernels}" + (f"; ENGINE_BACKEND={forced} forces a backend" if forced else ""),
             f"Triton: {triton_status()}",
             "Recipes (every recipe class engine.recipes exports):"]
    return "\n".join(lines + recipe_lines())
