"""The delta queries of the PLD grid cut at loss 690 (small noise multipliers, see
:mod:`privlearn.accounting._pld_grid_tail`): the certified delta at an epsilon is never
below a lower bound on the true delta computed independently of privlearn."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import special, stats

from privlearn.accounting import Gaussian, compose, subsample


def _gaussian_log_delta(mu: np.ndarray, eps: np.ndarray) -> np.ndarray:
    """log delta(eps) of N(mu, 1) against N(0, 1) (Balle & Wang 2018, Theorem 8)."""
    a = special.log_ndtr(mu / 2 - eps / mu)
    b = eps + special.log_ndtr(-mu / 2 - eps / mu)
    with np.errstate(all="ignore"):
        return np.where(b >= a, -np.inf, a + np.log1p(-np.exp(np.minimum(b - a, 0.0))))


def _lower_delta(sigma: float, q: float, steps: int, eps: float) -> float:
    """A lower bound on delta(eps) of ``steps`` Poisson-subsampled Gaussian steps (remove
    direction): a sampled step's loss ``log(1 - q + q e^L)`` is at least ``log q + L``, an
    unsampled one's at least ``log(1 - q)``, delta(eps) = E_P[(1 - e^(eps - S))_+]
    increases with the summed loss S, and the base losses of k sampled steps sum to the
    loss of a Gaussian with ``mu = sqrt(k) / sigma``."""
    ks = np.arange(1, steps + 1)
    log_w = stats.binom.logpmf(ks, steps, q)
    shift = eps - ks * math.log(q) - (steps - ks) * math.log1p(-q)
    return float(np.exp(special.logsumexp(log_w + _gaussian_log_delta(np.sqrt(ks) / sigma, shift))))


@pytest.mark.parametrize(
    "sigma, q, steps, eps",
    [
        (0.03, 0.3, 10, 4000.0),  # single-step losses up to ~865
        (0.01, 0.01, 10, 10000.0),  # up to ~5800
        (0.005, 0.99, 3, 61000.0),  # beyond 1e4
        (0.02, 0.002, 200, 2500.0),
    ],
)
def test_cut_grid_delta_is_not_below_an_independent_lower_bound(sigma, q, steps, eps) -> None:
    want = _lower_delta(sigma, q, steps, eps)
    assert 1e-14 < want < 0.5  # a query in the range that matters, not a vacuous one
    b = compose(subsample(Gaussian(sigma), q), steps).delta_bounds(eps)
    assert b.accountant == "pld"
    assert b.upper >= want * (1 - 1e-12)
    assert b.lower <= b.upper
    assert b.upper <= 1.5 * want  # the lower bound is tight at these noise multipliers
