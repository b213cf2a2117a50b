"""The floor row of bench_optim (`--floor`): benchmarks/optim_floor.c compiled for the level engine's kernels run.

The C file is a fused AdamW step with two LINEAR int8 block states (the cheapest 8-bit code: one conversion each
way), compiled with -ffast-math: a lower bound for any fused step with two 8-bit states on this machine, not a
format engine offers. It needs a C compiler (`cc`), as engine's own developer build does.
"""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("optim_floor.c")
ARCH_FLAGS = {"avx512": ["-march=x86-64-v4", "-mprefer-vector-width=512"], "avx2": ["-march=x86-64-v3"],
              "baseline": []}


class FloorStep:
    """`.step()` runs the floor kernel over tensors shaped like an optimizer's parameters (a bench row)."""

    def __init__(self, base: list[torch.Tensor], grads: list[torch.Tensor], isa: str, folder: Path) -> None:
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            raise RuntimeError("bench optim --floor: no C compiler (cc / gcc) on PATH")
        flags = ARCH_FLAGS[isa] if platform.machine().lower() in ("x86_64", "amd64") else []
        library, objects = folder / f"optim_floor_{isa}.so", folder / f"optim_floor_{isa}.o"
        # compiled with -ffast-math but linked without it: linked with it, the library's start-up code would set
        # flush-to-zero / denormals-are-zero for the whole process when it is loaded (GCC's crtfastmath.o)
        subprocess.run([cc, "-O3", "-ffast-math", *flags, "-fPIC", "-c", "-o", str(objects), str(SOURCE)], check=True)
        subprocess.run([cc, "-shared", "-o", str(library), str(objects)], check=True)
        self._fn = ctypes.CDLL(str(library)).floor_step
        blocks = [(t.numel() // 128) * 128 for t in base]
        self.w = [t[:k].clone() for t, k in zip(base, blocks)]
        self.g = [t[:k].clone() for t, k in zip(grads, blocks)]
        self.m = [torch.zeros(k, dtype=torch.int8) for k in blocks]
        self.v = [torch.zeros(k, dtype=torch.int8) for k in blocks]
        self.ms = [torch.zeros(k // 128) for k in blocks]
        self.vs = [torch.zeros(k // 128) for k in blocks]

    def step(self) -> None:
        f = ctypes.c_float
        for w, g, m, v, ms, vs in zip(self.w, self.g, self.m, self.v, self.ms, self.vs):
            self._fn(*(ctypes.c_void_p(t.data_ptr()) for t in (w, g, m, v, ms, vs)), ctypes.c_long(w.numel()),
                     f(0.9), f(0.999), f(1e-3), f(1e-8), f(1 - 1e-5))

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.m, *self.v, *self.ms, *self.vs))


def floor_row(base: list[torch.Tensor], grads: list[torch.Tensor], isa: str) -> FloorStep:
    """The floor's bench row, its library built in a fresh temporary folder (kept for the process's life)."""
    return FloorStep(base, grads, isa, Path(tempfile.mkdtemp(prefix="engine-optim-floor-")))
