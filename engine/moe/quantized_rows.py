"""Rows of a row-quantized tensor moved with their scales: what `permute` does to FP8 / MX / NVFP4 tokens.

A token's rowwise data and its scales (one per row, or per 1 x block of the row) belong to that row alone, so
gathering rows gathers the data rows and the scale rows, bit for bit, with no dequantize and no requantize. A
scale shared by the whole tensor (per-tensor FP8) or a tensor-level amax (NVFP4) stays as it is. The columnwise
copy mixes tokens in its blocks (or is a transform of them), so the result holds the rowwise usage only.
"""

from __future__ import annotations

import torch

from engine.tensors import QuantizedTensor, QuantizedTensorBase

__all__ = ["gather_quantized_rows", "row_local"]


def row_local(storage: QuantizedTensorBase) -> bool:
    """Whether each row's rowwise scales are its own or one per tensor (rows can move without their neighbours)."""
    block = storage.scheme.rowwise_block
    return block.is_tensor or block.rows == 1


def gather_quantized_rows(tokens: QuantizedTensor | QuantizedTensorBase, rows: torch.Tensor
                          ) -> QuantizedTensor | QuantizedTensorBase:
    """tokens[rows] of a 2D quantized tensor (or storage), as the same kind, holding its rowwise usage."""
    storage = tokens.qstorage if isinstance(tokens, QuantizedTensor) else tokens
    name = storage.scheme.name
    if len(storage.shape) != 2:
        raise ValueError(f"tokens: expected a 2D [tokens, hidden] quantized tensor, got shape {tuple(storage.shape)}; "
                         "reshape(-1, hidden) it first")
    if storage.rowwise_data is None:
        raise ValueError(f"tokens: this {name} tensor holds no rowwise data (rows cannot move without it); quantize "
                         "the tokens with rowwise usage (quantizer.set_usage(rowwise=True))")
    if not row_local(storage):
        block = storage.scheme.rowwise_block
        raise ValueError(f"tokens: {name} scales span {block.rows} rows, so rows cannot move with their scales; "
                         "quantize tokens with a per-row or 1 x block scheme (MXFP8, block 1x128, rowwise, "
                         "per-tensor), or dequantize() them first")
    scale = storage.rowwise_scale_inv
    if not storage.scheme.rowwise_block.is_tensor:
        scale = scale.index_select(0, rows)
    changes = {"columnwise_data": None, "columnwise_scale_inv": None}
    if storage.scheme.tensor_scale:
        changes["amax_columnwise"] = None
    moved = storage.replace(shape=torch.Size((rows.numel(), storage.shape[1])),
                            rowwise_data=storage.rowwise_data.index_select(0, rows), rowwise_scale_inv=scale, **changes)
    return QuantizedTensor.wrap(moved) if isinstance(tokens, QuantizedTensor) else moved
