"""Release kernels and calibration of SSP and AdaSSP (Wang 2018, Algorithms 1 and 2).

The noisy sufficient statistics, their solvers and the noise calibration behind
:class:`~privlearn.models.SSPRegressor` and :class:`~privlearn.models.AdaSSPRegressor`;
sensitivities, privacy argument and references in :mod:`privlearn.models.linear`.
"""

from __future__ import annotations

import functools
import math
import numbers

import numpy as np

from privlearn import _validation as _v
from privlearn.accounting import Gaussian, Mechanism, calibrate, compose
from privlearn.errors import ParameterValueError

#: the notebook's normal quantile used by AdaSSP's high-probability bounds (Wang 2018, Alg. 2).
ADASSP_Z = 1.96

#: the notebook's noise-multiplier ratios: ``(X^T X, X^T y)`` for SSP and ``(X^T X, X^T y,
#: lambda_min)`` for AdaSSP (its ``SSP_scale`` / ``AdaSSP_scale``).
SSP_BUDGET_SPLIT = (2.0, 3.0)
ADASSP_BUDGET_SPLIT = (2.0, 3.0, 5.0)

#: Ways of perturbing ``X^T X`` (see :func:`symmetric_noise`).
MATRIX_NOISES = ("frobenius", "upper_triangle")
#: AdaSSP regularisers (see :func:`adassp_coefficients`).
REGULARIZATIONS = ("eigenvalue_floor", "ridge")


def _split_message(budget_split, n_parts: int) -> str:
    default = SSP_BUDGET_SPLIT if n_parts == 2 else ADASSP_BUDGET_SPLIT
    return (f"budget_split must be a sequence of {n_parts} positive finite noise-multiplier "
            f"ratios, got {budget_split!r}; e.g. budget_split={tuple(map(int, default))}, or "
            "None for that default")


def _check_split(budget_split, n_parts: int) -> tuple[float, ...]:
    if budget_split is None:
        return SSP_BUDGET_SPLIT if n_parts == 2 else ADASSP_BUDGET_SPLIT
    try:
        split = tuple(float(r) for r in budget_split)
    except (TypeError, ValueError):
        raise ParameterValueError(_split_message(budget_split, n_parts)) from None
    if len(split) != n_parts or not all(math.isfinite(r) and r > 0 for r in split):
        raise ParameterValueError(_split_message(budget_split, n_parts))
    return split


