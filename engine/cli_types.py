"""argparse types for the numbers the commands take: a bad value is refused by argparse, naming the flag."""

from __future__ import annotations

import argparse
import math
from typing import Callable


def whole_number(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """A type for a whole number >= minimum (and < maximum, if given)."""

    def parse(text: str) -> int:
        try:
            value: int | None = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value >= maximum):
            bound = f" and < {maximum}" if maximum is not None else ""
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}{bound}, got {text!r}")
        return value

    parse.__name__ = f"whole_number_from_{minimum}"
    return parse


def finite_positive(text: str) -> float:
    """A type for a finite number > 0 (a learning rate: inf or nan would train to NaN)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value
