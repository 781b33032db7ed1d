"""Private linear regression: SSP, AdaSSP (Wang 2018) and noisy gradient descent.

All three release noisy versions of quantities whose add/remove sensitivity is bounded
because every feature row has L2 norm at most ``x_bound`` and every label lies in
``[-y_bound, y_bound]``; rows above the bound are scaled down to it and labels clipped
before anything is computed (the data are never trusted to satisfy the bounds).

Sensitivities (add/remove one record ``(x, y)`` with ``||x|| <= X``, ``|y| <= Y``):

* ``X^T X`` changes by ``x x^T``, Frobenius norm ``||x||^2 <= X^2``; the seed releases
  the upper triangle (diagonal included) with i.i.d. noise and mirrors it, which has the
  same sensitivity (Wang 2018, Alg. 2 / seed 000).
* ``X^T y`` changes by ``x y``, norm ``<= X Y``.
* ``lambda_min(X^T X)`` changes by at most ``X^2`` (Weyl's inequality).
* the sum-of-squares gradient ``sum_i x_i (x_i^T theta - y_i)`` changes by
  ``||x (x^T theta - y)|| <= X^2 ||theta|| + X Y`` (seed 000's ``GS_t``).

Noise scales are calibrated through :mod:`privlearn.accounting`: SSP is the composition
of two Gaussian mechanisms with noise multipliers ``(2s, 3s)``, AdaSSP of three with
``(2s, 3s, 5s)`` (the ratios of seed 000's ``SSP_scale``/``AdaSSP_scale``), NoisyGD of
``n_iter`` Gaussian mechanisms with multiplier ``noise_multiplier``. Compositions of
Gaussians are accounted exactly (Dong, Roth & Su 2022, Cor. 3.3; Balle & Wang 2018,
Thm. 8) and calibrated on the safe side (noise rounded up, iterations rounded down).

References
----------
.. [1] Y.-X. Wang (2018), Revisiting differentially private linear regression: optimal
       and adaptive prediction & estimation in unbounded domain, UAI. Algorithm 1
       (SSP) and Algorithm 2 (AdaSSP).
.. [2] R. Bassily, A. Smith, A. Thakurta (2014), Private empirical risk minimization:
       efficient algorithms and tight error bounds, FOCS (noisy gradient descent).
.. [3] B. Balle, Y.-X. Wang (2018), Improving the Gaussian mechanism for differential
       privacy: analytical calibration and optimal denoising, ICML, Theorem 8.
"""

from __future__ import annotations

import math

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils.validation import check_is_fitted, validate_data

from privlearn.accounting import Gaussian, Mechanism, calibrate, compose
from privlearn.models._base import (
    check_choice,
    check_int_param,
    check_positive_param,
    check_privacy_budget,
    clip_rows,
    make_rng,
    spent_epsilon,
)

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
    "theoretical_learning_rate",
    "ADASSP_Z",
]

#: Seed 000's normal quantile used by AdaSSP's high-probability bounds (Wang 2018, Alg. 2).
ADASSP_Z = 1.96


def ssp_mechanism(scale: float) -> Mechanism:
    """SSP as a mechanism: Gaussians with noise multipliers ``2 scale`` (X^T X) and
    ``3 scale`` (X^T y), composed (seed 000's ``SSP_scale``)."""
    return compose([Gaussian(2.0 * scale), Gaussian(3.0 * scale)])


def adassp_mechanism(scale: float) -> Mechanism:
    """AdaSSP as a mechanism: multipliers ``2s`` (X^T X), ``3s`` (X^T y) and ``5s``
    (lambda_min), composed (seed 000's ``AdaSSP_scale``)."""
    return compose([Gaussian(2.0 * scale), Gaussian(3.0 * scale), Gaussian(5.0 * scale)])


def calibrate_ssp_scale(
    epsilon: float, delta: float, *, adaptive: bool, accountant: str = "pld"
) -> float:
    """Smallest common scale ``s`` (rounded up) such that the SSP / AdaSSP mechanism
    satisfies (epsilon, delta)-DP."""
    factory = adassp_mechanism if adaptive else ssp_mechanism
    return float(calibrate(factory, epsilon, delta, accountant=accountant))


def _sym_noise(rng: np.random.Generator, reps: int, dim: int) -> np.ndarray:
    """Seed 000's symmetric noise: i.i.d. N(0,1) upper triangle mirrored below."""
    Z = rng.standard_normal((reps, dim, dim))
    upper = np.triu(Z)
    return upper + np.swapaxes(np.triu(Z, k=1), -1, -2)


