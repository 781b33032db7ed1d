"""Optimised strategies: banded Toeplitz and BLT coefficients for a workload.

Both minimise ``loss = reduce_t ||(A C^{-1})[t, :]||^2 * sens(C)^2``
(:func:`privlearn.correlated.error.loss`) over the strategy's few coefficients, for a
given number of steps, participation schema and Toeplitz workload, with L-BFGS
(:func:`scipy.optimize.minimize`) on analytic gradients:

* ``C^{-1}``'s first column ``r`` solves ``T(c) r = e_0``; ``d r / d c_k = -S_k (r * r)``
  (Toeplitz matrices commute), so the error's gradient is one correlation with ``r * r``;
* the sensitivity in the objective is that of the worst pattern -- participations
  ``min_sep`` apart from step 0 -- exact for ``bands <= min_sep`` and for non-negative,
  non-increasing coefficients ([KL24], Theorem 2). When ``bands > min_sep`` the banded
  coefficients are constrained to be non-negative and non-increasing (and a BLT is by
  construction), so the objective's sensitivity is the true one.

Every product is an FFT convolution (``O(n log n)``), so an optimisation for
``n = 2000`` steps takes well under a second to a few seconds. The start points are fixed
(the banded square root of [KL24]; BLT decays spread over time scales ``1 .. n``), so the
result is deterministic. The returned strategy's sensitivity is computed afresh by
:func:`privlearn.correlated.sensitivity.sensitivity`, never taken from the optimiser.

References
----------
.. [CC23b] Choquette-Choo et al. (2023), (Amplified) Banded Matrix Factorization, NeurIPS.
.. [KL24] Kalinin & Lampert (2024), Banded Square Root Matrix Factorization for
       Differentially Private Model Training, NeurIPS, Theorem 2.
.. [MJPD24] McMahan, Jia, Pillutla, Dvijotham et al. (2024), Hassle-Free Matrix
       Factorization Mechanisms for Private Learning (arXiv:2408.08868), Section 4.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize, special

from privlearn._validation import check_choice, check_count
from privlearn.correlated import _toeplitz
from privlearn.correlated.error import REDUCTIONS, Workload, _workload
from privlearn.correlated.participation import (
    FixedEpochs,
    MinSeparation,
    Participation,
    SingleParticipation,
)
from privlearn.correlated.strategies import (
    BandedToeplitz,
    BufferedToeplitz,
    square_root_coefs,
)

__all__ = ["optimize_banded_toeplitz", "optimize_blt"]

_BIG = 1e300


def _pattern(participation: Participation | None, n: int) -> tuple[int, int]:
    """(separation, participations) of the worst pattern of the schema."""
    if participation is None or isinstance(participation, SingleParticipation):
        return n, 1
    if isinstance(participation, MinSeparation):
        return participation.min_sep, participation.participations(n)
    if isinstance(participation, FixedEpochs):
        return participation.steps_per_epoch(n), participation.epochs
    raise TypeError(
        f"participation must be a privlearn.correlated Participation, got {participation!r}"
    )


def _weights(n: int, reduction: str) -> np.ndarray:
    """``E = sum_i w_i b_i^2``: the mean error weights ``b_i^2`` by the ``n - i`` queries
    it enters; the max error is that of the last query (Toeplitz)."""
    if reduction == "mean":
        return (n - np.arange(n)) / n
    return np.ones(n)


def _log_loss_and_grad(
    c: np.ndarray, r: np.ndarray, n: int, a: np.ndarray, w: np.ndarray, sep: int, k: int
) -> tuple[float, np.ndarray]:
    """``log(E(c) S(c))`` and its gradient in the full coefficient vector ``c`` (length n)."""
    b = _toeplitz.convolve(a, r, n)
    err = float(np.sum(w * b * b))
    g_r = _toeplitz.correlate(2.0 * w * b, a, n)
    g_err = -_toeplitz.correlate(g_r, _toeplitz.convolve(r, r, n), n)
    v = np.zeros(n)
    for m in range(k):
        s = m * sep
        if s >= n:
            break
        v[s:] += c[: n - s]
    sens2 = float(v @ v)
    g_sens = np.zeros(n)
    for m in range(k):
        s = m * sep
        if s >= n:
            break
        g_sens[: n - s] += 2.0 * v[s:]
    if not (math.isfinite(err) and err > 0 and sens2 > 0):
        return _BIG, np.zeros(n)
    return math.log(err) + math.log(sens2), g_err / err + g_sens / sens2


def optimize_banded_toeplitz(
    steps: int,
    bands: int,
    participation: Participation | None = None,
    workload: Workload | None = None,
    reduction: str = "mean",
    *,
    max_iterations: int = 500,
) -> BandedToeplitz:
    """The ``bands``-banded Toeplitz strategy minimising the loss, normalised to
    ``||c|| = 1``.

    Parameters
    ----------
    steps : int
        Number of steps ``n`` the strategy is optimised for.
    bands : int in [1, steps]
    participation : Participation, optional
        The schema of the sampler that will be used (default single participation).
        With ``MinSeparation(b)`` or cyclic sampling, ``bands <= b`` keeps the exact
        banded sensitivity and the amplified accounting.
    workload : Workload, optional
        Default :class:`~privlearn.correlated.error.PrefixSum`.
    reduction : {"mean", "max"}
        Mean or largest per-query squared error.
    max_iterations : int
        L-BFGS iterations.

    Examples
    --------
    >>> from privlearn.correlated import MinSeparation, loss, optimize_banded_toeplitz
    >>> C = optimize_banded_toeplitz(steps=256, bands=8, participation=MinSeparation(16))
    >>> C.bands, loss(C, 256) < loss(type(C).square_root(8), 256)
    (8, True)
    """
    n = check_count("steps", steps, minimum=1)
    b = check_count("bands", bands, minimum=1)
    if b > n:
        raise ValueError(f"bands must be in [1, steps={n}], got {bands!r}")
    reduction = check_choice("reduction", reduction, REDUCTIONS)
    if b == 1:
        return BandedToeplitz((1.0,))
    sep, k = _pattern(participation, n)
    a = _workload(workload).coefs(n)
    w = _weights(n, reduction)
    monotone = k > 1 and b > sep  # keep the closed-form sensitivity exact

    def coefs(x: np.ndarray) -> np.ndarray:
        return np.cumsum(x[::-1])[::-1] if monotone else x

    def fun(x: np.ndarray) -> tuple[float, np.ndarray]:
        c = coefs(x)
        if not (c[0] > 0 and np.all(np.isfinite(c))):
            return _BIG, np.zeros(b)
        with np.errstate(over="ignore", invalid="ignore"):
            r = _toeplitz.inverse(c, n)
            if not np.all(np.isfinite(r)):
                return _BIG, np.zeros(b)
            f, g = _log_loss_and_grad(_toeplitz.pad(c, n), r, n, a, w, sep, k)
        if not (math.isfinite(f) and np.all(np.isfinite(g))):
            return _BIG, np.zeros(b)
        g = g[:b]
        if monotone:  # c_j = sum_{i >= j} x_i
            g = np.cumsum(g)
        return f, g

    c0 = square_root_coefs(b)
    x0 = np.append(-np.diff(c0), c0[-1]) if monotone else c0
    bounds = [(0.0, None)] * b if monotone else None
    res = optimize.minimize(
        fun, x0, jac=True, method="L-BFGS-B", bounds=bounds,
        options={"maxiter": max_iterations, "ftol": 1e-13, "gtol": 1e-10},
    )
    best = res.x if res.fun <= fun(x0)[0] else x0
    return BandedToeplitz(tuple(coefs(best))).normalized()


def _blt_from(x: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
    """(theta, omega) from unconstrained parameters: ``theta = sigmoid(u)`` in (0, 1),
    ``omega = sigmoid(s) softmax(v)`` (positive, summing to < 1 so that the Toeplitz
    coefficients ``1, sum(omega), ...`` are positive and decreasing)."""
    u, s, v = x[:m], x[m], x[m + 1 :]
    theta = special.expit(u)
    total = float(special.expit(s))
    soft = special.softmax(v)
    return theta, total * soft, total, soft


def optimize_blt(
    steps: int,
    buffers: int,
    participation: Participation | None = None,
    workload: Workload | None = None,
    reduction: str = "max",
    *,
    max_iterations: int = 1000,
) -> BufferedToeplitz:
    """The BLT strategy with ``buffers`` buffers minimising the loss.

    The decays are kept in (0, 1) and the output weights positive with sum below 1, so
    the Toeplitz coefficients are positive and decreasing: the sensitivity under every
    schema is then the exact closed form ([KL24], Theorem 2), and the noise recurrence
    is stable ([MJPD24], Section 4).

    Parameters
    ----------
    steps : int
    buffers : int >= 1
    participation, workload, reduction
        As :func:`optimize_banded_toeplitz` (default reduction ``"max"``, the usual BLT
        objective).

    Examples
    --------
    >>> from privlearn.correlated import loss, optimize_blt, Identity
    >>> C = optimize_blt(steps=512, buffers=3)
    >>> C.buffers, loss(C, 512, reduction="max") < 0.2 * loss(Identity(), 512, reduction="max")
    (3, True)
    """
    n = check_count("steps", steps, minimum=1)
    m = check_count("buffers", buffers, minimum=1)
    reduction = check_choice("reduction", reduction, REDUCTIONS)
    sep, k = _pattern(participation, n)
    a = _workload(workload).coefs(n)
    w = _weights(n, reduction)
    t = np.arange(n - 1, dtype=float)

    def fun(x: np.ndarray) -> tuple[float, np.ndarray]:
        theta, omega, total, soft = _blt_from(x, m)
        strategy = BufferedToeplitz(tuple(theta), tuple(omega))
        order = np.argsort(-theta, kind="stable")  # the strategy sorts its buffers
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):
            c = strategy.toeplitz_coefs(n)
            r = strategy.inverse_toeplitz_coefs(n)
            if not np.all(np.isfinite(r)):
                return _BIG, np.zeros_like(x)
            f, g_c = _log_loss_and_grad(c, r, n, a, w, sep, k)
        if not (math.isfinite(f) and np.all(np.isfinite(g_c))):
            return _BIG, np.zeros_like(x)
        g1 = g_c[1:]  # c_t = sum_j omega_j theta_j^(t-1), t >= 1
        th, om = theta[order], omega[order]
        with np.errstate(under="ignore"):
            powers = th[None, :] ** t[:, None]  # (n-1, m)
            d_theta_pow = np.zeros_like(powers)
            d_theta_pow[1:] = t[1:, None] * th[None, :] ** t[:-1, None]
        g_omega = np.empty(m)
        g_theta = np.empty(m)
        g_omega[order] = g1 @ powers
        g_theta[order] = om * (g1 @ d_theta_pow)
        g_u = g_theta * theta * (1.0 - theta)
        # omega = total * soft: d/ds = total (1 - total) soft; d/dv = total * J_softmax
        g_s = float(g_omega @ soft) * (1.0 - total)
        g_v = total * soft * (g_omega - float(g_omega @ soft))
        return f, np.concatenate([g_u, [g_s], g_v])

    # decays spread geometrically over time scales 1 .. n
    scales = np.geomspace(2.0, max(n, 4), m)
    x0 = np.concatenate([special.logit(1.0 - 1.0 / scales), [0.0], np.zeros(m)])
    res = optimize.minimize(
        fun, x0, jac=True, method="L-BFGS-B",
        options={"maxiter": max_iterations, "ftol": 1e-13, "gtol": 1e-10},
    )
    best = res.x if res.fun <= fun(x0)[0] else x0
    theta, omega, _, _ = _blt_from(best, m)
    return BufferedToeplitz(tuple(theta), tuple(omega))
