"""WeightFormat: what one inference config makes of a Linear weight, and the GEMM that reads it.

A `quantize_`d weight is a storage of the format's scheme (`engine.tensors.QuantizedTensorBase`: the weight's
[N, K] shape, rowwise buffers only, as inference never reads W^T), the one storage type training uses; it is
the source of truth: dequantize, checks, save and load go through it. What a format adds to its scheme:

* `quantize(w)`: the storage of a weight (the scheme's reference, or an engine quantizer).
* `to_parts(st)` / `from_parts(parts, shape, dtype)`: the checkpoint's plain tensors (its "parts", named as
  the saved keys' suffixes: `engine.inference.saving`) and back. The parts are the layout the GEMM reads
  (int4: N padded to 16 and K to the group, scale and zero as [K/g, N16, 2]), and `from_parts` makes the
  storage's buffers views of them, so the two share their memory.
* `prepare(parts)`: the tensors the GEMM reads ("operands"), made once: the parts, or a kernel's own copy
  where it has one (int8 dynamic: oneDNN's prepacked weight, kept next to the storage).
* `linear(x, operands, shape, bias)`: y[M, N] = x[M, K] @ W^T (+ bias).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from engine.schemes import Scheme
from engine.tensors.storage import QuantizedTensorBase

PartSpecs = dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]]


def check_scales(t: torch.Tensor, part: str, what: str = "scales", *, positive: bool = True) -> None:
    """ValueError naming `part` unless every value of t is finite (and > 0 if `positive`); checked at load (syncs)."""
    tf = t.float()
    bad = ~(torch.isfinite(tf) & (tf > 0)) if positive else ~torch.isfinite(tf)
    if bool(bad.any()):
        raise ValueError(f"{part}: expected finite {what}{' > 0' if positive else ''}, got {tf[bad][:4].tolist()} "
                         f"({int(bad.sum())} of {t.numel()})")


def rowwise(scheme: Scheme, shape: tuple[int, int], dtype: torch.dtype,
            buffers: dict[str, torch.Tensor]) -> QuantizedTensorBase:
    """A storage of `scheme` holding the rowwise `buffers` of an [N, K] weight (checked by the constructor)."""
    return QuantizedTensorBase(scheme=scheme, shape=torch.Size(shape), nominal_dtype=dtype, **buffers)


class WeightFormat(ABC):
    """One config's weight: its scheme, its storage, its checkpoint parts and its GEMM (see the module docstring)."""

    #: the part each storage field is saved as (what error messages of the storage's checks are renamed to)
    PARTS: ClassVar[dict[str, str]] = {"rowwise_data": "data", "rowwise_scale_inv": "scale_inv",
                                       "amax_rowwise": "amax"}

    @abstractmethod
    def quantize(self, w: torch.Tensor) -> QuantizedTensorBase:
        """The storage of a weight [N, K]."""

    @abstractmethod
    def to_parts(self, st: QuantizedTensorBase) -> dict[str, torch.Tensor]:
        """The storage as a checkpoint holds it (and as the GEMM reads it, unless `prepare` makes its own)."""

    @abstractmethod
    def part_specs(self, shape: tuple[int, int]) -> PartSpecs:
        """Each part's shape and the dtypes it may have, for a weight of `shape` (what a checkpoint is checked by)."""

    @abstractmethod
    def from_parts(self, parts: dict[str, torch.Tensor], shape: tuple[int, int],
                   dtype: torch.dtype) -> QuantizedTensorBase:
        """The storage whose buffers are views of `parts` (`to_parts` undone)."""

    def check(self, st: QuantizedTensorBase, parts: dict[str, torch.Tensor]) -> None:
        """At load: the storage's checks of its scales (`QuantizedTensorBase.check_values`), as ValueErrors naming
        the part they came from."""
        try:
            st.check_values()
        except ValueError as err:
            field, _, rest = str(err).partition(": ")
            raise ValueError(f"{self.PARTS.get(field, field)}: {rest}") from None

    def prepare(self, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The operands the GEMM reads: the parts themselves unless the kernel keeps its own layout."""
        return dict(parts)

    def held(self, st: QuantizedTensorBase, operands: dict[str, torch.Tensor]) -> QuantizedTensorBase:
        """What the weight keeps of its storage next to `operands`: all of it, unless a kernel's own copy holds the
        same values (then that buffer is left out and `restored` from the copy when asked: no memory twice)."""
        return st

    def restored(self, st: QuantizedTensorBase, operands: dict[str, torch.Tensor]) -> QuantizedTensorBase:
        """The whole storage from what `held` kept and the operands."""
        return st

    @abstractmethod
    def linear(self, x: torch.Tensor, ops: dict[str, torch.Tensor], shape: tuple[int, int],
               bias: torch.Tensor | None) -> torch.Tensor:
        """y[M, N] = x[M, K] @ W^T (+ bias) on the operands `prepare` made."""
