"""A ``budget_split`` whose ratios are too far apart is refused naming it.

Calibrating SSP's common scale ``s`` for noise multipliers ``r_i s`` fails when the
ratios differ by many orders of magnitude (the smallest multiplier would need ``s``
beyond the range searched): the refusal was the calibrator's, advising to "pass
bounds=(lower, upper)", a parameter the estimators do not take, and naming neither
``budget_split`` nor the estimator.
"""

from __future__ import annotations

import numpy as np
import pytest

from privlearn.accounting import Gaussian, compose
from privlearn.errors import ConfigurationError
from privlearn.models import AdaSSPRegressor, SSPRegressor

X = np.random.default_rng(0).uniform(-0.5, 0.5, size=(40, 2))
Y = X[:, 0]


@pytest.mark.slow  # each failed calibration searches the whole range: ~5 s
@pytest.mark.parametrize(
    "make, split",
    [(SSPRegressor, (1e-12, 1.0)), (AdaSSPRegressor, (1.0, 1.0, 1e-13))],
)
def test_ratios_too_far_apart_are_refused_naming_budget_split(make, split):
    # the premise: at the largest scale searched (1e12) the smallest multiplier is
    # still far too small for epsilon 1 at delta 1e-6
    assert compose([Gaussian(r * 1e12) for r in split]).epsilon(1e-6) > 1.0
    with pytest.raises(ConfigurationError, match=r"budget_split=\(.*\) cannot be calibrated") as e:
        make(budget_split=split).fit(X, Y)
    assert "bounds=" not in str(e.value)
