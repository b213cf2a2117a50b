"""The inspector's files: one JSON line per record (`records.jsonl`) and the same rows as CSV (`records.csv`),
appended step by step. Non-finite numbers are written as the strings "inf", "-inf", "nan" (JSON has none)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

#: the CSV's columns, in order (a record's other keys go to the JSON lines only)
COLUMNS = (
    "step", "layer", "source", "recipe", "kind", "operand", "usage", "gemm", "scheme", "numel", "amax",
    "scale_min", "scale_max", "underflow_pct", "saturation_pct", "sqnr_db", "mse", "zero_scale_pct",
    "subnormal_scale_pct", "saturated_scale_pct", "rel_error", "grad_noise_ratio", "below_threshold",
)


def plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


class RecordWriter:
    """Appends records to DIR/records.jsonl and DIR/records.csv (the header once, when the CSV is new)."""

    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.jsonl, self.csv = out / "records.jsonl", out / "records.csv"

    def write(self, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        with self.jsonl.open("a", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps({k: plain(v) for k, v in record.items()}) + "\n")
        new = not self.csv.exists()
        with self.csv.open("a", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
            if new:
                writer.writeheader()
            writer.writerows({k: plain(v) for k, v in r.items()} for r in records)
