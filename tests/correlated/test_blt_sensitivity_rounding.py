"""The certified sensitivity of a BLT bounds that of the BLT itself, not only that of its
rounded Toeplitz coefficients: checked against the sensitivity computed in 200-bit
arithmetic (mpmath) from the same float parameters, a naive ground truth."""

from __future__ import annotations

import mpmath
import numpy as np
import pytest

from privlearn.correlated import (
    BufferedToeplitz,
    FixedEpochs,
    MinSeparation,
    SingleParticipation,
    sensitivity,
)


def _exact(theta, omega, n: int, sep: int, k: int) -> mpmath.mpf:
    """``||C (e_0 + e_sep + ... )||`` for ``min(k, ceil(n / sep))`` participations, the
    worst pattern for non-negative decreasing coefficients ([KL24] Theorem 2), in
    200-bit arithmetic."""
    with mpmath.workprec(200):
        th = [mpmath.mpf(t) for t in theta]
        om = [mpmath.mpf(w) for w in omega]
        c = [mpmath.mpf(1)] + [
            mpmath.fsum(w * t**j for w, t in zip(om, th, strict=True)) for j in range(n - 1)
        ]
        k = min(k, (n - 1) // sep + 1)
        total = mpmath.mpf(0)
        for i in range(n):
            s = mpmath.fsum(c[i - m * sep] for m in range(k) if i - m * sep >= 0)
            total += s * s
        return mpmath.sqrt(total)


# BLTs whose float coefficients' norm fell below the exact norm (found by a random search
# over decays in (0.05, 0.99) and weights summing to < 0.9): (decays, weights, steps)
SINGLE = [
    ((0.963589512680572,), (0.8867380958420974,), 100),
    ((0.5173797911869006, 0.41698918194224593), (0.24669274383451395, 0.42868912690322136), 118),
    ((0.8878522366959716, 0.5742219070133568), (0.7839100980065291, 0.07307437465836157), 26),
    (
        (0.9185441377703081, 0.8279394540276578, 0.8139846648117697),
        (0.5871189799970271, 0.016931198600193847, 0.16992371145726418),
        8,
    ),
    (
        (0.33656921654286076, 0.29166447214814584, 0.13160593666016282),
        (0.1810450393331149, 0.04171895722604316, 0.07068407395094722),
        106,
    ),
    (
        (0.9361063105530014, 0.8085846833105045, 0.3538696407572757),
        (0.44670400907462715, 0.09850112376074241, 0.1838976916143371),
        116,
    ),
    (
        (0.9166705060258307, 0.4399185833671871, 0.2201432101067835, 0.08211132746524538),
        (0.267184854005816, 0.0388004646392024, 0.1288322401553593, 0.12702557662403258),
        91,
    ),
]


@pytest.mark.parametrize("theta,omega,n", SINGLE)
def test_single_participation_bounds_the_exact_norm(theta, omega, n):
    s = sensitivity(BufferedToeplitz(theta, omega), SingleParticipation(), n)
    exact = _exact(theta, omega, n, n, 1)
    assert mpmath.mpf(s.value) >= exact
    assert s.value == pytest.approx(float(exact), rel=1e-13)  # and stays tight


def test_random_blts_under_every_schema_bound_the_exact_value():
    rng = np.random.default_rng(7)
    for _ in range(60):
        m = int(rng.integers(1, 5))
        theta = tuple(np.sort(rng.uniform(0.05, 0.99, m))[::-1].tolist())
        omega = tuple((rng.dirichlet(np.ones(m + 1))[:m] * 0.9).tolist())
        C = BufferedToeplitz(theta, omega)
        k = int(rng.integers(2, 12))
        n = k * int(rng.integers(1, 12))
        sep = int(rng.integers(1, n + 1))
        for part, (s, kk) in [
            (SingleParticipation(), (n, 1)),
            (MinSeparation(sep, k), (sep, k)),
            (FixedEpochs(k), (n // k, k)),
        ]:
            value = sensitivity(C, part, n).value
            exact = _exact(theta, omega, n, s, kk)
            assert mpmath.mpf(value) >= exact, (theta, omega, n, part)
            assert value == pytest.approx(float(exact), rel=1e-13)
