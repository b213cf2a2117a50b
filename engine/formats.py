"""Number formats used by FP8 and MX quantization.

Each format is described by its bit layout; every derived number (max, min normal,
min subnormal) is computed from that layout, so the table below is the spec and the
values follow from it. `decode` turns raw codes into values with the same rules, which
lets the tests check torch's own dtypes code by code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FloatFormat:
    """A small floating-point format: sign bit (optional), exponent bits, mantissa bits.

    `finite_only`: no inf; the all-ones exponent is used for normal numbers, except the
    codes listed as NaN (E4M3: only S.1111.111 is NaN; MX fp6/fp4: no NaN at all).
    `ieee_like`: the all-ones exponent is inf (mantissa 0) or NaN, as in IEEE 754.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    signed: bool
    ieee_like: bool
    has_nan: bool
    torch_dtype: torch.dtype | None

    @property
    def bits(self) -> int:
        return int(self.signed) + self.exponent_bits + self.mantissa_bits

    @property
    def max_exponent(self) -> int:
        """Unbiased exponent of the largest finite value ("emax" in the OCP MX spec)."""
        top = (1 << self.exponent_bits) - 1
        if self.ieee_like or (self.has_nan and self.mantissa_bits == 0):
            top -= 1  # the all-ones exponent is inf/NaN (IEEE-like) or the NaN code (E8M0)
        return top - self.bias

    @property
    def max(self) -> float:
        mantissa_codes = 1 << self.mantissa_bits
        top_mantissa = mantissa_codes - 1
        if self.has_nan and not self.ieee_like and self.mantissa_bits > 0:
            top_mantissa -= 1  # E4M3: the all-ones mantissa at the top exponent is NaN
        if self.mantissa_bits == 0:  # E8M0: pure exponent
            return 2.0**self.max_exponent
        return (1 + top_mantissa / mantissa_codes) * 2.0**self.max_exponent

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias) if self.mantissa_bits else 2.0 ** (-self.bias)

    @property
    def min_subnormal(self) -> float | None:
        if self.mantissa_bits == 0:
            return None
        return 2.0 ** (1 - self.bias - self.mantissa_bits)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Values (float64) of integer codes, by the format's rules alone."""
        c = codes.to(torch.int64)
        m_mask = (1 << self.mantissa_bits) - 1
        e_mask = (1 << self.exponent_bits) - 1
        mant = (c & m_mask).double()
        exp = (c >> self.mantissa_bits) & e_mask
        sign = ((c >> (self.exponent_bits + self.mantissa_bits)) & 1) if self.signed else torch.zeros_like(c)
        if self.mantissa_bits == 0:
            value = torch.pow(2.0, (exp - self.bias).double())
        else:
            frac = mant / (1 << self.mantissa_bits)
            normal = (1 + frac) * torch.pow(2.0, (exp - self.bias).double())
            subnormal = frac * 2.0 ** (1 - self.bias)
            value = torch.where(exp == 0, subnormal, normal)
        value = torch.where(sign == 1, -value, value)
        if self.ieee_like:
            top = exp == e_mask
            value = torch.where(top & (mant == 0), torch.where(sign == 1, -math.inf, math.inf), value)
            value = torch.where(top & (mant != 0), math.nan, value)
        elif self.has_nan:
            nan_code = (exp == e_mask) & ((c & m_mask) == m_mask)
            value = torch.where(nan_code, math.nan, value)
        return value


E4M3 = FloatFormat("E4M3", 4, 3, 7, True, False, True, torch.float8_e4m3fn)
E5M2 = FloatFormat("E5M2", 5, 2, 15, True, True, True, torch.float8_e5m2)
E8M0 = FloatFormat("E8M0", 8, 0, 127, False, False, True, torch.float8_e8m0fnu)
E2M1 = FloatFormat("E2M1", 2, 1, 1, True, False, False, None)  # torch has only the packed x2 dtype
E2M3 = FloatFormat("E2M3", 2, 3, 1, True, False, False, None)
E3M2 = FloatFormat("E3M2", 3, 2, 3, True, False, False, None)

FORMATS: dict[str, FloatFormat] = {f.name: f for f in (E4M3, E5M2, E8M0, E2M1, E2M3, E3M2)}
FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)

