"""Workloads and the expected error of a factorization ``A = B C``.

With noise ``C^{-1} z`` (``z ~ N(0, I)``, noise multiplier 1 relative to the
sensitivity), the released ``A x + B z`` has per-query squared error ``||B[t, :]||^2``
for ``B = A C^{-1}``; multiplied by ``sens(C)^2`` it is the error at a fixed privacy level,
the quantity strategies are compared and optimised on ([CC23b], Section 2; the ``loss``
of jax_privacy's ``toeplitz`` module).

For lower-triangular Toeplitz ``A`` and ``C``, ``B`` is Toeplitz with first column
``b = a * r`` (``r`` that of ``C^{-1}``) and the error of query ``t`` is
``sum_{j <= t} b_j^2``: the last query has the largest error.

References
----------
.. [CC23b] Choquette-Choo et al. (2023), (Amplified) Banded Matrix Factorization, NeurIPS.
.. [DPFTRL] Kairouz, McMahan, Song, Thakkar, Thakurta & Xu (2021), Practical and Private
       (Deep) Learning without Sampling or Shuffling, ICML (prefix sums as the workload
       of SGD; momentum as a Toeplitz workload).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.linalg import solve_triangular

from privlearn._validation import check_choice, check_count, check_real
from privlearn.correlated import _toeplitz
from privlearn.correlated._limits import check_horizon
from privlearn.correlated.participation import Participation, SingleParticipation
from privlearn.correlated.sensitivity import sensitivity
from privlearn.correlated.strategies import (
    DenseStrategy,
    ToeplitzStrategy,
    _check_finite,
    _dense_steps,
)
from privlearn.errors import ParameterTypeError, ParameterValueError

__all__ = ["Workload", "PrefixSum", "MomentumPrefixSum", "per_query_error", "loss"]

REDUCTIONS = ("mean", "max")


class Workload:
    """A lower-triangular Toeplitz workload ``A`` given by its first column."""

    __slots__ = ()

    def coefs(self, n: int) -> np.ndarray:
        raise NotImplementedError


@dataclass(frozen=True)
class PrefixSum(Workload):
    """``A[t, s] = 1`` for ``s <= t``: the iterates of SGD with a constant learning rate."""

    def coefs(self, n: int) -> np.ndarray:
        return np.ones(check_count("n", n, minimum=1))


@dataclass(frozen=True)
class MomentumPrefixSum(Workload):
    """The iterates of SGD with heavy-ball momentum ``beta`` and a constant learning
    rate (``m_t = beta m_{t-1} + g_t``, ``x_t = x_{t-1} + m_t``):
    ``A[t, s] = sum_{j <= t - s} beta^j``, i.e. ``(1 - beta^(t-s+1)) / (1 - beta)`` for
    ``beta < 1`` and ``t - s + 1`` for ``beta = 1`` (the double prefix sum: the cumulative
    sum is exact at every ``beta`` in ``[0, 1]``, and the error, the optimisers and the
    strategies only use these coefficients, [DPFTRL]).

    ``momentum`` above 1 is refused: the coefficients then grow geometrically.
    """

    momentum: float

    def __post_init__(self) -> None:
        beta = check_real("momentum", self.momentum)
        if not 0.0 <= beta <= 1.0:
            raise ParameterValueError(
                f"momentum must be in [0, 1], got {self.momentum!r}; use 0.9 for typical "
                "heavy-ball momentum, or PrefixSum() for plain SGD")
        object.__setattr__(self, "momentum", beta)

    def coefs(self, n: int) -> np.ndarray:
        n = check_count("n", n, minimum=1)
        return np.cumsum(self.momentum ** np.arange(n, dtype=float))


def _workload(workload: Workload | None) -> Workload:
    if workload is None:
        return PrefixSum()
    if not isinstance(workload, Workload):
        raise ParameterTypeError(
            f"workload must be a privlearn.correlated Workload (PrefixSum, "
            f"MomentumPrefixSum, ...) or None, got {workload!r}")
    return workload


def per_query_error(
    strategy: ToeplitzStrategy | DenseStrategy, steps: int, workload: Workload | None = None
) -> np.ndarray:
    """Squared error of each query, ``||(A C^{-1})[t, :]||^2``, at unit noise (length
    ``steps``). Multiply by ``sens(C)^2`` to compare strategies (:func:`loss`).

    A :class:`~privlearn.correlated.strategies.DenseStrategy` gives that of its leading
    ``steps x steps`` block (``steps`` at most its own): ``B = A C^{-1}`` by a triangular
    solve, ``O(steps^3)``.

    Raises
    ------
    AccountingError
        The error overflows (``C^{-1}`` grows geometrically): never nan or inf.
    ParameterValueError
        ``steps`` above ``2**27`` (:data:`~privlearn.correlated._limits.MAX_STEPS`).
    """
    n = check_count("steps", steps, minimum=1)
    if isinstance(strategy, DenseStrategy):
        return _dense_error(strategy, _dense_steps(strategy, steps), workload)
    check_horizon(n, steps)
    with np.errstate(over="ignore", invalid="ignore"):
        r = strategy.inverse_toeplitz_coefs(n)
        b = _toeplitz.convolve(_workload(workload).coefs(n), r, n)
        err = np.cumsum(b * b)
    return _check_finite("error", strategy, err, n)


def _dense_error(strategy: DenseStrategy, n: int, workload: Workload | None) -> np.ndarray:
    """Per-query error of a dense ``C``: row norms of ``B`` with ``C^T B^T = A^T``."""
    c = strategy.materialize(n)
    a = _toeplitz.materialize(_workload(workload).coefs(n), n)
    with np.errstate(over="ignore", invalid="ignore"):
        bt = solve_triangular(c.T, a.T, lower=False)
        err = np.einsum("ij,ij->j", bt, bt)
    return _check_finite("error", strategy, err, n)


def loss(
    strategy: ToeplitzStrategy | DenseStrategy,
    steps: int,
    participation: Participation | None = None,
    workload: Workload | None = None,
    reduction: str = "mean",
) -> float:
    """Mean (or max) per-query squared error times the squared sensitivity.

    The expected squared error of the workload's answers at a fixed privacy level, up to
    the noise multiplier's square: the objective of :mod:`privlearn.correlated.optimize`.

    Parameters
    ----------
    strategy : ToeplitzStrategy or DenseStrategy
    steps : int
    participation : Participation, optional
        Default :class:`SingleParticipation`.
    workload : Workload, optional
        Default :class:`PrefixSum`.
    reduction : {"mean", "max"}
    """
    reduction = check_choice("reduction", reduction, REDUCTIONS)
    err = per_query_error(strategy, steps, workload)
    e = float(err.mean() if reduction == "mean" else err.max())
    sens = sensitivity(strategy, participation or SingleParticipation(), steps).value
    return e * sens * sens
