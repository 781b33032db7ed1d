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

__all__ = ["log_mgf", "coarse_log_mgf", "chernoff_theta", "chernoff_window", "tail_bounds"]

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
        k, mx = _row_logsumexp(ls, lam, loss)
        tot += count * (k + 8 * U * (np.abs(k) + np.abs(mx) + 1.0))
    return tot


#: entries of the exponent matrix computed at once (the whole ``lam x losses`` matrix of
#: a PMF of 10^6 points at 96 exponents is 0.8 GB, and filling it cost far more than the
#: arithmetic)
_CHUNK_ENTRIES = 1 << 20


def _row_logsumexp(ls: np.ndarray, lam: np.ndarray,
                   loss: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(log sum_i exp(ls_i + lam_j loss_i), max_i (ls_i + lam_j loss_i))`` for every
    ``lam_j``, a few exponents at a time (each row is summed exactly as a whole-matrix
    evaluation would sum it)."""
    k, mx = np.empty(lam.size), np.empty(lam.size)
    rows = max(1, _CHUNK_ENTRIES // max(loss.size, 1))
    for j in range(0, lam.size, rows):
        a = ls[None, :] + lam[j:j + rows, None] * loss[None, :]
        m = a.max(1)
        a -= m[:, None]
        np.exp(a, out=a)
        k[j:j + rows] = m + np.log(a.sum(1))
        mx[j:j + rows] = m
    return k, mx


def chernoff_window(pmfs, h: float, tol: float) -> tuple[float, float, float, float]:
    """(a, b, lam_a, lam_b) with P(S < a) <= tol and P(S > b) <= tol (Chernoff bound
    ``P(S > b) <= exp(K(lam) - lam b)``, finite parts only).

    Any ``lam`` gives a valid bound; the best of the 48 in ``_LAMBDAS`` is located on the
    PMFs coarsened to at most 4096 blocks (:func:`coarse_log_mgf`, a heuristic input),
    and the bound is then evaluated exactly (:func:`log_mgf`, rounded up) at the 5 values
    around it: on PMFs of 10^5-10^6 points this is about 8 times cheaper than 48 exact
    evaluations, and the window differs only by how far the coarse optimum is off."""
    lt = math.log(tol)
    out = []
    for upper_tail in (True, False):
        if max(pmf.p.size for pmf, _ in pmfs) > 4 * _COARSE_BLOCKS:
            kc = coarse_log_mgf(pmfs, h, _LAMBDAS, upper_tail, _COARSE_BLOCKS)
            i = int(np.argmin((kc - lt) / _LAMBDAS))
            lam = _LAMBDAS[max(i - 2, 0): i + 3]
        else:
            lam = _LAMBDAS
        v = (log_mgf(pmfs, h, lam, upper_tail) - lt) / lam
        i = int(np.argmin(v))
        out.append((float(v[i]), float(lam[i])))
    (vb, lam_b), (va, lam_a) = out
    lo_sup = sum(c * pmf.k0 for pmf, c in pmfs) * h
    hi_sup = sum(c * (pmf.k0 + pmf.p.size - 1) for pmf, c in pmfs) * h
    return max(-va, lo_sup), min(vb, hi_sup), lam_a, lam_b


#: block count of the coarsened PMFs that locate the Chernoff exponent
_COARSE_BLOCKS = 4096


def coarse_log_mgf(pmfs, h: float, lam: np.ndarray, upper_tail: bool,
                    max_blocks: int) -> np.ndarray:
    """``log E[exp(+-lam S)]`` approximately: every ``w`` consecutive masses summed at
    their mean loss, at most about ``max_blocks`` blocks per PMF (each step's mean is
    kept exactly). Locates the exponent only; never used in a bound."""
    tot = np.zeros_like(lam)
    for pmf, count in pmfs:
        n = pmf.p.size
        w = max(1, -(-n // max_blocks))
        nb = -(-n // w)
        x = np.zeros(nb * w)
        x[:n] = np.maximum(pmf.p, 0.0)
        x = x.reshape(nb, w)
        blocks = x.sum(1)
        keep = blocks > 0
        if not np.any(keep):
            return np.full_like(lam, -np.inf)
        idx = (x @ np.arange(w, dtype=float))[keep] / blocks[keep]
        loss = (pmf.k0 + w * np.nonzero(keep)[0] + idx) * h
        if not upper_tail:
            loss = -loss
        tot += count * _row_logsumexp(np.log(blocks[keep]), lam, loss)[0]
    return tot


def tail_bounds(pmfs, h: float, lo: float, hi: float, lam_a: float, lam_b: float):
    """Certified ``P(S < lo)`` and ``P(S > hi)`` from a few Chernoff exponents."""
    lo_sup = sum(c * pmf.k0 for pmf, c in pmfs) * h
    hi_sup = sum(c * (pmf.k0 + pmf.p.size - 1) for pmf, c in pmfs) * h
    mult = np.array([0.6, 1.0, 1.6])

    def bound(lam: np.ndarray, upper_tail: bool) -> float:
        edge = hi if upper_tail else -lo
        return float(np.exp(min(0.0, float(np.min(log_mgf(pmfs, h, lam, upper_tail)
                                                   - lam * edge)))))

    t_hi = 0.0 if hi >= hi_sup else bound(lam_b * mult, True)
    t_lo = 0.0 if lo <= lo_sup else bound(lam_a * mult, False)
    # the window's exponents come from a coarser grid; where the losses live on a scale
    # of a few fine grid steps (e.g. an (epsilon=0, delta) part, whose finite losses are
    # 0 up to rounding) they are far too small to bound anything, so a poor bound is
    # retried with exponents up to ~1/h (any exponent gives a valid bound)
    if t_hi > _RETRY_ABOVE:
        t_hi = min(t_hi, bound(_fine_lambdas(h), True))
    if t_lo > _RETRY_ABOVE:
        t_lo = min(t_lo, bound(_fine_lambdas(h), False))
    return t_lo * (1 + 1e-12), t_hi * (1 + 1e-12)


#: a tail bound above this is retried with :func:`_fine_lambdas` (the accountants' tail
#: tolerance is ~1e-18, so only a bound that is useless as it stands)
_RETRY_ABOVE = 1e-12


def _fine_lambdas(h: float) -> np.ndarray:
    """Chernoff exponents from 1e-3 up to ``1e3 / h`` (at least ``_LAMBDAS``' range)."""
    return np.geomspace(_LAMBDAS[0], max(float(_LAMBDAS[-1]), 1e3 / h), 96)


def chernoff_theta(pmfs, h: float, eps: float) -> float:
    """The tilt minimising the Chernoff bound ``K(theta) - theta eps`` of the composed
    finite loss (``K`` its log moment generating function, from the PMFs): the tilted
    distribution is then centred at ``eps``.

    Any positive tilt gives a certified composition (``_pld_fft.compose_fft_tilted``);
    the optimum only keeps its allowance small, and ``K - theta eps`` is flat there. So
    it is located on PMFs coarsened to at most 16384 blocks (:func:`coarse_log_mgf`),
    then refined on the exact PMFs (to about 0.1%)."""
    grid = np.geomspace(1e-4, 1e3, 141)
    k = coarse_log_mgf(pmfs, h, grid, True, 16384) - grid * eps
    i = int(np.argmin(k))
    # exact values on the 17 grid points around the coarse optimum, then a
    # golden-section search in the cells around the best of them (K is convex)
    local = grid[max(i - 8, 0): i + 9]
    k = log_mgf(pmfs, h, local, True) - local * eps
    j = int(np.argmin(k))
    lo, hi = local[max(j - 1, 0)], local[min(j + 1, local.size - 1)]
    for _ in range(12):
        m1, m2 = lo + 0.382 * (hi - lo), lo + 0.618 * (hi - lo)
        f1, f2 = (float(log_mgf(pmfs, h, np.array([t]), True)[0]) - t * eps
                  for t in (m1, m2))
        if f1 < f2:
            hi = m2
        else:
            lo = m1
    return 0.5 * (lo + hi)
