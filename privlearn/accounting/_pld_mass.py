"""Privacy-loss mass at infinity of a PLD composition: the delta no epsilon removes.

An (epsilon, delta)-DP step (:class:`~privlearn.accounting.ApproxDP`, alone or
subsampled) puts P-mass ``delta`` at privacy loss ``+inf`` (Kairouz, Oh & Viswanath 2015,
Theorem 2.1); ``k`` compositions of steps with masses ``m_i`` carry
``1 - prod (1 - m_i)^k_i`` there, so ``delta(eps)`` never falls below it (Dong, Roth & Su
2022, Proposition 2.12: the profile of a composition is that of the product pair).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from privlearn.errors import AccountingError, CertificationError

__all__ = ["mass_at_infinity", "refuse_below_mass_at_infinity"]


def mass_at_infinity(parts, step: Callable) -> float:
    """A lower bound on delta at every epsilon: the composed P-mass at loss ``+inf`` of
    each direction's pairs (``1 - prod (1 - m_i)^k_i``, rounded down), the larger.

    ``parts`` are ``(mechanism, count)`` pairs; ``step`` maps a mechanism to its PLD step
    (``.a``, and ``.b`` or None: the pairs of the two directions)."""
    steps = []
    for m, k in parts:
        try:
            steps.append((step(m), k))
        except (ArithmeticError, ValueError, AccountingError):
            # no pair to read (a pure-DP part whose epsilon is too large to form one):
            # its mass is not counted, a smaller lower bound (the accountant's own path
            # answers or refuses such a part as before)
            continue
    out = 0.0
    for direction in (0, 1):
        log_finite = 0.0
        for s, k in steps:
            pair = s.a if direction == 0 or s.b is None else s.b
            log_finite += k * math.log1p(-min(pair.mass_at_infinity, 1.0))
        out = max(out, -math.expm1(log_finite) * (1.0 - 1e-12))
    return out


def refuse_below_mass_at_infinity(parts, step: Callable, delta: float) -> None:
    """Raise :class:`CertificationError` when ``0 < delta`` is below the composition's
    mass at infinity: no finite epsilon certifies it, and searching the grids (tilted,
    refined, the RDP fallback) for one took minutes before the same refusal."""
    mass = mass_at_infinity(parts, step)
    if 0.0 < delta < mass:
        raise CertificationError(
            f"pld: cannot certify delta={delta:g}: the composition's privacy-loss mass at "
            f"infinity (the delta of its (epsilon, delta)-DP parts) is {mass:.6g}, above "
            f"delta, so no finite epsilon holds; pass a delta above {mass:.6g}"
        )
