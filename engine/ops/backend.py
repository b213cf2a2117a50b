"""The one place that chooses how quantization math runs: reference, native (C++) or Triton.

Every backend implements the functions below with the same signatures and gives the
same bits as `engine.ops.reference`. CUDA tensors go to the Triton kernels; CPU tensors
to the C++ kernels when they could be built, else to the reference with a one-time
warning. `ENGINE_BACKEND=reference|native|triton` forces one (tests and benchmarks).

Contract (x2d is a 2D fp32/bf16/fp16 tensor; outputs are new contiguous tensors):

* `amax(x) -> fp32 [1]`: max|x|, NaN if x has NaN, 0 for an empty tensor.
* `cast_transpose(x2d, scale, fp8_dtype, *, rowwise, columnwise) -> (data [M,K] | None, data_t [K,M] | None, amax [1])`
* `quantize_block(x2d, fp8_dtype, *, tile_rows, tile_cols, force_pow_2_scales, amax_epsilon, value_for_inf)
  -> (data [M,K], scale_inv fp32 [ceil(M/tile_rows), ceil(K/tile_cols)])`; x2d may be a transposed view.
* `quantize_mxfp8(x, fp8_dtype, *, scale_mode, columnwise) -> (data x.shape, uint8 codes)`, a partial
  last block where the blocked dim is not a multiple of 32.
* `fp8_to_bf16(data) -> bf16 tensor of data's shape` (exact).
* optional, both usages in one call (the registry uses them where a backend has them; the C++ one does):
  `quantize_block_usages(x2d, fp8_dtype, *, tile_rows, tile_cols, rowwise, columnwise, ...)` and
  `quantize_mxfp8_usages(x, fp8_dtype, *, scale_mode, rowwise, columnwise)`
  `-> (rowwise data | None, its scales | None, columnwise data | None, its scales | None)`.

Every tensor argument must be a plain, dense tensor with data (`check_tensor`): a tensor
subclass (DTensor, FakeTensor, ...), a meta, sparse or nested tensor gets a TypeError
naming the argument here, whichever backend is chosen, and never reaches a kernel.
"""

from __future__ import annotations

import functools
import os
import warnings
from types import ModuleType
from typing import Any

import torch

from engine.ops import reference
from engine.ops.inputs import PLAIN_TENSOR_TYPES, check_not_subclass, check_tensor  # noqa: F401  (backend.check_tensor)

BACKENDS = ("reference", "native", "triton")


_ENV_DATA = getattr(os.environ, "_data", None)  # CPython's store behind os.environ (bytes keys on POSIX)
_ENV_KEY = os.fsencode("ENGINE_BACKEND") if os.name == "posix" else "ENGINE_BACKEND"


def _getenv_backend() -> str | None:
    """os.environ.get("ENGINE_BACKEND"), without the key encoding and value decoding of each call
    (~2 us; it is read for every quantize and GEMM). os.environ writes (monkeypatch.setenv too) update
    the same dict, so the answer is the same."""
    if isinstance(_ENV_DATA, dict):
        value = _ENV_DATA.get(_ENV_KEY)
        return None if value is None else os.fsdecode(value)
    return os.environ.get("ENGINE_BACKEND")


def forced_backend() -> str | None:
    name = _getenv_backend() or None
    if name is not None and name not in BACKENDS:
        raise ValueError(f"ENGINE_BACKEND: expected one of {BACKENDS}, got {name!r}")
    return name


def _native_or_reason() -> tuple[ModuleType | None, str]:
    """The C++ kernels' module when they built, else None and why not."""
    try:
        from engine.ops import native
    except ImportError as err:
        return None, f"engine.ops.native cannot be imported: {err}"
    if native.available():
        return native, ""
    return None, native.why_unavailable()


def _native() -> ModuleType | None:
    return _native_or_reason()[0]


def _triton() -> ModuleType:
    from engine.ops import triton as triton_ops

    return triton_ops


def module(name: str) -> tuple[ModuleType | None, str]:
    """The kernels of backend `name` ("native", "triton" or "reference"), or None and why not."""
    if name == "native":
        kernels = _native()
        return kernels, ("" if kernels is not None else _native_or_reason()[1])
    if name == "triton":
        return _triton(), ""
    return reference, ""


def backend_for(device: torch.device) -> ModuleType:
    """The module whose functions run quantization for tensors on `device`."""
    return _choose(device.type, forced_backend())


@functools.lru_cache(maxsize=None)
def _choose(device_type: str, forced: str | None) -> ModuleType:
    """Decided once per (device type, forced backend), so the fallback warning is shown once."""
    name = forced or ("triton" if device_type == "cuda" else "native")
    kernels, why = module(name)
    if kernels is not None:
        return kernels
    if forced:
        raise RuntimeError(f"ENGINE_BACKEND={forced}, but the C++ kernels are unavailable: {why}")
    warnings.warn(f"engine: the C++ CPU kernels are unavailable; quantization runs the slow reference path ({why})",
                  RuntimeWarning, stacklevel=5)
    return reference


def _route(x: torch.Tensor, name: str) -> ModuleType:
    """The backend for the tensor argument `name`: checked once here, then chosen by its device."""
    return backend_for(check_tensor(x, name).device)


def amax(x: torch.Tensor) -> torch.Tensor:
    return _route(x, "x").amax(x)


def cast_transpose(x2d: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, **kw: Any) -> tuple:
    check_tensor(scale, "scale")
    return _route(x2d, "x2d").cast_transpose(x2d, scale, fp8_dtype, **kw)


def quantize_block(x2d: torch.Tensor, fp8_dtype: torch.dtype, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return _route(x2d, "x2d").quantize_block(x2d, fp8_dtype, **kw)


def quantize_mxfp8(x: torch.Tensor, fp8_dtype: torch.dtype, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return _route(x, "x").quantize_mxfp8(x, fp8_dtype, **kw)


def fp8_to_bf16(data: torch.Tensor) -> torch.Tensor:
    return _route(data, "data").fp8_to_bf16(data)
