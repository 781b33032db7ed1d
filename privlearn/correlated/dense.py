"""The optimal dense (non-Toeplitz) strategy: :func:`optimize_dense`.

The loss of a factorization at a fixed privacy level depends on ``C`` only through the
Gram matrix ``X = C^T C``: the mean squared error is ``tr(A X^{-1} A^T) / n`` and the
sensitivity a function of ``X`` (:func:`~privlearn.correlated.sensitivity.dense_sensitivity`).
Following [DMRST22] (single participation) and [CC23] (fixed epochs), the loss is
minimised over ``X`` in a convex set on which the sensitivity is exactly 1 (or
``sqrt(k)``), then ``C`` is the lower-triangular factor of ``X``:

* single participation: ``X[i, i] = 1`` (every column of ``C`` has norm 1; [DMRST22],
  Section 3: the optimum of ``tr(A^T A X^{-1})`` under ``diag(X) = 1``);
* fixed epochs, ``k`` epochs of ``b`` steps ([CC23], Section 4): ``X[i, j] = 0`` for
  ``i != j`` with ``i = j (mod b)`` (two steps of the same record), and
  ``sum_m X[j + m b, j + m b] = 1`` for every ``j``: every record's contribution then has
  ``||C u||^2 = sum_i X[i, i] ||g_i||^2 <= 1``, whatever the signs;
* b-min-separation (as jax_privacy's ``dense.optimize(bands=min_sep, equal_norm=True)``):
  ``X[i, j] = 0`` for ``|i - j| >= min_sep`` and ``X[i, i] = 1``, so ``C`` has
  ``min_sep`` bands and ``k`` participations have ``sens^2 = k``.

The objective is convex in ``X`` ([DMRST22], Section 3); the constraints are linear, so
it is minimised by L-BFGS (Nocedal & Wright, Numerical Optimization, Algorithm 7.4)
over the free entries of ``X`` with the diagonal's equality constraints projected out
(the gradient ``-X^{-1} A^T A X^{-1} / n`` from one Cholesky factorization, ``O(n^3)``
per evaluation; the backtracking line search halves a step that leaves the
positive-definite cone). This is the problem jax_privacy 2.0.0's ``dense.optimize``
solves (projected L-BFGS from ``X = I / k``), from the same start point; on every case
measured the result matched or bettered it (within ``1e-9``, relative).

The sensitivity of the returned strategy is computed afresh from its matrix when used
(:func:`~privlearn.correlated.sensitivity.sensitivity`), never taken from the optimiser.

References
----------
.. [DMRST22] Denisov, McMahan, Rush, Smith & Thakurta (2022), Improved Differential
       Privacy for SGD via Optimal Private Linear Operators on Adaptive Streams, NeurIPS
       (arXiv:2202.08312), Section 3.
.. [CC23] Choquette-Choo, McMahan, Rush & Thakurta (2023), Multi-Epoch Matrix
       Factorization Mechanisms for Private Machine Learning, ICML (arXiv:2211.06530),
       Section 4.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import linalg

from privlearn._progress import check_show_progress
from privlearn._validation import check_choice, check_count
from privlearn.correlated import _toeplitz
from privlearn.correlated.error import Workload, _workload
from privlearn.correlated.optimize import _MEMO, _memo_key, _memoised, _safe
from privlearn.correlated.participation import (
    FixedEpochs,
    MinSeparation,
    Participation,
    SingleParticipation,
)
from privlearn.correlated.strategies import DenseStrategy
from privlearn.errors import (
    ParameterTypeError,
    ParameterValueError,
    StrategyOptimizationError,
)

__all__ = ["optimize_dense", "MAX_OPTIMIZE_DENSE_STEPS"]

#: largest number of steps :func:`optimize_dense` takes (an evaluation is a Cholesky
#: factorization and two ``n x n`` products: 2-3 s per evaluation at the limit, one thread)
MAX_OPTIMIZE_DENSE_STEPS = 2048
#: strategies up to this many steps are kept for reuse (a matrix of ``n^2`` floats each)
_MEMO_STEPS = 512


class _Structure:
    """The affine set of Gram matrices: ``X = diag(x0) + sym(y on free) + diag(P w)``,
    ``P`` the projection removing each diagonal group's mean (so the group sums stay
    ``sum x0 = 1``)."""

    def __init__(self, n: int, groups: np.ndarray, free: np.ndarray) -> None:
        self.n = n
        self.groups = groups  # group id of each diagonal entry
        self.sizes = np.bincount(groups).astype(float)
        self.x0 = 1.0 / self.sizes[groups]
        iu = np.triu_indices(n, 1)
        keep = free[iu]
        self.rows, self.cols = iu[0][keep], iu[1][keep]
        # a group of one has a fixed diagonal entry: no variable for it
        self.varied = np.flatnonzero(self.sizes[groups] > 1)
        self.size = self.rows.size + self.varied.size

    def project(self, d: np.ndarray) -> np.ndarray:
        """``d`` less the mean of its group (on the diagonal entries)."""
        means = np.bincount(self.groups, weights=d) / self.sizes
        return d - means[self.groups]

    def matrix(self, v: np.ndarray) -> np.ndarray:
        n = self.n
        x = np.zeros((n, n))
        y = v[: self.rows.size]
        x[self.rows, self.cols] = y
        x[self.cols, self.rows] = y
        d = np.zeros(n)
        d[self.varied] = v[self.rows.size :]
        x[np.diag_indices(n)] = self.x0 + self.project(d)
        return x

    def gradient(self, g: np.ndarray) -> np.ndarray:
        """The gradient in ``v`` from ``g = df/dX`` (symmetric)."""
        off = 2.0 * g[self.rows, self.cols]
        diag = self.project(np.diag(g).copy())[self.varied]
        return np.concatenate([off, diag])


def _structure(participation: Participation | None, n: int) -> tuple[_Structure, int, tuple]:
    """The constraint set, the squared sensitivity on it, and the memo's key of the
    schema."""
    i, j = np.indices((n, n))
    if participation is None or isinstance(participation, SingleParticipation):
        return _Structure(n, np.arange(n), np.ones((n, n), bool)), 1, ("single",)
    if type(participation) is FixedEpochs:
        per = participation.steps_per_epoch(n)
        if participation.epochs == 1:
            return _Structure(n, np.arange(n), np.ones((n, n), bool)), 1, ("single",)
        groups = np.arange(n) % per
        return (
            _Structure(n, groups, (i % per) != (j % per)),
            1,
            ("epochs", per, participation.epochs),
        )
    if type(participation) is MinSeparation:
        sep, k = participation.min_sep, participation.participations(n)
        if k == 1:
            return _Structure(n, np.arange(n), np.ones((n, n), bool)), 1, ("single",)
        return (_Structure(n, np.arange(n), np.abs(i - j) < sep), k, ("min_sep", sep, k))
    raise ParameterTypeError(
        f"participation must be SingleParticipation, FixedEpochs or MinSeparation (or "
        f"None) for optimize_dense, got {participation!r}; no dense constraint set with a "
        "known sensitivity is defined for another schema"
    )


def _objective(structure: _Structure, gram_a: np.ndarray):
    """``log tr(A X^{-1} A^T)`` and its gradient in the free entries: with ``X = L L^T``,
    ``H = X^{-1} A^T``, ``f = tr(A H)`` and ``df/dX = -H H^T``."""
    a_t = gram_a  # A^T

    def fun(v: np.ndarray) -> tuple[float, np.ndarray]:
        x = structure.matrix(v)
        factor = linalg.cho_factor(x, lower=True, check_finite=False)
        h = linalg.cho_solve(factor, a_t, check_finite=False)
        f = float(np.einsum("ij,ji->", a_t.T, h))
        if not f > 0.0:
            return math.inf, np.zeros_like(v)
        g = -(h @ h.T) / f
        return math.log(f), structure.gradient(g)

    return fun


def _lbfgs(fun, x: np.ndarray, max_iterations: int, bar, memory: int = 20) -> np.ndarray:
    """Minimise ``fun`` (value and gradient; ``inf`` outside the positive-definite cone)
    from ``x`` by L-BFGS (Nocedal & Wright, Numerical Optimization, 2006, Algorithm 7.4)
    with a backtracking Armijo line search, which halves a step that leaves the cone
    (scipy's L-BFGS-B line search stops there instead). Pairs with non-positive
    curvature are not stored, so the direction stays one of descent. Stops when an
    iteration lowers the value by less than ``1e-13`` (relative) three times in a row, or
    after ``max_iterations``; returns the best point seen."""
    f, g = fun(x)
    if not math.isfinite(f):
        raise StrategyOptimizationError(
            "the dense optimiser's start point has a non-finite loss (a numerical "
            "failure); try fewer steps"
        )
    pairs: list[tuple[np.ndarray, np.ndarray, float]] = []
    stalled = 0
    for _ in range(max_iterations):
        q = g.copy()
        alphas = []
        for s, y, rho in reversed(pairs):
            alpha = rho * (s @ q)
            alphas.append(alpha)
            q -= alpha * y
        if pairs:
            s, y, _ = pairs[-1]
            q *= (s @ y) / (y @ y)
        else:  # first step: at most 0.1 in any entry of X
            q *= 0.1 / max(float(np.max(np.abs(q))), 1e-300)
        for (s, y, rho), alpha in zip(pairs, reversed(alphas), strict=True):
            q += (alpha - rho * (y @ q)) * s
        d = -q
        slope = float(g @ d)
        if not slope < 0.0:  # not a descent direction: restart from the gradient
            pairs.clear()
            d = -g * (0.1 / max(float(np.max(np.abs(g))), 1e-300))
            slope = float(g @ d)
            if not slope < 0.0:
                break
        step = 1.0
        while True:
            x_new = x + step * d
            f_new, g_new = fun(x_new)
            if f_new <= f + 1e-4 * step * slope:
                break
            step *= 0.5
            if step < 1e-12:
                return x
        s, y = x_new - x, g_new - g
        sy = float(s @ y)
        if sy > 1e-12 * float(np.sqrt((s @ s) * (y @ y))):
            pairs.append((s, y, 1.0 / sy))
            if len(pairs) > memory:
                pairs.pop(0)
        stalled = stalled + 1 if f - f_new <= 1e-13 * max(1.0, abs(f)) else 0
        x, f, g = x_new, f_new, g_new
        bar.update(1)
        if stalled >= 3:
            break
    return x


def _from_gram(x: np.ndarray) -> np.ndarray:
    """The lower-triangular ``C`` with ``C^T C = X`` (Cholesky of the reversed ``X``)."""
    factor = np.linalg.cholesky(x[::-1, ::-1])
    return np.tril(factor.T[::-1, ::-1])


def optimize_dense(
    steps: int,
    participation: Participation | None = None,
    workload: Workload | None = None,
    reduction: str = "mean",
    *,
    max_iterations: int = 2000,
    show_progress: bool | None = None,
) -> DenseStrategy:
    """The dense lower-triangular strategy minimising the mean squared error at unit
    sensitivity ([DMRST22]; [CC23]).

    Parameters
    ----------
    steps : int in [1, 2048]
        Number of steps ``n``: the strategy is an ``n x n`` matrix and runs for at most
        ``n`` steps (its noise keeps every past draw: ``n`` buffers of the parameters'
        size, :class:`~privlearn.correlated.noise.CorrelatedNoise`).
    participation : Participation, optional
        :class:`~privlearn.correlated.participation.SingleParticipation` (default),
        :class:`~privlearn.correlated.participation.FixedEpochs` or
        :class:`~privlearn.correlated.participation.MinSeparation`; the constraint set
        of each is in the module docstring.
    workload : Workload, optional
        Any lower-triangular Toeplitz workload (default
        :class:`~privlearn.correlated.error.PrefixSum`).
    reduction : {"mean"}
        Only the mean error (the objective of [DMRST22] and of jax_privacy's
        ``dense.optimize``); for the largest error use
        :func:`~privlearn.correlated.optimize_blt`.
    max_iterations : int
        L-BFGS iterations.
    show_progress : bool, optional
        As :func:`~privlearn.correlated.optimize_banded_toeplitz`.

    Returns
    -------
    DenseStrategy
        Its sensitivity under ``participation`` is 1 (``sqrt(k)`` under min-separation)
        up to rounding; :func:`~privlearn.correlated.sensitivity` computes it afresh. The
        same arguments in one process give the same object for up to 512 steps.

    Raises
    ------
    StrategyOptimizationError
        A numerical failure (no finite loss), never a silent result.
    ParameterValueError
        ``steps`` outside ``[1, 2048]`` or ``reduction`` other than ``"mean"``.
    ParameterTypeError
        Another participation schema.

    Notes
    -----
    ``O(n^3)`` per evaluation, a few hundred evaluations: 256 steps take 3-8 s on a
    loaded 2-core machine, against 15-32 s for jax_privacy 2.0.0's ``dense.optimize``
    (its L-BFGS keeps one pair of past gradients; this one 20); an evaluation takes about
    0.3 s at 1024 steps and 2-3 s at 2048 (one thread), so those take minutes.

    Examples
    --------
    >>> from privlearn.correlated import FixedEpochs, loss, optimize_dense
    >>> C = optimize_dense(16, FixedEpochs(2))
    >>> C.steps, round(loss(C, 16, FixedEpochs(2)), 2)
    (16, 5.8)
    """
    n = check_count("steps", steps, minimum=1)
    if n > MAX_OPTIMIZE_DENSE_STEPS:
        raise ParameterValueError(
            f"steps must be in [1, {MAX_OPTIMIZE_DENSE_STEPS}] for optimize_dense (each "
            f"evaluation factors an n x n matrix), got {steps!r}; use optimize_blt or "
            "optimize_banded_toeplitz for longer runs"
        )
    if reduction != "mean":
        check_choice("reduction", reduction, ("mean", "max"))
        raise ParameterValueError(
            f"reduction must be 'mean' for optimize_dense, got {reduction!r}; use "
            "optimize_blt(..., reduction='max') for the largest error"
        )
    max_iterations = check_count("max_iterations", max_iterations, minimum=1)
    show_progress = check_show_progress(show_progress)
    structure, _, schema = _structure(participation, n)
    key = _memo_key("dense", n, 0, schema, workload, reduction, max_iterations)
    if n > _MEMO_STEPS:
        key = None
    return _memoised(
        key,
        f"optimising a dense strategy for {n} steps",
        show_progress,
        lambda bar: _optimize(structure, n, workload, max_iterations, bar),
    )


#: empties the memo of optimised strategies (shared with the Toeplitz optimisers)
optimize_dense.cache_clear = _MEMO.clear  # type: ignore[attr-defined]


def _optimize(structure: _Structure, n: int, workload, max_iterations: int, bar) -> DenseStrategy:
    a = _toeplitz.materialize(_workload(workload).coefs(n), n)
    fun = _safe(_objective(structure, np.ascontiguousarray(a.T)))
    v0 = np.zeros(structure.size)
    v = _lbfgs(fun, v0, max_iterations, bar) if structure.size else v0
    x = structure.matrix(v)
    try:
        c = _from_gram(x)
    except np.linalg.LinAlgError:
        raise StrategyOptimizationError(
            f"the optimised Gram matrix for {n} steps is not positive definite (a "
            "numerical failure); try fewer steps"
        ) from None
    if not np.all(np.isfinite(c)):
        raise StrategyOptimizationError(f"the optimised dense strategy for {n} steps is not finite")
    return DenseStrategy(c)