def ssp_coefficients(
    XTX: np.ndarray,
    XTy: np.ndarray,
    sigma1: float,
    sigma2: float,
    x_bound: float,
    y_bound: float,
    rng: np.random.Generator,
    reps: int = 1,
) -> np.ndarray:
    """``reps`` independent SSP solutions (Wang 2018, Alg. 1), shape (reps, dim).

    ``hat(X^T X) = X^T X + x_bound^2 sigma1 Z_sym``, ``hat(X^T y) = X^T y + x_bound
    y_bound sigma2 N(0, I)``, ``theta = hat(X^T X)^{-1} hat(X^T y)``.
    """
    dim = XTX.shape[0]
    hat_xtx = XTX[None] + x_bound**2 * sigma1 * _sym_noise(rng, reps, dim)
    hat_xty = XTy[None] + x_bound * y_bound * sigma2 * rng.standard_normal((reps, dim))
    return np.linalg.solve(hat_xtx, hat_xty[..., None])[..., 0]


def adassp_coefficients(
    XTX: np.ndarray,
    XTy: np.ndarray,
    sigma1: float,
    sigma2: float,
    sigma3: float,
    x_bound: float,
    y_bound: float,
    rng: np.random.Generator,
    reps: int = 1,
    lambda_min: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``reps`` independent AdaSSP solutions (Wang 2018, Alg. 2 as in seed 000).

    Releases ``hat(X^T X)``, ``hat(X^T y)`` as SSP and a noisy smallest eigenvalue
    ``lambda_min + x_bound^2 sigma3 N(0,1)``; with ``z = 1.96`` the ridge is
    ``lambda = max(0, sqrt(d) sigma1 x_bound^2 z - max(0, hat(lambda_min) -
    x_bound^2 sigma3 z))`` and ``theta = (hat(X^T X) + lambda I)^{-1} hat(X^T y)``.

    Returns the coefficients (reps, dim) and the ridge parameters (reps,).
    """
    dim = XTX.shape[0]
    hat_xtx = XTX[None] + x_bound**2 * sigma1 * _sym_noise(rng, reps, dim)
    hat_xty = XTy[None] + x_bound * y_bound * sigma2 * rng.standard_normal((reps, dim))
    if lambda_min is None:
        lambda_min = float(np.linalg.eigvalsh(XTX)[0])
    noisy_min = lambda_min + x_bound**2 * sigma3 * rng.standard_normal(reps)
    lower = np.maximum(0.0, noisy_min - x_bound**2 * sigma3 * ADASSP_Z)
    lamb = np.maximum(0.0, math.sqrt(dim) * sigma1 * x_bound**2 * ADASSP_Z - lower)
    A = hat_xtx + lamb[:, None, None] * np.eye(dim)[None]
    return np.linalg.solve(A, hat_xty[..., None])[..., 0], lamb


def theoretical_learning_rate(
    smoothness: float, dim: int, noise_std: float, n_iter: int
) -> float:
    """Seed 000's learning rate ``min(1/L, 4 / sqrt(d * noise_std * L * n_iter))``.

    ``L`` is the smoothness (largest eigenvalue of ``X^T X``) and ``noise_std`` the
    per-coordinate gradient-noise level ``sigma * GS`` with the seed's typical
    ``GS = x_bound^2 + x_bound y_bound`` (the seed's ``theoretical_lr_choice``, which
    follows the standard noisy-GD rate of Bassily, Smith & Thakurta 2014).
    """
    return float(min(1.0 / smoothness, 4.0 / math.sqrt(dim * noise_std * smoothness * n_iter)))


def noisy_gd_paths(
    XTX: np.ndarray,
    XTy: np.ndarray,
    sigma: float,
    lr: float,
    n_iter: int,
    x_bound: float,
    y_bound: float,
    rng: np.random.Generator,
    reps: int = 1,
    log_every: int | None = None,
    chunk: int = 256,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run ``reps`` independent NoisyGD chains at once (seed 000).

    ``theta_{t+1} = theta_t - lr (X^T X theta_t - X^T y + GS_t sigma N(0, I))`` with
    ``GS_t = x_bound^2 ||theta_t|| + x_bound y_bound``, from ``theta_0 = 0``.

    Returns
    -------
    theta : (reps, dim) final iterates
    path : (n_logs, reps, dim) iterates after iterations ``log_iters``
    log_iters : (n_logs,) int, the number of iterations completed at each log point
        (``1, 1 + log_every, 1 + 2 log_every, ...`` as the seed logs ``i % log_gap == 0``)
    """
    dim = XTX.shape[0]
    theta = np.zeros((reps, dim))
    logs: list[np.ndarray] = []
    iters: list[int] = []
    i = 0
    while i < n_iter:
        m = min(chunk, n_iter - i)
        noise = rng.standard_normal((m, reps, dim))
        for j in range(m):
            gs = x_bound**2 * np.sqrt(np.einsum("ij,ij->i", theta, theta)) + x_bound * y_bound
            grad = theta @ XTX - XTy
            theta = theta - lr * (grad + (gs * sigma)[:, None] * noise[j])
            if log_every is not None and (i + j) % log_every == 0:
                logs.append(theta.copy())
                iters.append(i + j + 1)
        i += m
    path = np.array(logs) if logs else np.zeros((0, reps, dim))
    return theta, path, np.array(iters, dtype=np.int64)


class _PrivateLinearBase(RegressorMixin, BaseEstimator):
    """Shared input handling: validation, clipping, intercept, prediction."""

    def _validate_common(self) -> tuple[float, float, float, float]:
        eps, delta = check_privacy_budget(self.epsilon, self.delta)
        if delta == 0.0:
            raise ValueError(
                f"delta must be in (0, 1) for {type(self).__name__} (it uses Gaussian noise, "
                "which has no pure-DP guarantee), got delta=0"
            )
        xb = check_positive_param("x_bound", self.x_bound)
        yb = check_positive_param("y_bound", self.y_bound)
        if not isinstance(self.fit_intercept, bool | np.bool_):
            raise ValueError(f"fit_intercept must be a bool, got {self.fit_intercept!r}")
        return eps, delta, xb, yb

    def _prepare(self, X, y, xb: float, yb: float):
        X, y = validate_data(self, X, y, y_numeric=True, dtype=np.float64)
        if X.shape[0] < 1:
            raise ValueError("X must have at least one sample")
        X, n_clipped = clip_rows(X, xb)
        y_clipped = np.clip(y, -yb, yb)
        self.n_rows_clipped_ = n_clipped
        self.n_labels_clipped_ = int(np.count_nonzero(y_clipped != y))
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
            self.intercept_ = float(theta[-1] * xb)
        else:
            self.coef_ = theta.copy()
            self.intercept_ = 0.0

    def predict(self, X) -> np.ndarray:
        """Linear prediction ``X @ coef_ + intercept_`` (post-processing: no privacy cost)."""
        check_is_fitted(self)
        X = validate_data(self, X, reset=False, dtype=np.float64)
        return X @ self.coef_ + self.intercept_


class SSPRegressor(_PrivateLinearBase):
    """Sufficient statistics perturbation (Wang 2018, Algorithm 1), (epsilon, delta)-DP.

    Parameters
    ----------
    epsilon : float > 0
    delta : float in (0, 1)
    x_bound : float > 0
        Bound on the L2 norm of a feature row; rows above it are scaled down to it.
    y_bound : float > 0
        Labels are clipped to ``[-y_bound, y_bound]``.
    fit_intercept : bool
        Fit an intercept by appending the constant column ``x_bound`` (augmented rows then
        have norm at most ``sqrt(2) x_bound``, which the noise accounts for). Seed 000
        fits none.
    accountant : str
        Accountant used for calibration (default ``"pld"``, exact for Gaussians).
    random_state : None, int, numpy Generator or RandomState

    Attributes
    ----------
    coef_, intercept_ : fitted parameters
    mechanism_ : Mechanism
        What ran: ``compose([Gaussian(2 s), Gaussian(3 s)])``.
    noise_scale_ : float
        The calibrated common scale ``s``.
    epsilon_, delta_ : float
        Certified epsilon spent at ``delta_`` (<= ``epsilon``).
    n_rows_clipped_, n_labels_clipped_ : int
    """

    def __init__(
        self,
        epsilon: float = 1.0,
        delta: float = 1e-6,
        x_bound: float = 1.0,
        y_bound: float = 1.0,
        fit_intercept: bool = True,
        accountant: str = "pld",
        random_state=None,
    ):
        self.epsilon = epsilon
        self.delta = delta
        self.x_bound = x_bound
        self.y_bound = y_bound
        self.fit_intercept = fit_intercept
        self.accountant = accountant
        self.random_state = random_state

    _adaptive = False

    def fit(self, X, y):
        """Release noisy sufficient statistics and solve the normal equations."""
        eps, delta, xb, yb = self._validate_common()
        rng = make_rng(self.random_state)
        X, y, xb_eff = self._prepare(X, y, xb, yb)
        XTX, XTy = X.T @ X, X.T @ y
        s = calibrate_ssp_scale(eps, delta, adaptive=self._adaptive, accountant=self.accountant)
        if self._adaptive:
            self.mechanism_ = adassp_mechanism(s)
            theta, lamb = adassp_coefficients(
                XTX, XTy, 2 * s, 3 * s, 5 * s, xb_eff, yb, rng, reps=1
            )
            self.ridge_ = float(lamb[0])
        else:
            self.mechanism_ = ssp_mechanism(s)
            theta = ssp_coefficients(XTX, XTy, 2 * s, 3 * s, xb_eff, yb, rng, reps=1)
        self.noise_scale_ = s
        self.delta_ = delta
        self.epsilon_ = spent_epsilon(self.mechanism_, delta, self.accountant)
        self._set_coef(theta[0], xb)
        return self


class AdaSSPRegressor(SSPRegressor):
    """Adaptive SSP (Wang 2018, Algorithm 2), (epsilon, delta)-DP.

    Like :class:`SSPRegressor`, plus a privately released smallest eigenvalue of
    ``X^T X`` that sets a ridge penalty large enough to keep the noisy system well
    conditioned (seed 000's rule, see :func:`adassp_coefficients`).

    Attributes
    ----------
    mechanism_ : ``compose([Gaussian(2 s), Gaussian(3 s), Gaussian(5 s)])``
    ridge_ : float
        The data-adaptive ridge parameter lambda that was used.
    (others as :class:`SSPRegressor`)

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


class NoisyGDRegressor(_PrivateLinearBase):
    """Full-batch noisy gradient descent for least squares (seed 000), (epsilon, delta)-DP.

    ``theta_{t+1} = theta_t - lr (sum_i x_i (x_i^T theta_t - y_i) + GS_t sigma N(0, I))``
    with the theta-dependent sensitivity ``GS_t = x_bound^2 ||theta_t|| + x_bound y_bound``.
    The mechanism is the composition of ``n_iter`` Gaussian mechanisms with multiplier
    ``sigma`` (Bassily, Smith & Thakurta 2014), accounted exactly.

    Parameters
    ----------
    epsilon, delta, x_bound, y_bound, fit_intercept, accountant, random_state
        As :class:`SSPRegressor`.
    noise_multiplier : float > 0 or None
        ``sigma``. Default 500 (seed 000's "large noise, many iterations" regime; the
        seed's other regime is 50). With ``n_iter=None`` the number of iterations is
        calibrated to the budget (the largest integer that fits, rounded down). If None,
        ``n_iter`` must be given and sigma is calibrated instead (rounded up).
    n_iter : int or None
        Number of iterations; if both ``n_iter`` and ``noise_multiplier`` are given the
        budget is checked and a ValueError raised if exceeded.
    learning_rate : "theory" or float > 0
        ``"theory"`` (default): seed 000's choice, see :func:`theoretical_learning_rate`.
    smoothness : "data", "public" or float > 0
        The smoothness ``L`` used by the theoretical learning rate. ``"data"`` (seed
        000's choice) uses the largest eigenvalue of ``X^T X`` computed from the private
        data **without privacy protection**: the released model then leaks this one
        number, which the seed waves through ("ideally we can release it also at a
        small additional cost"). ``"public"`` uses the data-independent upper bound
        ``x_bound^2 n`` (the seed's suggestion; it treats ``n`` as public, as the
        sum-of-gradients formulation already does). A float is used as given.
    log_every : int or None
        Record the iterate and the epsilon spent after iterations ``1, 1 + log_every,
        ...`` (seed 000's ``log_gap``) in ``coef_path_`` and ``epsilon_path_``.

    Attributes
    ----------
    coef_, intercept_ : final iterate
    n_iter_, noise_multiplier_, learning_rate_, smoothness_ : what ran
    mechanism_ : ``compose(Gaussian(sigma), steps=n_iter)``
    epsilon_, delta_ : certified epsilon spent at ``delta_``
    path_iterations_, coef_path_, intercept_path_, epsilon_path_ : trajectory (when
        ``log_every`` is set); ``epsilon_path_[k]`` is the exact epsilon after
        ``path_iterations_[k]`` iterations (analytic Gaussian composition, O(1) each).
    """

    def __init__(
        self,
        epsilon: float = 1.0,
        delta: float = 1e-6,
        x_bound: float = 1.0,
        y_bound: float = 1.0,
        fit_intercept: bool = True,
        noise_multiplier: float | None = 500.0,
        n_iter: int | None = None,
        learning_rate="theory",
        smoothness="data",
        log_every: int | None = None,
        accountant: str = "pld",
        random_state=None,
    ):
        self.epsilon = epsilon
        self.delta = delta
        self.x_bound = x_bound
        self.y_bound = y_bound
        self.fit_intercept = fit_intercept
        self.noise_multiplier = noise_multiplier
        self.n_iter = n_iter
        self.learning_rate = learning_rate
        self.smoothness = smoothness
        self.log_every = log_every
        self.accountant = accountant
        self.random_state = random_state

    def _resolve_schedule(self, eps: float, delta: float) -> tuple[float, int]:
        sigma = check_positive_param("noise_multiplier", self.noise_multiplier, allow_none=True)
        n_iter = check_int_param("n_iter", self.n_iter, 1, allow_none=True)
        if sigma is None and n_iter is None:
            raise ValueError("give noise_multiplier or n_iter (or both); got both None")
        if n_iter is None:
            n_iter = int(
                calibrate(
                    lambda k: compose(Gaussian(sigma), steps=int(k)),
                    eps,
                    delta,
                    bounds=(1, 10**9),
                    integer=True,
                    accountant=self.accountant,
                )
            )
        elif sigma is None:
            sigma = float(
                calibrate(
                    lambda s: compose(Gaussian(s), steps=n_iter), eps, delta,
                    accountant=self.accountant,
                )
            )
        else:
            spent = spent_epsilon(compose(Gaussian(sigma), steps=n_iter), delta, self.accountant)
            if spent > eps:
                raise ValueError(
                    f"noise_multiplier={sigma} with n_iter={n_iter} spends epsilon={spent:.6g} "
                    f"> epsilon={eps} at delta={delta}; leave one of them None to calibrate"
                )
        return sigma, n_iter

    def fit(self, X, y):
        """Run noisy gradient descent from zero."""
        eps, delta, xb, yb = self._validate_common()
        log_every = check_int_param("log_every", self.log_every, 1, allow_none=True)
        if not (isinstance(self.learning_rate, str) and self.learning_rate == "theory"):
            check_positive_param("learning_rate", self.learning_rate)
        if isinstance(self.smoothness, str):
            check_choice("smoothness", self.smoothness, ("data", "public"))
        else:
            check_positive_param("smoothness", self.smoothness)
        rng = make_rng(self.random_state)
        sigma, n_iter = self._resolve_schedule(eps, delta)
        X, y, xb_eff = self._prepare(X, y, xb, yb)
        XTX, XTy = X.T @ X, X.T @ y
        dim = X.shape[1]
        if isinstance(self.smoothness, str):
            if self.smoothness.lower() == "data":
                L = float(np.linalg.eigvalsh(XTX)[-1])
            else:
                L = xb_eff**2 * X.shape[0]
        else:
            L = float(self.smoothness)
        if L <= 0:
            L = xb_eff**2 * X.shape[0]
        if isinstance(self.learning_rate, str):
            gs_typical = xb_eff**2 * 1.0 + xb_eff * yb
            lr = theoretical_learning_rate(L, dim, sigma * gs_typical, n_iter)
        else:
            lr = float(self.learning_rate)
        theta, path, iters = noisy_gd_paths(
            XTX, XTy, sigma, lr, n_iter, xb_eff, yb, rng, reps=1, log_every=log_every
        )
        if not np.all(np.isfinite(theta)):
            raise FloatingPointError(
                f"NoisyGD diverged (learning_rate={lr:.3g}); use a smaller learning_rate"
            )
        self.noise_multiplier_ = sigma
        self.n_iter_ = n_iter
        self.learning_rate_ = lr
        self.smoothness_ = L
        self.mechanism_ = compose(Gaussian(sigma), steps=n_iter)
        self.delta_ = delta
        self.epsilon_ = spent_epsilon(self.mechanism_, delta, self.accountant)
        self._set_coef(theta[0], xb)
        if log_every is not None:
            self.path_iterations_ = iters
            p = path[:, 0, :]
            self.coef_path_ = p[:, :-1] if self.fit_intercept else p
            self.intercept_path_ = p[:, -1] * xb if self.fit_intercept else np.zeros(len(p))
            self.epsilon_path_ = np.array(
                [
                    spent_epsilon(compose(Gaussian(sigma), steps=int(t)), delta, "analytic")
                    for t in iters
                ]
            )
        return self
