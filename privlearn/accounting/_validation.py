"""Input validation shared by the public boundary of :mod:`privlearn.accounting`.

Every check raises :class:`ValueError` (or :class:`TypeError` for wrong types) whose
message names the parameter, its valid range and the value received.
"""

from __future__ import annotations

import math
import numbers
from enum import Enum
from typing import TypeVar

E = TypeVar("E", bound=Enum)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_real(name: str, value: object) -> float:
    if not _is_real(value):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    return float(value)  # type: ignore[arg-type]


def check_positive(name: str, value: object, *, allow_inf: bool = False) -> float:
    """A finite (or, if ``allow_inf``, possibly infinite) number > 0."""
    x = check_real(name, value)
    rng = "(0, inf]" if allow_inf else "(0, inf) and finite"
    if math.isnan(x) or x <= 0 or (math.isinf(x) and not allow_inf):
        raise ValueError(f"{name} must be in {rng}, got {value!r}")
    return x


def check_nonnegative(name: str, value: object, *, allow_inf: bool = False) -> float:
    x = check_real(name, value)
    rng = "[0, inf]" if allow_inf else "[0, inf) and finite"
    if math.isnan(x) or x < 0 or (math.isinf(x) and not allow_inf):
        raise ValueError(f"{name} must be in {rng}, got {value!r}")
    return x


def check_delta(name: str, value: object, *, allow_one: bool = False) -> float:
    """A privacy parameter delta in [0, 1) (or [0, 1] with ``allow_one``)."""
    x = check_real(name, value)
    if math.isnan(x) or not (0.0 <= x < 1.0 or (allow_one and x == 1.0)):
        rng = "[0, 1]" if allow_one else "[0, 1)"
        raise ValueError(f"{name} must be in {rng}, got {value!r}")
    return x


def check_epsilon(name: str, value: object) -> float:
    """A privacy parameter epsilon in [0, inf)."""
    return check_nonnegative(name, value)


def check_rate(name: str, value: object) -> float:
    """A sampling rate in (0, 1]."""
    x = check_real(name, value)
    if math.isnan(x) or not 0.0 < x <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return x


def check_probability_open(name: str, value: object) -> float:
    """A probability in [0, 1] (callers narrow the range, e.g. randomized response)."""
    x = check_real(name, value)
    if math.isnan(x) or not 0.0 <= x <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return x


def check_count(name: str, value: object, *, minimum: int = 0) -> int:
    """A non-negative integer count (steps, number of compositions)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if _is_real(value) and float(value).is_integer() and math.isfinite(float(value)):
            value = int(value)  # accept 10.0, reject 10.5
        else:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    v = int(value)
    if v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return v


def check_enum(name: str, value: object, enum_type: type[E]) -> E:
    """Accept an enum member or its string value (case-insensitive)."""
    if isinstance(value, enum_type):
        return value
    if isinstance(value, str):
        key = value.strip().lower().replace("-", "_")
        for member in enum_type:
            if key in (str(member.value).lower(), member.name.lower()):
                return member
    valid = ", ".join(repr(m.value) for m in enum_type)
    raise ValueError(f"{name} must be one of {valid}, got {value!r}")
