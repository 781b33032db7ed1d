"""Private linear regression: SSP, AdaSSP (Wang 2018) and noisy gradient descent.

All three release noisy versions of quantities whose add/remove sensitivity is bounded
because every feature row has L2 norm at most ``x_bound`` and every label lies in
``[-y_bound, y_bound]`` (or the interval ``y_bound = (y_min, y_max)``, see
:class:`SSPRegressor`); rows above the bound are scaled down to it and labels clipped
before anything is computed (the data are never trusted to satisfy the bounds). ``Y``
below is the resulting bound on a label's magnitude as the mechanism sees it.

Sensitivities (add/remove one record ``(x, y)`` with ``||x|| <= X``, ``|y| <= Y``):

* ``X^T X`` changes by ``x x^T``, Frobenius norm ``||x||^2 <= X^2``; the seed releases
  the upper triangle (diagonal included) with i.i.d. noise and mirrors it, which has the
  same sensitivity (Wang 2018, Alg. 2 / the LR study). By default we release the isometric
  coordinates ``(M_ii, sqrt(2) M_ij)`` instead, whose L2 sensitivity is exactly
  ``||x||^2``: the off-diagonal noise is ``1/sqrt(2)`` of the study's at the same privacy
  (:func:`symmetric_noise`).
* ``X^T y`` changes by ``x y``, norm ``<= X Y``.
* ``lambda_min(X^T X)`` changes by at most ``X^2`` (Weyl's inequality).
* the sum-of-squares gradient ``sum_i x_i (x_i^T theta - y_i)`` changes by
  ``||x (x^T theta - y)|| <= X^2 ||theta|| + X Y`` (the LR study's ``GS_t``).

Noise scales are calibrated through :mod:`privlearn.accounting`: SSP is the composition
of two Gaussian mechanisms with noise multipliers ``(2s, 3s)``, AdaSSP of three with
``(2s, 3s, 5s)`` (the ratios of the LR study's ``SSP_scale``/``AdaSSP_scale``; other ratios
through ``budget_split``), NoisyGD of
``n_iter`` Gaussian mechanisms with multiplier ``noise_multiplier``. Compositions of
Gaussians are accounted exactly (Dong, Roth & Su 2022, Cor. 3.3; Balle & Wang 2018,
Thm. 8) and calibrated on the safe side (noise rounded up, iterations rounded down).

Everything done after the release (PSD projection, eigenvalue floor, solving) is
post-processing of the noisy statistics and costs no privacy (Dwork & Roth 2014,
Prop. 2.1). The LR study's exact algorithms remain available:
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

import functools
import math
import numbers
import warnings

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.utils.validation import check_is_fitted, validate_data

from privlearn.accounting import Gaussian, Mechanism, calibrate, compose
from privlearn.errors import PrivacyLeakWarning
from privlearn.models._base import (
    cancel_on_error,
    check_choice,
    check_int_param,
    check_positive_param,
    check_privacy_budget,
    clip_rows,
    make_rng,
    reserve_on_ledger,
    settle_on_ledger,
    spent_epsilon,
)
from privlearn.models._release import DataClippedWarning, _RemovedAttributesMixin

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
    "check_label_range",
]

#: the LR study's normal quantile used by AdaSSP's high-probability bounds (Wang 2018, Alg. 2).
ADASSP_Z = 1.96

#: the LR study's noise-multiplier ratios: ``(X^T X, X^T y)`` for SSP and ``(X^T X, X^T y,
#: lambda_min)`` for AdaSSP (its ``SSP_scale`` / ``AdaSSP_scale``).
SSP_BUDGET_SPLIT = (2.0, 3.0)
ADASSP_BUDGET_SPLIT = (2.0, 3.0, 5.0)

#: Ways of perturbing ``X^T X`` (see :func:`symmetric_noise`).
MATRIX_NOISES = ("frobenius", "upper_triangle")
#: AdaSSP regularisers (see :func:`adassp_coefficients`).
REGULARIZATIONS = ("eigenvalue_floor", "ridge")


def _check_split(budget_split, n_parts: int) -> tuple[float, ...]:
    if budget_split is None:
        return SSP_BUDGET_SPLIT if n_parts == 2 else ADASSP_BUDGET_SPLIT
    try:
        split = tuple(float(r) for r in budget_split)
    except TypeError:
        raise ValueError(
            f"budget_split must be a sequence of {n_parts} positive finite noise-multiplier "
            f"ratios, got {budget_split!r}"
        ) from None
    if len(split) != n_parts or not all(math.isfinite(r) and r > 0 for r in split):
        raise ValueError(
            f"budget_split must be a sequence of {n_parts} positive finite noise-multiplier "
            f"ratios, got {budget_split!r}"
        )
    return split


def check_label_range(y_bound) -> tuple[float, float]:
    """The label interval ``(lo, hi)`` from ``y_bound``: a float ``Y > 0`` means
    ``[-Y, Y]``; a pair ``(lo, hi)`` of finite numbers with ``lo < hi`` is used as given."""
    if isinstance(y_bound, str) or not hasattr(y_bound, "__len__") or np.ndim(y_bound) == 0:
        try:
            yb = check_positive_param(
                "y_bound", y_bound.item() if isinstance(y_bound, np.ndarray) else y_bound
            )
        except ValueError:
            raise ValueError(
                "y_bound must be a finite number > 0 (labels in [-y_bound, y_bound]) or a "
                f"pair (y_min, y_max) of finite numbers with y_min < y_max, got {y_bound!r}; "
                "e.g. y_bound=5.0 or y_bound=(0.0, 5.0)"
            ) from None
        return -yb, yb
    pair = tuple(y_bound)
    ok = len(pair) == 2 and all(
        isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
        for v in pair
    )
    if not ok or not float(pair[0]) < float(pair[1]):
        raise ValueError(
            "y_bound as an interval must be a pair (y_min, y_max) of finite numbers with "
            f"y_min < y_max, got {y_bound!r}; e.g. y_bound=(0.0, 5.0), or a single number "
            "Y > 0 for [-Y, Y]"
        )
    return float(pair[0]), float(pair[1])


def ssp_mechanism(scale: float, budget_split=SSP_BUDGET_SPLIT) -> Mechanism:
    """SSP as a mechanism: Gaussians with noise multipliers ``r_1 scale`` (X^T X) and
    ``r_2 scale`` (X^T y), composed; ``(r_1, r_2) = (2, 3)`` is the LR study's ``SSP_scale``."""
    r = _check_split(budget_split, 2)
    return compose([Gaussian(r[0] * scale), Gaussian(r[1] * scale)])


