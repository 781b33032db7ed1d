"""Closed forms the tests compare privlearn with, computed independently of it (mpmath at
50 digits). Importable from every test module: pytest puts this folder, which holds the
suite's conftest.py, on ``sys.path``."""

from __future__ import annotations

import mpmath as mp


def exact_gaussian_delta(sigma: float, eps: float) -> mp.mpf:
    """delta(eps) of the Gaussian mechanism of noise multiplier ``sigma`` and unit
    sensitivity at 50 digits (Balle & Wang 2018, Theorem 8)."""
    with mp.workdps(50):
        mu = 1 / mp.mpf(sigma)
        e = mp.mpf(eps)
        return mp.ncdf(-e / mu + mu / 2) - mp.exp(e) * mp.ncdf(-e / mu - mu / 2)


def exact_gaussian_epsilon(sigma: float, delta: float) -> float:
    """The exact epsilon(delta) by bisection on the 50-digit curve (monotone in eps),
    rounded up (the bracket's upper end)."""
    with mp.workdps(50):
        target = mp.mpf(delta)
        lo, hi = mp.mpf(0), mp.mpf(1)
        while exact_gaussian_delta(sigma, hi) > target:
            hi *= 2
        for _ in range(120):
            mid = (lo + hi) / 2
            if exact_gaussian_delta(sigma, mid) > target:
                lo = mid
            else:
                hi = mid
        return float(hi)


def exact_gaussian_sigma(eps: float, delta: float) -> float:
    """The smallest noise multiplier with delta(eps) <= delta, by bisection on the exact
    curve (delta(eps) decreases in sigma), rounded up."""
    lo, hi = 1e-3, 1e6
    for _ in range(200):
        mid = (lo + hi) / 2
        if exact_gaussian_delta(mid, eps) > delta:
            lo = mid
        else:
            hi = mid
    return hi
