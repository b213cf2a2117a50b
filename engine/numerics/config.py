"""InspectConfig: what `engine.inspect` records, how often, and where it writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, field_validator

from engine.recipes import Recipe


class InspectConfig(BaseModel):
    """Frozen settings of one inspector.

    every:    record every N-th step (a step is one forward of the inspected model: steps 0, N, 2N, ...)
    out:      a directory for `records.jsonl` and `records.csv` (None: keep the records in memory only)
    what_if:  another recipe whose statistics are recorded next to the training recipe's (None: none)
    group:    the ranks a step's numbers are reduced over under torch.distributed (None: the world)
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    every: int = 1
    out: Path | None = None
    what_if: Recipe | None = None
    group: dist.ProcessGroup | None = None

    @field_validator("group", mode="before")
    @classmethod
    def _group(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, dist.ProcessGroup):
            raise ValueError(f"group: expected a torch.distributed.ProcessGroup or None, got {type(value).__name__}")
        return value

    @field_validator("every", mode="before")
    @classmethod
    def _every(cls, value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"every: expected an int >= 1, got {value!r}")
        return value

    @field_validator("out", mode="before")
    @classmethod
    def _out(cls, value: Any) -> Path | None:
        if value is not None and not isinstance(value, (str, Path)):
            raise ValueError(f"out: expected a directory (str or pathlib.Path) or None, got {type(value).__name__}")
        return None if value is None else Path(value)

    @field_validator("what_if", mode="before")
    @classmethod
    def _what_if(cls, value: Any) -> Recipe | None:
        if value is not None and not isinstance(value, Recipe):
            raise ValueError(f"what_if: expected an engine.recipes.Recipe or None, got {type(value).__name__}")
        return value