def check_label_range(y_bound) -> tuple[float, float]:
    """The label interval ``(lo, hi)`` from ``y_bound``: a float ``Y > 0`` means
    ``[-Y, Y]``; a pair ``(lo, hi)`` of finite numbers with ``lo < hi`` is used as given."""
    if isinstance(y_bound, str) or not hasattr(y_bound, "__len__") or np.ndim(y_bound) == 0:
        try:
            yb = _v.check_positive(
                "y_bound", y_bound.item() if isinstance(y_bound, np.ndarray) else y_bound
            )
        except ValueError:
            raise ParameterValueError(
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
        raise ParameterValueError(
            "y_bound as an interval must be a pair (y_min, y_max) of finite numbers with "
            f"y_min < y_max, got {y_bound!r}; e.g. y_bound=(0.0, 5.0), or a single number "
            "Y > 0 for [-Y, Y]"
        )
    return float(pair[0]), float(pair[1])


def ssp_mechanism(scale: float, budget_split=SSP_BUDGET_SPLIT) -> Mechanism:
    """SSP as a mechanism: Gaussians with noise multipliers ``r_1 scale`` (X^T X) and
    ``r_2 scale`` (X^T y), composed; ``(r_1, r_2) = (2, 3)`` is the notebook's ``SSP_scale``."""
    r = _check_split(budget_split, 2)
    return compose([Gaussian(r[0] * scale), Gaussian(r[1] * scale)])


def adassp_mechanism(scale: float, budget_split=ADASSP_BUDGET_SPLIT) -> Mechanism:
    """AdaSSP as a mechanism: multipliers ``r_1 s`` (X^T X), ``r_2 s`` (X^T y) and
    ``r_3 s`` (lambda_min), composed; ``(2, 3, 5)`` is the notebook's ``AdaSSP_scale``."""
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
    (epsilon, delta)-DP. ``budget_split=None`` uses the notebook's ratios."""
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

    ``"upper_triangle"`` (the notebook, "Analyze Gauss" of Dwork, Talwar, Thakurta & Zhang
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
    matrix_noise = _v.check_choice("matrix_noise", matrix_noise, MATRIX_NOISES)
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
    / 2``). The notebook's ridge ``sqrt(d) sigma_1 z`` is ``z`` times this scale; AdaSSP uses the
    same rule for either noise, so the ridge keeps its meaning (a ``z``-quantile bound on the
    noise along a direction) when the noise shrinks."""
    matrix_noise = _v.check_choice("matrix_noise", matrix_noise, MATRIX_NOISES)
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
    (the notebook) ``theta = hat(X^T X)^{-1} hat(X^T y)``; with ``project_psd=True`` (default)
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
    """``reps`` independent AdaSSP solutions (Wang 2018, Alg. 2 as in the notebook).

    Releases ``hat(X^T X)``, ``hat(X^T y)`` as :func:`ssp_coefficients` and a noisy smallest
    eigenvalue ``lambda_min + x_bound^2 sigma3 N(0,1)`` (sensitivity ``x_bound^2`` by
    Weyl's inequality). With ``z = 1.96`` and ``r = noise_direction_scale(d, matrix_noise)``
    (``sqrt(d)`` for the study's noise) the regularisation level is
    ``lambda = max(0, r sigma1 x_bound^2 z - max(0, hat(lambda_min) - x_bound^2 sigma3 z))``.

    ``regularization="ridge"`` (Wang 2018; the notebook):
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
    regularization = _v.check_choice("regularization", regularization, REGULARIZATIONS)
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


def ssp_release(
    XTX: np.ndarray,
    XTy: np.ndarray,
    noise_scale: float,
    budget_split,
    x_bound: float,
    y_bound: float,
    rng: np.random.Generator,
    reps: int = 1,
    *,
    adaptive: bool,
    matrix_noise: str = "frobenius",
    project_psd: bool = True,
    regularization: str = "eigenvalue_floor",
    name: str | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """``reps`` SSP (Wang 2018, Alg. 1) or AdaSSP (Alg. 2) solutions from the sufficient
    statistics: the release of :class:`~privlearn.models.SSPRegressor` /
    :class:`~privlearn.models.AdaSSPRegressor` and of the linear-regression experiment.

    The noise multipliers are ``budget_split * noise_scale`` (``noise_scale`` from
    :func:`calibrate_ssp_scale`); ``x_bound`` and ``y_bound`` are the bounds the
    sensitivities use (see :func:`ssp_coefficients`, :func:`adassp_coefficients`).
    ``project_psd`` applies to SSP, ``regularization`` to AdaSSP.

    Returns the coefficients (reps, dim) and AdaSSP's regularisation levels (reps,), None
    for SSP. Raises ``FloatingPointError`` (naming ``name``) when the noisy normal
    equations give a non-finite coefficient: nothing is released then.
    """
    split = _check_split(budget_split, 3 if adaptive else 2)
    sig = [r * noise_scale for r in split]
    lamb = None
    if adaptive:
        theta, lamb = adassp_coefficients(
            XTX, XTy, *sig, x_bound, y_bound, rng, reps=reps,
            matrix_noise=matrix_noise, regularization=regularization,
        )
    else:
        theta = ssp_coefficients(
            XTX, XTy, *sig, x_bound, y_bound, rng, reps=reps,
            matrix_noise=matrix_noise, project_psd=bool(project_psd),
        )
    if not np.all(np.isfinite(theta)):
        label = name or ("AdaSSP" if adaptive else "SSP")
        raise FloatingPointError(
            f"{label}: the noisy normal equations gave non-finite coefficients"
        )
    return theta, lamb
