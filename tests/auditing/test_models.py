"""audit_estimator: the claim it compares with is the estimator's epsilon at the delta
of the audit, not at the estimator's own delta."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from _audit_helpers import unit_ball_regression
from scipy.optimize import brentq
from scipy.stats import norm

from privlearn.accounting import Gaussian

pytest.importorskip("sklearn")
from sklearn.base import BaseEstimator, RegressorMixin  # noqa: E402

from privlearn.auditing.models import audit_estimator  # noqa: E402


def _gaussian_epsilon(mu: float, delta: float) -> float:
    """epsilon(delta) of the Gaussian mechanism of sensitivity/std ``mu`` (Balle & Wang
    2018, Theorem 8: delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu))."""
    if delta == 0:
        return math.inf

    def gap(eps):
        return norm.cdf(mu / 2 - eps / mu) - math.exp(eps) * norm.cdf(-mu / 2 - eps / mu) - delta

    return brentq(gap, 0.0, 200.0, xtol=1e-12) if gap(0.0) > 0 else 0.0


class GaussianSumRegressor(RegressorMixin, BaseEstimator):
    """An honest release: ``coef_ = X^T y + N(0, (sigma x_bound y_bound)^2 I)``, the
    Gaussian mechanism with noise multiplier ``sigma`` (one record moves ``X^T y`` by at
    most ``x_bound * y_bound`` in L2), accounted at ``delta`` like privlearn's
    estimators (``mechanism_``, ``epsilon_``, ``delta_``)."""

    def __init__(self, sigma=0.5, delta=0.3, x_bound=1.0, y_bound=1.0, random_state=None):
        self.sigma, self.delta, self.x_bound, self.y_bound = sigma, delta, x_bound, y_bound
        self.random_state = random_state

    def fit(self, X, y):
        rng = np.random.default_rng(self.random_state)
        assert np.all(np.linalg.norm(X, axis=1) <= self.x_bound + 1e-12)
        assert np.all(np.abs(y) <= self.y_bound)
        noise = rng.normal(0.0, self.sigma * self.x_bound * self.y_bound, X.shape[1])
        self.coef_ = X.T @ y + noise
        self.mechanism_ = Gaussian(self.sigma)
        self.delta_ = float(self.delta)
        self.epsilon_ = float(self.mechanism_.epsilon(self.delta_))
        return self


@pytest.fixture
def data():
    return unit_ball_regression(100, [0.3, -0.2, 0.1])


def test_an_audit_at_a_smaller_delta_compares_with_the_epsilon_at_that_delta(data):
    # mu = 2: epsilon 2.19 at the estimator's delta 0.3, 11.0 at 1e-6; 1,000 canaries
    # give a one-run bound near 3 at delta 1e-6, which refutes nothing of the mechanism
    # but exceeded the estimator's epsilon at its own delta (a false violation)
    est = GaussianSumRegressor(sigma=0.5, delta=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for seed in range(3):
            res = audit_estimator(est, *data, 1000, delta=1e-6, seed=seed)
            assert res.delta == 1e-6
            assert res.claimed_epsilon == pytest.approx(_gaussian_epsilon(2.0, 1e-6), rel=1e-3)
            assert res.epsilon_lower_bound > _gaussian_epsilon(2.0, 0.3)  # the attack is strong
            assert not res.violation


def test_the_default_delta_keeps_the_estimators_epsilon(data):
    est = GaussianSumRegressor(sigma=0.5, delta=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = audit_estimator(est, *data, 200, seed=0)
    assert res.delta == 0.3
    assert res.claimed_epsilon == pytest.approx(_gaussian_epsilon(2.0, 0.3), rel=1e-3)


def test_an_audit_at_delta_zero_of_a_gaussian_release_claims_no_finite_epsilon(data):
    est = GaussianSumRegressor(sigma=0.5, delta=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = audit_estimator(est, *data, 200, delta=0.0, seed=0)
    assert res.claimed_epsilon == math.inf and not res.violation
