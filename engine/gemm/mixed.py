"""GEMMs pairing a per-tensor operand with a tile-scaled one (e.g. torchao's rowwise dgrad: per-row dy
against a per-tensor weight), on the CPU.

The per-tensor operand is read as tiles of its whole rows by the other operand's K width, each
holding its one scale; the pair then runs the tile numerics (`cpu.pow2_tiles` when both are
powers of two: exact bf16 values and one GEMM; `cpu.fp32_tiles` otherwise).
"""

from __future__ import annotations

import torch

from engine.gemm import cpu
from engine.gemm.operand import GemmOperand


def as_tiles(t: GemmOperand, like: GemmOperand) -> GemmOperand:
    """Per-tensor `t` as `rows x like.tile_cols` tiles that all carry its one scale_inv (no copy)."""
    k_tiles = -(-t.k // like.tile_cols)
    scales = t.scale_inv.reshape(1, 1).expand(1, k_tiles)
    return GemmOperand(t.data, scales, False, t.encoding, max(t.rows, 1), like.tile_cols)


def tensor_by_tiles(a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    """One per-tensor and one tile-scaled operand (either order)."""
    a, b = (as_tiles(a, b), b) if a.per_tensor else (a, as_tiles(b, a))
    impl = cpu.pow2_tiles if a.kind == b.kind == "pow2" else cpu.fp32_tiles
    return impl(a, b, out_dtype, bias)
