"""One subsampled Gaussian step, answered from its dominating pair without a grid
(private helper of :mod:`privlearn.accounting.pld`).

A single step needs no composition: its privacy profile is the hockey-stick divergence
of its dominating pair, which for the Poisson-subsampled pairs of a Gaussian
``(P, Q) = (N(mu, 1), N(0, 1))`` reduces exactly to the Gaussian profile ``delta_G``
(Balle & Wang 2018, Theorem 8; evaluated with certified bounds by
:func:`privlearn.accounting.analytic.gdp_delta_bounds`):

* remove, ``((1-q) Q + q P, Q)``: ``(1-q) Q + q P - e^eps Q = q (P - e^{eps'} Q)`` with
  ``e^{eps'} = 1 + (e^eps - 1) / q``, so ``delta(eps) = q delta_G(eps')`` (Balle, Barthe &
  Gaboardi 2018, Theorem 8: the amplification identity is exact for this pair);
* add, ``(Q, (1-q) Q + q P)``: ``Q - e^eps ((1-q) Q + q P) = q e^eps (c Q - P)`` with
  ``c = 1 + (e^{-eps} - 1) / q``; for ``c <= 0`` the profile is 0, otherwise
  ``delta(eps) = q e^eps c delta_G(-log c)`` (the Gaussian pair is its own swap).

The step's profile is the larger of its directions (add/remove composes the worse one;
for the symmetrised replace-one profile of fixed-size sampling, Dong, Roth & Su 2022,
Theorem 9, the convex conjugate of ``min(f, f^-1)**`` is the larger of the two, so one
step's profile is again the maximum). Every rounding is bracketed: the arguments of
``delta_G`` by an explicit error allowance and monotonicity (``delta_G`` decreases in its
argument, ``c delta_G(-log c)`` increases in ``c``), the products by a few ulps. The
epsilon search keeps only points whose certified delta bounds are checked, so the upper
end satisfies ``delta_upper(eps) <= delta`` and the lower end ``delta_lower(eps) > delta``.
"""

from __future__ import annotations

import math

from privlearn.accounting._pld_pairs import AddPair, GaussianPair, RemovePair
from privlearn.accounting.analytic import gdp_delta_bounds

__all__ = ["single_step_gaussian"]

_U = 2.0**-53
#: largest epsilon the search brackets (beyond it the grid's own path answers)
_EPS_CAP = 1e4


def _directions(step) -> list[tuple[bool, float, float]] | None:
    """``(is_remove, mu, q)`` for each pair of a step made of subsampled Gaussian pairs."""
    out = []
    for pair in (step.a, step.b):
        if pair is None:
            continue
        remove = isinstance(pair, RemovePair)
        rem = pair if remove else getattr(pair, "rem", None)
        if not (isinstance(pair, (RemovePair, AddPair)) and isinstance(rem.base, GaussianPair)):
            return None
        mu, q = rem.base.mu, rem.qr
        if not (0.0 < mu < math.inf and 0.0 < q <= 1.0):
            return None
        out.append((remove, mu, q))
    return out or None


def _remove_bounds(mu: float, q: float, eps: float) -> tuple[float, float]:
    """Certified ``(lower, upper)`` on ``q delta_G(eps')``, ``e^{eps'} = 1 + (e^eps - 1)/q``."""
    if eps > 30.0:  # e^eps - 1 + q without overflow
        r = eps - math.log(q) + math.log1p(-(1.0 - q) * math.exp(-eps))
    else:
        r = math.log1p(math.expm1(eps) / q)
    err = 16.0 * _U * (1.0 + abs(r) + abs(math.log(q)))
    lo = gdp_delta_bounds(mu, r + err)[0]
    up = gdp_delta_bounds(mu, max(0.0, r - err))[1]
    return q * lo * (1.0 - 4.0 * _U), min(1.0, q * up * (1.0 + 4.0 * _U))


def _add_bounds(mu: float, q: float, eps: float) -> tuple[float, float]:
    """Certified ``(lower, upper)`` on ``q e^eps c delta_G(-log c)``,
    ``c = 1 + (e^{-eps} - 1) / q`` (0 where ``c <= 0``)."""
    x = math.expm1(-eps) / q
    c = 1.0 + x
    err = 8.0 * _U * max(1.0, abs(x))
    c_lo, c_hi = c - err, min(1.0, c + err)

    def value(cc: float, upper: bool) -> float:
        if cc <= 0.0:
            return 0.0
        arg = -math.log(cc)
        slack = 4.0 * _U * (1.0 + abs(arg))
        if upper:
            d = gdp_delta_bounds(mu, max(0.0, arg - slack))[1]
            pref = 1.0 if eps > 700.0 else min(1.0, q * math.exp(eps) * cc * (1.0 + 8.0 * _U))
            return min(1.0, pref * d * (1.0 + 4.0 * _U))
        if eps > 700.0:
            return 0.0
        d = gdp_delta_bounds(mu, arg + slack)[0]
        return q * math.exp(eps) * cc * d * (1.0 - 12.0 * _U)

    return value(c_lo, False), value(c_hi, True)


def _bounds(dirs, eps: float) -> tuple[float, float]:
    lo = up = 0.0
    for remove, mu, q in dirs:
        a, b = (_remove_bounds if remove else _add_bounds)(mu, q, eps)
        lo, up = max(lo, a), max(up, b)
    return lo, up


def single_step_gaussian(step, what: str, at: float, rel_gap: float) -> tuple[float, float] | None:
    """Certified ``(lower, upper)`` on epsilon(delta=at) (``what="epsilon"``) or
    delta(epsilon=at) (``what="delta"``) of one step whose pairs are Poisson-subsampled
    Gaussian pairs (module docstring); None for any other step, or when the bracket is
    wider than ``rel_gap`` relative (the caller's grid then answers)."""
    dirs = _directions(step)
    if dirs is None or not (0.0 <= at < math.inf):
        return None
    if what == "delta":
        lo, up = _bounds(dirs, at)
        return (lo, up) if up - lo <= rel_gap * up else None
    if not 0.0 < at < 1.0:
        return None
    delta = at
    up_of = lambda e: _bounds(dirs, e)[1]  # noqa: E731
    lo_of = lambda e: _bounds(dirs, e)[0]  # noqa: E731
    # upper end: a point with delta_upper(eps) <= delta
    if up_of(0.0) <= delta:
        eps_up = 0.0
    else:
        a, b = 0.0, 1.0
        while up_of(b) > delta:
            a, b = b, 2.0 * b
            if b > _EPS_CAP:
                return None
        for _ in range(200):
            m = 0.5 * (a + b)
            if not a < m < b:
                break
            if up_of(m) <= delta:
                b = m
            else:
                a = m
        eps_up = b
    # lower end: a point with delta_lower(eps) > delta (0 when there is none below eps_up)
    if not lo_of(0.0) > delta:
        eps_lo = 0.0
    else:
        a, b = 0.0, eps_up
        for _ in range(200):
            m = 0.5 * (a + b)
            if not a < m < b:
                break
            if lo_of(m) > delta:
                a = m
            else:
                b = m
        eps_lo = a
    if eps_up - eps_lo > rel_gap * eps_up:
        return None
    return eps_lo, eps_up
