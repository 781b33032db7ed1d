"""Input handling shared by the private linear regressors of :mod:`privlearn.models.linear`."""

from __future__ import annotations

import math
import warnings

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils.validation import check_is_fitted, validate_data

from privlearn.models._base import (
    check_positive_param,
    check_privacy_budget,
    clip_rows,
)
from privlearn.models._params import (
    ACCOUNTANT,
    EPSILON,
    LEDGER,
    RANDOM_STATE,
    Boolean,
    Delta,
    PrivateEstimatorMixin,
    Real,
    Unchecked,
)
from privlearn.models._release import DataClippedWarning, _RemovedAttributesMixin
from privlearn.models._ssp import check_label_range

#: Constraints of the parameters every private linear regressor has.
COMMON_CONSTRAINTS = {
    "epsilon": EPSILON,
    "delta": Delta(),
    "x_bound": Real(0, None, low_open=True,
                    hint="the public bound on the rows' L2 norm (rows are clipped to it)"),
    "y_bound": Unchecked("a bound B (labels in [-B, B]) or a public interval (lo, hi), "
                         "checked by check_label_range"),
    "fit_intercept": Boolean(),
    "accountant": ACCOUNTANT,
    "random_state": RANDOM_STATE,
    "ledger": LEDGER,
}


class _PrivateLinearBase(PrivateEstimatorMixin, _RemovedAttributesMixin, RegressorMixin,
                         BaseEstimator):
    """Shared input handling: validation, clipping, intercept, prediction."""

    _removed_attributes = ("n_rows_clipped_", "n_labels_clipped_")
    _parameter_constraints = COMMON_CONSTRAINTS

    def _validate_common(self) -> tuple[float, float, float, float]:
        self._validate_params()
        eps, delta = check_privacy_budget(self.epsilon, self.delta)
        if delta == 0.0:
            raise ValueError(
                f"delta must be in (0, 1) for {type(self).__name__} (it uses Gaussian noise, "
                "which has no pure-DP guarantee), got delta=0; pass a small delta such as "
                "1e-6"
            )
        xb = check_positive_param("x_bound", self.x_bound)
        lo, hi = check_label_range(self.y_bound)
        if not isinstance(self.fit_intercept, bool | np.bool_):
            raise ValueError(f"fit_intercept must be a bool, got {self.fit_intercept!r}")
        return eps, delta, xb, self._label_sensitivity_bound(lo, hi)

    @property
    def _y_range(self) -> tuple[float, float]:
        return check_label_range(self.y_bound)

    def _label_centre(self) -> float:
        """Public shift subtracted from the labels before fitting (0 unless an intercept is
        fitted with an interval ``y_bound``, then its midpoint)."""
        lo, hi = self._y_range
        return 0.5 * (lo + hi) if self.fit_intercept else 0.0

    def _label_sensitivity_bound(self, lo: float, hi: float) -> float:
        """Bound ``Y`` on ``|y - c|`` for the (clipped, centred) labels the mechanism sees.

        With an intercept the labels are centred at the public midpoint ``c = (lo + hi) / 2``
        (the intercept absorbs the shift exactly), so ``Y = (hi - lo) / 2``; without one
        there is no shift, and ``Y = max(|lo|, |hi|)``. Every sensitivity (``X^T y``: ``X Y``;
        NoisyGD's gradient: ``X^2 ||theta|| + X Y``) uses ``Y`` -- never less than the true
        bound on the labels used."""
        if self.fit_intercept:
            return 0.5 * (hi - lo)
        return max(abs(lo), abs(hi))

    def _prepare(self, X, y, xb: float, yb: float):
        X, y = validate_data(self, X, y, y_numeric=True, dtype=np.float64)
        if X.shape[0] < 1:
            raise ValueError("X must have at least one sample")
        # Rows above the bound by floating-point rounding only (e.g. L2-normalised rows
        # with norm 1 + 2e-16) are clipped too, but not reported.
        n_clipped = int(np.count_nonzero(np.linalg.norm(X, axis=1) > xb * (1.0 + 1e-9)))
        X, _ = clip_rows(X, xb)
        lo, hi = self._y_range
        y_clipped = np.clip(y, lo, hi)
        n_labels = int(np.count_nonzero(y_clipped != y))
        if n_clipped or n_labels:
            # To the person fitting only: the counts are never stored on the model.
            warnings.warn(
                f"{type(self).__name__}: clipping changed {n_clipped} of {X.shape[0]} rows "
                f"(L2 norm > x_bound={xb:g}) and {n_labels} labels (outside "
                f"[{lo:g}, {hi:g}]); the fit uses the clipped data. Raise x_bound / widen "
                "y_bound (using public knowledge only) if this is more than expected.",
                DataClippedWarning,
                stacklevel=4,
            )
        y_clipped = y_clipped - self._label_centre()
        if self.fit_intercept:
            # Append the constant x_bound: augmented rows have norm <= sqrt(2) x_bound.
            X = np.hstack([X, np.full((X.shape[0], 1), xb)])
            xb_eff = math.sqrt(2.0) * xb
        else:
            xb_eff = xb
        return X, y_clipped, xb_eff

    def _set_coef(self, theta: np.ndarray, xb: float) -> None:
        if self.fit_intercept:
            self.coef_ = theta[:-1].copy()
            self.intercept_ = float(theta[-1] * xb) + self._label_centre()
        else:
            self.coef_ = theta.copy()
            self.intercept_ = 0.0

    def predict(self, X) -> np.ndarray:
        """Linear prediction ``X @ coef_ + intercept_`` (post-processing: no privacy cost)."""
        check_is_fitted(self)
        X = validate_data(self, X, reset=False, dtype=np.float64)
        return X @ self.coef_ + self.intercept_
