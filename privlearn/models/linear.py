"""Private linear regression: SSP, AdaSSP (Wang 2018) and noisy gradient descent.

All three release noisy versions of quantities whose add/remove sensitivity is bounded
because every feature row has L2 norm at most ``x_bound`` and every label lies in
``[-y_bound, y_bound]`` (or the interval ``y_bound = (y_min, y_max)``, see
:class:`SSPRegressor`); rows above the bound are scaled down to it and labels clipped
before anything is computed (the data are never trusted to satisfy the bounds). ``Y``
below is the resulting bound on a label's magnitude as the mechanism sees it.

"The notebook" below is the reference comparison of SSP, AdaSSP and noisy gradient descent
on California housing that privlearn's linear-regression experiment reproduces
(``privlearn reproduce linear-regression``; sources in the documentation's provenance
page).

Sensitivities (add/remove one record ``(x, y)`` with ``||x|| <= X``, ``|y| <= Y``):

* ``X^T X`` changes by ``x x^T``, Frobenius norm ``||x||^2 <= X^2``; the notebook releases
  the upper triangle (diagonal included) with i.i.d. noise and mirrors it, which has the
  same sensitivity (Wang 2018, Alg. 2 / the notebook). By default we release the isometric
  coordinates ``(M_ii, sqrt(2) M_ij)`` instead, whose L2 sensitivity is exactly
  ``||x||^2``: the off-diagonal noise is ``1/sqrt(2)`` of the study's at the same privacy
  (:func:`symmetric_noise`).
* ``X^T y`` changes by ``x y``, norm ``<= X Y``.
* ``lambda_min(X^T X)`` changes by at most ``X^2`` (Weyl's inequality).
* the sum-of-squares gradient ``sum_i x_i (x_i^T theta - y_i)`` changes by
  ``||x (x^T theta - y)|| <= X^2 ||theta|| + X Y`` (the notebook's ``GS_t``).

Noise scales are calibrated through :mod:`privlearn.accounting`: SSP is the composition
of two Gaussian mechanisms with noise multipliers ``(2s, 3s)``, AdaSSP of three with
``(2s, 3s, 5s)`` (the ratios of the notebook's ``SSP_scale``/``AdaSSP_scale``; other ratios
through ``budget_split``), NoisyGD of
``n_iter`` Gaussian mechanisms with multiplier ``noise_multiplier``. Compositions of
Gaussians are accounted exactly (Dong, Roth & Su 2022, Cor. 3.3; Balle & Wang 2018,
Thm. 8) and calibrated on the safe side (noise rounded up, iterations rounded down).

Everything done after the release (PSD projection, eigenvalue floor, solving) is
post-processing of the noisy statistics and costs no privacy (Dwork & Roth 2014,
Prop. 2.1). The notebook's exact algorithms remain available:
``SSPRegressor(matrix_noise="upper_triangle", project_psd=False)`` and
``AdaSSPRegressor(matrix_noise="upper_triangle", regularization="ridge")``.

References
----------
.. [1] Y.-X. Wang (2018), Revisiting differentially private linear regression: optimal
       and adaptive prediction & estimation in unbounded domain, UAI. Algorithm 1
       (SSP) and Algorithm 2 (AdaSSP).
.. [2] R. Bassily, A. Smith, A. Thakurta (2014), Private empirical risk minimization:
       efficient algorithms and tight error bounds, FOCS (noisy gradient descent).
.. [3] B. Balle, Y.-X. Wang (2018), Improving the Gaussian mechanism for differential
       privacy: analytical calibration and optimal denoising, ICML, Theorem 8.
.. [4] C. Dwork, A. Roth (2014), The algorithmic foundations of differential privacy,
       Prop. 2.1 (post-processing), Thm. A.1 (Gaussian mechanism).
.. [5] C. Dwork, K. Talwar, A. Thakurta, L. Zhang (2014), Analyze Gauss: optimal bounds
       for privacy-preserving principal component analysis, STOC.
.. [6] N. J. Higham (1988), Computing a nearest symmetric positive semidefinite matrix,
       Linear Algebra Appl. 103 (eigenvalue clipping is the Frobenius projection).
"""


