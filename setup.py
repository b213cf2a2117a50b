"""Builds engine's C++ kernels (csrc/) into `engine._native` at install time; the metadata is in pyproject.toml.

    pip install --no-build-isolation -e .     # in place: engine/_native*.so (what `make install` runs)
    pip install --no-build-isolation .        # into site-packages
    python setup.py build_ext --inplace       # rebuild in place after a csrc/ edit (ninja recompiles what changed)

torch must be importable while building (its headers and `torch.utils.cpp_extension`): hence
--no-build-isolation, since an isolated build would install a torch of its own (a CUDA one from PyPI).
The sources, flags, per-ISA wrappers and build key come from engine/ops/native_build.py, shared with the
JIT fallback of engine/ops/native.py. MAX_JOBS (default: every core) sets ninja's parallel jobs.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
os.chdir(ROOT)  # the sources are given relative to the checkout (setuptools names objects after them)


def _native_build():
    """engine/ops/native_build.py loaded by path: importing the engine package would need torch and more."""
    spec = importlib.util.spec_from_file_location("engine_native_build", ROOT / "engine" / "ops" / "native_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError as err:
    sys.exit(f"engine's setup.py: torch must be importable to build the C++ kernels ({err}). Install torch first "
             "(`pip install torch==2.13.0`), then `pip install --no-build-isolation -e .` (an isolated build "
             "cannot see it, and would fetch another torch).")

nb = _native_build()
CSRC = Path("csrc")
WRAPPER_DIR = Path("build") / "variants"  # generated: glue__<file>, <variant>__<file> (native_build)
OBJECT_DIR = ROOT / "build" / "temp"


class TimedBuildExtension(BuildExtension):
    """torch's BuildExtension (ninja), with its objects kept in build/temp (an editable install's own temporary
    folder would make every rebuild a full one), saying on stderr how long the C++ build took."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.build_temp = str(OBJECT_DIR)

    def build_extensions(self) -> None:
        start = time.perf_counter()
        super().build_extensions()
        print(f"engine: built the C++ kernels ({', '.join(v for v, _ in nb.VARIANTS)}) in "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def extension() -> CppExtension:
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))  # torch's default leaves it to ninja (cores + 2)
    key = nb.build_key(CSRC, torch.__version__)
    wrappers = nb.write_glue_wrappers(CSRC, WRAPPER_DIR, key) + nb.write_variant_wrappers(CSRC, WRAPPER_DIR)
    # -g0: Python's own CFLAGS bring -g, which makes the torch-header TUs slower to build and the library larger
    return CppExtension("engine._native", [w.as_posix() for w in wrappers], include_dirs=[str(ROOT / CSRC)],
                        extra_compile_args=[*nb.CFLAGS, "-g0"], extra_link_args=list(nb.LDFLAGS))


setup(ext_modules=[extension()], cmdclass={"build_ext": TimedBuildExtension.with_options(use_ninja=True)})
