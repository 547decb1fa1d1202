"""Argument checks shared by every public constructor, and public for code built on the library
(the recipes use them for their own options).

Each check raises ``ValueError`` naming the argument, the bad value and what is allowed, so a
misconfiguration fails at construction time rather than several epochs into a run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, TypeVar

T = TypeVar("T")


def check_range(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    *,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
) -> float:
    """Return ``value`` as a float if it is a finite real number inside the given interval."""
    interval = (
        ("[" if low_inclusive else "(")
        + ("-inf" if low is None else f"{low:g}")
        + ", "
        + ("inf" if high is None else f"{high:g}")
        + ("]" if high_inclusive else ")")
    )
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite number in {interval}, got {value!r}")
    too_low = low is not None and (value < low if low_inclusive else value <= low)
    too_high = high is not None and (value > high if high_inclusive else value >= high)
    if too_low or too_high:
        raise ValueError(f"`{name}` must be in {interval}, got {value!r}")
    return float(value)


def check_int(name: str, value: Any, low: int, high: int | None = None) -> int:
    """Return ``value`` if it is an integer in ``[low, high]`` (``high=None``: no upper bound)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"`{name}` must be an integer {allowed}, got {value!r}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """Return ``value`` if it is ``True`` or ``False`` (not a truthy string such as ``"no"``)."""
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False, got {value!r}")
    return value


def check_timeout(name: str, value: Any) -> timedelta:
    """A collective timeout as a ``timedelta``: ``value`` itself, or seconds (> 0) as configs write it."""
    if isinstance(value, timedelta):
        if value <= timedelta(0):
            raise ValueError(f"`{name}` must be positive, got {value!r}")
        return value
    return timedelta(seconds=check_range(name, value, 0.0, None, low_inclusive=False))


def check_choice(name: str, value: T, choices: Iterable[T]) -> T:
    """Return ``value`` if it is one of ``choices``."""
    options = list(choices)
    if value not in options:
        raise ValueError(f"`{name}` must be one of {options}, got {value!r}")
    return value
