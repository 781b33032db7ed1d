"""The NoisyGD recursion for least squares (Bassily, Smith & Thakurta 2014; the notebook)
and its learning rate: the kernel behind :class:`~privlearn.models.NoisyGDRegressor`.

NumPy only (no scikit-learn), so that the linear-regression experiment runs it without
importing the estimators; re-exported by :mod:`privlearn.models.linear`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from privlearn._renamed import renamed_keywords

__all__ = ["theoretical_learning_rate", "noisy_gd_paths"]


def theoretical_learning_rate(
    smoothness: float, dim: int, noise_std: float, n_iter: int
) -> float:
    """The notebook's learning rate ``min(1/L, 4 / sqrt(d * noise_std * L * n_iter))``.

    ``L`` is the smoothness (largest eigenvalue of ``X^T X``) and ``noise_std`` the
    per-coordinate gradient-noise level ``sigma * GS`` with the study's typical
    ``GS = x_bound^2 + x_bound y_bound`` (the study's ``theoretical_lr_choice``, which
    follows the standard noisy-GD rate of Bassily, Smith & Thakurta 2014).
    """
    return float(min(1.0 / smoothness, 4.0 / math.sqrt(dim * noise_std * smoothness * n_iter)))


@renamed_keywords("noisy_gd_paths", sigma="noise_multiplier")
def noisy_gd_paths(
    XTX: np.ndarray,
    XTy: np.ndarray,
    noise_multiplier: float,
    lr: float | np.ndarray,
    n_iter: int,
    x_bound: float,
    y_bound: float,
    rng: np.random.Generator,
    reps: int = 1,
    log_every: int | None = None,
    chunk: int = 256,
    progress: Callable[[int], object] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run ``reps`` independent NoisyGD chains at once (the notebook).

    ``theta_{t+1} = theta_t - lr (X^T X theta_t - X^T y + GS_t sigma N(0, I))`` with
    ``GS_t = x_bound^2 ||theta_t|| + x_bound y_bound`` and ``sigma = noise_multiplier``,
    from ``theta_0 = 0``. ``lr`` is one learning rate for all chains or one per chain,
    shape (reps,).

    Returns
    -------
    theta : (reps, dim) final iterates
    path : (n_logs, reps, dim) iterates after iterations ``log_iters``
    log_iters : (n_logs,) int, the number of iterations completed at each log point
        (``1, 1 + log_every, 1 + 2 log_every, ...`` as the notebook logs ``i % log_gap == 0``)

    ``progress``, if given, is called with the number of iterations of each block of
    ``chunk`` iterations once it is done (a progress bar's ``update``); it never changes
    the iterates or the random draws. ``sigma=``, the former name of
    ``noise_multiplier``, is deprecated.
    """
    sigma = noise_multiplier  # the notebook's notation
    dim = XTX.shape[0]
    lr_arr = np.broadcast_to(np.asarray(lr, dtype=float), (reps,))
    if reps == 1 and log_every is None:
        return _noisy_gd_single(
            XTX, XTy, sigma, float(lr_arr[0]), n_iter, x_bound, y_bound, rng, chunk, progress
        )
    if np.all(lr_arr == lr_arr[0]):
        return _noisy_gd_shared_lr(XTX, XTy, sigma, float(lr_arr[0]), n_iter, x_bound,
                                   y_bound, rng, reps, log_every, chunk, progress)
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
        if progress is not None:
            progress(m)
    path = np.array(logs) if logs else np.zeros((0, reps, dim))
    return theta, path, np.array(iters, dtype=np.int64)


def _noisy_gd_single(XTX, XTy, sigma, lr, n_iter, x_bound, y_bound, rng, chunk,
                     progress=None):
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
        if progress is not None:
            progress(m)
    empty = np.zeros((0, 1, dim))
    return theta[None, :], empty, np.zeros(0, dtype=np.int64)


def _noisy_gd_shared_lr(XTX, XTy, sigma, lr, n_iter, x_bound, y_bound, rng, reps, log_every,
                        chunk, progress=None):
    """:func:`noisy_gd_paths` for chains sharing one learning rate, in fewer NumPy calls.

    The recursion rearranged: with ``A = I - lr X^T X`` (symmetric) and the chunk's noise
    ``Z_t`` premultiplied, ``theta_{t+1} = A theta_t + (lr X^T y - lr sigma b Z_t) -
    ||theta_t|| (lr sigma a Z_t)`` (``GS_t = a ||theta_t|| + b``), the chains held as the
    columns of a (dim, reps) array so that the per-chain norm broadcasts without reshaping.
    The same random draws, in the same order, as the general loop; the same iterates up to
    floating-point rounding (tested). About 2.4 times as fast at the study's ``dim = 8``,
    where NumPy's per-call overhead dominates.
    """
    dim = XTX.shape[0]
    a, b = x_bound**2, x_bound * y_bound
    A = np.eye(dim) - lr * XTX
    c = (lr * XTy)[:, None]  # (dim, 1)
    ones = np.ones(dim)
    theta = np.zeros((dim, reps))
    logs: list[np.ndarray] = []
    iters: list[int] = []
    matmul, dot, sqrt = np.matmul, np.dot, np.sqrt
    i = 0
    while i < n_iter:
        m = min(chunk, n_iter - i)
        z = np.ascontiguousarray(rng.standard_normal((m, reps, dim)).transpose(0, 2, 1))
        z *= lr * sigma
        scaled = z * a          # multiplies ||theta_t||
        shift = c - z * b       # the constant part of each step
        for j in range(m):
            nrm = sqrt(dot(ones, theta * theta))
            new = matmul(A, theta)
            new += shift[j]
            new -= scaled[j] * nrm
            theta = new
            if log_every is not None and (i + j) % log_every == 0:
                logs.append(theta.T.copy())
                iters.append(i + j + 1)
        i += m
        if progress is not None:
            progress(m)
    path = np.array(logs) if logs else np.zeros((0, reps, dim))
    return np.ascontiguousarray(theta.T), path, np.array(iters, dtype=np.int64)