#: MX element formats that torch has no dtype for, by name. Their quantized data is uint8 codes
#: (`engine.ops.mx_elements`): E2M1 packed two per byte, E2M3 / E3M2 one per byte. torch's
#: `float4_e2m1fn_x2` is not used for storage: FP6 has no torch dtype either, so one uniform
#: representation (uint8 codes) serves all three; CPU ops on float4_e2m1fn_x2 are few (no
#: arithmetic, no comparison) and it is a free `.view` where a CUDA kernel wants it.
MX_ELEMENTS: dict[str, FloatFormat] = {"e2m1": E2M1, "e2m3": E2M3, "e3m2": E3M2}
_FP8_NAMES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


@dataclass(frozen=True)
class IntFormat:
    """A signed integer element: `bits` wide, symmetric codes in [-max, max] (int8: +-127; int4: +-7, and the
    code -8 that asymmetric int4 uses for its zero point's offset). torch_dtype None: packed uint8 codes."""

    name: str
    bits: int
    torch_dtype: torch.dtype | None

    @property
    def max(self) -> float:
        return float((1 << (self.bits - 1)) - 1)


INT8 = IntFormat("INT8", 8, torch.int8)
INT4 = IntFormat("INT4", 4, None)
#: integer elements (inference weights and int8 activations), by name
INT_ELEMENTS: dict[str, IntFormat] = {"int8": INT8, "int4": INT4}


def element_format(element: torch.dtype | FloatFormat, name: str = "element") -> FloatFormat:
    """The FloatFormat of a scheme element (an FP8 dtype or an MX element format); TypeError naming `name`."""
    if isinstance(element, FloatFormat):
        if element not in MX_ELEMENTS.values():
            raise TypeError(f"{name}: expected one of the MX element formats {sorted(MX_ELEMENTS)}, got {element.name}")
        return element
    if element in FP8_DTYPES:
        return format_of(element)
    raise TypeError(f"{name}: expected torch.float8_e4m3fn, torch.float8_e5m2 or one of {sorted(MX_ELEMENTS)}, "
                    f"got {element!r}")


def element_name(element: torch.dtype | FloatFormat | IntFormat) -> str:
    """"e4m3", "e5m2", "e2m1", "e2m3", "e3m2", "int8" or "int4"."""
    if isinstance(element, IntFormat):
        return element.name.lower()
    element_format(element)  # a TypeError for anything else
    return _FP8_NAMES[element] if isinstance(element, torch.dtype) else element.name.lower()


def parse_element(value: object, name: str = "element") -> torch.dtype | FloatFormat:
    """A scheme element from an FP8 dtype, an MX FloatFormat or a name ("e2m1", "e4m3", "float8_e4m3fn", ...)."""
    if isinstance(value, str):
        key = value.lower().removeprefix("torch.")
        by_name = {**MX_ELEMENTS, **{n: d for d, n in _FP8_NAMES.items()},
                   **{str(d).removeprefix("torch."): d for d in FP8_DTYPES}}
        if key in by_name:
            return by_name[key]
    elif isinstance(value, FloatFormat) and value in MX_ELEMENTS.values():
        return value
    elif isinstance(value, torch.dtype) and value in FP8_DTYPES:
        return value
    raise TypeError(f"{name}: expected one of {sorted(MX_ELEMENTS)}, 'e4m3', 'e5m2' or an FP8 torch dtype, "
                    f"got {value!r}")


def format_of(dtype: torch.dtype) -> FloatFormat:
    """The format behind an FP8 torch dtype."""
    for fmt in FORMATS.values():
        if fmt.torch_dtype == dtype:
            return fmt
    raise TypeError(f"dtype: expected one of {[str(f.torch_dtype) for f in FORMATS.values() if f.torch_dtype]}, got {dtype}")


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 element dtype (E4M3: 448, E5M2: 57344)."""
    if dtype not in FP8_DTYPES:
        raise TypeError(f"fp8_dtype: expected torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    return format_of(dtype).max


def format_table() -> str:
    """A plain-text table of every format, for `python -m engine formats`."""
    header = ("format", "bits", "exp", "mant", "bias", "max", "min normal", "min subnormal", "torch dtype")
    rows = [header]
    for f in FORMATS.values():
        sub = f.min_subnormal
        rows.append((
            f.name, str(f.bits), str(f.exponent_bits), str(f.mantissa_bits), str(f.bias),
            f"{f.max:g}", f"{f.min_normal:g}", "-" if sub is None else f"{sub:g}",
            str(f.torch_dtype).replace("torch.", "") if f.torch_dtype else "-",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
