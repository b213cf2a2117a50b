"""Row slices of 2D quantized tensors, without dequantizing: what FSDP2 does to a weight when it shards it.

FSDP2's `fully_shard` splits a parameter along dim 0 (`torch.chunk` -> aten.split), makes a
zero-padded shard (`new_zeros`), and copies the rows in (`narrow` -> aten.slice, `copy_`).
A row slice keeps the FP8 bytes and the scales of the rows it holds:

* one scale per tensor: any rows; the slice shares the scale;
* scale blocks that span rows (128x128 tiles, MX's 32x1 columnwise blocks): the slice must start
  at a block boundary and end at one (or at the last row), else a ValueError names the rule;
* a columnwise copy that the scheme can derive exactly from the rowwise one (per-tensor,
  128x128) is left out of the slice: it is remade from the rowwise bytes when needed.

Splitting other 2D layouts (NVFP4, axiswise) along dim 0 is a NotImplementedError that names
FSDP2 (which would otherwise shard FP8 primary weights as fp32 copies); other slices and dims
return NotImplemented: the op then runs on the dequantized value with a QuantizedFallbackWarning.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.schemes import ScaleEncoding
from engine.tensors.quantized import QuantizedTensor, _handles
from engine.tensors.storage import QuantizedTensorBase

aten = torch.ops.aten
_E8M0_ONE = 127  # the E8M0 code of 2**0


def row_block(storage: QuantizedTensorBase) -> int:
    """Rows a slice must be a multiple of (1: any rows): the largest row span of a scale block it keeps."""
    scheme, rows = storage.scheme, 1
    for usage, block in (("rowwise", scheme.rowwise_block), ("columnwise", scheme.columnwise_block)):
        if getattr(storage, f"{usage}_data") is None or (usage == "columnwise" and scheme.derivable):
            continue
        rows = max(rows, 1 if block.is_tensor else block.rows)
    return rows


def _sliceable(storage: QuantizedTensorBase) -> bool:
    return len(storage.shape) == 2 and storage.scheme.sliceable


def slice_rows(storage: QuantizedTensorBase, start: int, stop: int) -> QuantizedTensorBase:
    """Rows [start, stop) of a 2D storage, sharing its buffers (views); ValueError if a scale block is cut."""
    n, k = storage.shape
    block = row_block(storage)
    if start < stop and (start % block or (stop % block and stop != n)):
        raise ValueError(
            f"rows {start}:{stop} of a {n}x{k} {storage.scheme.name} tensor cut a {block}-row scale block: "
            f"quantized tensors are split along dim 0 (and sharded by FSDP2) by whole blocks of {block} rows; "
            f"with FSDP2 over N ranks, ceil(rows / N) must be a multiple of {block}")
    scheme, changes = storage.scheme, {}
    for usage, x_block in (("rowwise", scheme.rowwise_block), ("columnwise", scheme.columnwise_block)):
        data, scale = getattr(storage, f"{usage}_data"), getattr(storage, f"{usage}_scale_inv")
        columnwise = usage == "columnwise"
        if data is None or (columnwise and scheme.derivable):
            changes[f"{usage}_data"] = changes[f"{usage}_scale_inv"] = None
            continue
        transposed = columnwise and scheme.columnwise_transposed
        step = 1 if x_block.is_tensor else x_block.rows
        lo, hi = start // step, -(-stop // step)
        if transposed:
            changes[f"{usage}_data"] = data[:, start:stop]
            changes[f"{usage}_scale_inv"] = scale if x_block.is_tensor else scale[:, lo:hi]
        else:
            changes[f"{usage}_data"] = data[start:stop]
            changes[f"{usage}_scale_inv"] = scale if x_block.is_tensor else scale[lo:hi]
    return storage.replace(shape=torch.Size((stop - start, k)), **changes)


def zeros_like_rows(storage: QuantizedTensorBase, shape: torch.Size, device: Any = None) -> QuantizedTensorBase:
    """A quantized zero of `shape` with storage's scheme, usages (derivable columnwise left out) and quantizer.

    A per-tensor scale is the source's (so that a zero-padded shard carries the scale of the
    tensor it pads); block scales are 1.
    """
    scheme = storage.scheme
    columnwise = storage.has_columnwise and not scheme.derivable
    out = QuantizedTensorBase.empty(shape, scheme=scheme, nominal_dtype=storage.nominal_dtype,
                                    device=device or storage.device, rowwise=storage.has_rowwise or not columnwise,
                                    columnwise=columnwise, quantizer=storage.quantizer)
    source_scale = storage.rowwise_scale_inv if storage.has_rowwise else storage.columnwise_scale_inv
    for name, t in out.buffers().items():
        if t is None:
            continue
        if name.endswith("_data"):
            t.view(torch.uint8).zero_()
        elif scheme.rowwise_block.is_tensor:
            t.copy_(source_scale)
        elif scheme.scale is ScaleEncoding.E8M0:
            t.fill_(_E8M0_ONE)
        else:
            t.fill_(1.0)
    return out


def _dim0(self: QuantizedTensor, dim: int) -> bool:
    return _sliceable(self._qstorage) and dim in (0, -2)


def _refuse_row_split(self: QuantizedTensor, dim: int) -> None:
    """Row splits of a 2D layout this file cannot slice: an error, not a high-precision copy. FSDP2 shards a
    weight this way, and would otherwise train silently on fp32 shards of FP8 primary weights."""
    storage = self._qstorage
    if len(storage.shape) == 2 and dim in (0, -2) and not _sliceable(storage):
        raise NotImplementedError(
            f"split along dim 0 of a {storage.scheme.name} quantized tensor: row slices exist only for schemes "
            "without a block spanning all rows, a tensor-level scale or a transform. This is how FSDP2 shards "
            "parameters: FP8 primary weights (fp8_model_init) of this recipe cannot be sharded; build the model "
            "without fp8_model_init (FSDP2 then gathers high-precision weights) or dequantize() first")


@_handles(aten.split.Tensor)
def _split(self: QuantizedTensor, split_size: int, dim: int = 0) -> Any:
    _refuse_row_split(self, dim)
    if not _dim0(self, dim):
        return NotImplemented
    n = self.shape[0]
    sizes = [min(split_size, n - start) for start in range(0, n, split_size)] if split_size > 0 else [n]
    return _split_with_sizes(self, sizes or [0], 0)


@_handles(aten.split_with_sizes.default)
def _split_with_sizes(self: QuantizedTensor, split_sizes: list[int], dim: int = 0) -> Any:
    _refuse_row_split(self, dim)
    if not _dim0(self, dim) or sum(split_sizes) != self.shape[0]:
        return NotImplemented
    out, start = [], 0
    for size in split_sizes:
        out.append(QuantizedTensor.wrap(slice_rows(self._qstorage, start, start + size)))
        start += size
    return out


@_handles(aten.slice.Tensor)
def _slice(self: QuantizedTensor, dim: int = 0, start: int | None = None, end: int | None = None,
           step: int = 1) -> Any:
    if not _dim0(self, dim) or step != 1:
        return NotImplemented
    n = self.shape[0]
    lo, hi = slice(start, end).indices(n)[:2]
    return QuantizedTensor.wrap(slice_rows(self._qstorage, lo, max(lo, hi)))


@_handles(aten.new_zeros.default)
def _new_zeros(self: QuantizedTensor, size: Any, **kwargs: Any) -> Any:
    shape = torch.Size(size)
    if kwargs.get("dtype") not in (None, self.dtype) or len(shape) != 2 or not _sliceable(self._qstorage):
        return NotImplemented
    return QuantizedTensor.wrap(zeros_like_rows(self._qstorage, shape, kwargs.get("device")))


@_handles(aten.as_strided.default)
def _as_strided(self: QuantizedTensor, size: Any, stride: Any, storage_offset: int | None = None) -> Any:
    """Only the identity (FSDP2 makes its unsharded parameter with it): the same value, as an alias."""
    contiguous = torch.empty(self.shape, device="meta").stride()
    if tuple(size) != tuple(self.shape) or tuple(stride) != tuple(contiguous) or storage_offset not in (None, 0):
        return NotImplemented
    return QuantizedTensor.wrap(self._qstorage.replace())
