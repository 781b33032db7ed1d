"""Public bounds whose noise overflows float64 are refused before anything is spent.

Each release adds a standard normal (or Laplace) draw times a scale fixed by public
settings alone: the calibrated multiplier times the sensitivity (``x_bound^2`` for
``X^T X``, ``x_bound * y_bound`` for ``X^T y`` and NoisyGD's first gradient,
``max_grad_norm`` for DP-SGD's clipped sum). The earlier check refused only an
``x_bound`` whose square overflows (about 1e154): bounds below it whose noise scale
overflows failed inside the release, after the ledger reservation (a bare
``LinAlgError``, a "diverged" ``FloatingPointError`` advising a smaller learning rate),
or returned coefficients of 0 from overflowed arithmetic.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from privlearn.accounting import Gaussian, calibrate, compose
from privlearn.errors import ConfigurationError, DataClippedWarning
from privlearn.ledger import Ledger
from privlearn.models import (
    AdaSSPRegressor,
    DPSGDClassifier,
    DPSGDRegressor,
    NoisyGDRegressor,
    SSPRegressor,
)
from privlearn.models._ssp import ssp_release

RNG = np.random.default_rng(0)
X = RNG.uniform(-1.0, 1.0, size=(200, 3)) / np.sqrt(3.0)  # rows of norm <= 1
Y = X @ [0.3, -0.2, 0.1]

CASES = {
    # x_bound's square is finite (the earlier check passed it), the noise on X^T X is not
    "ssp-x": (SSPRegressor, {"x_bound": 9e153}, Y),
    "adassp-x": (AdaSSPRegressor, {"x_bound": 1e153}, Y),
    "ssp-y": (SSPRegressor, {"y_bound": 1e307}, Y),
    "noisygd-x": (NoisyGDRegressor, {"x_bound": 9e153, "noise_multiplier": 50.0}, Y),
    "noisygd-y": (NoisyGDRegressor, {"y_bound": 1e307, "noise_multiplier": 50.0}, Y),
    "dpsgd-regressor": (DPSGDRegressor, {"max_grad_norm": 1e308, "n_iter": 5}, Y),
    "dpsgd-classifier": (
        DPSGDClassifier,
        {"max_grad_norm": 1e306, "n_iter": 5, "classes": [0, 1]},
        (Y > 0).astype(int),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bounds_whose_noise_overflows_are_refused_before_the_ledger_is_charged(case, tmp_path):
    cls, kw, y = CASES[case]
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=5.0, delta=1e-4)
    est = cls(epsilon=1.0, delta=1e-5, ledger=led.budget("d"), random_state=0, **kw)
    with pytest.raises(ConfigurationError, match="overflows float64") as info:
        est.fit(X, y)
    assert all(
        f"{k}={v!r}" in str(info.value)
        for k, v in kw.items()
        if k in ("x_bound", "y_bound", "max_grad_norm")
    )
    assert led.spent("d").entries == 0
    assert not hasattr(est, "coef_")


def test_the_refused_ssp_scale_does_overflow_the_release():
    """Ground truth for ``ssp-y``: SSP's common scale ``s`` calibrated independently
    (the composition of Gaussians of multipliers ``2 s`` and ``3 s`` at epsilon 1,
    delta 1e-5), then the release kernel run at it. Its noise on ``X^T y`` has scale
    ``3 s sqrt(2) 1e307``, about ``1e308``: draws beyond ``1.7`` standard deviations are
    infinite, and the fits fail after the noise was drawn."""
    s = float(calibrate(lambda v: compose([Gaussian(2 * v), Gaussian(3 * v)]), 1.0, 1e-5))
    Z = np.hstack([X, np.full((len(X), 1), 1.0)])
    failed = 0
    for seed in range(10):
        with np.errstate(all="ignore"):
            try:
                ssp_release(
                    Z.T @ Z,
                    Z.T @ Y,
                    s,
                    (2.0, 3.0),
                    math.sqrt(2.0),
                    1e307,
                    np.random.default_rng(seed),
                    adaptive=False,
                )
            except (FloatingPointError, np.linalg.LinAlgError):
                failed += 1
    assert failed > 0


@pytest.mark.parametrize("case", list(CASES))
def test_bounds_ten_thousand_times_smaller_still_fit_to_finite_predictions(case):
    cls, kw, y = CASES[case]
    kw = {
        k: (v / 1e4 if k in ("x_bound", "y_bound", "max_grad_norm") else v) for k, v in kw.items()
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow in the release either
        warnings.simplefilter("ignore", DataClippedWarning)
        est = cls(epsilon=1.0, delta=1e-5, random_state=0, **kw).fit(X, y)
    assert np.all(np.isfinite(est.coef_)) and np.isfinite(est.intercept_)
