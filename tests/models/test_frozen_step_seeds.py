"""A frozen private step seeded like another private step of the pipeline is warned of.

``PrivatePipeline`` warns when its private steps share an integer ``random_state``: they
draw the same normals, and a combination of their releases cancels the noise. A private
fit made beforehand and kept as a ``sklearn.frozen.FrozenEstimator`` step drew its noise
from its seed's stream too, but its seed was not compared: ``PrivateStandardScaler(...,
random_state=42)`` frozen before ``SSPRegressor(random_state=42)`` fitted unwarned.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from sklearn.frozen import FrozenEstimator

from privlearn.errors import PrivacyLeakWarning
from privlearn.models import PrivatePipeline, PrivateStandardScaler, SSPRegressor

RNG = np.random.default_rng(0)
X = RNG.uniform(-1.0, 1.0, size=(100, 2)) / 2.0
Y = X @ [0.3, -0.2]


def _scaler(seed):
    return PrivateStandardScaler(feature_range=(-1, 1), quantile=None, random_state=seed)


def test_the_two_fits_draw_the_same_normals():
    """The premise, from NumPy alone: the scaler's moment release and SSP's X^T X noise
    both start with ``default_rng(42)``'s first normals."""
    a = np.random.default_rng(42).normal(size=5)
    b = np.random.default_rng(42).standard_normal((1, 3, 3)).ravel()
    np.testing.assert_array_equal(a, b[:5])


@pytest.mark.parametrize("nested", [False, True])
def test_a_frozen_private_fit_sharing_an_int_seed_is_warned_of(nested):
    kept = _scaler(42).fit(X)
    if nested:
        kept = PrivatePipeline([("scale", _scaler(42))]).fit(X)
    pipe = PrivatePipeline(
        [("pre", FrozenEstimator(kept)), ("model", SSPRegressor(random_state=42))]
    )
    with pytest.warns(PrivacyLeakWarning, match=r"share random_state=42"):
        pipe.fit(X, Y)


@pytest.mark.parametrize("seeds", [(42, 7), (42, None), (None, None)])
def test_a_frozen_private_fit_seeded_otherwise_is_not(seeds):
    pipe = PrivatePipeline(
        [
            ("pre", FrozenEstimator(_scaler(seeds[0]).fit(X))),
            ("model", SSPRegressor(random_state=seeds[1])),
        ]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyLeakWarning)
        pipe.fit(X, Y)