def adassp_mechanism(scale: float, budget_split=ADASSP_BUDGET_SPLIT) -> Mechanism:
    """AdaSSP as a mechanism: multipliers ``r_1 s`` (X^T X), ``r_2 s`` (X^T y) and
    ``r_3 s`` (lambda_min), composed; ``(2, 3, 5)`` is the LR study's ``AdaSSP_scale``."""
    r = _check_split(budget_split, 3)
    return compose([Gaussian(r[0] * scale), Gaussian(r[1] * scale), Gaussian(r[2] * scale)])


def calibrate_ssp_scale(
    epsilon: float,
    delta: float,
    *,
    adaptive: bool,
    accountant: str = "pld",
    budget_split=None,
) -> float:
    """Smallest common scale ``s`` (rounded up, so never optimistic) such that the SSP /
    AdaSSP mechanism with noise multipliers ``budget_split * s`` satisfies
    (epsilon, delta)-DP. ``budget_split=None`` uses the LR study's ratios."""
    split = _check_split(budget_split, 3 if adaptive else 2)
    return _calibrate_ssp_scale(float(epsilon), float(delta), adaptive, accountant, split)


@functools.lru_cache(maxsize=1024)
def _calibrate_ssp_scale(epsilon, delta, adaptive, accountant, split) -> float:
    # Pure function of hashable arguments: cached so that repeated fits at one budget
    # (experiments, tests) calibrate once.
    factory = adassp_mechanism if adaptive else ssp_mechanism
    return float(calibrate(lambda s: factory(s, split), epsilon, delta, accountant=accountant))


def symmetric_noise(
    rng: np.random.Generator, reps: int, dim: int, matrix_noise: str = "frobenius"
) -> np.ndarray:
    """``reps`` symmetric noise matrices for releasing ``X^T X`` with L2 sensitivity 1.

    ``"upper_triangle"`` (the LR study, "Analyze Gauss" of Dwork, Talwar, Thakurta & Zhang
    2014, Alg. 1): i.i.d. N(0, 1) on and above the diagonal, mirrored below. Valid because
    the upper triangle of ``x x^T`` has L2 norm at most ``||x x^T||_F = ||x||^2``.

    ``"frobenius"`` (default): N(0, 1) on the diagonal and N(0, 1/2) off it, mirrored. This
    is the Gaussian mechanism applied to ``v(M) = (M_ii, sqrt(2) M_ij (i < j))``, which is
    an isometry from symmetric matrices with the Frobenius norm to R^{d(d+1)/2}; since
    ``||v(x x^T)||_2 = ||x x^T||_F = ||x||^2`` exactly, the same noise multiplier gives the
    same privacy, and mapping back divides the off-diagonal noise by ``sqrt(2)`` (the
    Gaussian mechanism's sensitivity is the L2 norm of the released vector; Dwork & Roth
    2014, Thm. A.1; Balle & Wang 2018, Thm. 8). Strictly less noise, same guarantee.

    Both draw the same ``(reps, dim, dim)`` standard normals, in the same order.
    """
    check_choice("matrix_noise", matrix_noise, MATRIX_NOISES)
    Z = rng.standard_normal((reps, dim, dim))
    upper = np.triu(Z, k=1)
    if matrix_noise == "frobenius":
        upper = upper / math.sqrt(2.0)
    diag = np.einsum("rii->ri", Z)
    out = upper + np.swapaxes(upper, -1, -2)
    out[:, np.arange(dim), np.arange(dim)] = diag
    return out


def noise_direction_scale(dim: int, matrix_noise: str = "frobenius") -> float:
    """Root-mean-square of ``||E v||`` for a unit vector ``v`` and unit-multiplier noise ``E``
    from :func:`symmetric_noise`: ``sqrt(d)`` for ``"upper_triangle"`` (every entry of row
    ``i`` has variance 1) and ``sqrt((d + 1) / 2)`` for ``"frobenius"`` (``sum_i (1 + v_i^2)
    / 2``). The LR study's ridge ``sqrt(d) sigma_1 z`` is ``z`` times this scale; AdaSSP uses the
    same rule for either noise, so the ridge keeps its meaning (a ``z``-quantile bound on the
    noise along a direction) when the noise shrinks."""
    check_choice("matrix_noise", matrix_noise, MATRIX_NOISES)
    return math.sqrt(dim) if matrix_noise == "upper_triangle" else math.sqrt((dim + 1) / 2.0)


def _psd_solve(A: np.ndarray, b: np.ndarray, floor: np.ndarray | None = None) -> np.ndarray:
    """Solve with the projection of symmetric ``A`` (reps, d, d) onto the PSD cone (its
    eigenvalues clipped at 0; Higham 1988), pseudo-inverted: eigen-directions with
    non-positive (or, relative to the largest, numerically zero) eigenvalues are dropped.
    With ``floor`` (reps,), eigenvalues are raised to at least ``floor`` instead."""
    w, V = np.linalg.eigh(A)
    if floor is not None:
        w = np.maximum(w, floor[:, None])
    tol = A.shape[-1] * np.finfo(float).eps * np.max(np.abs(w), axis=-1, keepdims=True)
    keep = w > tol
    inv = np.where(keep, 1.0 / np.where(keep, w, 1.0), 0.0)
    coef = np.einsum("rji,rj->ri", V, b) * inv
    return np.einsum("rij,rj->ri", V, coef)


