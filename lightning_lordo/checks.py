"""Checks of one value each, whose error names the argument, the value given, what is allowed and the fix
(``ValueError``; nothing is clamped)."""

from __future__ import annotations

import math
from numbers import Real
from typing import Any


def fail(name: str, value: Any, allowed: str, fix: str) -> ValueError:
    """The error for ``name=value``: what is allowed, and how to fix it."""
    return ValueError(f"Invalid {name}={value!r}: {allowed}. {fix}")


def is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def check_unit_interval(name: str, value: Any, *, closed_right: bool) -> float:  # [0, 1], or [0, 1)
    right = "]" if closed_right else ")"
    ok = is_number(value) and 0.0 <= value and (value <= 1.0 if closed_right else value < 1.0)
    if not ok:
        raise fail(name, value, f"it must be a number in [0, 1{right}", f"Pass e.g. {name}=0.9.")
    return float(value)


def check_positive(name: str, value: Any, *, allow_zero: bool = False) -> float:
    ok = is_number(value) and math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise fail(name, value, f"it must be a finite number {bound}", f"Pass a value {bound}.")
    return float(value)


def check_positive_int(name: str, value: Any, *, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise fail(name, value, f"it must be an integer >= {minimum}", f"Pass e.g. {name}={max(minimum, 1)}.")
    return value


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise fail(name, value, f"allowed values are {', '.join(map(repr, choices))}", "Pick one of them.")
    return value
