"""How an optimizer state is stored: `StateFormat`, and its plain-PyTorch reference encode / decode.

Every state is a tensor of its parameter's shape plus, for the blocked formats, one scale per block of the
flattened tensor (blocks of consecutive elements; the last may be partial):

| name | storage | bytes / element | rounding |
|---|---|---|---|
| `fp32` | float32 | 4 | - |
| `bf16` | bfloat16 | 2 | nearest even |
| `bf16_sr` | bfloat16 | 2 | stochastic (8 random bits, `engine.ops.nvfp4_sr.random_bits`) |
| `fp8` / `fp8_e4m3` | float8_e4m3fn, fp32 scale per 1x128 block | 1.03125 | engine's `block1d_e4m3` scheme |
| `fp8_e5m2` | float8_e5m2, fp32 scale per 1x128 block | 1.03125 | engine's `block1d_e5m2` scheme |
| `fp8_mx` | float8_e4m3fn, E8M0 scale per 32 elements | 1.03125 | engine's `mx_e4m3` scheme |
| `int8` | uint8 code of a 256-entry map, fp32 absmax per 256 | 1.015625 | nearest code (`dynamic_map`) |

FP8 reuses `engine.ops.reference.quantize_blocked` / `dequantize_blocked` on the flattened tensor (no new
format code). The second moment of Adam is stored as sqrt(v) in the FP8 and int8 formats (`sqrt_second_moment`,
on by default): see `dynamic_map` for why.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import torch

from engine.ops import reference
from engine.ops.nvfp4_sr import random_bits
from engine.optim import dynamic_map
from engine.schemes import SCHEMES, Scheme

Kind = Literal["fp32", "bf16", "fp8", "int8"]
INT8_BLOCK = 256


@dataclasses.dataclass(frozen=True)
class StateFormat:
    """One state's storage. `kind` fp32 | bf16 | fp8 | int8; `stochastic` (bf16): stochastic rounding;
    `scheme` (fp8): an engine scheme name of 1-row blocks (block1d_e4m3, block1d_e5m2, mx_e4m3, mx_e5m2);
    `sqrt_second_moment` (fp8, int8): Adam's exp_avg_sq is stored as its square root."""

    kind: Kind = "fp32"
    stochastic: bool = False
    scheme: str = "block1d_e4m3"
    sqrt_second_moment: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("fp32", "bf16", "fp8", "int8"):
            raise ValueError(f"kind: expected one of fp32, bf16, fp8, int8, got {self.kind!r}")
        if self.stochastic and self.kind != "bf16":
            raise ValueError(f"stochastic: only bf16 states round stochastically, got kind={self.kind!r}")
        if self.kind == "fp8" and self.scheme not in FP8_SCHEMES:
            raise ValueError(f"scheme: expected one of {sorted(FP8_SCHEMES)} for fp8 states, got {self.scheme!r}")

    @property
    def name(self) -> str:
        if self.kind == "bf16":
            return "bf16_sr" if self.stochastic else "bf16"
        base = {"fp8": f"fp8:{self.scheme}", "int8": "int8", "fp32": "fp32"}[self.kind]
        return base if self.kind == "fp32" or self.sqrt_second_moment else base + ":plain_v"

    @property
    def blocked(self) -> bool:
        return self.kind in ("fp8", "int8")

    def stores_sqrt(self, second_moment: bool) -> bool:
        return second_moment and self.blocked and self.sqrt_second_moment

    @property
    def block(self) -> int:
        if self.kind == "int8":
            return INT8_BLOCK
        return self.fp8_scheme.stored_block(False).cols if self.kind == "fp8" else 0

    @property
    def fp8_scheme(self) -> Scheme:
        return SCHEMES[self.scheme]

    def bytes_per_element(self) -> float:
        per = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0}[self.kind]
        if self.kind == "int8":
            per += 4.0 / INT8_BLOCK
        elif self.kind == "fp8":
            per += (1.0 if self.fp8_scheme.name.startswith("mx") else 4.0) / self.block
        return per


FP8_SCHEMES = ("block1d_e4m3", "block1d_e5m2", "mx_e4m3", "mx_e5m2")
NAMES: dict[str, StateFormat] = {
    "fp32": StateFormat("fp32"),
    "bf16": StateFormat("bf16"),
    "bf16_sr": StateFormat("bf16", stochastic=True),
    "fp8": StateFormat("fp8"),
    "fp8_e4m3": StateFormat("fp8"),
    "fp8_e5m2": StateFormat("fp8", scheme="block1d_e5m2"),
    "fp8_mx": StateFormat("fp8", scheme="mx_e4m3"),
    "int8": StateFormat("int8"),
}


