"""Multinomial (softmax) logistic regression trained by DP-SGD: the kernel behind
:class:`~privlearn.models.DPSGDClassifier` for ``K >= 3`` public classes.

The parameters are a ``(p, K)`` matrix ``Theta`` (``p = d`` features, plus one row for
the intercept with ``fit_intercept=True``). For one record ``(z, y)`` the softmax
cross-entropy ``-log softmax(Theta^T z)_y`` has gradient

    ``G = z (softmax(Theta^T z) - e_y)^T``  (a ``p x K`` outer product),

so its norm factorises: ``||vec G||_2 = ||z||_2 ||r||_2`` and ``||vec G||_1 = ||z||_1
||r||_1`` with ``r = softmax(Theta^T z) - e_y``. With ``P = softmax(...)`` a probability
vector, ``||r||_2^2 = (1 - P_y)^2 + sum_{k != y} P_k^2 <= 2 (1 - P_y)^2 <= 2`` and
``||r||_1 = 2 (1 - P_y) <= 2``: the unclipped gradient is at most ``sqrt(2) ||z||_2``
(L2) or ``2 ||z||_1`` (L1), against ``||z||`` for the binary logistic loss (whose
residual ``sigmoid - y`` is at most 1 in absolute value). As on the binary path nothing
relies on that bound: every per-example gradient is *clipped explicitly* to
``max_grad_norm = C`` over the whole parameter vector (Abadi et al. 2016, Alg. 1, step
"clip gradient"), so adding or removing one record moves the sum of clipped gradients by
at most ``C`` in the norm of the noise, whatever the data, and the mechanism of the
binary path -- the Gaussian (resp. Laplace) mechanism of L2 (resp. L1) sensitivity ``C``
on the ``p K`` coordinates, Poisson-subsampled and composed ``T`` times -- describes
this run as well (the noise is dimension-free: each coordinate gets ``sigma C``;
Dwork & Roth 2014, Thm. A.1 / Thm. 3.6).

References
----------
.. [1] M. Abadi et al. (2016), Deep learning with differential privacy, CCS, Alg. 1.
.. [2] C. Dwork, A. Roth (2014), The algorithmic foundations of differential privacy,
       Thm. 3.6 (Laplace mechanism), Thm. A.1 (Gaussian mechanism).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from scipy.special import log_softmax, softmax

from privlearn.models._dpsgd_steps import noisy_sum, poisson_batch

__all__ = [
    "clipped_softmax_gradient_sum",
    "softmax_dpsgd",
    "softmax_scores_to_log_proba",
    "softmax_scores_to_proba",
]


def clipped_softmax_gradient_sum(
    U: np.ndarray,
    scale: np.ndarray,
    unorm: np.ndarray,
    Z: np.ndarray,
    labels: np.ndarray,
    theta: np.ndarray,
    C: float,
    ord_: int,
) -> np.ndarray:
    """``sum_i clip_C(G_i)`` for the softmax cross-entropy, shape ``theta.shape``.

    Parameters
    ----------
    U, scale, unorm : ndarray
        The rows as ``z_i = scale_i u_i`` with ``unorm_i = ||u_i||_ord`` finite (the
        binary path's ``_scaled_design``; ``scale_i = 1`` and ``u_i = z_i`` but for rows
        whose norm overflows).
    Z : ndarray (n, p)
        The rows themselves (for the scores ``Theta^T z_i``).
    labels : ndarray (n,) of int
        Class indices in ``0 .. K-1``.
    theta : ndarray (p, K)
    C : float
        The clipping bound on ``||vec G_i||_ord``.
    ord_ : {1, 2}
        The norm of the clipping (2 for Gaussian noise, 1 for Laplace noise).

    Returns
    -------
    ndarray (p, K)
        ``sum_i u_i c_i^T`` with ``c_i = scale_i r_i min(1, C / ||G_i||)``, so each term
        has norm at most ``C``. A gradient whose norm overflows is clipped to norm ``C``
        in its own direction; a record whose scores are not numbers (an extreme row
        overflowing ``Theta^T z_i``) contributes nothing. Either way one record moves
        the sum by at most ``C``.
    """
    n = Z.shape[0]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        r = softmax(Z @ theta, axis=1)
        r[np.arange(n), labels] -= 1.0
        rnorm = np.linalg.norm(r, ord=ord_, axis=1) if n else np.zeros(0)
        gnorm = rnorm * scale * unorm
        factor = np.where(
            gnorm > C, np.where(np.isfinite(gnorm), scale * (C / gnorm), C / (unorm * rnorm)), scale
        )
        c = r * factor[:, None]
        c = np.where(np.all(np.isfinite(c), axis=1, keepdims=True), c, 0.0)
    return U.T @ c


def softmax_dpsgd(
    Z: np.ndarray,
    U: np.ndarray,
    scale: np.ndarray,
    unorm: np.ndarray,
    labels: np.ndarray,
    n_classes: int,
    *,
    noise: str,
    sigma: float,
    sampling_rate: float,
    C: float,
    lr: float,
    lam: float,
    rng: np.random.Generator,
    steps: Iterable[int],
    path: np.ndarray | None = None,
) -> np.ndarray:
    """Run DP-SGD on the softmax cross-entropy (the steps of the binary path: Poisson
    sample, clip per example, noise on the sum, divide by the expected batch size
    ``q n``, step ``Theta - lr (g + lam Theta)``) from ``Theta = 0``; return ``Theta``
    of shape ``(p, K)``.

    ``path``, if given (shape ``(T, p, K)``), receives every iterate. The noise is
    ``N(0, (sigma C)^2)`` (resp. ``Laplace(sigma C)``) on each of the ``p K``
    coordinates, drawn as one ``(p, K)`` array per step.
    """
    n, p = Z.shape
    q = float(sampling_rate)
    ord_ = 2 if noise == "gaussian" else 1
    denom = q * n
    theta = np.zeros((p, n_classes))
    for t in steps:
        # 1. sample (Poisson)
        Zb, Ub, yb, sb, nb = poisson_batch(rng, q, Z, U, labels, scale, unorm)
        # 2. clip per example (over the whole p x K gradient) and sum
        total = clipped_softmax_gradient_sum(Ub, sb, nb, Zb, yb, theta, C, ord_)
        # 3. noise on the sum
        total = noisy_sum(total, noise, sigma * C, rng)
        # 4. scale by the expected batch size; 5. step
        with np.errstate(over="ignore", invalid="ignore"):  # divergence: the caller refuses
            theta = theta - lr * (total / denom + lam * theta)
        if path is not None:
            path[t] = theta
    return theta


def softmax_scores_to_proba(scores: np.ndarray) -> np.ndarray:
    """Row-wise softmax of the ``(n, K)`` scores (stable: shifted by the row maximum)."""
    return softmax(scores, axis=1)


def softmax_scores_to_log_proba(scores: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax of the ``(n, K)`` scores, without underflow."""
    return log_softmax(scores, axis=1)