def ssp_coefficients(
    XTX: np.ndarray,
    XTy: np.ndarray,
    sigma1: float,
    sigma2: float,
    x_bound: float,
    y_bound: float,
    rng: np.random.Generator,
    reps: int = 1,
    *,
    matrix_noise: str = "frobenius",
    project_psd: bool = True,
) -> np.ndarray:
    """``reps`` independent SSP solutions (Wang 2018, Alg. 1), shape (reps, dim).

    ``hat(X^T X) = X^T X + x_bound^2 sigma1 E`` (``E`` from :func:`symmetric_noise`),
    ``hat(X^T y) = X^T y + x_bound y_bound sigma2 N(0, I)``. With ``project_psd=False``
    (the LR study) ``theta = hat(X^T X)^{-1} hat(X^T y)``; with ``project_psd=True`` (default)
    ``hat(X^T X)`` is first projected onto the PSD cone and pseudo-inverted (see
    :func:`_psd_solve`). ``X^T X`` is PSD, so the projection only removes noise; it is
    post-processing of the released statistics and costs no privacy (Dwork & Roth 2014,
    Prop. 2.1). It removes SSP's heavy tail: when the noise makes ``hat(X^T X)`` indefinite
    or nearly singular, the plain solve returns huge coefficients.
    """
    dim = XTX.shape[0]
    hat_xtx = XTX[None] + x_bound**2 * sigma1 * symmetric_noise(rng, reps, dim, matrix_noise)
    hat_xty = XTy[None] + x_bound * y_bound * sigma2 * rng.standard_normal((reps, dim))
    if project_psd:
        return _psd_solve(hat_xtx, hat_xty)
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
    *,
    matrix_noise: str = "frobenius",
    regularization: str = "eigenvalue_floor",
) -> tuple[np.ndarray, np.ndarray]:
    """``reps`` independent AdaSSP solutions (Wang 2018, Alg. 2 as in the LR study).

    Releases ``hat(X^T X)``, ``hat(X^T y)`` as :func:`ssp_coefficients` and a noisy smallest
    eigenvalue ``lambda_min + x_bound^2 sigma3 N(0,1)`` (sensitivity ``x_bound^2`` by
    Weyl's inequality). With ``z = 1.96`` and ``r = noise_direction_scale(d, matrix_noise)``
    (``sqrt(d)`` for the study's noise) the regularisation level is
    ``lambda = max(0, r sigma1 x_bound^2 z - max(0, hat(lambda_min) - x_bound^2 sigma3 z))``.

    ``regularization="ridge"`` (Wang 2018; the LR study):
    ``theta = (hat(X^T X) + lambda I)^{-1} hat(X^T y)``.

    ``regularization="eigenvalue_floor"`` (default): ``hat(X^T X) = V diag(w) V^T`` and
    ``theta = V diag(1 / max(w, lambda)) V^T hat(X^T y)``, i.e. ``hat(X^T X)`` is projected
    (in Frobenius norm) onto ``{A : A >= lambda I}`` before solving. Like the ridge it
    guarantees an eigenvalue at least ``lambda`` in every direction, so it controls the
    same ill-conditioning that AdaSSP's ``lambda`` is chosen against; unlike the ridge it
    leaves eigen-directions the noisy statistics resolve (eigenvalue above ``lambda``)
    unshrunk, which removes the ridge's bias there. Same released statistics, so the same
    privacy (post-processing, Dwork & Roth 2014, Prop. 2.1). When ``lambda = 0`` the
    directions with non-positive eigenvalue are dropped (PSD projection).

    Returns the coefficients (reps, dim) and the regularisation levels ``lambda`` (reps,).
    """
    check_choice("regularization", regularization, REGULARIZATIONS)
    dim = XTX.shape[0]
    hat_xtx = XTX[None] + x_bound**2 * sigma1 * symmetric_noise(rng, reps, dim, matrix_noise)
    hat_xty = XTy[None] + x_bound * y_bound * sigma2 * rng.standard_normal((reps, dim))
    if lambda_min is None:
        lambda_min = float(np.linalg.eigvalsh(XTX)[0])
    noisy_min = lambda_min + x_bound**2 * sigma3 * rng.standard_normal(reps)
    lower = np.maximum(0.0, noisy_min - x_bound**2 * sigma3 * ADASSP_Z)
    scale = noise_direction_scale(dim, matrix_noise)
    lamb = np.maximum(0.0, scale * sigma1 * x_bound**2 * ADASSP_Z - lower)
    if regularization == "eigenvalue_floor":
        return _psd_solve(hat_xtx, hat_xty, floor=lamb), lamb
    A = hat_xtx + lamb[:, None, None] * np.eye(dim)[None]
    return np.linalg.solve(A, hat_xty[..., None])[..., 0], lamb


def theoretical_learning_rate(
    smoothness: float, dim: int, noise_std: float, n_iter: int
) -> float:
    """The LR study's learning rate ``min(1/L, 4 / sqrt(d * noise_std * L * n_iter))``.

    ``L`` is the smoothness (largest eigenvalue of ``X^T X``) and ``noise_std`` the
    per-coordinate gradient-noise level ``sigma * GS`` with the study's typical
    ``GS = x_bound^2 + x_bound y_bound`` (the study's ``theoretical_lr_choice``, which
    follows the standard noisy-GD rate of Bassily, Smith & Thakurta 2014).
    """
    return float(min(1.0 / smoothness, 4.0 / math.sqrt(dim * noise_std * smoothness * n_iter)))


