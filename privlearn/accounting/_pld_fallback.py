"""The certified answer of :meth:`PLDAccountant.delta` when no loss grid can hold the
composition (a single-step privacy loss beyond floating point): the RDP accountant's
delta, as :meth:`PLDAccountant.epsilon` falls back to its epsilon.

Kept out of :mod:`privlearn.accounting.pld` (its size).
"""

from __future__ import annotations

import math

from privlearn.accounting._types import PrivacyBound
from privlearn.accounting.accountants import get_accountant
from privlearn.errors import AccountingError, PrivacyLossOverflowError, UnsupportedMechanismError

__all__ = ["fallback_delta"]

_U = 2.0**-52


def fallback_delta(
    mechanism, epsilon: float, pure_epsilon: float, floor: float, err: PrivacyLossOverflowError
) -> PrivacyBound:
    """``PrivacyBound(upper, lower, "rdp")``: the RDP accountant's certified delta at
    ``epsilon`` (Mironov 2017, Proposition 3 as refined by Canonne, Kamath & Steinke 2020,
    Proposition 12), capped by ``pure_epsilon - epsilon`` (every composed loss is at most
    the pure epsilon, so ``delta <= 1 - e^(epsilon - pure_epsilon)``); the lower end is
    ``floor`` (the mass at infinity). Raises ``err`` where the RDP accountant cannot
    answer either."""
    try:
        up = get_accountant("rdp").delta(mechanism, epsilon).upper
    except (UnsupportedMechanismError, AccountingError):
        raise err from None
    if math.isfinite(pure_epsilon):
        up = min(up, max(0.0, pure_epsilon * (1.0 + 16.0 * _U) - epsilon))
    return PrivacyBound(up, min(floor, up), "rdp")
