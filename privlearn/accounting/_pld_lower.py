"""A certified lower bound from a binary post-processing of every step (private helper
of :mod:`privlearn.accounting.pld`).

The grid's dominated pair can certify nothing at all (lower bound 0) when the grid
spacing exceeds the single-step losses of a small sampling rate: the lowering that keeps
the grid pair dominated near loss 0 (about ``h`` times the mass there) exceeds the whole
profile, and the greatest convex minorant is then 0 for every epsilon >= 0 (e.g. Poisson
sampling at ``q = 1e-5``, noise multiplier 0.4, ``10^4`` steps). Any test is a
post-processing, so thresholding each step's loss at ``t`` gives the binary pair
``(P(L > t), Q(L > t))``, which the step's pair dominates (data processing); shrinking
``P(L > t)`` and growing ``Q(L > t)`` keeps it dominated (its trade-off curve is the
convex hull of points on or above the true one), which absorbs the rounding of the tails.
The composition of binary pairs is enumerated exactly
(:func:`privlearn.accounting.closed_form._compose`, with its rounding allowances) within a
window of counts around the binomial mean (the dropped counts, of mass below ``2 e^-400``,
only lower the profile), so its rounded-down profile is a certified lower bound on the
mechanism's (Dong, Roth & Su 2022,
Lemma 2.9 with Theorem 3.2: composition preserves the order of trade-off functions).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from privlearn.accounting import closed_form
from privlearn.accounting._pld_grid import loss_range
from privlearn.accounting._types import PrivacyBound
from privlearn.errors import AccountingError

__all__ = ["binary_lower"]

#: relative shrink of the tails, far above their rounding error
_SHRINK = 1e-9
#: thresholds tried per direction
_THRESHOLDS = 24


def _atoms(pair, t: float) -> closed_form.Atoms | None:
    pg, _, qg, _ = (float(np.asarray(v).reshape(-1)[0]) for v in pair.tails(np.array([t])))
    p, q = pg * (1.0 - _SHRINK), min(1.0, qg * (1.0 + _SHRINK))
    if not (0.0 < q < p < 1.0):
        return None
    lp, lq, lp1, lq1 = math.log(p), math.log(q), math.log1p(-p), math.log1p(-q)
    return closed_form.Atoms((lp - lq, lp1 - lq1), (lp, lp1), (lq, lq1))


def _window(atoms: closed_form.Atoms, k: int) -> tuple[int, int]:
    """Counts of the second atom (``L <= t``) kept for ``k`` steps: its binomial mean
    ``+-`` (40 standard deviations + 600). By Bernstein's inequality the dropped count
    vectors hold mass below ``2 e^-400``; dropping mass only lowers the composed profile,
    so every lower bound read from it stays a lower bound (all ``10^6`` steps' counts
    cost a second a threshold)."""
    p = math.exp(atoms.log_p[1])
    mean, sd = k * p, math.sqrt(k * p * (1.0 - p))
    return (max(0, math.floor(mean - 40.0 * sd - 600.0)),
            min(k, math.ceil(mean + 40.0 * sd + 600.0)))


def _directions(parts, step) -> list[list[tuple[object, int]]]:
    """Each direction's single-step pairs (the tight pairs of the accountant, attained)."""
    steps = [(step(m), k) for m, k in parts]
    return [
        [(st.a, k) for st, k in steps],
        [(st.a if st.b is None else st.b, k) for st, k in steps],
    ]


def binary_lower(
    bound: PrivacyBound, parts: Sequence[tuple[object, int]], step: Callable, what: str, at: float
) -> PrivacyBound:
    """``bound`` with its lower end raised to the best lower bound on ``what``
    (``"epsilon"`` at delta ``at`` or ``"delta"`` at epsilon ``at``) of the thresholded
    compositions (module docstring), where it is missing or below half the upper end;
    never above the upper end. ``step(m)`` gives a part's pairs (``.a``, ``.b``)."""
    up, lo = bound.upper, (0.0 if bound.lower is None else bound.lower)
    if not (math.isfinite(up) and up > 0.0 and lo < 0.5 * up):
        return bound
    best = lo
    fracs = np.geomspace(1e-4, 1.0, _THRESHOLDS)
    try:
        directions = _directions(parts, step)
    except (ArithmeticError, ValueError, AccountingError):
        return bound  # a part without such pairs (a huge pure-DP epsilon): lower end kept
    for pairs in directions:
        try:
            his = [loss_range(pair, 1e-18)[1] for pair, _ in pairs]
        except (ArithmeticError, ValueError, AccountingError):
            continue
        for f in fracs:
            atoms = [(_atoms(pair, f * hi), k) for (pair, k), hi in zip(pairs, his, strict=True)]
            if any(a is None for a, _ in atoms):
                continue
            windows = [_window(a, k) for a, k in atoms]
            pld = closed_form._compose(atoms, windows)  # type: ignore[arg-type]
            if pld is None:  # too many atoms
                break
            best = max(best, getattr(pld, what)(at, False))
    if best <= lo:
        return bound
    return PrivacyBound(up, min(best, up), bound.accountant)
