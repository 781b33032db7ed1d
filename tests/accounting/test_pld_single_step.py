"""One subsampled Gaussian step is answered from its dominating pair (no grid): checked
against a naive ground truth, the hockey-stick divergence integrated in high precision."""

from __future__ import annotations

import math

import mpmath
import pytest

from privlearn.accounting import Gaussian, subsample
from privlearn.accounting.pld import PLDAccountant

mpmath.mp.dps = 40


def _mixture_delta(sigma: float, q: float, eps: float, remove: bool, sens: float) -> float:
    """``sup_S P(S) - e^eps Q(S)`` of the Poisson pair, integrated over the output y.

    remove: ``P = (1-q) N(0, s^2) + q N(c, s^2)``, ``Q = N(0, s^2)``; add: the pair swapped.
    The integrand ``(p - e^eps q)_+`` is positive on one half-line (the loss is monotone
    in y); its end is found by root finding and the integral taken by quadrature."""
    s, c, e = mpmath.mpf(sigma), mpmath.mpf(sens), mpmath.e ** mpmath.mpf(eps)

    def pdf(y, m):
        return mpmath.npdf(y, m, s)

    def mix(y):
        return (1 - q) * pdf(y, 0) + q * pdf(y, c)

    if remove:
        f = lambda y: mix(y) - e * pdf(y, 0)  # noqa: E731  positive for large y
    else:
        f = lambda y: pdf(y, 0) - e * mix(y)  # noqa: E731  positive for small y
    lo, hi = mpmath.mpf(-60) * s - c, mpmath.mpf(60) * s + c
    if f(hi if remove else lo) <= 0:
        return 0.0
    a, b = lo, hi  # bisection on the sign change (f changes sign once)
    for _ in range(200):
        mid = (a + b) / 2
        if (f(mid) > 0) == remove:
            b = mid
        else:
            a = mid
    root = (a + b) / 2
    pts = [root, root + 10 * s, hi] if remove else [lo, root - 10 * s, root]
    pts = sorted(pts)
    return float(mpmath.quad(f, pts))


def _truth(sigma, q, eps, scheme):
    sens = 1.0 if scheme == "poisson" else 2.0  # fixed size: twice the sensitivity
    return max(
        _mixture_delta(sigma, q, eps, True, sens), _mixture_delta(sigma, q, eps, False, sens)
    )


CASES = [
    (0.3, 1e-5, "poisson"),
    (0.3, 1e-5, "fixed"),
    (1.0, 0.01, "poisson"),
    (0.8, 1e-3, "poisson"),
    (2.0, 0.5, "fixed"),
    (0.6, 0.3, "poisson"),
]


@pytest.mark.parametrize(("sigma", "q", "scheme"), CASES)
def test_single_step_delta_brackets_the_integral(sigma, q, scheme):
    m = subsample(Gaussian(noise_multiplier=sigma), rate=q, scheme=scheme)
    for eps in (0.05, 0.5, 2.0):
        b = PLDAccountant().delta(m, eps)
        truth = _truth(sigma, q, eps, scheme)
        assert b.lower <= truth * (1 + 1e-12) and truth <= b.upper * (1 + 1e-12)
        assert b.upper - b.lower <= 1e-6 * b.upper + 1e-300


@pytest.mark.parametrize(("sigma", "q", "scheme"), CASES)
@pytest.mark.parametrize("delta", [1e-12, 1e-5])
def test_single_step_epsilon_is_certified_and_tight(sigma, q, scheme, delta):
    m = subsample(Gaussian(noise_multiplier=sigma), rate=q, scheme=scheme)
    b = PLDAccountant().epsilon(m, delta)
    # the grid left sigma 0.3, q 1e-5, delta 1e-12 with a 12% bracket, after ~10-30 s
    assert b.upper - b.lower <= 1e-9 * max(b.upper, 1e-12)
    if b.upper > 0:
        assert _truth(sigma, q, b.upper, scheme) <= delta * (1 + 1e-10)
    if b.lower > 0:
        assert _truth(sigma, q, b.lower, scheme) >= delta * (1 - 1e-10)


def test_single_step_replace_one_fixed_size_matches_symmetrised_profile():
    # replace-one, fixed size: max of the two directions of the base at twice the bound
    m = subsample(
        Gaussian(noise_multiplier=2.0), rate=0.5, scheme="fixed", neighbouring="replace_one"
    )
    b = PLDAccountant().delta(m, 1.0)
    truth = _truth(2.0, 0.5, 1.0, "fixed")
    assert b.lower <= truth <= b.upper * (1 + 1e-12)
    assert not math.isclose(b.upper, 0.0)
