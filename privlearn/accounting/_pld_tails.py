"""Chernoff bounds on the composed privacy loss (private helper of
:mod:`privlearn.accounting.pld`): the moment generating function of a sum of independent
grid losses, bounded from the single-step PMFs (block-aggregated where that only increases
it), gives the FFT window and certifies the mass outside it (``P(S > b) <=
exp(K(lam) - lam b)``; e.g. Boucheron, Lugosi & Massart 2013, Section 2.2).
"""

from __future__ import annotations

import math

import numpy as np

from privlearn.accounting._pld_grid import StepPMF, U

__all__ = ["log_mgf", "chernoff_window", "tail_bounds"]

_LAMBDAS = np.geomspace(1e-3, 3e3, 48)
_LAMBDAS_TAIL = np.geomspace(1e-2, 1e9, 89)


def log_mgf(
    pmfs: list[tuple[StepPMF, int]], h: float, lam: np.ndarray, upper_tail: bool
) -> np.ndarray:
    """Upper bound on ``log E[exp(lam S)]`` (``upper_tail``) or ``log E[exp(-lam S)]`` of
    the finite part of ``S = sum of independent losses`` (rounded up)."""
    tot = np.zeros_like(lam)
    for pmf, count in pmfs:
        keep = pmf.p > 0
        if not np.any(keep):
            return np.full_like(lam, -np.inf)
        ls = np.log(pmf.p[keep])
        loss = (pmf.k0 + np.nonzero(keep)[0]) * h
        if not upper_tail:
            loss = -loss
        a = ls[None, :] + lam[:, None] * loss[None, :]
        mx = a.max(1)
        k = mx + np.log(np.exp(a - mx[:, None]).sum(1))
        tot += count * (k + 8 * U * (np.abs(k) + np.abs(mx) + 1.0))
    return tot


def chernoff_window(pmfs, h: float, tol: float) -> tuple[float, float, float, float]:
    """(a, b, lam_a, lam_b) with P(S < a) <= tol and P(S > b) <= tol (Chernoff bound
    ``P(S > b) <= exp(K(lam) - lam b)``, finite parts only)."""
    lt = math.log(tol)
    K_up = log_mgf(pmfs, h, _LAMBDAS, True)
    vb = (K_up - lt) / _LAMBDAS
    ib = int(np.argmin(vb))
    K_lo = log_mgf(pmfs, h, _LAMBDAS, False)
    va = (K_lo - lt) / _LAMBDAS
    ia = int(np.argmin(va))
    lo_sup = sum(c * pmf.k0 for pmf, c in pmfs) * h
    hi_sup = sum(c * (pmf.k0 + pmf.p.size - 1) for pmf, c in pmfs) * h
    return max(-float(va[ia]), lo_sup), min(float(vb[ib]), hi_sup), _LAMBDAS[ia], _LAMBDAS[ib]


def tail_bounds(pmfs, h: float, lo: float, hi: float, lam_a: float, lam_b: float):
    """Certified ``P(S < lo)`` and ``P(S > hi)`` from a few Chernoff exponents."""
    lo_sup = sum(c * pmf.k0 for pmf, c in pmfs) * h
    hi_sup = sum(c * (pmf.k0 + pmf.p.size - 1) for pmf, c in pmfs) * h
    mult = np.array([0.6, 1.0, 1.6])
    if hi >= hi_sup:
        t_hi = 0.0
    else:
        lam = lam_b * mult
        t_hi = float(np.exp(min(0.0, float(np.min(log_mgf(pmfs, h, lam, True) - lam * hi)))))
    if lo <= lo_sup:
        t_lo = 0.0
    else:
        lam = lam_a * mult
        t_lo = float(np.exp(min(0.0, float(np.min(log_mgf(pmfs, h, lam, False) + lam * lo)))))
    return t_lo * (1 + 1e-12), t_hi * (1 + 1e-12)