def noisy_gd_paths(
    XTX: np.ndarray,
    XTy: np.ndarray,
    sigma: float,
    lr: float | np.ndarray,
    n_iter: int,
    x_bound: float,
    y_bound: float,
    rng: np.random.Generator,
    reps: int = 1,
    log_every: int | None = None,
    chunk: int = 256,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run ``reps`` independent NoisyGD chains at once (the LR study).

    ``theta_{t+1} = theta_t - lr (X^T X theta_t - X^T y + GS_t sigma N(0, I))`` with
    ``GS_t = x_bound^2 ||theta_t|| + x_bound y_bound``, from ``theta_0 = 0``. ``lr`` is
    one learning rate for all chains or one per chain, shape (reps,).

    Returns
    -------
    theta : (reps, dim) final iterates
    path : (n_logs, reps, dim) iterates after iterations ``log_iters``
    log_iters : (n_logs,) int, the number of iterations completed at each log point
        (``1, 1 + log_every, 1 + 2 log_every, ...`` as the seed logs ``i % log_gap == 0``)
    """
    dim = XTX.shape[0]
    lr_arr = np.broadcast_to(np.asarray(lr, dtype=float), (reps,))
    if reps == 1 and log_every is None:
        return _noisy_gd_single(
            XTX, XTy, sigma, float(lr_arr[0]), n_iter, x_bound, y_bound, rng, chunk
        )
    lr_col = lr_arr[:, None]
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
            theta = theta - lr_col * (grad + (gs * sigma)[:, None] * noise[j])
            if log_every is not None and (i + j) % log_every == 0:
                logs.append(theta.copy())
                iters.append(i + j + 1)
        i += m
    path = np.array(logs) if logs else np.zeros((0, reps, dim))
    return theta, path, np.array(iters, dtype=np.int64)


def _noisy_gd_single(XTX, XTy, sigma, lr, n_iter, x_bound, y_bound, rng, chunk):
    """One chain of :func:`noisy_gd_paths` without logging, with scalar bookkeeping.

    The same recursion and the same random draws (``(chunk, 1, dim)`` standard normals per
    block) as the batched loop, written with 1-d arrays and ``math.sqrt`` because NumPy's
    per-call overhead dominates at ``dim = 8`` (about 3x faster). Agrees with the batched
    loop up to floating-point rounding (tested)."""
    dim = XTX.shape[0]
    theta = np.zeros(dim)
    a, b = x_bound**2, x_bound * y_bound
    dot, sqrt = np.dot, math.sqrt
    i = 0
    while i < n_iter:
        m = min(chunk, n_iter - i)
        noise = rng.standard_normal((m, 1, dim)) * sigma
        for j in range(m):
            gs = a * sqrt(dot(theta, theta)) + b
            theta = theta - lr * (dot(XTX, theta) - XTy + gs * noise[j, 0])
        i += m
    empty = np.zeros((0, 1, dim))
    return theta[None, :], empty, np.zeros(0, dtype=np.int64)


class _PrivateLinearBase(_RemovedAttributesMixin, RegressorMixin, BaseEstimator):
    """Shared input handling: validation, clipping, intercept, prediction."""

    _removed_attributes = ("n_rows_clipped_", "n_labels_clipped_")

    def _validate_common(self) -> tuple[float, float, float, float]:
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


class SSPRegressor(_PrivateLinearBase):
    """Sufficient statistics perturbation (Vu & Slavkovic 2009; Foulds et al. 2016; Wang
    2018, Algorithm 1), (epsilon, delta)-DP.

    Releases ``X^T X`` and ``X^T y`` with Gaussian noise and solves the normal equations
    built from the noisy statistics.

    Parameters
    ----------
    epsilon : float > 0
    delta : float in (0, 1)
    x_bound : float > 0
        Bound on the L2 norm of a feature row; rows above it are scaled down to it.
    y_bound : float > 0 or pair (y_min, y_max)
        Public bound on the labels: a float ``Y`` means ``[-Y, Y]``, a pair the interval
        ``[y_min, y_max]`` (``y_min < y_max``, both finite). Labels are clipped to it. The
        sensitivities use ``Y = (y_max - y_min) / 2`` when ``fit_intercept`` (the labels
        are centred at the public midpoint, which the intercept absorbs exactly) and
        ``Y = max(|y_min|, |y_max|)`` without an intercept (no shift is possible then).
    fit_intercept : bool
        Fit an intercept by appending the constant column ``x_bound`` (augmented rows then
        have norm at most ``sqrt(2) x_bound``, which the noise accounts for). The LR study
        fits none.
    budget_split : sequence of 2 floats > 0 or None
        Noise-multiplier ratios ``(r_XTX, r_XTy)``; the common scale is calibrated so
        that the composition is (epsilon, delta)-DP. None: the LR study's ``(2, 3)``.
    matrix_noise : {"frobenius", "upper_triangle"}
        How ``X^T X`` is perturbed, see :func:`symmetric_noise`. ``"frobenius"`` (default)
        has ``1/sqrt(2)`` of the study's off-diagonal noise at the same privacy;
        ``"upper_triangle"`` is the LR study's.
    project_psd : bool
        Solve with the PSD projection of the noisy ``X^T X`` (pseudo-inverse; default,
        post-processing, no privacy cost) instead of its plain inverse (the LR study). See
        :func:`ssp_coefficients`. The LR study's SSP is
        ``SSPRegressor(matrix_noise="upper_triangle", project_psd=False)``.
    accountant : str
        Accountant used for calibration (default ``"pld"``, exact for Gaussians).
    random_state : None, int, numpy Generator or RandomState
    ledger : BudgetHandle, optional
        ``Ledger(path).budget(dataset)`` (:mod:`privlearn.ledger`): the mechanism is
        spent on it before the data is read; over budget,
        ``BudgetExceededError`` is raised and nothing is recorded or released.

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
    docs/trust-model.md). ``n_rows_clipped_`` and ``n_labels_clipped_`` were removed
    (reading them raises AttributeError): they were exact counts of the private data, a
    privacy bug. Clipping that changes rows or labels now emits a
    :class:`~privlearn.models.DataClippedWarning` to the person fitting.

    Notes
    -----
    the LR study (California housing, epsilon = 1, delta = 1e-6, 200,000 repetitions): the
    default's median training MSE is 0.680 (standard deviation of a 50-fit median 0.012);
    the study's version has median 0.760 with a heavy upper tail (19% of its fits have
    MSE > 1.39, from an indefinite or nearly singular noisy ``X^T X``), so its 50-fit
    median exceeds 0.77 40% of the time (sd 0.040) and a 20-fit median above 1.1 has
    probability 1.5% (binomial; matched by simulation over 1,000 seeds: no stream reuse or
    correlation between repetitions). The PSD projection removes most of that tail;
    medians at epsilon = 0.1 / 0.5 / 1 / 2: seed 1.160 / 0.793 / 0.760 / 0.726, default
    0.793 / 0.689 / 0.680 / 0.668.

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

    def _validate_variant(self) -> tuple[float, ...]:
        split = _check_split(self.budget_split, 3 if self._adaptive else 2)
        check_choice("matrix_noise", self.matrix_noise, MATRIX_NOISES)
        if self._adaptive:
            check_choice("regularization", self.regularization, REGULARIZATIONS)
        elif not isinstance(self.project_psd, bool | np.bool_):
            raise ValueError(f"project_psd must be a bool, got {self.project_psd!r}")
        return split

    def calibrated_noise_scale(self) -> float:
        """The common noise scale ``s`` that :meth:`fit` uses for this budget (rounded up)."""
        eps, delta, _, _ = self._validate_common()
        split = self._validate_variant()
        return calibrate_ssp_scale(
            eps, delta, adaptive=self._adaptive, accountant=self.accountant, budget_split=split
        )

    def _planned_mechanism(self) -> Mechanism:
        """The mechanism one fit runs (data-independent: calibrated from the budget)."""
        split = self._validate_variant()
        factory = adassp_mechanism if self._adaptive else ssp_mechanism
        return factory(self.calibrated_noise_scale(), split)

    def _draw(self, X, y, reps: int, rng: np.random.Generator):
        """Validate, calibrate, release and solve ``reps`` times (one batched draw).

        The single code path of :meth:`fit` and :meth:`sample_coefficients`."""
        eps, delta, xb, yb = self._validate_common()
        split = self._validate_variant()
        res = reserve_on_ledger(self, lambda: compose(self._planned_mechanism(), steps=reps))
        with cancel_on_error(res):  # validation reads the data but releases nothing
            X, y, xb_eff = self._prepare(X, y, xb, yb)
        XTX, XTy = X.T @ X, X.T @ y
        s = self.calibrated_noise_scale()
        sig = [r * s for r in split]
        noise = self.matrix_noise.lower()
        if self._adaptive:
            mech = adassp_mechanism(s, split)
            theta, lamb = adassp_coefficients(
                XTX, XTy, *sig, xb_eff, yb, rng, reps=reps, matrix_noise=noise,
                regularization=self.regularization.lower(),
            )
        else:
            mech = ssp_mechanism(s, split)
            theta = ssp_coefficients(
                XTX, XTy, *sig, xb_eff, yb, rng, reps=reps, matrix_noise=noise,
                project_psd=bool(self.project_psd),
            )
            lamb = None
        if not np.all(np.isfinite(theta)):
            raise FloatingPointError(
                f"{type(self).__name__}: the noisy normal equations gave non-finite "
                "coefficients"
            )
        settle_on_ledger(res)
        return theta, lamb, mech, s, delta, xb

    def fit(self, X, y):
        """Release noisy sufficient statistics and solve the normal equations."""
        rng = make_rng(self.random_state)
        theta, lamb, mech, s, delta, xb = self._draw(X, y, 1, rng)
        self.mechanism_ = mech
        self.noise_scale_ = s
        self.delta_ = delta
        self.epsilon_ = spent_epsilon(mech, delta, self.accountant)
        if lamb is not None:
            self.ridge_ = float(lamb[0])
        self._set_coef(theta[0], xb)
        return self

    def sample_coefficients(self, X, y, n_repetitions: int) -> tuple[np.ndarray, np.ndarray]:
        """Coefficients of ``n_repetitions`` independent fits, drawn in one batch.

        Runs exactly the code of :meth:`fit` (same validation, calibration, noise and
        solver) with ``n_repetitions`` independent noise draws from ``random_state``; the
        first row equals ``fit(X, y).coef_`` for the same ``random_state``. For experiments
        and tests: each row alone is (epsilon, delta)-DP, but releasing all rows composes
        ``n_repetitions`` mechanisms. The estimator is not fitted by this call.

        Returns
        -------
        coef : ndarray (n_repetitions, n_features)
        intercept : ndarray (n_repetitions,)
        """
        n = check_int_param("n_repetitions", n_repetitions, 1)
        rng = make_rng(self.random_state)
        theta, _, _, _, _, xb = self._draw(X, y, n, rng)
        if self.fit_intercept:
            return theta[:, :-1].copy(), theta[:, -1] * xb + self._label_centre()
        return theta, np.zeros(n)


