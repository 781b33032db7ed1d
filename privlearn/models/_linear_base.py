"""Input handling shared by the private linear regressors of :mod:`privlearn.models.linear`."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
from sklearn.base import RegressorMixin
from sklearn.utils.validation import check_is_fitted

from privlearn import _validation as _v
from privlearn.errors import ParameterValueError
from privlearn.models._noise_range import refuse_overflowing_noise
from privlearn.models._release import DataClippedWarning
from privlearn.models._ssp import check_label_range
from privlearn.models.base import (
    PrivateEstimator,
    ReleasePlan,
    clip_rows,
    data_shape,
    require_delta_for_gaussian,
    row_norms,
    validate_input,
    warn_person_fitting,
)
from privlearn.models.constraints import (
    ACCOUNTANT,
    EPSILON,
    LEDGER,
    RANDOM_STATE,
    Boolean,
    Delta,
    Real,
    Unchecked,
)

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


@dataclass(frozen=True, kw_only=True)
class LinearPlan(ReleasePlan):
    """A linear regressor's plan: the public bounds the sensitivities use, and the number
    of independent fits drawn at once (``sample_coefficients``; None: one fit)."""

    x_bound: float
    label_bound: float
    reps: int | None = None

    @property
    def draws(self) -> int:
        return 1 if self.reps is None else self.reps


class _PrivateLinearBase(RegressorMixin, PrivateEstimator):
    """Shared input handling: bounds, clipping, intercept, prediction."""

    _parameter_constraints = COMMON_CONSTRAINTS

    def _bounds(self, params: dict[str, Any]) -> dict[str, float]:
        """The plan's common fields from the validated parameters; Gaussian noise needs
        ``delta > 0``."""
        require_delta_for_gaussian(params["delta"], type(self).__name__, laplace=False)
        xb = params["x_bound"]
        xb_eff = math.sqrt(2.0) * xb if self.fit_intercept else xb
        if not math.isfinite(xb_eff * xb_eff):
            # the sensitivities use its square: refused now, not once the release has
            # spent (an overflow there would fail the fit after the reservation)
            column = " (sqrt(2) x_bound with the intercept column)" if self.fit_intercept else ""
            raise ParameterValueError(
                f"{type(self).__name__}: x_bound={xb!r} is too large: the sensitivity of "
                f"X^T X is the square of the rows' bound{column}, which overflows float64 "
                "(x_bound must stay below about 1e154). Divide X by a public constant so "
                "that its rows have norms of order 1, and pass the bound of the rescaled "
                "rows")
        if xb_eff * xb_eff < sys.float_info.min:
            # its square underflows to a subnormal or 0: a zero sensitivity (and learning
            # rate 1 / 0 for NoisyGD), or noise rounded to the few subnormal steps
            raise ParameterValueError(
                f"{type(self).__name__}: x_bound={xb!r} is too small: the sensitivity of "
                "X^T X is the square of the rows' bound, which underflows float64 "
                "(x_bound must stay above about 1e-154). Multiply X by a public constant "
                "so that its rows have norms of order 1, and pass the bound of the "
                "rescaled rows")
        lo, hi = check_label_range(self.y_bound)
        return dict(delta=params["delta"], accountant=params["accountant"],
                    x_bound=params["x_bound"],
                    label_bound=self._label_sensitivity_bound(lo, hi))

    def _refuse_overflowing_noise(self, X, params: dict[str, Any],
                                  scales: dict[str, float]) -> None:
        """Refuse, before anything is reserved, bounds whose noise ``scales`` (``{what:
        scale}``, in the data's units) overflow float64 in the release
        (:func:`~privlearn.models._noise_range.refuse_overflowing_noise`; ``X``'s columns,
        public, and the intercept's are the coordinates summed)."""
        shape = data_shape(X) if X is not None else ()
        dim = (int(shape[1]) if len(shape) == 2 else 1) + int(bool(self.fit_intercept))
        # a noise_multiplier given (NoisyGD) scales the noise too: named with the bounds
        sigma = params.get("noise_multiplier")
        given = "" if sigma is None else f", noise_multiplier={sigma!r}"
        refuse_overflowing_noise(
            type(self).__name__, scales, dim,
            f"x_bound={params['x_bound']!r}, y_bound={self.y_bound!r}, "
            f"epsilon={params['epsilon']!r}, delta={params['delta']!r}{given}",
            ("Pass a smaller noise_multiplier, or d" if given else "D")
            + "ivide X (and y) by public constants so that the rows' norms and the labels "
            "are of order 1, pass the bounds of the rescaled data, and scale the "
            "coefficients back")

    def _label_centre(self) -> float:
        """Public shift subtracted from the labels before fitting (0 unless an intercept is
        fitted with an interval ``y_bound``, then its midpoint)."""
        lo, hi = check_label_range(self.y_bound)
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

    def _effective_x_bound(self, plan: LinearPlan) -> float:
        """The bound on the rows the mechanism sees: the intercept column (the constant
        ``x_bound``) makes augmented rows at most ``sqrt(2) x_bound`` long."""
        return math.sqrt(2.0) * plan.x_bound if self.fit_intercept else plan.x_bound

    def _check_data(self, X, y, plan: LinearPlan):
        """Validate, clip rows to ``x_bound`` and labels to ``y_bound``, centre the labels
        and append the intercept column (reads the data, releases nothing)."""
        X, y = validate_input(self, X, y, y_numeric=True, dtype=np.float64)
        xb = plan.x_bound
        # Rows above the bound by floating-point rounding only (e.g. L2-normalised rows
        # with norm 1 + 2e-16) are clipped too, but not reported.
        n_clipped = int(np.count_nonzero(row_norms(X) > xb * (1.0 + 1e-9)))
        X, _ = clip_rows(X, xb)
        lo, hi = check_label_range(self.y_bound)
        y_clipped = np.clip(y, lo, hi)
        n_labels = int(np.count_nonzero(y_clipped != y))
        if n_clipped or n_labels:
            # To the person fitting only: the counts are never stored on the model.
            warn_person_fitting(
                f"{type(self).__name__}: clipping changed {n_clipped} of {X.shape[0]} rows "
                f"(L2 norm > x_bound={xb:g}) and {n_labels} labels (outside "
                f"[{lo:g}, {hi:g}]); the fit uses the clipped data. Raise x_bound / widen "
                "y_bound (using public knowledge only) if this is more than expected.",
                DataClippedWarning,
                stacklevel=5,
            )
        y_clipped = y_clipped - self._label_centre()
        if self.fit_intercept:
            X = np.hstack([X, np.full((X.shape[0], 1), xb)])
        return X, y_clipped

    def _coefficients(self, theta: np.ndarray, plan: LinearPlan) -> dict[str, Any]:
        """``coef_`` and ``intercept_`` from the solutions ``theta`` (draws, d): those of
        the one fit, or stacked for ``sample_coefficients`` (``plan.reps`` set)."""
        if self.fit_intercept:
            coef = theta[:, :-1].copy()
            intercept = theta[:, -1] * plan.x_bound + self._label_centre()
        else:
            coef, intercept = theta.copy(), np.zeros(theta.shape[0])
        if plan.reps is None:
            return {"coef_": coef[0], "intercept_": float(intercept[0])}
        return {"coef_": coef, "intercept_": intercept}

    def _sample(self, X, y, n_repetitions: int) -> tuple[np.ndarray, np.ndarray]:
        """``sample_coefficients``: the pipeline of :meth:`fit` with ``n_repetitions``
        independent draws (one reservation of their composition); fits nothing."""
        reps = _v.check_count("n_repetitions", n_repetitions, minimum=1,
                              integral_floats=False)
        with self._not_fitting():
            plan = self._plan(self._validate_params(), X, y, reps=reps)
            out = self._run(plan, X, y)
        return out["coef_"], out["intercept_"]

    def __sklearn_tags__(self):
        """scikit-learn's ``poor_score`` tag: the noise is calibrated to the worst case
        over the public bounds, so on scikit-learn's small check data set (200
        standardised rows, unbounded) the fit does not reach its R^2 > 0.5; its other
        checks (malformed input, list input, prediction shape) still run."""
        tags = super().__sklearn_tags__()
        tags.regressor_tags.poor_score = True
        return tags

    def predict(self, X) -> np.ndarray:
        """Linear prediction ``X @ coef_ + intercept_`` (post-processing: no privacy cost)."""
        check_is_fitted(self)
        X = validate_input(self, X, reset=False, dtype=np.float64)
        return X @ self.coef_ + self.intercept_
