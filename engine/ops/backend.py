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
"""

from __future__ import annotations

import functools
import os
import warnings
from types import ModuleType
from typing import Any

import torch

from engine.ops import reference

BACKENDS = ("reference", "native", "triton")


def forced_backend() -> str | None:
    name = os.environ.get("ENGINE_BACKEND") or None
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


def backend_for(device: torch.device) -> ModuleType:
    """The module whose functions run quantization for tensors on `device`."""
    return _choose(device.type, forced_backend())


@functools.lru_cache(maxsize=None)
def _choose(device_type: str, forced: str | None) -> ModuleType:
    """Decided once per (device type, forced backend), so the fallback warning is shown once."""
    if forced == "reference":
        return reference
    if forced == "triton" or (forced is None and device_type == "cuda"):
        return _triton()
    native = _native()
    if native is not None:
        return native
    if forced == "native":
        raise RuntimeError(f"ENGINE_BACKEND=native, but the C++ kernels are unavailable: {_native_or_reason()[1]}")
    warnings.warn("engine: the C++ CPU kernels are unavailable; quantization runs the slow reference path "
                  f"({_native_or_reason()[1]})", RuntimeWarning, stacklevel=4)
    return reference


def amax(x: torch.Tensor) -> torch.Tensor:
    return backend_for(x.device).amax(x)


def cast_transpose(x2d: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, **kw: Any) -> tuple:
    return backend_for(x2d.device).cast_transpose(x2d, scale, fp8_dtype, **kw)


def quantize_block(x2d: torch.Tensor, fp8_dtype: torch.dtype, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return backend_for(x2d.device).quantize_block(x2d, fp8_dtype, **kw)


def quantize_mxfp8(x: torch.Tensor, fp8_dtype: torch.dtype, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return backend_for(x.device).quantize_mxfp8(x, fp8_dtype, **kw)


def fp8_to_bf16(data: torch.Tensor) -> torch.Tensor:
    return backend_for(data.device).fp8_to_bf16(data)