class AdaSSPRegressor(SSPRegressor):
    """Adaptive SSP (Wang 2018, Algorithm 2), (epsilon, delta)-DP.

    Like :class:`SSPRegressor`, plus a privately released smallest eigenvalue of
    ``X^T X`` that sets a regularisation level ``lambda`` large enough to keep the noisy
    system well conditioned (the LR study's rule, see :func:`adassp_coefficients`).

    Parameters
    ----------
    epsilon, delta, x_bound, y_bound, fit_intercept, accountant, random_state, ledger
        As :class:`SSPRegressor`.
    budget_split : sequence of 3 floats > 0 or None
        Noise-multiplier ratios for ``(X^T X, X^T y, lambda_min)``. None: the LR study's
        ``(2, 3, 5)``. Kept as the default: Wang's (2018) equal split ``(1, 1, 1)`` (his
        ``epsilon/3`` per release) is worse on the LR study with the ridge (median MSE 0.833 vs
        0.792 at epsilon = 0.1) and within 0.006 of it with the eigenvalue floor (0.703 vs
        0.698), so no split is chosen by looking at the data.
    matrix_noise : {"frobenius", "upper_triangle"}
        As :class:`SSPRegressor`. With ``"frobenius"`` the ridge rule's noise scale
        ``sqrt(d)`` becomes ``sqrt((d + 1) / 2)`` (:func:`noise_direction_scale`).
    regularization : {"eigenvalue_floor", "ridge"}
        ``"eigenvalue_floor"`` (default): raise the eigenvalues of the noisy ``X^T X`` to at
        least ``lambda``; ``"ridge"``: add ``lambda I`` (Wang 2018; the LR study). The LR study's
        AdaSSP is ``AdaSSPRegressor(matrix_noise="upper_triangle", regularization="ridge")``.

    Attributes
    ----------
    mechanism_ : ``compose([Gaussian(r_1 s), Gaussian(r_2 s), Gaussian(r_3 s)])``
    ridge_ : float
        The data-adaptive regularisation level lambda that was used.
    (others as :class:`SSPRegressor`)

    Notes
    -----
    Why the defaults (the LR study, California housing, delta = 1e-6; population medians of
    the training MSE from 200,000 repetitions, docs/benchmarks.md). On this data
    ``lambda_min(X^T X) = 0.13`` while ``lambda`` is about ``4 sigma_1`` (180 at
    epsilon = 0.1), so the ridge's bias dominates the error: the study's version has median
    0.829 at epsilon = 0.1 and 0.661 at epsilon = 1. No default constant was fitted to
    the data: the Frobenius noise is strictly smaller at the same privacy, the rule for
    ``lambda`` is the study's (``z`` times the RMS noise along a direction), and the
    eigenvalue floor is post-processing that removes the ridge's shrinkage of
    well-determined directions. Medians at epsilon = 0.1 / 0.5 / 1 / 2:

    ========================================  =====  =====  =====  =====
    variant                                   0.1    0.5    1      2
    ========================================  =====  =====  =====  =====
    the LR study (upper_triangle, ridge)      0.829  0.678  0.661  0.653
    frobenius, ridge                          0.793  0.671  0.658  0.651
    upper_triangle, eigenvalue_floor          0.703  0.658  0.653  0.650
    default (frobenius, eigenvalue_floor)     0.698  0.658  0.653  0.650
    ========================================  =====  =====  =====  =====

    The standard deviation of a 50-fit median of the default is 0.008 at epsilon = 0.1
    (bound 0.83: 16 sd away) and 0.0011 at epsilon = 1 (bound 0.665: 11 sd).

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


class NoisyGDRegressor(_PrivateLinearBase):
    """Full-batch noisy gradient descent for least squares (the LR study), (epsilon, delta)-DP.

    ``theta_{t+1} = theta_t - lr (sum_i x_i (x_i^T theta_t - y_i) + GS_t sigma N(0, I))``
    with the theta-dependent sensitivity ``GS_t = x_bound^2 ||theta_t|| + x_bound Y``
    (``Y`` the label bound, see ``y_bound``). The iterations are the composition of
    ``n_iter`` Gaussian mechanisms with multiplier ``sigma`` (Bassily, Smith & Thakurta
    2014), accounted exactly.

    The learning rate is part of what is released (it shapes every iterate), so it must
    not be an un-noised function of the data. By default (``smoothness="private"``) the
    smoothness ``L = lambda_max(X^T X)`` of the objective is released by one more Gaussian
    mechanism (sensitivity ``x_bound^2`` by Weyl's inequality), composed into
    ``mechanism_`` and paid from the same budget: it gets the fraction
    :data:`SMOOTHNESS_BUDGET_FRACTION` (1%) of the budget measured in ``1 / sigma^2``
    (Gaussian compositions add ``1 / sigma^2``; Dong, Roth & Su 2022, Cor. 3.3), i.e.
    multiplier ``sigma_L = sigma_total / sqrt(0.01)`` where ``sigma_total`` is the single
    Gaussian multiplier for (epsilon, delta). The learning rate uses the high-probability
    upper bound ``hat(L) = max(x_bound^2, noisy L + 1.96 sigma_L x_bound^2)``
    (post-processing). On the LR study's California setting (epsilon 2, delta 1e-6) this costs
    about 1% of the iterations and leaves the median training MSE at that of the seed's
    exact-``L`` rate (tests/models/test_privacy_fixes.py).

    Parameters
    ----------
    epsilon, delta, x_bound, y_bound, fit_intercept, accountant, random_state, ledger
        As :class:`SSPRegressor`.
    noise_multiplier : float > 0 or None
        ``sigma``. Default 500 (the LR study's "large noise, many iterations" regime; the
        seed's other regime is 50). With ``n_iter=None`` the number of iterations is
        calibrated to the budget (the largest integer that fits, rounded down). If None,
        ``n_iter`` must be given and sigma is calibrated instead (rounded up).
    n_iter : int or None
        Number of iterations; if both ``n_iter`` and ``noise_multiplier`` are given the
        budget is checked and a ValueError raised if exceeded.
    learning_rate : "theory" or float > 0
        ``"theory"`` (default): the LR study's choice, see :func:`theoretical_learning_rate`.
        A float is used as given (then no smoothness is released and no budget spent on it).
    smoothness : "private", "public", "data" or float > 0
        The smoothness ``L`` used by the theoretical learning rate.

        * ``"private"`` (default): released with noise as described above; covered by
          ``mechanism_``.
        * a float: used as given (public knowledge, costs nothing).
        * ``"public"``: the bound ``x_bound^2 n`` (``x_bound`` after the intercept
          column). It uses the exact number of rows ``n``, which add/remove
          neighbouring treats as private, so it emits a
          :class:`~privlearn.errors.PrivacyLeakWarning`.
        * ``"data"`` (the LR study's choice): the exact ``lambda_max(X^T X)``, released
          without protection in ``smoothness_`` and through the learning rate; emits a
          :class:`~privlearn.errors.PrivacyLeakWarning`. Before version 0.2 this was
          the default.
    log_every : int or None
        Record the iterate and the epsilon spent after iterations ``1, 1 + log_every,
        ...`` (the LR study's ``log_gap``) in ``coef_path_`` and ``epsilon_path_``.

    Attributes
    ----------
    coef_, intercept_ : final iterate
    n_iter_, noise_multiplier_, learning_rate_ : what ran
    smoothness_ : float or None
        The ``L`` the learning rate used (the noisy upper bound by default); None when
        ``learning_rate`` is a float.
    mechanism_ : ``compose([Gaussian(sigma_L), Gaussian(sigma) x n_iter])``
        (without the first part unless the smoothness was released privately)
    epsilon_, delta_ : certified epsilon spent at ``delta_``
    path_iterations_, coef_path_, intercept_path_, epsilon_path_ : trajectory (when
        ``log_every`` is set); ``epsilon_path_[k]`` is the exact epsilon after
        ``path_iterations_[k]`` iterations, including the smoothness release (analytic
        Gaussian composition, O(1) each).

    Notes
    -----
    The attributes ``n_rows_clipped_`` / ``n_labels_clipped_`` were removed: they were
    exact counts of the private data (a privacy bug); clipping now warns the person
    fitting with a :class:`~privlearn.models.DataClippedWarning`.
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
        smoothness="private",
        log_every: int | None = None,
        accountant: str = "pld",
        random_state=None,
        ledger=None,
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
        self.ledger = ledger

    def _check_lr_smoothness(self) -> tuple[bool, str | float]:
        """(theory learning rate?, smoothness mode or value); clear errors otherwise."""
        lr = self.learning_rate
        theory = isinstance(lr, str) and lr.lower() == "theory"
        if not theory:
            if isinstance(lr, str):
                raise ValueError(
                    f"learning_rate must be 'theory' or a finite number > 0, got {lr!r}"
                )
            check_positive_param("learning_rate", lr)
        sm = self.smoothness
        if isinstance(sm, str):
            sm = check_choice("smoothness", sm, SMOOTHNESS_MODES)
        else:
            try:
                sm = check_positive_param("smoothness", sm)
            except ValueError:
                raise ValueError(
                    f"smoothness must be one of {SMOOTHNESS_MODES} or a finite number > 0, "
                    f"got {self.smoothness!r}; the default 'private' releases it with noise"
                ) from None
        return theory, sm

    def _smoothness_multiplier(self, eps: float, delta: float, private_l: bool) -> float | None:
        """``sigma_L`` of the smoothness release (None when it is not released): a fixed
        fraction of the budget in ``1 / sigma^2``, from public parameters only."""
        if not private_l:
            return None
        return _smoothness_sigma(eps, delta, self.accountant)

    def _resolve_schedule(
        self, eps: float, delta: float, sigma_l: float | None
    ) -> tuple[float, int]:
        sigma = check_positive_param("noise_multiplier", self.noise_multiplier, allow_none=True)
        n_iter = check_int_param("n_iter", self.n_iter, 1, allow_none=True)
        if sigma is None and n_iter is None:
            raise ValueError(
                "give noise_multiplier or n_iter (or both); got both None. E.g. "
                "noise_multiplier=500 calibrates n_iter to the budget"
            )

        def mech(s, k):
            return _noisy_gd_mechanism(s, int(k), sigma_l)

        if n_iter is None:
            if spent_epsilon(mech(sigma, 1), delta, self.accountant) > eps:
                raise ValueError(
                    f"noise_multiplier={sigma} is too small for epsilon={eps} at "
                    f"delta={delta}: even one iteration exceeds the budget; use a larger "
                    "noise_multiplier"
                )
            n_iter = int(
                calibrate(
                    lambda k: mech(sigma, k),
                    eps,
                    delta,
                    bounds=(1, 10**9),
                    integer=True,
                    accountant=self.accountant,
                )
            )
        elif sigma is None:
            sigma = float(
                calibrate(lambda s: mech(s, n_iter), eps, delta, accountant=self.accountant)
            )
        else:
            spent = spent_epsilon(mech(sigma, n_iter), delta, self.accountant)
            if spent > eps:
                extra = (
                    " (including the private smoothness release; smoothness=<float> or "
                    "learning_rate=<float> avoid it)"
                    if sigma_l is not None
                    else ""
                )
                raise ValueError(
                    f"noise_multiplier={sigma} with n_iter={n_iter} spends "
                    f"epsilon={spent:.6g} > epsilon={eps} at delta={delta}{extra}; leave "
                    "one of them None to calibrate"
                )
        return sigma, n_iter

    def _draw(self, X, y, reps: int, rng: np.random.Generator, log_every: int | None):
        """Validate, calibrate and run ``reps`` independent chains (one batched run).

        The single code path of :meth:`fit` and :meth:`sample_coefficients`."""
        eps, delta, xb, yb = self._validate_common()
        theory, sm = self._check_lr_smoothness()
        private_l = theory and sm == "private"
        sigma_l = self._smoothness_multiplier(eps, delta, private_l)
        sigma, n_iter = self._resolve_schedule(eps, delta, sigma_l)
        res = reserve_on_ledger(
            self, lambda: compose(_noisy_gd_mechanism(sigma, n_iter, sigma_l), steps=reps)
        )
        if theory and sm in ("data", "public"):
            what = (
                "the exact largest eigenvalue of X^T X" if sm == "data"
                else "x_bound^2 times the exact number of rows n"
            )
            warnings.warn(
                f"NoisyGDRegressor(smoothness={sm!r}) sets the learning rate from {what}, "
                "which is not covered by mechanism_: the fitted model releases it "
                "un-noised. Use smoothness='private' (default) or a public float.",
                PrivacyLeakWarning,
                stacklevel=3,
            )
        with cancel_on_error(res):  # validation reads the data but releases nothing
            X, y, xb_eff = self._prepare(X, y, xb, yb)
        XTX, XTy = X.T @ X, X.T @ y
        dim = X.shape[1]
        if not theory:
            L = None
            lr = np.full(reps, float(self.learning_rate))
        else:
            if sm == "private":
                # One Gaussian release of lambda_max (sensitivity xb_eff^2, Weyl), then
                # post-processing: a 1.96-sigma upper bound, floored at one row's maximum.
                lam_max = float(np.linalg.eigvalsh(XTX)[-1])
                noisy = lam_max + xb_eff**2 * sigma_l * rng.standard_normal(reps)
                L = np.maximum(noisy + ADASSP_Z * sigma_l * xb_eff**2, xb_eff**2)
            elif sm == "data":
                L = np.full(reps, max(float(np.linalg.eigvalsh(XTX)[-1]), xb_eff**2))
            elif sm == "public":
                L = np.full(reps, xb_eff**2 * X.shape[0])
            else:
                L = np.full(reps, float(sm))
            gs_typical = xb_eff**2 * 1.0 + xb_eff * yb
            lr = np.array(
                [theoretical_learning_rate(float(l_), dim, sigma * gs_typical, n_iter)
                 for l_ in L]
            )
        with np.errstate(over="ignore", invalid="ignore"):
            theta, path, iters = noisy_gd_paths(
                XTX, XTy, sigma, lr, n_iter, xb_eff, yb, rng, reps=reps, log_every=log_every
            )
        if not np.all(np.isfinite(theta)):
            raise FloatingPointError(
                f"NoisyGD diverged (learning_rate={float(np.max(lr)):.3g}); use a smaller "
                "learning_rate"
            )
        settle_on_ledger(res)
        return theta, path, iters, sigma, n_iter, lr, L, sigma_l, delta, xb

    def sample_coefficients(self, X, y, n_repetitions: int) -> tuple[np.ndarray, np.ndarray]:
        """Final iterates of ``n_repetitions`` independent NoisyGD runs, as one batch.

        Runs the code of :meth:`fit` (same validation, schedule, learning rate and
        iteration, :func:`noisy_gd_paths`) with ``n_repetitions`` independent chains (each
        with its own smoothness release); with ``n_repetitions=1`` it returns
        ``fit(X, y).coef_`` for the same ``random_state``. Each row alone is
        (epsilon, delta)-DP; all rows together compose ``n_repetitions`` runs. The
        estimator is not fitted by this call.

        Returns
        -------
        coef : ndarray (n_repetitions, n_features)
        intercept : ndarray (n_repetitions,)
        """
        n = check_int_param("n_repetitions", n_repetitions, 1)
        rng = make_rng(self.random_state)
        out = self._draw(X, y, n, rng, None)
        theta, xb = out[0], out[-1]
        if self.fit_intercept:
            return theta[:, :-1].copy(), theta[:, -1] * xb + self._label_centre()
        return theta, np.zeros(n)

    def fit(self, X, y):
        """Run noisy gradient descent from zero."""
        log_every = check_int_param("log_every", self.log_every, 1, allow_none=True)
        rng = make_rng(self.random_state)
        theta, path, iters, sigma, n_iter, lr, L, sigma_l, delta, xb = self._draw(
            X, y, 1, rng, log_every
        )
        self.noise_multiplier_ = sigma
        self.n_iter_ = n_iter
        self.learning_rate_ = float(lr[0])
        self.smoothness_ = None if L is None else float(L[0])
        self.mechanism_ = _noisy_gd_mechanism(sigma, n_iter, sigma_l)
        self.delta_ = delta
        self.epsilon_ = spent_epsilon(self.mechanism_, delta, self.accountant)
        self._set_coef(theta[0], xb)
        if log_every is not None:
            self.path_iterations_ = iters
            p = path[:, 0, :]
            self.coef_path_ = p[:, :-1] if self.fit_intercept else p
            self.intercept_path_ = (
                p[:, -1] * xb + self._label_centre() if self.fit_intercept
                else np.zeros(len(p))
            )
            self.epsilon_path_ = np.array(
                [
                    spent_epsilon(_noisy_gd_mechanism(sigma, int(t), sigma_l), delta,
                                  "analytic")
                    for t in iters
                ]
            )
        return self


#: Smoothness modes of :class:`NoisyGDRegressor` (besides a float).
SMOOTHNESS_MODES = ("private", "public", "data")

#: Fraction of NoisyGD's budget, in ``1 / sigma^2`` (Gaussian-DP ``mu^2``), spent on the
#: private smoothness release. Fixed in advance (not tuned on any data set).
SMOOTHNESS_BUDGET_FRACTION = 0.01


def _noisy_gd_mechanism(sigma: float, n_iter: int, sigma_l: float | None) -> Mechanism:
    """What NoisyGD runs: ``n_iter`` Gaussians with multiplier ``sigma``, preceded by the
    smoothness release ``Gaussian(sigma_l)`` when there is one."""
    gd = compose(Gaussian(sigma), steps=n_iter)
    return gd if sigma_l is None else compose([Gaussian(sigma_l), gd])


@functools.lru_cache(maxsize=256)
def _smoothness_sigma(eps: float, delta: float, accountant: str) -> float:
    """``sigma_total / sqrt(SMOOTHNESS_BUDGET_FRACTION)`` with ``sigma_total`` the
    multiplier of one Gaussian that is exactly (eps, delta)-DP (rounded up)."""
    total = float(calibrate(lambda s: Gaussian(s), eps, delta, accountant=accountant))
    return total / math.sqrt(SMOOTHNESS_BUDGET_FRACTION)
