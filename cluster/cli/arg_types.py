"""Bounded argparse types for the commands' numeric options: one home for the rule, so that
every command refuses an out-of-range value the same way (argparse exits 2 with
"argument --X: must be ...") before it starts anything."""
from __future__ import annotations

import argparse
import math


def number_in(low: float | None = None, high: float | None = None, *,
              low_open: bool = False, high_open: bool = False):
    """A finite float within [low, high] (an open end excludes its bound; None: no bound)."""
    left, right = "(" if low_open else "[", ")" if high_open else "]"
    lo = "-inf" if low is None else f"{low:g}"
    hi = "inf" if high is None else f"{high:g}"
    span = f"{left}{lo}, {hi}{right}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"a number, got {text!r}") from None
        below = low is not None and (value <= low if low_open else value < low)
        above = high is not None and (value >= high if high_open else value > high)
        if not math.isfinite(value) or below or above:
            raise argparse.ArgumentTypeError(f"must be a finite number in {span}, got {text}")
        return value
    parse.__name__ = "float"  # argparse names the type in "invalid float value" messages
    return parse


def whole_in(low: int, high: int | None = None):
    """A whole number from `low` (to `high`)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"a whole number, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(
                f"must be at least {low}" + (f" and at most {high}" if high is not None else "")
                + f", got {text}")
        return value
    parse.__name__ = "int"
    return parse
