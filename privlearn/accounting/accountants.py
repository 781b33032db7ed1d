"""Accountant registry and the result type shared by all accountants.

An accountant turns a :class:`~privlearn.accounting.mechanisms.Mechanism` description
into privacy parameters. Each registered accountant implements

* ``epsilon(mechanism, delta) -> PrivacyBound``
* ``delta(mechanism, epsilon) -> PrivacyBound``

where ``PrivacyBound.upper`` is a certified upper bound (never optimistic) and
``PrivacyBound.lower`` a certified lower bound where the method provides one (else None).

Accountants are looked up by name (:func:`get_accountant`); new ones are added with
:func:`register_accountant`. The mechanism classes never need to change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from privlearn.accounting.mechanisms import Mechanism

__all__ = [
    "PrivacyBound",
    "Accountant",
    "AccountingError",
    "UnsupportedMechanismError",
    "register_accountant",
    "get_accountant",
    "available_accountants",
]


class AccountingError(ArithmeticError):
    """A numerical computation could not reach a certified result.

    Raised instead of returning nan, 0 or an optimistic value.
    """


class UnsupportedMechanismError(ValueError):
    """The chosen accountant cannot evaluate (part of) this mechanism."""


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
    name: str

    def epsilon(self, mechanism: Mechanism, delta: float) -> PrivacyBound: ...

    def delta(self, mechanism: Mechanism, epsilon: float) -> PrivacyBound: ...


_REGISTRY: dict[str, Accountant] = {}


def register_accountant(accountant: Accountant) -> Accountant:
    """Register an accountant under ``accountant.name`` (replacing any previous one)."""
    _REGISTRY[accountant.name] = accountant
    return accountant


def _ensure_builtin() -> None:
    # Import for side effect: each module registers its accountant.
    if "analytic" not in _REGISTRY:
        import privlearn.accounting.analytic  # noqa: F401
    if "rdp" not in _REGISTRY:
        try:
            import privlearn.accounting.rdp  # noqa: F401
        except ImportError:  # pragma: no cover - during development only
            pass
    if "pld" not in _REGISTRY:
        try:
            import privlearn.accounting.pld  # noqa: F401
        except ImportError:  # pragma: no cover - during development only
            pass


def available_accountants() -> list[str]:
    _ensure_builtin()
    return sorted(_REGISTRY)


def get_accountant(name: str | Accountant) -> Accountant:
    """Look up an accountant by name; raises ValueError listing valid names."""
    if not isinstance(name, str):
        if isinstance(name, Accountant):
            return name
        raise ValueError(f"accountant must be a name, got {name!r}")
    _ensure_builtin()
    key = name.strip().lower()
    try:
        return _REGISTRY[key]
    except KeyError:
        valid = ", ".join(repr(k) for k in sorted(_REGISTRY))
        raise ValueError(f"accountant must be one of {valid}, got {name!r}") from None
