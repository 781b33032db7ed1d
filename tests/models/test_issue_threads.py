"""Scenarios from users' issue threads on private scikit-learn libraries (diffprivlib,
SmartNoise, OpenDP, Private-kNN, PATE implementations), replayed on privlearn's
estimators. Each test checks a ground truth that does not come from privlearn's own
output: a closed-form sensitivity, a brute-force comparison of neighbouring data sets,
scikit-learn's or NumPy's own result, or equal noise draws that independent noise would
give with probability 0."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from sklearn.base import clone

from privlearn.errors import PrivacyLeakWarning
from privlearn.models import PrivatePipeline, PrivateStandardScaler, SSPRegressor

# the clipping reports go to the person fitting; not the subject here
pytestmark = pytest.mark.filterwarnings("ignore::privlearn.errors.DataClippedWarning")

RNG = np.random.default_rng(2026)
X = RNG.uniform(-1.0, 1.0, size=(300, 2))
Y = X @ np.array([0.4, -0.3])


def _scaler(random_state) -> PrivateStandardScaler:
    return PrivateStandardScaler(feature_range=(-1, 1), quantile=None, random_state=random_state)


def _leaves(pipe: PrivatePipeline) -> list:
    out = []
    for _, step in pipe.steps:
        out.extend(_leaves(step) if isinstance(step, PrivatePipeline) else [step])
    return out


@pytest.mark.parametrize(
    "make",
    [
        # one Generator, copied into each step by sklearn.base.clone (cross_val_score,
        # GridSearchCV): the copies start in the original's state
        lambda: clone(
            PrivatePipeline(
                [
                    ("a", _scaler(g := np.random.default_rng(5))),
                    ("inner", PrivatePipeline([("b", _scaler(g))])),
                ]
            )
        ),
        lambda: PrivatePipeline(
            [("a", _scaler(np.random.default_rng(1))), ("b", _scaler(np.random.default_rng(1)))]
        ),
        lambda: PrivatePipeline(
            [("a", _scaler(np.random.RandomState(1))), ("b", _scaler(np.random.RandomState(1)))]
        ),
    ],
    ids=["cloned-generator", "two-generators-one-seed", "two-randomstates-one-seed"],
)
def test_steps_whose_generators_start_alike_are_warned_as_shared_seeds(make):
    """IBM/differential-privacy-library#31 (and #72, #79): "using the same seed to
    instantiate multiple mechanisms may result in correlated noise, which will break
    differential privacy". The pipeline warned when two private steps shared an integer
    seed, but not when they held generators in one state -- what clone() makes of one
    Generator passed to several steps, and what np.random.default_rng(1) passed twice is.
    Both steps then release their noisy row counts with the very same noise (equal
    n_samples_seen_, which independent noise gives with probability 0)."""
    pipe = make()
    with pytest.warns(PrivacyLeakWarning, match="share random_state"):
        pipe.fit(X)
    a, b = _leaves(pipe)
    assert a.n_samples_seen_ == b.n_samples_seen_ != X.shape[0]


def test_one_generator_object_shared_by_the_steps_draws_independent_noise():
    """The same Generator *object* in every step (not copied) is drawn from in turn: the
    noise differs, and nothing is warned."""
    g = np.random.default_rng(5)
    pipe = PrivatePipeline([("a", _scaler(g)), ("m", SSPRegressor(random_state=g))])
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyLeakWarning)
        pipe.fit(X, Y)
        twin = PrivatePipeline([("a", _scaler(g)), ("b", _scaler(g))]).fit(X)
    a, b = _leaves(twin)
    assert a.n_samples_seen_ != b.n_samples_seen_
