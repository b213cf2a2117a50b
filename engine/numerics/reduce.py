"""A step's records made final: their sums added over the ranks of a process group (data or FSDP2 parallel
training: each rank saw its own tokens), then turned into the statistics a record shows.

Every rank holds the same records in the same order (the same model and steps), so three all-reduces (sum, max,
min) serve a whole step; ranks that disagree on the count are a RuntimeError, not a hang later. A wgrad reduced
this way compares each rank's own GEMM with its own reference (sums of squares over the ranks), before the
gradients are averaged.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from engine.collectives import group_size
from engine.numerics.stats import MAXES, MINS, SUMS, error_of, operand_stats

#: below this ratio of gradient norm to quantization noise quantized training stops helping (arXiv 2505.19115)
NOISE_THRESHOLD = math.sqrt(3.0)

Record = dict[str, Any]


def reduce_sums(records: list[Record], group: dist.ProcessGroup | None) -> None:
    """Replace each record's `sums` by their sum (max, min) over the ranks of `group`, in place (one rank: as is)."""
    if group_size(group) <= 1:
        return
    count = torch.tensor([len(records), -len(records)], dtype=torch.float64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    if count[0] != -count[1]:
        raise RuntimeError(f"engine.inspect: the ranks recorded different numbers of records this step (from "
                           f"{int(-count[1])} to {int(count[0])}); every rank must run the same layers")
    if not records:
        return
    table = {keys: torch.tensor([[float(r["sums"].get(k, fill)) for k in keys] for r in records], dtype=torch.float64)
             for keys, fill in ((SUMS, 0.0), (MAXES, -math.inf), (MINS, math.inf))}
    table[MINS] = -table[MINS]  # min as a max of negatives: two ops, three tensors
    dist.all_reduce(table[SUMS], op=dist.ReduceOp.SUM, group=group)
    both = torch.cat([table[MAXES], table[MINS]], dim=1)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    table[MAXES], table[MINS] = both[:, :len(MAXES)], -both[:, len(MAXES):]
    for i, record in enumerate(records):
        record["sums"] = {k: float(table[keys][i, j]) for keys in (SUMS, MAXES, MINS) for j, k in enumerate(keys)}


def finish(record: Record) -> Record:
    """The record as written: its statistics in place of its sums."""
    out = {k: v for k, v in record.items() if k != "sums"}
    sums = record["sums"]
    if record["kind"] == "operand":
        out.update(operand_stats(sums))
        return out
    error = error_of(sums)
    out["rel_error"] = error
    if record["gemm"] == "wgrad":  # the gradient norm over the quantization noise in it: 1 / the relative error
        ratio = math.inf if error == 0 else 1.0 / error
        out.update(grad_noise_ratio=ratio, below_threshold=ratio < NOISE_THRESHOLD)
    return out
