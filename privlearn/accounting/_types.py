"""Types and errors shared by every accountant (a leaf module).

It imports nothing from privlearn at run time but the leaf :mod:`privlearn.errors`, so
:mod:`~privlearn.accounting.accountants`, the accountant modules
(:mod:`~privlearn.accounting.pld`, :mod:`~privlearn.accounting.rdp`,
:mod:`~privlearn.accounting.analytic`), the private discretisation helpers and the mechanism
registry can all use these without importing each other. The public names are re-exported
by :mod:`privlearn.accounting` and :mod:`privlearn.accounting.accountants` (the two error
classes live in :mod:`privlearn.errors`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from privlearn.errors import AccountingError

if TYPE_CHECKING:  # pragma: no cover
    from privlearn.accounting.mechanisms import Mechanism

__all__ = ["PrivacyBound", "Accountant"]


@dataclass(frozen=True, slots=True)
class PrivacyBound:
    """A certified interval for a privacy parameter.

    Attributes
    ----------
    upper : float
        Certified upper bound (the value to report).
    lower : float or None
        Certified lower bound, when the accountant provides one.
    accountant : str
        Name of the accountant that produced it.
    """

    upper: float
    lower: float | None = None
    accountant: str = ""

    def __post_init__(self) -> None:
        if math.isnan(self.upper):
            raise AccountingError(f"accountant {self.accountant!r} produced a NaN upper bound")
        if self.lower is not None:
            if math.isnan(self.lower):
                raise AccountingError(
                    f"accountant {self.accountant!r} produced a NaN lower bound"
                )
            if self.lower > self.upper * (1 + 1e-12) + 1e-15:
                raise AccountingError(
                    f"accountant {self.accountant!r}: lower bound {self.lower!r} exceeds "
                    f"upper bound {self.upper!r}"
                )

    def __float__(self) -> float:
        return float(self.upper)


@runtime_checkable
class Accountant(Protocol):
    """What an accountant implements (see :mod:`privlearn.accounting.accountants`)."""

    name: str

    def epsilon(self, mechanism: Mechanism, delta: float) -> PrivacyBound: ...

    def delta(self, mechanism: Mechanism, epsilon: float) -> PrivacyBound: ...
