"""Deprecated location of the validation helpers: use :mod:`privlearn._validation`.

Kept as a thin re-export so that existing imports (``privlearn.cli`` and user code that
reached into this private module) keep working; new code imports ``privlearn._validation``.
"""

from __future__ import annotations

from privlearn._validation import (
    check_callable,
    check_choice,
    check_count,
    check_delta,
    check_enum,
    check_epsilon,
    check_nonnegative,
    check_positive,
    check_probability,
    check_rate,
    check_real,
)

#: Old name of :func:`privlearn._validation.check_probability`.
check_probability_open = check_probability

__all__ = [
    "check_callable",
    "check_choice",
    "check_count",
    "check_delta",
    "check_enum",
    "check_epsilon",
    "check_nonnegative",
    "check_positive",
    "check_probability",
    "check_probability_open",
    "check_rate",
    "check_real",
]
