"""The private scaler against closed forms: its epsilon is the analytic Gaussian
mechanism's (Balle & Wang 2018, Theorem 8) for the composition it runs, the noise it
draws has the accounted scale, and a record outside ``feature_range`` moves the released
sums by at most the sensitivity the accounting assumes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize
from scipy.stats import norm

from privlearn.models.preprocessing import PrivateStandardScaler


def analytic_gaussian_epsilon(sigma: float, delta: float) -> float:
    """Smallest epsilon of the Gaussian mechanism with noise ``sigma`` times the L2
    sensitivity at ``delta`` (Balle & Wang 2018, Theorem 8)."""
    def excess(eps):
        return (norm.cdf(0.5 / sigma - eps * sigma)
                - math.exp(eps) * norm.cdf(-0.5 / sigma - eps * sigma) - delta)
    return optimize.brentq(excess, 0.0, 100.0, xtol=1e-13)


@pytest.mark.parametrize("quantile", [0.01, None])
@pytest.mark.parametrize("epsilon, delta", [(0.5, 1e-6), (2.0, 1e-5)])
def test_scaler_epsilon_is_the_analytic_gaussian_of_what_it_runs(quantile, epsilon, delta):
    X = np.random.default_rng(0).normal(size=(500, 3))
    sc = PrivateStandardScaler(epsilon=epsilon, delta=delta, feature_range=(-10, 10),
                               quantile=quantile, random_state=0).fit(X)
    s = sc.noise_multiplier_
    # two Gaussian releases (histogram, moments) with multiplier s = one with s / sqrt(2)
    exact = analytic_gaussian_epsilon(s / math.sqrt(2.0) if quantile else s, delta)
    assert sc.epsilon_ >= exact * (1 - 1e-9)
    assert exact <= epsilon * (1 + 1e-9)  # calibrated within the budget ...
    assert sc.epsilon_ <= exact + 0.01 * epsilon  # ... and accounted tightly


def test_scaler_noise_has_the_accounted_scale():
    """The noisy row count (one coordinate of the moment release) has standard deviation
    ``noise_multiplier sqrt(2 d + 1)``: the L2 sensitivity of ``[u, u^2, 1]`` with
    ``u in [-1, 1]^d``."""
    d, n = 1, 1000
    X = np.random.default_rng(0).uniform(-1, 1, size=(n, d))
    counts, s = [], None
    for seed in range(400):
        sc = PrivateStandardScaler(epsilon=1.0, delta=1e-6, feature_range=(-1, 1),
                                   quantile=None, random_state=seed).fit(X)
        counts.append(sc.n_samples_seen_)
        s = sc.noise_multiplier_
    sd = s * math.sqrt(2 * d + 1)
    assert abs(np.mean(counts) - n) < 4 * sd / math.sqrt(400)
    assert 0.88 < np.std(counts) / sd < 1.12  # sqrt(2 d) / sqrt(2 d + 1) = 0.82


@pytest.mark.filterwarnings("ignore::privlearn.errors.DataClippedWarning")  # the point
@pytest.mark.parametrize("outlier", [1e9, -1e9, 3.0])
def test_a_record_outside_the_range_moves_the_sums_by_at_most_one(outlier):
    """Same noise (same seed), datasets differing in one record far outside
    ``feature_range``: the released first-moment sum ``(mean_ - c) / r * N`` and the count
    ``N`` change by at most 1 each (the clipped record's contribution)."""
    X = np.random.default_rng(1).uniform(-1, 1, size=(400, 2))
    X2 = np.vstack([X, [[outlier, 0.0]]])
    fit = [PrivateStandardScaler(epsilon=1.0, delta=1e-6, feature_range=(-2, 2),
                                 quantile=None, random_state=7).fit(Z) for Z in (X, X2)]
    sums = [(f.mean_ - 0.0) / 2.0 * f.n_samples_seen_ for f in fit]
    assert abs(fit[1].n_samples_seen_ - fit[0].n_samples_seen_ - 1.0) < 1e-9
    assert np.all(np.abs(sums[1] - sums[0]) <= 1.0 + 1e-9)
    assert np.all(np.abs(fit[1].bounds_) <= 2.0)
