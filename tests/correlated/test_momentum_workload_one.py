"""The momentum workload at every momentum in [0, 1], momentum 1 included (jax_privacy's
momentum tests use it: the double prefix sum), against the dense matrix of the momentum
recursion built by a plain loop, and through every downstream use (error, loss,
optimised strategies)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from privlearn.correlated import (
    BandedToeplitz,
    Identity,
    MomentumPrefixSum,
    loss,
    optimize_banded_toeplitz,
    optimize_blt,
    per_query_error,
)
from privlearn.errors import ParameterValueError

MOMENTA = [0.0, 0.5, 0.9, 1.0]


def _recursion_matrix(n: int, beta: float) -> np.ndarray:
    """``A[t, u]``: the iterate ``x_t`` for the unit gradient ``g = e_u``, by running
    ``m_t = beta m_{t-1} + g_t``, ``x_t = x_{t-1} + m_t`` step by step."""
    out = np.zeros((n, n))
    for u in range(n):
        m = x = 0.0
        for t in range(n):
            m = beta * m + (1.0 if t == u else 0.0)
            x += m
            out[t, u] = x
    return out


def _dense_loss(C: np.ndarray, A: np.ndarray) -> float:
    """Mean per-query squared error of ``A C^{-1}`` times the single-participation
    sensitivity of ``C`` squared (its largest column norm), from dense matrices."""
    B = A @ np.linalg.inv(C)
    sens = np.linalg.norm(C, axis=0).max()
    return float((B * B).sum(axis=1).mean() * sens**2)


@pytest.mark.parametrize("beta", MOMENTA)
def test_workload_is_the_momentum_recursion(beta):
    n = 24
    a = MomentumPrefixSum(beta).coefs(n)
    t, s = np.indices((n, n))
    dense = np.where(t >= s, a[np.clip(t - s, 0, n - 1)], 0.0)
    np.testing.assert_allclose(dense, _recursion_matrix(n, beta), rtol=1e-13, atol=0)


def test_momentum_one_is_the_double_prefix_sum():
    n = 30
    t, s = np.indices((n, n))
    double = np.tril(np.ones((n, n))) @ np.tril(np.ones((n, n)))  # prefix sum, twice
    np.testing.assert_array_equal(double, np.where(t >= s, t - s + 1.0, 0.0))
    np.testing.assert_array_equal(_recursion_matrix(n, 1.0), double)
    np.testing.assert_array_equal(MomentumPrefixSum(1).coefs(n), double[:, 0])


@pytest.mark.parametrize("beta", MOMENTA)
def test_error_and_loss_match_the_dense_recursion(beta):
    n = 40
    A = _recursion_matrix(n, beta)
    w = MomentumPrefixSum(beta)
    for strategy in (Identity(), BandedToeplitz.square_root(6)):
        C = strategy.materialize(n)
        B = A @ np.linalg.inv(C)
        np.testing.assert_allclose(per_query_error(strategy, n, w), (B * B).sum(axis=1), rtol=1e-10)
        assert loss(strategy, n, workload=w) == pytest.approx(_dense_loss(C, A), rel=1e-10)


@pytest.mark.parametrize("beta", MOMENTA)
def test_optimised_strategies_are_correct_and_improve_at_every_momentum(beta):
    n = 64
    A = _recursion_matrix(n, beta)
    w = MomentumPrefixSum(beta)
    start = _dense_loss(BandedToeplitz.square_root(8).materialize(n), A)
    for strategy in (optimize_banded_toeplitz(n, 8, workload=w), optimize_blt(n, 3, workload=w)):
        ours = loss(strategy, n, workload=w)
        dense = _dense_loss(strategy.materialize(n), A)
        assert math.isfinite(ours) and ours == pytest.approx(dense, rel=1e-9)
        assert dense < _dense_loss(np.eye(n), A)
    banded = optimize_banded_toeplitz(n, 8, workload=w)
    assert _dense_loss(banded.materialize(n), A) <= start * (1 + 1e-9)


@pytest.mark.parametrize("beta", [-0.1, 1.0 + 1e-9, 2.0])
def test_momentum_outside_zero_one_refused(beta):
    with pytest.raises(ParameterValueError, match=r"momentum must be in \[0, 1\]"):
        MomentumPrefixSum(beta)
