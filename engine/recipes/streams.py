"""Stochastic-rounding streams: the counters a recipe state owns for its quantizers that round stochastically.

Each such quantizer reads and advances an int64 `(stream, offset)` counter: the offset advances by the
elements quantized. `stream` holds `seed + gemm index` in its low 32 bits and, in its high 32 bits, a
number drawn from torch's default generator when the module builds its states (as TE's stochastic
rounding draws from torch's RNG): every module rounds with its own random stream, and
`torch.manual_seed` makes a run reproducible. The counters are scaling state: saved in the module's
`_extra_state` (`{"rng_counter": int64 [n, 2]}`) and a resumed run continues its streams exactly.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from engine.quantizers import Quantizer


def seed_streams(quantizers: Sequence[tuple[int, Quantizer | None]], seed: int,
                 device: torch.device | str | None) -> list[torch.Tensor]:
    """Give each stochastically rounding quantizer of (gemm index, quantizer) its own counter, in order: `seed +
    gemm` in the stream's low 32 bits, a draw from torch's default generator in its high bits; the counters."""
    counters, seen = [], set()
    for gemm, q in quantizers:
        if q is not None and getattr(q.rule, "stochastic_rounding", False) and id(q) not in seen:
            seen.add(id(q))
            stream = int(torch.randint(0, 2**31, (1,)).item()) << 32 | (seed + gemm) & 0xFFFFFFFF
            q.rule.rng_counter = torch.tensor([stream, 0], dtype=torch.int64, device=device)
            counters.append(q.rule.rng_counter)
    return counters


def check_counters(part: Any, where: str, rows: int | None) -> None:
    """A saved state's stochastic-rounding counters: {'rng_counter': int64 [rows, 2]} (stream, offset >= 0);
    `rows` None: any number of rows."""
    counters = part.get("rng_counter") if isinstance(part, dict) and set(part) == {"rng_counter"} else None
    shape = f"({rows}, 2)" if rows is not None else "(n, 2)"
    if not isinstance(counters, torch.Tensor) or type(counters) is not torch.Tensor or \
            counters.dtype != torch.int64 or counters.dim() != 2 or counters.shape[1] != 2 or \
            (rows is not None and counters.shape[0] != rows):
        raise ValueError(f"{where}: expected {{'rng_counter': an int64 tensor of shape {shape}}} "
                         f"(stochastic rounding's stream and offset per GEMM), got {part!r:.200}")
    if bool((counters[:, 1] < 0).any()):
        raise ValueError(f"{where}['rng_counter']: offsets must be >= 0, got {counters[:, 1].tolist()}")
