"""The planner's one error: input it cannot use, reported as one line, exit 2."""

from __future__ import annotations

import math
from typing import Any

from mpisgd.errors import UsageError


class PlanError(UsageError):
    """Input the planner cannot use: reported as one line, exit 2."""


def number(value: Any, what: str, *, positive: bool = False, whole: bool = False) -> float:
    """``value`` as a finite float (>= 0, or > 0 with ``positive``; a whole number with ``whole``), else
    PlanError naming ``what`` (a key a description lacks: ``what`` is missing)."""
    if value is None:
        raise PlanError(f"{what} is missing")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PlanError(f"{what} is {value!r}, not a number")
    try:
        x = float(value)
    except OverflowError:  # an int beyond float's range
        raise PlanError(f"{what} is too large ({str(value)[:20]}...)") from None
    if not math.isfinite(x) or x < 0 or (positive and x == 0):
        raise PlanError(f"{what} is {value!r}: it must be a finite number {'> 0' if positive else '>= 0'}")
    if whole and x != int(x):
        raise PlanError(f"{what} is {value!r}: it must be a whole number")
    return x
