"""Independent-trials bounds at large counts: the order-statistic quantiles must be
certified (never an error, never optimistic) for a million canaries and more."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize, stats
from scipy.special import betainc

from privlearn.auditing import bounds as B
from privlearn.auditing import epsilon_lower_bound


@pytest.mark.parametrize("n_ref", [500_000, 5_000_000, 50_000_000])
def test_beta_quantiles_are_certified_on_the_whole_grid_at_huge_counts(n_ref):
    # every threshold of the grid of an audit with n_ref reference scores: each returned
    # quantile has its CDF (scipy's regularised incomplete beta) at or above its level
    for c in np.concatenate([[0], B._count_grid(1, n_ref - 1)]):
        a, b = c + 1.0, float(n_ref - c)
        f = B._beta_quantiles_above(a, b)
        assert np.all(betainc(a, b, f) >= B._QUAD_LEVELS), (a, b)


def _gaussian_epsilon(mu: float, delta: float) -> float:
    """epsilon(delta) of mu-GDP (Balle & Wang 2018, Theorem 8), solved with brentq."""
    def gap(eps):
        return (stats.norm.cdf(-eps / mu + mu / 2)
                - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2) - delta)

    return optimize.brentq(gap, 0.0, 50.0, xtol=1e-12)


@pytest.mark.parametrize("method", ["clopper_pearson", "gdp"])
def test_a_million_independent_trials_give_a_valid_bound(method):
    # a million scores of the ideal attack on 1-GDP: the audit is computed (it raised
    # ArithmeticError when a Beta quantile of its grid could not be certified) and stays
    # below the true epsilon of the mechanism, with power
    delta = 1e-7
    rng = np.random.default_rng(7)
    lab = rng.random(1_000_000) < 0.5
    s = rng.normal(size=lab.size) + 1.0 * lab
    bound = epsilon_lower_bound(s[lab], s[~lab], delta=delta, method=method)
    truth = _gaussian_epsilon(1.0, delta)
    assert 0.5 * truth < bound <= truth, (bound, truth)