from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from privlearn.accounting import compose
from privlearn.errors import CalibrationError, ConfigurationError
from privlearn.models._linear_base import COMMON_CONSTRAINTS, LinearPlan, _PrivateLinearBase
from privlearn.models._noisygd import (
    MAX_CALIBRATED_ITERATIONS,
    SMOOTHNESS_BUDGET_FRACTION,
    NoisyGDRegressor,
    noisy_gd_paths,
    theoretical_learning_rate,
)
from privlearn.models._ssp import (
    ADASSP_BUDGET_SPLIT,
    ADASSP_Z,
    MATRIX_NOISES,
    REGULARIZATIONS,
    SSP_BUDGET_SPLIT,
    _check_split,
    adassp_coefficients,
    adassp_mechanism,
    calibrate_ssp_scale,
    check_label_range,
    noise_direction_scale,
    ssp_coefficients,
    ssp_mechanism,
    ssp_release,
    symmetric_noise,
)
from privlearn.models.base import make_rng
from privlearn.models.constraints import Boolean, Options, Unchecked

__all__ = [
    "SSPRegressor",
    "AdaSSPRegressor",
    "NoisyGDRegressor",
    "ssp_mechanism",
    "adassp_mechanism",
    "calibrate_ssp_scale",
    "ssp_coefficients",
    "adassp_coefficients",
    "noisy_gd_paths",
    "symmetric_noise",
    "noise_direction_scale",
    "theoretical_learning_rate",
    "ADASSP_Z",
    "SSP_BUDGET_SPLIT",
    "ADASSP_BUDGET_SPLIT",
    "SMOOTHNESS_BUDGET_FRACTION",
    "MAX_CALIBRATED_ITERATIONS",
    "check_label_range",
]


@dataclass(frozen=True, kw_only=True)
class SSPPlan(LinearPlan):
    """SSP / AdaSSP's plan: the calibrated common noise scale ``s`` and the ratios
    ``budget_split`` (the noise multipliers are ``r_i s``)."""

    noise_scale: float
    budget_split: tuple[float, ...]


