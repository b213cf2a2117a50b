"""NVFP4BlockScaling: Transformer Engine's NVFP4 training recipe (E2M1 per 16, E4M3 block scales, fp32 amax).

As TE 2.x sets it up (`common/recipe/__init__.py`): weights in 16x16 tiles (both usages from one
quantization, so the forward and dgrad weights agree); inputs and output gradients in 1x16 blocks
with the 16-point random Hadamard transform on their columnwise (wgrad) usage; output gradients
stochastically rounded. Each switch turns one of these off, with TE's names and defaults (TE reads
its defaults from NVTE_NVFP4_DISABLE_* environment variables; here they are plain fields).

Stochastic rounding draws from a counter owned by the module's backward recipe state: `(stream,
offset)`, the offset advancing by the elements quantized. `stream` holds `seed + gemm index` in its
low 32 bits and, in its high 32 bits, a number drawn from torch's default generator when the module
builds its states (as TE's stochastic rounding draws from torch's RNG): every module rounds with its
own random stream, and `torch.manual_seed` makes a run reproducible. The counters are scaling state:
they are saved in the module's `_extra_state` and a resumed run continues its streams exactly.
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import torch

from pydantic import field_validator

from engine.quantizers import Quantizer
from engine.recipes.base import SLOTS_PER_GEMM, Recipe, RecipeState
from engine.recipes.format import Format, StreamSeed, fixed_format
from engine.recipes.operands import BACKWARD_ROLES, FORWARD_ROLES, OPERANDS, Operand, QuantizerSpec, Role


class NVFP4BlockScaling(Recipe):
    """NVFP4 for every GEMM operand; `disable_rht`, `disable_stochastic_rounding`, `disable_2d_quantization`
    as TE's (all False by default); `seed` for the stochastic rounding of gradients."""

    name: ClassVar[str] = "nvfp4"

    fp8_format: Format = Format.E4M3  # the block scales' format (TE's fp8_format); the elements are E2M1
    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    seed: StreamSeed = 0  # the low 32 bits of every stochastic-rounding stream (plus the GEMM index): 0 <= seed < 2**32

    @field_validator("fp8_format", mode="after")
    @classmethod
    def _scales_are_e4m3(cls, value: Format) -> Format:
        return fixed_format(value, Format.E4M3, cls.__name__, "quantizes every operand, forward and backward, to "
                            "E2M1 elements with E4M3 block scales (as Transformer Engine's NVFP4 recipe does)")

    def element_for(self, role: Role) -> str:
        return "e2m1"

    def operands(self) -> dict[Operand, QuantizerSpec | None]:
        def spec(rht: bool = False, **params: bool) -> QuantizerSpec:
            return QuantizerSpec(scheme="nvfp4_rht_e2m1" if rht else "nvfp4_e2m1", rule="nvfp4", params=params)

        by_role = {
            Role.INPUT: spec(rht=not self.disable_rht),
            Role.WEIGHT: spec(with_2d_quantization=not self.disable_2d_quantization),
            Role.GRAD_OUTPUT: spec(rht=not self.disable_rht, stochastic_rounding=not self.disable_stochastic_rounding),
        }
        return {op: by_role[op[1]] for op in OPERANDS}

    def make_state(
        self, *, forward: bool, num_gemms: int = 1, device: torch.device | str | None = None,
        module: str = "", gemm_names: Sequence[str] = (),
    ) -> RecipeState:
        base = super().make_state(forward=forward, num_gemms=num_gemms, device=device)
        state = NVFP4State(self, forward, num_gemms, base._quantizers)
        state.rng_counters = seed_streams([(gemm, state.quantizer(role, gemm)) for gemm in range(num_gemms)
                                           for role in (FORWARD_ROLES if forward else BACKWARD_ROLES)],
                                          self.seed, device)
        return state

    def check_saved_state(self, part: Any, where: str, slots: int) -> None:
        """None, or a backward state's stochastic-rounding counters: int64 [gemms, 2] (stream, offset >= 0)."""
        if part is not None:
            check_counters(part, where, slots // SLOTS_PER_GEMM[False])


def seed_streams(quantizers: Sequence[tuple[int, Quantizer | None]], seed: int,
                 device: torch.device | str | None) -> list[torch.Tensor]:
    """Give each stochastically rounding quantizer of (gemm index, quantizer) its own counter, in order: `seed +
    gemm` in the stream's low 32 bits, a draw from torch's default generator in its high bits; the counters."""
    counters = []
    for gemm, q in quantizers:
        if q is not None and getattr(q.rule, "stochastic_rounding", False):
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


class NVFP4State(RecipeState):
    """An NVFP4 recipe state: the quantizers, and the stochastic-rounding counters they advance (saved)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rng_counters: list[torch.Tensor] = []

    def to_plain(self) -> dict[str, torch.Tensor] | None:
        if not self.rng_counters:
            return None
        return {"rng_counter": torch.stack([c.detach().cpu() for c in self.rng_counters])}

    def load_plain(self, part: dict[str, torch.Tensor]) -> None:
        """A checked saved state: each GEMM's counter continues where the saved one stopped."""
        for counter, saved in zip(self.rng_counters, part["rng_counter"]):
            counter.copy_(saved)

    def carry_from(self, old: RecipeState) -> None:
        if isinstance(old, NVFP4State) and len(old.rng_counters) == len(self.rng_counters):
            for counter, before in zip(self.rng_counters, old.rng_counters):
                counter.copy_(before)