def parse(value: str | StateFormat, what: str = "state_dtype") -> StateFormat:
    """A StateFormat from itself, a short name of NAMES or its `name`."""
    if isinstance(value, StateFormat):
        return value
    if isinstance(value, str):
        if value in NAMES:
            return NAMES[value]
        kind, _, rest = value.partition(":")
        scheme, _, plain = rest.partition(":")
        if kind == "fp8" and scheme in FP8_SCHEMES and plain in ("", "plain_v"):
            return StateFormat("fp8", scheme=scheme, sqrt_second_moment=not plain)
        if value == "int8:plain_v":
            return StateFormat("int8", sqrt_second_moment=False)
        raise ValueError(f"{what}: expected one of {', '.join(NAMES)} (or a StateFormat), got {value!r}")
    raise TypeError(f"{what}: expected a str or StateFormat, got {type(value).__name__}")


@functools.cache
def storage_dtype(fmt: StateFormat) -> torch.dtype:
    """The dtype of a state's data in `fmt` (what `encode` returns)."""
    if fmt.kind == "fp8":
        return encode(fmt, torch.zeros(1))[0].dtype
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}[fmt.kind]


# ------------------------------------------------------------------------------------------ reference
def _blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    """[n] -> [ceil(n / block), block], zero padded."""
    n = flat.numel()
    rows = -(-n // block)
    return torch.nn.functional.pad(flat, (0, rows * block - n)).reshape(rows, block)


def encode(fmt: StateFormat, x: torch.Tensor, counter: torch.Tensor | None = None, *,
           signed: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 `x` in `fmt`: (data of x's shape, scales per block or None). `counter` = the (seed, offset) of
    stochastic rounding (advanced by the caller); `signed` = False for values known >= 0 (sqrt(v), v)."""
    if fmt.kind in ("fp32", "bf16"):
        x = canonical_nan(x)
    if fmt.kind == "fp32":
        return x, None
    if fmt.kind == "bf16":
        if not fmt.stochastic:
            return to_bf16(x), None
        return round_bf16_stochastic(x, random_bits(tuple(x.shape), counter)), None
    flat = x.reshape(-1)
    if fmt.kind == "fp8":
        data, scale_inv = reference.quantize_blocked(flat.reshape(1, -1), fmt.fp8_scheme)
        return data.reshape(x.shape), scale_inv.reshape(-1)
    blocks = _blocks(flat, INT8_BLOCK)
    absmax = blocks.abs().amax(dim=1)
    normed = blocks / torch.where(absmax == 0, 1.0, absmax)[:, None]  # a true division, as the kernel
    codes = torch.bucketize(normed, dynamic_map.midpoints(signed), right=False)  # nearest, a tie down; NaN: 255
    return codes.to(torch.uint8).reshape(-1)[: flat.numel()].reshape(x.shape), absmax


def decode(fmt: StateFormat, data: torch.Tensor, scale: torch.Tensor | None, *, signed: bool = True) -> torch.Tensor:
    """The fp32 value of a stored state."""
    if fmt.kind in ("fp32", "bf16"):
        return data.float()
    if fmt.kind == "fp8":
        return reference.dequantize_blocked(data.reshape(1, -1), scale.reshape(1, -1), fmt.fp8_scheme,
                                            shape=torch.Size([1, data.numel()])).reshape(data.shape)
    codes = (dynamic_map.signed_codes() if signed else dynamic_map.unsigned_codes())[data.reshape(-1).long()]
    flat = (_blocks(codes, INT8_BLOCK) * scale[:, None]).reshape(-1)[: data.numel()]
    return flat.reshape(data.shape)


def canonical_nan(x: torch.Tensor) -> torch.Tensor:
    """x with every NaN the quiet NaN 0x7FC00000 (an arithmetic NaN's sign and payload depend on the operand
    order an instruction set picks; stored fp32 / bf16 values and updated weights hold this one)."""
    return torch.where(x.isnan(), torch.full_like(x, float("nan")), x)


def to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 rounding to nearest even, every NaN the quiet NaN 0x7FC0 (torch's vectorised CPU conversion
    writes NaN as 0xFFFF)."""
    bits = x.to(torch.bfloat16).view(torch.int16)
    return torch.where(x.isnan(), torch.tensor(0x7FC0, dtype=torch.int16), bits).view(torch.bfloat16)


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root (torch's CPU sqrt may be an ulp off, and differs by instruction
    set): in float64 then rounded once, which for an fp32 input is exact IEEE sqrt (53 >= 2 * 24 + 2 bits)."""
    return x.double().sqrt().float()


def round_bf16_stochastic(x: torch.Tensor, rbits: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, rounding away from zero with probability (dropped 16 bits) / 2^16, to 1/256 ulp: the 8
    random bits `rbits` go into bits 8..15 of x's fp32 pattern before truncation. NaN stays NaN (quiet),
    inf stays inf; a finite value may round up to inf only from above bf16's max."""
    bits = x.float().view(torch.int32)
    bumped = bits + (rbits.to(torch.int32) << 8)
    out = (bumped >> 16).to(torch.int16).view(torch.bfloat16)
    return torch.where(x.isnan(), to_bf16(x), out)