class SSPRegressor(_PrivateLinearBase):
    """Sufficient statistics perturbation (Vu & Slavkovic 2009; Foulds et al. 2016; Wang
    2018, Algorithm 1), (epsilon, delta)-DP.

    Releases ``X^T X`` and ``X^T y`` with Gaussian noise and solves the normal equations
    built from the noisy statistics.

    "The notebook" below is the reference comparison of SSP, AdaSSP and noisy gradient
    descent on California housing that ``privlearn reproduce linear-regression``
    reproduces (the documentation's provenance page); the defaults that differ from it
    are noted parameter by parameter.

    Parameters
    ----------
    epsilon : float > 0
        The privacy budget of one fit: the noise is calibrated so that the fit is
        ``(epsilon, delta)``-DP; ``epsilon_`` after ``fit`` is what it spent (at most this).
    delta : float in (0, 1)
        Chosen well below ``1 / n_samples`` (a
        :class:`~privlearn.errors.PrivacyLeakWarning` otherwise), e.g. 1e-6.
    x_bound : float > 0
        Public bound on the L2 norm of a feature row, known without looking at the data
        (from the features' documented ranges); rows above it are scaled down to it. A
        bound read off the data (``np.linalg.norm(X, axis=1).max()``) depends on its
        largest row and publishes it through the model, and nothing here can tell it
        from a public one: without a public bound, estimate one privately with
        ``privlearn.models.preprocessing.choose_x_bound`` (it returns its mechanism, to
        compose with the fit's ``mechanism_``).
    y_bound : float > 0 or pair (y_min, y_max)
        Public bound on the labels: a float ``Y`` means ``[-Y, Y]``, a pair the interval
        ``[y_min, y_max]`` (``y_min < y_max``, both finite), not ``(y.min(), y.max())``
        (``choose_y_bound`` estimates one privately). Labels are clipped to it. The
        sensitivities use ``Y = (y_max - y_min) / 2`` when ``fit_intercept`` (the labels
        are centred at the public midpoint, which the intercept absorbs exactly) and
        ``Y = max(|y_min|, |y_max|)`` without an intercept (no shift is possible then).
    fit_intercept : bool
        Fit an intercept by appending the constant column ``x_bound`` (augmented rows then
        have norm at most ``sqrt(2) x_bound``, which the noise accounts for). The notebook
        fits none.
    budget_split : sequence of 2 floats > 0 or None
        Noise-multiplier ratios ``(r_XTX, r_XTy)``; the common scale is calibrated so
        that the composition is (epsilon, delta)-DP. None: the notebook's ``(2, 3)``.
    matrix_noise : {"frobenius", "upper_triangle"}
        How ``X^T X`` is perturbed, see :func:`symmetric_noise`. ``"frobenius"`` (default)
        has ``1/sqrt(2)`` of the study's off-diagonal noise at the same privacy;
        ``"upper_triangle"`` is the notebook's.
    project_psd : bool
        Solve with the PSD projection of the noisy ``X^T X`` (pseudo-inverse; default,
        post-processing, no privacy cost) instead of its plain inverse (the notebook). See
        :func:`ssp_coefficients`. The notebook's SSP is
        ``SSPRegressor(matrix_noise="upper_triangle", project_psd=False)``.
    accountant : str
        Accountant used for calibration (default ``"pld"``, exact for Gaussians).
    random_state : None, int, numpy Generator or RandomState
        The noise's source. None (default): fresh OS entropy, and nothing the fitted
        model carries can regenerate its noise. A seed or generator makes the noise
        reproducible by whoever knows it (it travels with ``get_params()`` and the
        pickle): fix it for experiments only.
    ledger : BudgetHandle, optional
        ``Ledger(path).budget(dataset)`` (:mod:`privlearn.ledger`): the mechanism is
        reserved on it before the data is read (over budget,
        ``BudgetExceededError`` is raised and nothing is recorded or released) and
        settled when the fit is done.

    Attributes
    ----------
    coef_, intercept_ : fitted parameters
    mechanism_ : Mechanism
        What ran: ``compose([Gaussian(r_XTX s), Gaussian(r_XTy s)])``.
    noise_scale_ : float
        The calibrated common scale ``s``.
    epsilon_, delta_ : float
        Certified epsilon spent at ``delta_`` (<= ``epsilon``).

    Every attribute is released with the model and covered by ``mechanism_`` (see
    docs/trust-model.md). How many rows or labels clipping changed is an exact count of
    the private data, so it is never stored: a
    :class:`~privlearn.models.DataClippedWarning` tells the person fitting.

    Notes
    -----
    The default removes most of the notebook's heavy upper tail (an indefinite or nearly
    singular noisy ``X^T X``); measured medians: docs/benchmarks.md, "Linear-regression
    estimator variants".

    References
    ----------
    .. [1] D. Vu, A. Slavkovic (2009), Differential privacy for clinical trial data:
           preliminary evaluations, ICDM Workshops.
    .. [2] J. Foulds, J. Geumlek, M. Welling, K. Chaudhuri (2016), On the theory and
           practice of privacy-preserving Bayesian data analysis, UAI.
    .. [3] Y.-X. Wang (2018), Revisiting differentially private linear regression, UAI,
           Algorithm 1.
    """

    _adaptive = False
    _parameter_constraints = {
        **COMMON_CONSTRAINTS,
        "budget_split": Unchecked("weights of the releases, checked by _check_split"),
        "matrix_noise": Options(*MATRIX_NOISES),
        "project_psd": Boolean(),
    }

    def __init__(
        self,
        epsilon: float = 1.0,
        delta: float = 1e-6,
        x_bound: float = 1.0,
        y_bound: float = 1.0,
        fit_intercept: bool = True,
        budget_split=None,
        matrix_noise: str = "frobenius",
        project_psd: bool = True,
        accountant: str = "pld",
        random_state=None,
        ledger=None,
    ):
        self.epsilon = epsilon
        self.delta = delta
        self.x_bound = x_bound
        self.y_bound = y_bound
        self.fit_intercept = fit_intercept
        self.budget_split = budget_split
        self.matrix_noise = matrix_noise
        self.project_psd = project_psd
        self.accountant = accountant
        self.random_state = random_state
        self.ledger = ledger

    def calibrated_noise_scale(self) -> float:
        """The common noise scale ``s`` that :meth:`fit` uses for this budget (rounded up)."""
        return self._plan(self._validate_params(), None, None).noise_scale

    def _plan(self, params: dict[str, Any], X, y, *, reps: int | None = None) -> SSPPlan:
        """Calibrate the common scale (data-independent) and describe the releases."""
        common = self._bounds(params)
        split = _check_split(self.budget_split, 3 if self._adaptive else 2)
        try:
            s = calibrate_ssp_scale(params["epsilon"], params["delta"],
                                    adaptive=self._adaptive,
                                    accountant=params["accountant"], budget_split=split)
        except CalibrationError as e:
            if self.budget_split is None:
                raise
            # only ratios far apart leave the target out of the scales searched
            raise ConfigurationError(
                f"{type(self).__name__}: budget_split={self.budget_split!r} cannot be "
                f"calibrated to epsilon={params['epsilon']!r} at delta={params['delta']!r}: "
                f"its ratios differ by a factor of {max(split) / min(split):.3g}, so the "
                "common scale would have to leave the range searched (up to 1e12). Keep the "
                "ratios within a few orders of magnitude of one another, e.g. the default "
                "(None)") from e
        # the noise's scale on each release, in the data's units (see ssp_coefficients)
        xb = math.sqrt(2.0) * common["x_bound"] if self.fit_intercept else common["x_bound"]
        sensitivities = {"X^T X": xb * xb, "X^T y": xb * common["label_bound"],
                         "lambda_min(X^T X)": xb * xb}
        self._refuse_overflowing_noise(X, params, {
            name: r * s * sens for (name, sens), r in zip(sensitivities.items(), split,
                                                          strict=False)})
        one = (adassp_mechanism if self._adaptive else ssp_mechanism)(s, split)
        return SSPPlan(mechanism=one if reps is None else compose(one, steps=reps), reps=reps,
                       noise_scale=s, budget_split=split, **common)

    def _release(self, X, y, plan: SSPPlan) -> dict[str, Any]:
        """Release the noisy statistics (``plan.draws`` times, one batched draw) and
        solve."""
        theta, lamb = ssp_release(
            X.T @ X, X.T @ y, plan.noise_scale, plan.budget_split,
            self._effective_x_bound(plan), plan.label_bound, make_rng(self.random_state),
            reps=plan.draws, adaptive=self._adaptive, matrix_noise=self.matrix_noise.lower(),
            name=type(self).__name__, **self._solver_options(),
        )
        fitted = {"noise_scale_": plan.noise_scale, **self._coefficients(theta, plan)}
        if self._adaptive and plan.reps is None:
            fitted["ridge_"] = float(lamb[0])
        return fitted

    def _solver_options(self) -> dict[str, Any]:
        """The post-processing options of :func:`ssp_release` this estimator sets."""
        return {"project_psd": bool(self.project_psd)}

    def fit(self, X, y, **fit_params):
        """Release noisy sufficient statistics and solve the normal equations
        (``sample_weight`` is refused)."""
        return self._fit(X, y, fit_params=fit_params)

    def sample_coefficients(self, X, y, n_repetitions: int) -> tuple[np.ndarray, np.ndarray]:
        """Coefficients of ``n_repetitions`` independent fits, drawn in one batch.

        Runs exactly the code of :meth:`fit` (same validation, calibration, noise and
        solver) with ``n_repetitions`` independent noise draws from ``random_state``; the
        first row equals ``fit(X, y).coef_`` for the same ``random_state``. For experiments
        and tests: each row alone is (epsilon, delta)-DP, but releasing all rows composes
        ``n_repetitions`` mechanisms (that composition is what a ``ledger`` is charged).
        The estimator is not fitted by this call.

        Returns
        -------
        coef : ndarray (n_repetitions, n_features)
        intercept : ndarray (n_repetitions,)
        """
        return self._sample(X, y, n_repetitions)


