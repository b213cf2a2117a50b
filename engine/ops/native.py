"""C++ CPU kernels: the backend of `engine.ops.backend` for CPU tensors.

The kernels are built from `csrc/` (next to the `engine` package) at install time, into `engine._native`
(`make install`, `pip install --no-build-isolation -e .`: setup.py and `engine.ops.native_build`). They load
at the first kernel call, never at `import engine`. The installed library is used when it was built from the
csrc/ beside it: its `build_key()` (sources, flags, compiler, torch, Python, machine) must be the current one
(an installed copy without csrc/ beside it, as from a wheel, is used as it is). Otherwise - not installed,
stale after a csrc/ edit or a torch upgrade - the developer fallback builds the same sources with
`torch.utils.cpp_extension.load` (JIT) into torch's extension directory (`TORCH_EXTENSIONS_DIR`, default
`~/.cache/torch_extensions/py<ver>_cpu`) under `engine_native_<key>`: checkouts and virtualenvs with the
same sources share one build, and different ones never overwrite each other's. A JIT build runs under an
exclusive file lock in its directory (processes that start together build once; the others wait and load
it) and announces itself on stderr with why and how long; a cache hit loads the library directly and prints
nothing. It needs a C++ compiler with OpenMP and `ninja`. If the build fails, `available()` is False and
`why_unavailable()` says why; importing this module never raises.

One build holds every instruction set ("ISA") a CPU of this kind may have: on x86-64 `baseline` (SSE2),
`avx2` (x86-64-v3: AVX2, FMA, F16C, BMI2) and `avx512` (x86-64-v4), elsewhere `baseline` alone; the best the
CPU runs is chosen at load time (CPUID), so a build never runs instructions the CPU lacks. `isa()` tells
which one runs, `available_isas()` lists those this CPU runs, `use_isa(name)` forces one inside a block
(tests compare each with the reference). `ENGINE_ISA=baseline|avx2|avx512|auto`, read once when the kernels
load, caps them at a level the machine has (a ValueError at first use otherwise, naming what it has): with
`avx2`, `isa()` and `available_isas()` are those of an AVX2 CPU, so a whole process (a test run) behaves like
one. `ENGINE_NATIVE_VERBOSE=1` shows a JIT build.

Every function gives the same bits as its `engine.ops.reference` counterpart, with the
same signature plus optional preallocated outputs (`out_data=`, `out_data_t=`,
`out_scale_inv=`, ...): a caller that reuses buffers avoids the page faults of a fresh
large allocation, which cost more than the kernel. Given outputs must have exactly the
shape and dtype of the result and be contiguous; they are filled and returned.

`quantize_per_tensor` is all of per-tensor scaling in one call (x's amax, the scale by the
current-scaling rule or a given scale tensor read in C++, the cast(s), scale_inv and delayed
scaling's amax record), so a per-tensor quantization runs no torch op around the kernel;
`delayed_update` is delayed scaling's update of its amax history and scales (the torch ops of
`DelayedScalingState.update` for the built-in algorithms, in one call).

Every tensor argument must be a plain, dense CPU tensor (`check_cpu_tensor`): a tensor
subclass (DTensor, FakeTensor, ...), a meta or sparse tensor gets a TypeError naming the
argument, here and again in C++ (the kernels read raw memory through data pointers).

Work is split over OpenMP threads (`torch.get_num_threads()`); the kernels run with
round-to-nearest and without flush-to-zero whatever `torch.set_flush_denormal` says.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import shutil
import sys
import sysconfig
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import ModuleType

import torch

from engine import memory
from engine.formats import element_format, fp8_max
from engine.ops import native_build, nvfp4, reference
from engine.ops.exact_gemm import native_bf16_gemm
from engine.schemes import dims_2d
from engine.ops.inputs import PLAIN_TENSOR_TYPES, check_tensor

try:
    import fcntl
except ImportError:  # not POSIX: no lock (concurrent first builds may then collide)
    fcntl = None  # type: ignore[assignment]

INSTALLED = "engine._native"  # what setup.py builds
INSTALL_HINT = "`make install` or `pip install --no-build-isolation -e .` builds it at install"
EXTENSION_NAME = "engine_native"  # the JIT fallback's builds: engine_native_<key>
CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc"
CFLAGS, LDFLAGS = native_build.CFLAGS, native_build.LDFLAGS
DONE_MARKER = "engine_build_complete"  # written into the build directory after a build that loaded
LOCK_FILE = "engine_build.lock"

_FP8_KIND = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}

_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None
_isa_cap: str | None = None  # ENGINE_ISA as read when the kernels loaded (None: every ISA the CPU has)
ISA_ENV = "ENGINE_ISA"
ISA_ORDER = ("baseline", "avx2", "avx512")  # each level runs on every CPU the next one runs on
build_seconds: float | None = None  # wall time of the load in this process (build or cache hit)


def build_key(csrc_dir: Path | None = None) -> str:
    """16 hex digits identifying a build of `csrc_dir` (default: this checkout's csrc/) with this torch
    (`native_build.build_key`); the installed `engine._native` reports the key it was built with."""
    return native_build.build_key(CSRC_DIR if csrc_dir is None else csrc_dir, torch.__version__)


# ------------------------------------------------------------------ the installed build
def installed_build(key: str | None) -> tuple[ModuleType | None, str]:
    """(`engine._native`, '') when it is installed and was built with `key` (None: no csrc/ to compare with,
    any build will do), else (None, why not). A library whose file does not hold the key is not even loaded:
    a stale one may have been built against another torch."""
    import importlib.machinery

    # Looked up in this engine package's own folder only: an editable install's import hook would otherwise
    # hand a copy of the checkout the original's library.
    package, _, _ = INSTALLED.rpartition(".")
    here = [str(Path(__file__).resolve().parents[1])]  # the engine package
    spec = importlib.machinery.PathFinder.find_spec(INSTALLED, here if package == "engine" else None)
    if spec is None or spec.origin is None or spec.loader is None:
        return None, f"{INSTALLED} is missing"
    if key is not None and key.encode() not in Path(spec.origin).read_bytes():
        return None, f"{INSTALLED} is stale (not built from this csrc/ with these flags, compiler and torch)"
    module = sys.modules.get(INSTALLED)
    if module is None or getattr(module, "__file__", None) != spec.origin:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[INSTALLED] = module
    reported = module.build_key() if hasattr(module, "build_key") else None
    if key is not None and reported != key:
        return None, f"{INSTALLED} is stale (its build key is {reported or 'unknown'}, csrc/'s is {key})"
    return module, ""


# ------------------------------------------------------------------ the JIT fallback
def build_directory(key: str | None = None) -> Path:
    """Where the JIT build of `key` (default: this checkout's) lives: torch's extension root / engine_native_<key>."""
    from torch.utils import cpp_extension

    name = f"{EXTENSION_NAME}_{build_key() if key is None else key}"
    return Path(cpp_extension._get_build_directory(name, verbose=False))  # creates it; honours TORCH_EXTENSIONS_DIR


def _library(name: str, folder: Path) -> Path:
    from torch.utils import cpp_extension

    return folder / f"{name}{cpp_extension.LIB_EXT}"


def _is_built(name: str, folder: Path) -> bool:
    """A build finished (and loaded) in `folder`: its marker and its library are there."""
    return (folder / DONE_MARKER).is_file() and _library(name, folder).is_file()


def _import_built(name: str, folder: Path) -> ModuleType:
    """Load the built library as a Python module (what torch's load does after a build)."""
    path = _library(name, folder)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _exclusive(folder: Path) -> Iterator[None]:
    """An exclusive flock on the build directory's lock file, held while building."""
    if fcntl is None:
        yield
        return
    with open(folder / LOCK_FILE, "a+b") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"engine: waiting for another process building the C++ kernels into {folder}")
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def jit_sources(folder: Path, key: str) -> list[Path]:
    """The JIT build's sources, generated in `folder`/sources: every glue file (the key defined where it is
    used) and every kernel file once per ISA variant, each under a file name of its own (torch's loader names
    objects by file name alone)."""
    out = folder / "sources"
    return native_build.write_glue_wrappers(CSRC_DIR, out, key) + native_build.write_variant_wrappers(CSRC_DIR, out)


def _compile(name: str, folder: Path, key: str) -> ModuleType:
    """Compile with torch's JIT loader into `folder` and load the result."""
    from torch.utils import cpp_extension

    scripts = sysconfig.get_path("scripts")  # where pip put the `ninja` wheel's binary (e.g. .venv/bin)
    if shutil.which("ninja") is None and scripts:
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    return cpp_extension.load(
        name=name,
        sources=[str(path) for path in jit_sources(folder, key)],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        extra_include_paths=[str(CSRC_DIR)],
        build_directory=str(folder),
        verbose=bool(os.environ.get("ENGINE_NATIVE_VERBOSE")),
    )


def _jit_build(key: str, why: str) -> ModuleType:
    """Load the JIT build of these sources from torch's cache, or build it (once across processes) and load it."""
    if not native_build.glue_sources(CSRC_DIR):
        raise FileNotFoundError(f"C++ sources not found in {CSRC_DIR}")
    name = f"{EXTENSION_NAME}_{key}"
    folder = build_directory(key)
    if _is_built(name, folder):
        return _import_built(name, folder)  # the common case: no lock, no ninja
    with _exclusive(folder):
        if _is_built(name, folder):  # built by the process we waited for
            return _import_built(name, folder)
        # Under our lock nobody else is inside torch's loader for this directory: a `lock`
        # file of torch's is left over from a killed build, and would make torch wait forever.
        with contextlib.suppress(FileNotFoundError):
            (folder / "lock").unlink()
        _say(f"engine: building the C++ kernels (first use, 1-4 min) into {folder}")
        _say(f"engine: {why}; {INSTALL_HINT}")
        start = time.perf_counter()
        try:
            module = _compile(name, folder, key)
        except BaseException:
            _say(f"engine: building the C++ kernels failed after {time.perf_counter() - start:.1f} s")
            raise
        (folder / DONE_MARKER).write_text(f"{name}\n")
        _say(f"engine: built the C++ kernels in {time.perf_counter() - start:.1f} s")
        return module


def _build() -> ModuleType:
    """The installed `engine._native` when it was built from csrc/, else the JIT build of csrc/."""
    key = build_key() if CSRC_DIR.is_dir() else None
    module, why = installed_build(key)
    if module is not None:
        return module
    if key is None:
        raise FileNotFoundError(f"{why}, and there is no csrc/ at {CSRC_DIR} to build it from; {INSTALL_HINT}")
    return _jit_build(key, why)


def _describe(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip()
    lines = text.splitlines()
    if len(lines) > 40:  # compiler output: keep the head and the tail
        text = "\n".join(lines[:10] + ["..."] + lines[-25:])
    return f"building the C++ extension {EXTENSION_NAME!r} failed: {text}"


# ------------------------------------------------------------------ instruction sets
def _level(name: str) -> int:
    return ISA_ORDER.index(name)


def parse_isa(value: str, what: str = ISA_ENV) -> str | None:
    """An ISA name as ENGINE_ISA gives it: one of ISA_ORDER, None for '' or 'auto'; a ValueError otherwise."""
    name = value.strip().lower()
    if name in ("", "auto"):
        return None
    if name not in ISA_ORDER:
        raise ValueError(f"{what}: expected one of {', '.join(ISA_ORDER)} or auto, got {value!r}"
                         + ("; unset it to use the best kernels this CPU runs" if what == ISA_ENV else ""))
    return name


def _machine_isas(ext: ModuleType) -> list[str]:
    """The ISAs this CPU and build run, lowest first (the C++ module's CPUID answer, ENGINE_ISA not applied)."""
    return sorted(ext.available_isas(), key=_level)


def _capped(module: ModuleType, cap: str | None) -> ModuleType:
    """The loaded module running the best ISA at or below `cap`; a ValueError when the machine lacks `cap`."""
    if cap is not None:
        have = _machine_isas(module)
        if _level(cap) > _level(have[-1]):
            raise ValueError(f"{ISA_ENV}={cap}: this machine runs {', '.join(have)} (its CPU or this build has no "
                             f"{cap} kernels); set {ISA_ENV} to one of those or unset it")
        module.set_isa(max((n for n in have if _level(n) <= _level(cap)), key=_level))
    return module


def _extension() -> ModuleType | None:
    global _module, _error, _isa_cap, build_seconds
    if _module is None and _error is None:
        with _lock:
            if _module is None and _error is None:
                cap = parse_isa(os.environ.get(ISA_ENV, ""))  # a bad ENGINE_ISA raises here, every call, first
                start = time.perf_counter()
                try:
                    module = _build()
                except Exception as err:  # no compiler, no ninja, compile error, ...: report, never raise
                    _error = _describe(err)
                else:
                    _module, _isa_cap = _capped(module, cap), cap  # raises (leaving _module unset) past the CPU
                build_seconds = time.perf_counter() - start
    return _module


def available() -> bool:
    """True when the extension is loaded (loading it, or building it with the JIT fallback, on the first call)."""
    return _extension() is not None


def why_unavailable() -> str:
    """Why `available()` is False ('' when it is True)."""
    _extension()
    return _error or ""


def _ext() -> ModuleType:
    ext = _module if _module is not None else _extension()  # loaded: no call (this runs for every kernel call)
    if ext is None:
        raise RuntimeError(f"engine's C++ kernels are unavailable: {_error}")
    return ext


def isa_cap() -> str | None:
    """ENGINE_ISA's level as read when the kernels loaded (None: unset or auto)."""
    _ext()
    return _isa_cap


def loaded_from() -> str:
    """Which build runs: 'installed engine._native' or 'JIT build <library path>'."""
    ext = _ext()
    return f"installed {INSTALLED}" if ext.__name__ == INSTALLED else f"JIT build {ext.__file__}"


def isa() -> str:
    """The instruction set the kernels run: 'baseline', 'avx2' or 'avx512'."""
    return _ext().isa()


def available_isas() -> list[str]:
    """The instruction sets this CPU and build run, up to ENGINE_ISA's cap, lowest first (on an AVX-512 x86-64
    CPU ['baseline', 'avx2', 'avx512'])."""
    have = _machine_isas(_ext())
    return have if _isa_cap is None else [name for name in have if _level(name) <= _level(_isa_cap)]


@contextlib.contextmanager
def use_isa(name: str) -> Iterator[None]:
    """Run the kernels of `name` ('baseline', 'avx2', 'avx512' or 'auto': the best allowed) inside the block."""
    ext = _ext()
    wanted = parse_isa(name, "use_isa")
    allowed = available_isas()
    if wanted is None:
        wanted = allowed[-1]
    elif wanted not in allowed:
        raise ValueError(f"use_isa: {name!r} is not available here (available: {', '.join(allowed)}"
                         + (f"; {ISA_ENV}={_isa_cap} caps them)" if _isa_cap is not None else ")"))
    previous = ext.isa()
    ext.set_isa(wanted)
    try:
        yield
    finally:
        ext.set_isa(previous)


def _kind(fp8_dtype: torch.dtype) -> int:
    try:
        return _FP8_KIND[fp8_dtype]
    except (KeyError, TypeError):
        fp8_max(fp8_dtype)  # TypeError for anything but E4M3 / E5M2, as the reference
        raise


def check_cpu_tensor(x: object, name: str) -> torch.Tensor:
    """`x` if it is a plain, dense CPU tensor (`engine.ops.backend.check_tensor`), else a TypeError naming `name`."""
    if type(x) in PLAIN_TENSOR_TYPES and x.is_cpu and x.layout is torch.strided and not x.is_nested:
        return x  # the common case, in ~0.3 us
    check_tensor(x, name)
    raise TypeError(f"{name}: the native kernels take CPU tensors, got a tensor on {x.device}")


def _check_outputs(*outputs: tuple[torch.Tensor | None, str]) -> None:
    for t, name in outputs:
        if t is not None:
            check_cpu_tensor(t, name)


# ----------------------------------------------------------------------------- contract
def amax(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """max(|x|) as a 1-element fp32 tensor; 0 for an empty tensor; NaN if x has NaN."""
    check_cpu_tensor(x, "x")
    if out is not None:
        check_cpu_tensor(out, "out")
    if x.dtype not in reference.HIGH_PRECISION_DTYPES:
        result = reference.amax(x)
        return result if out is None else out.copy_(result)
    return _ext().amax(x, out)


def _scale_tensor(scale: object, name: str = "scale") -> torch.Tensor:
    """A 1-element scale as the fp32 CPU tensor the C++ reads (other dtypes converted, as the reference does)."""
    check_cpu_tensor(scale, name)
    if scale.numel() != 1:
        raise ValueError(f"{name}: expected a 1-element tensor, got shape {tuple(scale.shape)}")
    return scale if scale.dtype is torch.float32 else scale.float()


def _f32_scalar(t: object, name: str) -> torch.Tensor:
    """A 1-element fp32 CPU tensor that a kernel writes into."""
    check_cpu_tensor(t, name)
    if t.dtype is not torch.float32:
        raise TypeError(f"{name}: expected a float32 tensor, got {t.dtype}")
    if t.numel() != 1:
        raise ValueError(f"{name}: expected a 1-element tensor, got shape {tuple(t.shape)}")
    return t


def cast_transpose(
    x2d: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
    out_data: torch.Tensor | None = None,
    out_data_t: torch.Tensor | None = None,
    out_amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """One pass over x2d [M, K]: (sat(x * scale) [M, K] if rowwise, its transpose [K, M] if columnwise, amax [1]).

    `scale` (1 element) is read in C++, not turned into a Python number.
    """
    check_cpu_tensor(x2d, "x2d")
    reference.check_input(x2d, "x2d")
    scale = _scale_tensor(scale)
    _check_outputs((out_data, "out_data"), (out_data_t, "out_data_t"), (out_amax, "out_amax"))
    return _ext().cast_transpose(x2d, scale, _kind(fp8_dtype), rowwise, columnwise, out_data, out_data_t, out_amax)


def quantize_per_tensor(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
    scale: torch.Tensor | None = None,
    force_pow_2_scales: bool = False,
    amax_epsilon: float = 0.0,
    record_amax: torch.Tensor | None = None,
    out_data: torch.Tensor | None = None,
    out_data_t: torch.Tensor | None = None,
    out_scale_inv: torch.Tensor | None = None,
    out_amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 in one native call: (data [x.shape] | None, data_t [K, M] | None, scale_inv [1], amax [1]).

    The scale is the given 1-element `scale` (delayed scaling), else the current-scaling rule of
    x's own amax (`reference.compute_scale`, with `force_pow_2_scales` and `amax_epsilon`).
    scale_inv = 1 / scale (fp32 division), amax = max|x|. `record_amax` (fp32, 1 element) becomes
    max(record_amax, amax) in place, NaN if either is NaN (delayed scaling's record). M x K is
    x's 2D view (`reference.as_2d`); data has x's shape, data_t is that view transposed.
    """
    check_cpu_tensor(x, "x")
    reference.check_input(x)
    if scale is not None:
        scale = _scale_tensor(scale)
    if record_amax is not None:
        _f32_scalar(record_amax, "record_amax")
    if out_data is not None or out_data_t is not None or out_scale_inv is not None or out_amax is not None:
        _check_outputs((out_data, "out_data"), (out_data_t, "out_data_t"), (out_scale_inv, "out_scale_inv"),
                       (out_amax, "out_amax"))
    elif x.numel() >= memory.REUSED_OUTPUT_MIN_BYTES:  # large FP8 outputs reuse idle buffers (memory.output_buffer)
        m, k = dims_2d(x.shape)
        out_data = memory.output_buffer(tuple(x.shape), fp8_dtype) if rowwise else None
        out_data_t = memory.output_buffer((k, m), fp8_dtype) if columnwise else None
    return _ext().quantize_per_tensor(x, _kind(fp8_dtype), rowwise, columnwise, scale, force_pow_2_scales,
                                      amax_epsilon, record_amax, out_data, out_data_t, out_scale_inv, out_amax)


DELAYED_ALGOS = ("max", "most_recent")
MAX_MARGIN = 126  # 2**-margin stays a normal fp32 number


def delayed_update(
    amax_history: torch.Tensor, scale: torch.Tensor, fp8_max: float, margin: int, algo: str,
    held: Iterable[int] = (),
) -> None:
    """Delayed scaling's update, in place: history [L, n] and scale [n] (fp32, contiguous) as
    `DelayedScalingState.update` leaves them for the built-in `algo` ("max" | "most_recent").

    Row 0's NaN/inf become 0; amax = max over the rows (or row 0); scale = (fp8_max / amax) *
    2**-margin where amax is finite and > 0 (else the old scale), at most FLT_MAX; the history
    rolls up one row and row 0 becomes 0. Slots in `held` keep their history and scale.
    """
    for t, name in ((amax_history, "amax_history"), (scale, "scale")):
        check_cpu_tensor(t, name)
        if t.dtype is not torch.float32:
            raise TypeError(f"{name}: expected a float32 tensor, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: must be contiguous (it is updated in place)")
    if amax_history.dim() != 2 or amax_history.shape[0] < 1:
        raise ValueError(f"amax_history: expected shape [rows >= 1, n], got {tuple(amax_history.shape)}")
    n = amax_history.shape[1]
    if tuple(scale.shape) != (n,):
        raise ValueError(f"scale: expected shape ({n},) (one per amax_history column), got {tuple(scale.shape)}")
    if algo not in DELAYED_ALGOS:
        raise ValueError(f"algo: expected one of {DELAYED_ALGOS}, got {algo!r}")
    if isinstance(margin, bool) or not isinstance(margin, int) or not 0 <= margin <= MAX_MARGIN:
        raise ValueError(f"margin: expected an int in [0, {MAX_MARGIN}], got {margin!r}")
    if isinstance(fp8_max, bool) or not isinstance(fp8_max, (int, float)) or not 0 < fp8_max < float("inf"):
        raise ValueError(f"fp8_max: expected a finite number > 0, got {fp8_max!r}")
    slots = []
    for j in held:
        if isinstance(j, bool) or not isinstance(j, int) or not -n <= j < n:
            raise ValueError(f"held: expected slots in [{-n}, {n}), got {j!r}")
        slots.append(j % n)  # a negative slot counts from the end, as tensor indexing does
    _ext().delayed_update(amax_history, scale, float(fp8_max), margin, algo == "most_recent", slots)


def delayed_update_unchecked(amax_history: torch.Tensor, scale: torch.Tensor, fp8_max: float, margin: int,
                             most_recent: bool) -> None:
    """`delayed_update` without the Python checks, for tensors checked when they were made (the C++ checks
    dtypes, shapes and contiguity again)."""
    _ext().delayed_update(amax_history, scale, fp8_max, margin, most_recent, [])


def quantize_block(
    x2d: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    tile_rows: int,
    tile_cols: int,
    force_pow_2_scales: bool = True,
    amax_epsilon: float = 0.0,
    value_for_inf: float = reference.FLT_MAX,
    out_data: torch.Tensor | None = None,
    out_scale_inv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per tile_rows x tile_cols tile: (data [M, K], scale_inv fp32 [ceil(M/tr), ceil(K/tc)]).

    x2d may be a transposed view (the 1D columnwise case): it is read in tiles, never copied.
    """
    check_cpu_tensor(x2d, "x2d")
    _check_outputs((out_data, "out_data"), (out_scale_inv, "out_scale_inv"))
    kind = _kind(fp8_dtype)
    if x2d.dtype not in reference.HIGH_PRECISION_DTYPES:
        x2d = x2d.float()  # the reference computes on x2d.float() too
    if out_data is None and x2d.dim() == 2:  # a large output reuses an idle buffer (engine.memory.output_buffer)
        out_data = memory.output_buffer(tuple(x2d.shape), fp8_dtype)
    return _ext().quantize_block(x2d, kind, int(tile_rows), int(tile_cols), bool(force_pow_2_scales),
                                 float(amax_epsilon), float(value_for_inf), out_data, out_scale_inv)


def quantize_mxfp8(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    scale_mode: str = "rceil",
    columnwise: bool = False,
    out_data: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8, blocks of 32: (data with x's shape, uint8 E8M0 codes [M, ceil(K/32)] or [ceil(M/32), K])."""
    check_cpu_tensor(x, "x")
    reference.check_input(x)
    _check_outputs((out_data, "out_data"), (out_scale, "out_scale"))
    if scale_mode not in reference.SCALE_MODES:
        raise ValueError(f"scale_mode: expected one of {sorted(reference.SCALE_MODES)}, got {scale_mode!r}")
    kind = _kind(fp8_dtype)
    x2d = reference.as_2d(x)
    out2d = None
    if out_data is None and x2d.dim() == 2:  # a large output reuses an idle buffer (engine.memory.output_buffer)
        out2d = memory.output_buffer(tuple(x2d.shape), fp8_dtype)
    elif out_data is not None:
        if out_data.shape != x.shape:
            raise ValueError(f"out_data: expected shape {tuple(x.shape)}, got {tuple(out_data.shape)}")
        if not out_data.is_contiguous():
            raise ValueError("out_data: must be contiguous")
        out2d = out_data.view(x2d.shape)
    data, codes = _ext().quantize_mxfp8(x2d, kind, scale_mode == "rceil", columnwise, out2d, out_scale)
    return (out_data if out_data is not None else data if x.dim() == 2 else data.view(x.shape)), codes


UsageBuffers = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def quantize_block_usages(
    x2d: torch.Tensor, fp8_dtype: torch.dtype, *, tile_rows: int, tile_cols: int, rowwise: bool, columnwise: bool,
    force_pow_2_scales: bool = True, amax_epsilon: float = 0.0, value_for_inf: float = reference.FLT_MAX,
) -> UsageBuffers:
    """`quantize_block` of x2d (rowwise) and of x2d^T (columnwise, same tiles) in one native call:
    (data [M, K], scale_inv, data [K, M], scale_inv), None for a usage not asked for."""
    check_cpu_tensor(x2d, "x2d")
    kind = _kind(fp8_dtype)
    if x2d.dtype not in reference.HIGH_PRECISION_DTYPES:
        x2d = x2d.float()  # the reference computes on x2d.float() too
    out_row = out_col = None
    if x2d.dim() == 2 and x2d.numel() >= memory.REUSED_OUTPUT_MIN_BYTES:  # large outputs reuse idle buffers
        m, k = x2d.shape
        out_row = memory.output_buffer((m, k), fp8_dtype) if rowwise else None
        out_col = memory.output_buffer((k, m), fp8_dtype) if columnwise else None
    return _ext().quantize_block_usages(x2d, kind, int(tile_rows), int(tile_cols), bool(force_pow_2_scales),
                                        float(amax_epsilon), float(value_for_inf), bool(rowwise), bool(columnwise),
                                        out_row, out_col)


def quantize_mxfp8_usages(x: torch.Tensor, fp8_dtype: torch.dtype, *, scale_mode: str = "rceil", rowwise: bool,
                          columnwise: bool) -> UsageBuffers:
    """Both usages of `quantize_mxfp8` in one native call: (data, codes [M, ceil(K/32)], data, codes
    [ceil(M/32), K]), data in x's shape, None for a usage not asked for."""
    check_cpu_tensor(x, "x")
    reference.check_input(x)
    if scale_mode not in reference.SCALE_MODES:
        raise ValueError(f"scale_mode: expected one of {sorted(reference.SCALE_MODES)}, got {scale_mode!r}")
    kind = _kind(fp8_dtype)
    x2d = reference.as_2d(x)
    out_row = out_col = None
    if x2d.dim() == 2 and x2d.numel() >= memory.REUSED_OUTPUT_MIN_BYTES:  # large outputs reuse idle buffers
        out_row = memory.output_buffer(tuple(x2d.shape), fp8_dtype) if rowwise else None
        out_col = memory.output_buffer(tuple(x2d.shape), fp8_dtype) if columnwise else None
    row, row_codes, col, col_codes = _ext().quantize_mxfp8_usages(x2d, kind, scale_mode == "rceil", bool(rowwise),
                                                                  bool(columnwise), out_row, out_col)
    if x.dim() != 2:
        row, col = (None if t is None else t.view(x.shape) for t in (row, col))
    return row, row_codes, col, col_codes


def fp8_to_bf16(data: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 values as bf16 (exact), same shape. Other dtypes get the reference's plain cast."""
    check_cpu_tensor(data, "data")
    if out is not None:
        check_cpu_tensor(out, "out")
    if data.dtype not in _FP8_KIND:
        result = reference.fp8_to_bf16(data)
        return result if out is None else out.copy_(result)
    return _ext().fp8_to_bf16(data, out)


def exact_gemm(a: torch.Tensor, a_scale_inv: torch.Tensor, a_tile: tuple[int, int], b: torch.Tensor,
               b_scale_inv: torch.Tensor, b_tile: tuple[int, int], bias: torch.Tensor | None,
               out_dtype: torch.dtype) -> torch.Tensor | None:
    """decode(a) @ decode(b)^T (+ bias) in out_dtype: the exact CPU GEMM of `engine.gemm.cpu` in one call.

    a [M, K] and b [N, K] are FP8 data (any strides), or bf16 element values (decoded MXFP4/MXFP6
    codes). A tile of (0, 0) means one scale per
    tensor: both must be, and the fp32 product of the two scale_inv is addmm's alpha; None
    when that product is not a normal fp32 number (the caller rescales). Otherwise each
    scale_inv has one power-of-2 scale (fp32, or uint8 E8M0 codes) per tile of that shape.
    Each operand is decoded to bf16 exactly; an out_dtype other than bf16, and bf16 where torch's bf16
    GEMM is not native (`exact_gemm.native_bf16_gemm`), runs an fp32 GEMM (addmm, or below a size
    threshold on AVX-512 a small fp32-FMA kernel whose summation order depends on K alone: numerics in
    engine/ops/exact_gemm.py). The C++ side checks every argument.
    """
    bf16_gemm = out_dtype == torch.bfloat16 and native_bf16_gemm()
    return _ext().exact_gemm(a, a_scale_inv, a_tile[0], a_tile[1], b, b_scale_inv, b_tile[0], b_tile[1], bias,
                             out_dtype, bf16_gemm)


def grouped_exact_gemm(a: Sequence[torch.Tensor], a_scale_inv: Sequence[torch.Tensor],
                       a_tiles: Sequence[tuple[int, int]], b: Sequence[torch.Tensor],
                       b_scale_inv: Sequence[torch.Tensor], b_tiles: Sequence[tuple[int, int]],
                       biases: Sequence[torch.Tensor | None] | None, out_dtype: torch.dtype,
                       out: torch.Tensor | None, *, numerics: str = "exact",
                       amaxes: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] = ((), ()),
                       amax_divisors: tuple[float, float] = (2688.0, 2688.0)) -> list[torch.Tensor | None]:
    """The CPU GEMM general_gemm runs for every group g (a[g], b[g], each side's tile shape per group) in one call,
    with its bits. `numerics`: "exact" (per-tensor FP8 or power-of-2 tile pairs: `exact_gemm`), "nvfp4" (fp32 block
    scales and one fp32 amax per operand in `amaxes`, divided by `amax_divisors`: engine.gemm.cpu.nvfp4) or
    "fp32_tiles" (fp32 tile scales: engine.gemm.cpu.fp32_tiles).

    With `out` (contiguous [sum of a's rows, N], out_dtype) each group's result is written into its rows, and the
    list holds None for a group written and an empty tensor for one not written (a per-tensor scale product that
    is not a normal number: the caller computes it). Without `out`: the groups' results, None where exact_gemm
    gives None. (csrc/gemm/grouped_gemm_glue.cpp)"""
    bf16_gemm = out_dtype == torch.bfloat16 and native_bf16_gemm()
    return _ext().grouped_exact_gemm(list(a), list(a_scale_inv), [v for tile in a_tiles for v in tile], list(b),
                                     list(b_scale_inv), [v for tile in b_tiles for v in tile], numerics,
                                     list(amaxes[0]), list(amaxes[1]), float(amax_divisors[0]),
                                     float(amax_divisors[1]), [] if biases is None else list(biases), out_dtype,
                                     bf16_gemm, out)


# ------------------------------------------------------------------------------ MXFP4 / MXFP6
_MX_SMALL_KIND = {"E2M1": 0, "E2M3": 1, "E3M2": 2}


def _mx_small_kind(element: object) -> int:
    fmt = element_format(element)  # a TypeError naming element for anything else
    if fmt.name not in _MX_SMALL_KIND:
        raise TypeError(f"element: expected an MX element without a torch dtype (E2M1, E2M3, E3M2), got {fmt.name}")
    return _MX_SMALL_KIND[fmt.name]


def quantize_mx_coded(
    x: torch.Tensor, element: object, *, scale_mode: str = "rceil", rowwise: bool = True, columnwise: bool = True,
    out_row_data: torch.Tensor | None = None, out_row_codes: torch.Tensor | None = None,
    out_col_data: torch.Tensor | None = None, out_col_codes: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """MXFP4 / MXFP6 (E2M1, E2M3 or E3M2 `element`), both usages in one pass over x: (rowwise data, rowwise
    E8M0 codes [M, ceil(K/32)], columnwise data, columnwise codes [ceil(M/32), K]), None for a usage not
    asked for. Data keeps x's shape with the last dim packed (E2M1: ceil(K/2) bytes, low nibble first).
    `out_*`: preallocated uint8 outputs (data as 2D [M, packed K]), contiguous, of exactly those shapes."""
    check_cpu_tensor(x, "x")
    reference.check_input(x)
    kind = _mx_small_kind(element)
    if scale_mode not in reference.SCALE_MODES:
        raise ValueError(f"scale_mode: expected one of {sorted(reference.SCALE_MODES)}, got {scale_mode!r}")
    outs = {"out_row_data": out_row_data, "out_row_codes": out_row_codes, "out_col_data": out_col_data,
            "out_col_codes": out_col_codes}
    _check_outputs(*((t, name) for name, t in outs.items()))
    x2d = reference.as_2d(x)
    if all(t is None for t in outs.values()) and x2d.numel() >= memory.REUSED_OUTPUT_MIN_BYTES:
        # large outputs reuse idle buffers (engine.memory.output_buffer); E2M1 packs two elements per byte
        fmt = element_format(element)
        packed = (x2d.shape[0], -(-x2d.shape[1] // 2) if fmt.name == "E2M1" else x2d.shape[1])
        outs["out_row_data"] = memory.output_buffer(packed, torch.uint8) if rowwise else None
        outs["out_col_data"] = memory.output_buffer(packed, torch.uint8) if columnwise else None
    row, row_codes, col, col_codes = _ext().quantize_mx_small(x2d, kind, scale_mode == "rceil", bool(rowwise),
                                                              bool(columnwise), **outs)
    shape = (*x.shape[:-1], row.shape[-1] if rowwise else col.shape[-1]) if x.dim() else ()
    return ((row.view(shape) if rowwise else None), (row_codes if rowwise else None),
            (col.view(shape) if columnwise else None), (col_codes if columnwise else None))


def elements_to_bf16(data: torch.Tensor, element: object, cols: int | None = None) -> torch.Tensor:
    """E2M1 (packed) / E2M3 / E3M2 codes -> bf16 values [..., cols], exact, unscaled (reference.elements_to_bf16)."""
    check_cpu_tensor(data, "data")
    kind = _mx_small_kind(element)
    if data.dtype != torch.uint8:
        raise TypeError(f"data: expected uint8 element codes, got {data.dtype}")
    if data.dim() == 0:
        data = data.reshape(1)
    if cols is None:
        cols = data.shape[-1] * (2 if kind == 0 else 1)
    return _ext().mx_small_to_bf16(data, kind, int(cols))


# ------------------------------------------------------------------------------------------ NVFP4
NVFP4_BLOCK = 16


def _check_flag(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return value


def _given_amax(t: object, name: str) -> torch.Tensor:
    """A given per-tensor amax as the fp32 1-element tensor the C++ reads (the reference takes `t.float()`)."""
    check_cpu_tensor(t, name)
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {t.dtype}")
    if t.numel() != 1:
        raise ValueError(f"{name}: expected a 1-element tensor, got shape {tuple(t.shape)}")
    return t.float()


def quantize_nvfp4(
    x: torch.Tensor, *, rowwise: bool = True, columnwise: bool = True, two_d: bool = False, rht: bool = False,
    amax: torch.Tensor | None = None, amax_t: torch.Tensor | None = None, counter: torch.Tensor | None = None,
    out_row_data: torch.Tensor | None = None, out_row_scales: torch.Tensor | None = None,
    out_col_data: torch.Tensor | None = None, out_col_scales: torch.Tensor | None = None,
    four_over_six: bool = False, four_over_six_err_mode: str = "MAE", four_over_six_e4m3_max: float = 448.0,
) -> dict[str, torch.Tensor | None]:
    """NVFP4 of x for the asked usages, the bits of `engine.ops.nvfp4.quantize` (same options, same dict).

    Rowwise 1x16 blocks (`two_d`: 16x16 tiles), columnwise = x^T in 1x16 blocks (`rht`: of the 16-point
    RHT of x^T along the token axis). `amax` / `amax_t`: given per-tensor amaxes, else x's own (after the
    RHT). `counter`: the int64 `[2]` (seed, offset) of stochastic rounding (`nvfp4_sr.random_bits`): the
    rowwise bits start at offset, the columnwise ones after the rowwise M*K; the counter is read, not
    advanced (the caller advances it). None rounds to nearest even. Data are 2D: `[M, ceil(K/2)]` and
    `[K, ceil(M/2)]` uint8, scales `[M, ceil(K/16)]` and `[K, ceil(M/16)]` float8_e4m3fn. `out_*`: buffers
    of exactly those shapes and dtypes, contiguous, for an asked usage, written and returned; without
    them the large data reuse idle buffers (`engine.memory.output_buffer`: no fresh pages to fault in).
    `four_over_six` / `four_over_six_err_mode` / `four_over_six_e4m3_max`: TE's 4over6
    (`engine.ops.nvfp4_4over6`); not with `rht` nor `counter`.
    """
    check_cpu_tensor(x, "x")
    reference.check_input(x)
    flags = {name: _check_flag(v, name) for name, v in
             (("rowwise", rowwise), ("columnwise", columnwise), ("two_d", two_d), ("rht", rht))}
    if two_d and rht:
        raise ValueError("two_d and rht: TE applies the RHT to inputs and gradients only, never with 16x16 tiles")
    nvfp4.check_four_over_six(four_over_six, four_over_six_err_mode, four_over_six_e4m3_max, rht=rht,
                              stochastic=counter is not None)
    x2d = reference.as_2d(x)
    if rht and columnwise and x2d.shape[0] % NVFP4_BLOCK:
        raise ValueError(f"x: the random Hadamard transform mixes {NVFP4_BLOCK} tokens, so the token count "
                         f"(M, the product of the leading dims) must be a multiple of {NVFP4_BLOCK}, "
                         f"got {x2d.shape[0]}")
    amax = None if amax is None else _given_amax(amax, "amax")
    amax_t = None if amax_t is None else _given_amax(amax_t, "amax_t")
    if counter is not None:
        check_cpu_tensor(counter, "counter")
        if counter.dtype != torch.int64 or tuple(counter.shape) != (2,):
            raise TypeError(f"counter: expected an int64 tensor of shape (2,) holding (seed, offset), got "
                            f"{counter.dtype} {tuple(counter.shape)}")
    outs = _nvfp4_outputs(x2d, flags["rowwise"], flags["columnwise"], out_row_data=out_row_data,
                          out_row_scales=out_row_scales, out_col_data=out_col_data, out_col_scales=out_col_scales)
    ext = _ext()
    row, row_scales, row_amax, col, col_scales, col_amax = ext.quantize_nvfp4(
        x2d, flags["rowwise"], flags["columnwise"], flags["two_d"], flags["rht"], amax, amax_t, counter, **outs,
        four_over_six=four_over_six, four_over_six_err_mode=four_over_six_err_mode, four_over_six_e4m3_max=float(four_over_six_e4m3_max))
    e4m3 = torch.float8_e4m3fn
    return {
        "rowwise_data": row if rowwise else None, "rowwise_scale_inv": row_scales.view(e4m3) if rowwise else None,
        "amax_rowwise": row_amax if rowwise else None,
        "columnwise_data": col if columnwise else None,
        "columnwise_scale_inv": col_scales.view(e4m3) if columnwise else None,
        "amax_columnwise": col_amax if columnwise else None,
    }


def _nvfp4_outputs(x2d: torch.Tensor, rowwise: bool, columnwise: bool, **given: torch.Tensor | None,
                   ) -> dict[str, torch.Tensor | None]:
    """quantize_nvfp4's out_* buffers as the binding takes them (uint8), checked; idle reused ones for the
    large data not given."""
    m, k = x2d.shape
    shapes = {"out_row_data": ((m, -(-k // 2)), torch.uint8, rowwise),
              "out_row_scales": ((m, -(-k // NVFP4_BLOCK)), torch.float8_e4m3fn, rowwise),
              "out_col_data": ((k, -(-m // 2)), torch.uint8, columnwise),
              "out_col_scales": ((k, -(-m // NVFP4_BLOCK)), torch.float8_e4m3fn, columnwise)}
    outs: dict[str, torch.Tensor | None] = {}
    for name, (shape, dtype, asked) in shapes.items():
        t = given[name]
        if t is None:
            outs[name] = memory.output_buffer(shape, dtype) if asked and dtype is torch.uint8 else None
            continue
        check_cpu_tensor(t, name)
        if not asked:
            raise ValueError(f"{name}: given for a usage not asked for ({'rowwise' if 'row' in name else 'columnwise'}"
                             f"=False)")
        if t.dtype != dtype:
            raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
        outs[name] = t.view(torch.uint8)
    return outs


# ---------------------------------------------------------------------------- weight-only int GEMMs
WO_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _wo_input(x: object) -> torch.Tensor:
    check_cpu_tensor(x, "x")
    if x.dtype not in WO_DTYPES:
        raise TypeError(f"x: expected float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2D tensor [M, K], got shape {tuple(x.shape)}")
    return x


def int4_linear(x: torch.Tensor, data: torch.Tensor, scale_and_zero: torch.Tensor, group_size: int,
                n: int) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, n] in x's dtype, W groupwise int4 (`Int4WeightOnly`'s parts, csrc/inference/wo_gemm.h):
    data uint8 [rows >= n, K/2] (q[n, 2i] in the low nibble of byte i), scale_and_zero bfloat16
    [K/group_size, rows, 2]; w = (q - 8) * scale + zero, computed per group as scale * sum x * (q - 8) + zero *
    sum x in fp32: the fp32 reference up to the order and grouping of the fp32 additions."""
    _wo_input(x)
    check_cpu_tensor(data, "data")
    check_cpu_tensor(scale_and_zero, "scale_and_zero")
    for value, name in ((group_size, "group_size"), (n, "n")):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    return _ext().int4_linear(x, data, scale_and_zero, group_size, n)


def int8_linear(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (data * scale[:, None])^T -> [M, N] in x's dtype for per-channel int8 data [N, K] and a
    float32 / bfloat16 scale [N]: fp32 sums of x * q, times the scale. The same as the fp32 reference up to
    the order of the fp32 additions."""
    _wo_input(x)
    check_cpu_tensor(data, "data")
    check_cpu_tensor(scale, "scale")
    return _ext().int8_linear(x, data, scale, False)


def fp8_linear(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (decode(data) * scale[:, None])^T -> [M, N] in x's dtype for E4M3 data [N, K] (float8_e4m3fn or
    its uint8 bytes) and a float32 scale [N]: fp32 sums of x times the exact E4M3 values (a NaN code is a NaN),
    times the scale. The same as the fp32 reference up to the order of the fp32 additions."""
    _wo_input(x)
    check_cpu_tensor(data, "data")
    check_cpu_tensor(scale, "scale")
    return _ext().int8_linear(x, data, scale, True)


#: the element kinds of `block_linear` (csrc/inference/wo_gemm.h)
BLOCK_ELEMENTS = {"E2M1": 0, "E2M3": 1, "E3M2": 2, "E4M3": 3}


def block_linear(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, element: str, block: int,
                 amax: torch.Tensor | None = None, factor: float = 0.0) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype for a block-scaled float weight [N, K]: element codes `data` uint8
    (E2M1 two a byte along K, low nibble first: [N, ceil(K/2)]; else [N, K]) and a scale code per `block` (16 or
    32) elements `scale` uint8 [N, ceil(K/block)]: E8M0 (MX), or, given the fp32 `amax` [1], NVFP4's E4M3 codes,
    the block scale being (e4m3 * amax) * `factor` in fp32. Each weight is the reference's fp32 value (element *
    block scale, one fp32 multiplication) and the sums are fp32: the fp32 reference up to the order of additions."""
    _wo_input(x)
    check_cpu_tensor(data, "data")
    check_cpu_tensor(scale, "scale")
    if element not in BLOCK_ELEMENTS:
        raise ValueError(f"element: expected one of {sorted(BLOCK_ELEMENTS)}, got {element!r}")
    if isinstance(block, bool) or not isinstance(block, int):
        raise TypeError(f"block: expected an int, got {type(block).__name__}")
    if amax is not None:
        check_cpu_tensor(amax, "amax")
    return _ext().block_linear(x, data, scale, BLOCK_ELEMENTS[element], block, amax, float(factor))


def int8_quantize_rows(x: torch.Tensor, biased: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 of x [M, K] in one pass: (q int8 [M, K], scale fp32 [M]), the bits of
    `engine.inference.int_formats.rowwise_int8` (scale = max(amax / 127, fp32 tiny), q = round-half-even(x /
    scale) clamped to [-127, 127]); a row with a NaN gets a NaN scale and q = 0 where x / scale is NaN.
    `biased`: q + 128 as uint8 instead (oneDNN's u8 activations with zero point 128)."""
    _wo_input(x)
    if not isinstance(biased, bool):
        raise TypeError(f"biased: expected a bool, got {type(biased).__name__}")
    return _ext().int8_quantize_rows(x, biased)


def int8_rescale(acc: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(acc.float() * sx[:, None] * sw[None, :]).to(dtype) in one pass, bit for bit: acc int32 (or float32) [M, N],
    sx and sw float32 [M] and [N], dtype float32, bfloat16 or float16."""
    for t, name in ((acc, "acc"), (sx, "sx"), (sw, "sw")):
        check_cpu_tensor(t, name)
    if dtype not in WO_DTYPES:
        raise TypeError(f"dtype: expected float32, bfloat16 or float16, got {dtype}")
    return _ext().int8_rescale(acc, sx, sw, dtype)


def adam_step(w: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, m_scale: torch.Tensor | None, m_kind: int,
              v: torch.Tensor, v_scale: torch.Tensor | None, v_kind: int, v_sqrt: bool, tables: tuple,
              scalars: tuple, maximize: bool) -> None:
    """One fused Adam / AdamW step of a tensor over compressed states, in place (csrc/optim/adam.h): `w` fp32,
    `grad` fp32 / bf16, states by kind (0 fp32, 1 bf16, 2 / 3 E4M3 / E5M2 with fp32 scale_inv per 128, 4 uint8
    codes with fp32 absmax per 256), `tables` = (signed codes, signed midpoints, unsigned codes, unsigned
    midpoints), `scalars` = (beta1, 1-beta1, beta2, 1-beta2, step_size, 1/sqrt(bc2), eps, decay, wd). Bit for bit
    engine.optim.Adam.reference_step."""
    _ext().adam_step(w, grad, None, m, m_scale, m_kind, v, v_scale, v_kind, v_sqrt, *tables, *scalars, maximize)
