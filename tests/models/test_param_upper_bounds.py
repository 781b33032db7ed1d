"""Absurd counts and a subnormal score budget are refused up front with a typed error
naming the parameter (2**70 iterations was a bare OverflowError or a calibration without
end; 2**70 bins or expected runs ran out of memory; a subnormal score_epsilon was
reported as noise_multiplier=inf)."""

import warnings

import numpy as np
import pytest

from privlearn.errors import ParameterValueError
from privlearn.models import (
    DPSGDClassifier,
    DPSGDRegressor,
    NoisyGDRegressor,
    PrivateSearchCV,
    PrivateStandardScaler,
)

rng = np.random.default_rng(0)
X = rng.uniform(-1, 1, (40, 3))
y_cls = (X[:, 0] > 0).astype(int)
y_reg = X[:, 0].copy()


@pytest.mark.parametrize(
    "make, y",
    [
        (lambda: DPSGDClassifier(epsilon=1, delta=1e-5, n_iter=2**70, classes=[0, 1]), y_cls),
        (lambda: DPSGDRegressor(epsilon=1, delta=1e-5, n_iter=2**70), y_reg),
        (lambda: NoisyGDRegressor(epsilon=1, delta=1e-5, n_iter=2**70), y_reg),
        (
            lambda: NoisyGDRegressor(epsilon=1, delta=1e-5, n_iter=2**70, noise_multiplier=None),
            y_reg,
        ),
    ],
)
def test_huge_n_iter_is_refused_naming_n_iter(make, y):
    with pytest.raises(ParameterValueError, match=r"n_iter must be an integer in \[1, "):
        make().fit(X, y)


def test_huge_n_bins_is_refused_naming_n_bins():
    with pytest.raises(ParameterValueError, match=r"n_bins must be an integer in \[2, "):
        PrivateStandardScaler(n_bins=2**70, feature_range=(-1, 1)).fit(X)


def _search(**kw):
    return PrivateSearchCV(
        NoisyGDRegressor(epsilon=1, delta=1e-5, n_iter=10),
        {"n_iter": [10, 20]},
        loss_bound=1.0,
        **kw,
    )


def test_huge_expected_runs_is_refused_naming_expected_runs():
    with pytest.raises(ParameterValueError, match=r"expected_runs must be in \[1, "):
        _search(expected_runs=2**70).fit(X, y_reg)


def test_subnormal_score_epsilon_is_refused_naming_score_epsilon():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ParameterValueError, match=r"^score_epsilon must be .* got 5e-324"):
            _search(score_epsilon=5e-324).fit(X, y_reg)


def test_bounds_admit_their_maximum():
    from privlearn.models.constraints import MAX_ITERATIONS, N_BINS, N_ITER

    assert N_ITER("n_iter", MAX_ITERATIONS) == 2**31 - 1
    assert N_BINS("n_bins", 10**6) == 10**6