class AdaSSPRegressor(SSPRegressor):
    """Adaptive SSP (Wang 2018, Algorithm 2), (epsilon, delta)-DP.

    Like :class:`SSPRegressor`, plus a privately released smallest eigenvalue of
    ``X^T X`` that sets a regularisation level ``lambda`` large enough to keep the noisy
    system well conditioned (the notebook's rule, see :func:`adassp_coefficients`).

    Parameters
    ----------
    epsilon, delta, x_bound, y_bound, fit_intercept, accountant, random_state, ledger
        As :class:`SSPRegressor`.
    budget_split : sequence of 3 floats > 0 or None
        Noise-multiplier ratios for ``(X^T X, X^T y, lambda_min)``. None: the notebook's
        ``(2, 3, 5)``. Kept as the default: Wang's (2018) equal split ``(1, 1, 1)`` (his
        ``epsilon/3`` per release) is worse on the notebook with the ridge (median MSE 0.833 vs
        0.792 at epsilon = 0.1) and within 0.006 of it with the eigenvalue floor (0.703 vs
        0.698), so no split is chosen by looking at the data.
    matrix_noise : {"frobenius", "upper_triangle"}
        As :class:`SSPRegressor`. With ``"frobenius"`` the ridge rule's noise scale
        ``sqrt(d)`` becomes ``sqrt((d + 1) / 2)`` (:func:`noise_direction_scale`).
    regularization : {"eigenvalue_floor", "ridge"}
        ``"eigenvalue_floor"`` (default): raise the eigenvalues of the noisy ``X^T X`` to at
        least ``lambda``; ``"ridge"``: add ``lambda I`` (Wang 2018; the notebook). The notebook's
        AdaSSP is ``AdaSSPRegressor(matrix_noise="upper_triangle", regularization="ridge")``.

    Attributes
    ----------
    mechanism_ : ``compose([Gaussian(r_1 s), Gaussian(r_2 s), Gaussian(r_3 s)])``
    ridge_ : float
        The data-adaptive regularisation level lambda that was used.
    (others as :class:`SSPRegressor`)

    Notes
    -----
    No default constant was fitted to the data: the Frobenius noise is strictly smaller at
    the same privacy, the rule for ``lambda`` is the study's (``z`` times the RMS noise
    along a direction), and the eigenvalue floor is post-processing that removes the
    ridge's shrinkage of well-determined directions. Measured medians of each variant:
    docs/benchmarks.md, "Linear-regression estimator variants".

    Examples
    --------
    >>> import numpy as np
    >>> from privlearn.models import AdaSSPRegressor
    >>> rng = np.random.default_rng(0)
    >>> X = rng.normal(size=(500, 3)); X /= np.linalg.norm(X, axis=1, keepdims=True)
    >>> y = np.clip(X @ [1.0, 2.0, 0.5] + 2.5, 0, 5)
    >>> AdaSSPRegressor(epsilon=1.0, delta=1e-6, x_bound=1.0, y_bound=5.0,
    ...                 fit_intercept=False, random_state=0).fit(X, y).predict(X).shape
    (500,)
    """

    _adaptive = True
    _parameter_constraints = {
        **COMMON_CONSTRAINTS,
        "budget_split": Unchecked("weights of the releases, checked by _check_split"),
        "matrix_noise": Options(*MATRIX_NOISES),
        "regularization": Options(*REGULARIZATIONS),
    }

    def __init__(
        self,
        epsilon: float = 1.0,
        delta: float = 1e-6,
        x_bound: float = 1.0,
        y_bound: float = 1.0,
        fit_intercept: bool = True,
        budget_split=None,
        matrix_noise: str = "frobenius",
        regularization: str = "eigenvalue_floor",
        accountant: str = "pld",
        random_state=None,
        ledger=None,
    ):
        self.epsilon = epsilon
        self.delta = delta
        self.x_bound = x_bound
        self.y_bound = y_bound
        self.fit_intercept = fit_intercept
        self.budget_split = budget_split
        self.matrix_noise = matrix_noise
        self.regularization = regularization
        self.accountant = accountant
        self.random_state = random_state
        self.ledger = ledger

    def _solver_options(self) -> dict[str, Any]:
        return {"regularization": self.regularization.lower()}
