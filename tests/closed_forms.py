"""Closed forms the tests compare privlearn with, computed independently of it (mpmath at
50 digits, or exact sums). Importable from every test module: pytest puts this folder,
which holds the suite's conftest.py, on ``sys.path`` (benchmarks/tiny_delta.py puts it
there itself)."""

from __future__ import annotations

import mpmath as mp


def exact_gaussian_delta(sigma: float, eps: float) -> mp.mpf:
    """delta(eps) of the Gaussian mechanism of noise multiplier ``sigma`` and unit
    sensitivity at 50 digits (Balle & Wang 2018, Theorem 8)."""
    with mp.workdps(50):
        mu = 1 / mp.mpf(sigma)
        e = mp.mpf(eps)
        return mp.ncdf(-e / mu + mu / 2) - mp.exp(e) * mp.ncdf(-e / mu - mu / 2)


def smallest_meeting(delta_of, target, lo, hi, iterations: int):
    """The smallest ``x`` in ``[lo, hi]`` with ``delta_of(x) <= target`` for ``delta_of``
    non-increasing in ``x``, by bisection, rounded up (the bracket's upper end)."""
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if delta_of(mid) > target:
            lo = mid
        else:
            hi = mid
    return hi


def exact_gaussian_epsilon(sigma: float, delta: float) -> float:
    """The exact epsilon(delta) by bisection on the 50-digit curve (monotone in eps),
    rounded up (the bracket's upper end)."""
    with mp.workdps(50):
        target = mp.mpf(delta)
        hi = mp.mpf(1)
        while exact_gaussian_delta(sigma, hi) > target:
            hi *= 2
        return float(smallest_meeting(lambda e: exact_gaussian_delta(sigma, e), target,
                                      mp.mpf(0), hi, 120))


def exact_gaussian_sigma(eps: float, delta: float) -> float:
    """The smallest noise multiplier with delta(eps) <= delta, by bisection on the exact
    curve (delta(eps) decreases in sigma), rounded up."""
    return smallest_meeting(lambda s: exact_gaussian_delta(s, eps), delta, 1e-3, 1e6, 200)


def poisson_replace_one_renyi(q: float, s: float, alpha: float) -> float:
    """Renyi divergence of order ``alpha`` of ``(1-q) N(0,s^2) + q N(1,s^2)`` from
    ``(1-q) N(0,s^2) + q N(-1,s^2)`` (the replace-one pair of a Poisson-sampled Gaussian
    of noise multiplier ``s``), by quadrature."""
    import math

    import numpy as np
    from scipy import integrate, stats

    def f(x: float) -> float:
        lp = np.logaddexp(math.log1p(-q) + stats.norm.logpdf(x, 0, s),
                          math.log(q) + stats.norm.logpdf(x, 1, s))
        lq = np.logaddexp(math.log1p(-q) + stats.norm.logpdf(x, 0, s),
                          math.log(q) + stats.norm.logpdf(x, -1, s))
        return math.exp(alpha * lp + (1 - alpha) * lq)

    v, _ = integrate.quad(f, -40 * s - 40, 40 * s + 40, limit=1000, epsabs=0,
                          epsrel=1e-13, points=[0])
    return math.log(v) / (alpha - 1)


def exact_randomized_response_epsilon(p: float, k: int, delta: float,
                                      xtol: float = 1e-13) -> float:
    """Exact epsilon(delta) of ``k``-fold binary randomized response (truth with
    probability ``p``): the privacy loss is ``(2j - k) eps0``, ``eps0 = log(p / (1 - p))``,
    with ``j ~ Binomial(k, p)`` under P (Kairouz, Oh & Viswanath 2015); the root of
    ``E[(1 - e^(eps - L))_+] = delta`` by brentq to ``xtol``."""
    import math

    import numpy as np
    from scipy import optimize, special

    eps0 = math.log(p / (1 - p))
    j = np.arange(k + 1)
    logpmf = (special.gammaln(k + 1) - special.gammaln(j + 1) - special.gammaln(k - j + 1)
              + j * math.log(p) + (k - j) * math.log1p(-p))
    loss = (2 * j - k) * eps0

    def d(e: float) -> float:
        gain = -np.expm1(np.minimum(e - loss, 0.0))  # (1 - e^{e - L})_+
        return float(np.sum(np.exp(logpmf) * gain)) - delta

    return optimize.brentq(d, 0.0, k * eps0, xtol=xtol)
