"""Strategy optimisers against dense brute force and against their own guarantees.

* the objective the optimisers minimise (privlearn's ``loss``) equals the loss of the
  materialised matrices -- ``A C^{-1}`` by a dense solve, the sensitivity as the largest
  ``||C u||`` over every participation pattern, enumerated;
* the optimised strategy is as good as an independent multi-start optimisation of that
  dense loss over the raw coefficients (banded) or the raw decays and weights (BLT);
* more bands never hurt, the optimum is never worse than the banded square root.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import optimize

from privlearn.correlated import (
    BandedToeplitz,
    BufferedToeplitz,
    FixedEpochs,
    MinSeparation,
    loss,
    optimize_banded_toeplitz,
    optimize_blt,
)


@functools.lru_cache(maxsize=64)
def _pattern_matrix(n: int, participation) -> np.ndarray:
    """Indicator columns of every set of steps one record may contribute to."""
    pats = _patterns(n, participation)
    u = np.zeros((n, len(pats)))
    for j, p in enumerate(pats):
        u[list(p), j] = 1.0
    return u


def _patterns(n: int, participation) -> list[tuple[int, ...]]:
    """Every set of steps one record may contribute to."""
    if participation is None:
        return [(i,) for i in range(n)]
    if isinstance(participation, FixedEpochs):
        b = n // participation.epochs
        return [tuple(range(j, n, b)) for j in range(b)]
    sep, k = participation.min_sep, participation.participations(n)
    out = []
    for size in range(1, k + 1):
        for combo in itertools.combinations(range(n), size):
            if all(b - a >= sep for a, b in zip(combo, combo[1:], strict=False)):
                out.append(combo)
    return out


def dense_loss(c_matrix: np.ndarray, participation, reduction: str) -> float:
    """The loss of a dense strategy matrix by brute force: per-query errors of
    ``A C^{-1}`` (prefix sums), the sensitivity as the largest ``||C u||`` over the
    patterns, for contributions of the same sign (worst for ``C^T C >= 0``)."""
    n = c_matrix.shape[0]
    a = np.tril(np.ones((n, n)))
    b = np.linalg.solve(c_matrix.T, a.T).T
    err = (b * b).sum(axis=1)
    e = err.mean() if reduction == "mean" else err.max()
    sens2 = float(np.max(np.sum((c_matrix @ _pattern_matrix(n, participation)) ** 2, axis=0)))
    return float(e * sens2)


def _toeplitz_matrix(c: np.ndarray, n: int) -> np.ndarray:
    c = np.concatenate([c, np.zeros(max(0, n - c.size))])[:n]
    i, j = np.indices((n, n))
    return np.where(i >= j, c[np.clip(i - j, 0, n - 1)], 0.0)


PARTICIPATIONS = [None, MinSeparation(3), MinSeparation(2, 3), FixedEpochs(2)]


@pytest.mark.parametrize("participation", PARTICIPATIONS)
@pytest.mark.parametrize("reduction", ["mean", "max"])
def test_loss_agrees_with_dense_brute_force(participation, reduction):
    n = 8
    rng = np.random.default_rng(3)
    # positive decreasing (every rule exact) and signed banded with bands <= min_sep
    strategies = [BufferedToeplitz((0.9, 0.4), (0.2, 0.15)),
                  BandedToeplitz.square_root(5)]
    if participation is None or isinstance(participation, MinSeparation) and \
            participation.min_sep >= 3:
        strategies.append(BandedToeplitz((1.0, -0.3, 0.2)))
    for C in strategies:
        ours = loss(C, n, participation, reduction=reduction)
        brute = dense_loss(C.materialize(n), participation, reduction)
        assert ours == pytest.approx(brute, rel=1e-9)
    del rng


def _multistart_banded(n, bands, participation, reduction, starts=6) -> float:
    """Independent reference: L-BFGS on the dense loss over raw coefficients (finite
    differences), from the square root and random starts; for bands > min_sep the
    coefficients are kept non-negative and non-increasing, as the optimiser must."""
    monotone = isinstance(participation, MinSeparation) and bands > participation.min_sep or \
        isinstance(participation, FixedEpochs) and bands > n // participation.epochs

    def coefs(x):
        return np.cumsum(np.abs(x)[::-1])[::-1] if monotone else np.concatenate([[1.0], x])

    def f(x):
        c = coefs(x)
        if c[0] <= 0:
            return 1e30
        return math.log(dense_loss(_toeplitz_matrix(c, n), participation, reduction))

    rng = np.random.default_rng(bands * 100 + n)
    sqrt = np.asarray(BandedToeplitz.square_root(bands).coefs)
    x0s = [np.append(-np.diff(sqrt), sqrt[-1]) if monotone else sqrt[1:] / sqrt[0]]
    for _ in range(starts - 1):
        x0s.append(rng.uniform(0.0, 0.6, bands if monotone else bands - 1))
    best = math.inf
    for x0 in x0s:
        res = optimize.minimize(f, x0, method="L-BFGS-B", options={"maxiter": 2000})
        best = min(best, res.fun)
    return math.exp(best)


@pytest.mark.parametrize("n,bands,participation,reduction", [
    (8, 3, None, "mean"), (8, 4, None, "max"), (9, 3, MinSeparation(3), "mean"),
    (8, 4, MinSeparation(2, 3), "max"), (8, 3, FixedEpochs(2), "mean"),
    (10, 2, MinSeparation(4), "max"),
])
def test_banded_matches_dense_multistart(n, bands, participation, reduction):
    C = optimize_banded_toeplitz(n, bands, participation, reduction=reduction)
    assert C.bands == bands
    ours = loss(C, n, participation, reduction=reduction)
    assert ours == pytest.approx(dense_loss(C.materialize(n), participation, reduction),
                                 rel=1e-9)
    assert ours <= _multistart_banded(n, bands, participation, reduction) * (1 + 1e-6)


def _multistart_blt(n, buffers, participation, reduction, starts=6) -> float:
    """Independent reference: the dense loss over raw decays in (0, 1) and positive
    weights summing to < 1 (positive, decreasing coefficients: the class the optimiser
    searches, every BLT whose sensitivity rule is exact)."""

    def unpack(x):
        theta = 1.0 / (1.0 + np.exp(-x[:buffers]))
        w = np.exp(x[buffers:])
        omega = w / (1.0 + w.sum())
        return theta, omega

    def f(x):
        theta, omega = unpack(x)
        C = BufferedToeplitz(tuple(theta), tuple(omega))
        return math.log(dense_loss(C.materialize(n), participation, reduction))

    rng = np.random.default_rng(buffers * 10 + n)
    best = math.inf
    for _ in range(starts):
        x0 = np.concatenate([rng.normal(1.0, 1.5, buffers), rng.normal(-1.5, 1.0, buffers)])
        res = optimize.minimize(f, x0, method="Nelder-Mead",
                                options={"maxiter": 2000, "xatol": 1e-8, "fatol": 1e-12})
        res = optimize.minimize(f, res.x, method="L-BFGS-B")
        best = min(best, res.fun)
    return math.exp(best)


@pytest.mark.parametrize("n,buffers,participation,reduction", [
    (10, 1, None, "max"), (12, 2, MinSeparation(3), "max"),
    pytest.param(10, 2, None, "mean", marks=pytest.mark.slow),
    pytest.param(10, 2, FixedEpochs(2), "mean", marks=pytest.mark.slow),
])
def test_blt_matches_dense_multistart(n, buffers, participation, reduction):
    C = optimize_blt(n, buffers, participation, reduction=reduction)
    ours = loss(C, n, participation, reduction=reduction)
    assert ours == pytest.approx(dense_loss(C.materialize(n), participation, reduction),
                                 rel=1e-9)
    assert ours <= _multistart_blt(n, buffers, participation, reduction) * 1.001


@settings(max_examples=15, deadline=None)
@given(n=st.integers(4, 300), bands=st.integers(1, 12), more=st.integers(1, 6),
       reduction=st.sampled_from(["mean", "max"]),
       schema=st.sampled_from(["single", "sep", "epochs"]))
def test_more_bands_never_worse_and_never_worse_than_square_root(
        n, bands, more, reduction, schema):
    bands = min(bands, n)
    wider = min(bands + more, n)
    p = {"single": None, "sep": MinSeparation(max(1, n // 5)),
         "epochs": FixedEpochs(2) if n % 2 == 0 else None}[schema]
    narrow = optimize_banded_toeplitz(n, bands, p, reduction=reduction)
    wide = optimize_banded_toeplitz(n, wider, p, reduction=reduction)
    l_narrow = loss(narrow, n, p, reduction=reduction)
    l_wide = loss(wide, n, p, reduction=reduction)
    assert l_wide <= l_narrow * (1 + 1e-7)
    for C, b in ((narrow, bands), (wide, wider)):
        start = loss(BandedToeplitz.square_root(b), n, p, reduction=reduction)
        assert loss(C, n, p, reduction=reduction) <= start * (1 + 1e-12)


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(n=st.integers(2, 400), buffers=st.integers(1, 4),
       reduction=st.sampled_from(["mean", "max"]), sep=st.integers(1, 50))
def test_blt_more_buffers_never_much_worse(n, buffers, reduction, sep):
    p = MinSeparation(min(sep, n)) if sep > 1 else None
    few = loss(optimize_blt(n, buffers, p, reduction=reduction), n, p, reduction=reduction)
    more = loss(optimize_blt(n, buffers + 1, p, reduction=reduction), n, p,
                reduction=reduction)
    assert more <= few * 1.001


def _multistart_blt_loss(n, buffers, participation, reduction, starts=6) -> float:
    """Independent reference for larger ``n``: the same raw decays and weights as
    :func:`_multistart_blt`, scored with ``privlearn.correlated.loss`` (checked against
    dense brute force above) instead of dense matrices."""

    def f(x):
        theta = 1.0 / (1.0 + np.exp(-np.clip(x[:buffers], -700, 700)))
        w = np.exp(np.clip(x[buffers:], -700, 700))
        C = BufferedToeplitz(tuple(theta), tuple(w / (1.0 + w.sum())))
        return math.log(loss(C, n, participation, reduction=reduction))

    rng = np.random.default_rng(0)
    best = math.inf
    for _ in range(starts):
        x0 = np.concatenate([rng.normal(2.0, 2.5, buffers), rng.normal(-1.5, 1.0, buffers)])
        res = optimize.minimize(f, x0, method="Nelder-Mead",
                                options={"maxiter": 3000, "xatol": 1e-9, "fatol": 1e-13})
        res = optimize.minimize(f, res.x, method="L-BFGS-B")
        best = min(best, res.fun)
    return math.exp(best)


@pytest.mark.slow
@pytest.mark.parametrize("n,buffers,participation,reduction", [
    (600, 2, MinSeparation(110), "mean"),  # two starts agreed on an idle second buffer
    (256, 2, FixedEpochs(4), "max"),  # the first starts all reach a decay at 1
    (256, 3, FixedEpochs(4), "max"), (100, 2, None, "mean"),
])
def test_blt_matches_multistart_at_moderate_n(n, buffers, participation, reduction):
    C = optimize_blt(n, buffers, participation, reduction=reduction)
    ours = loss(C, n, participation, reduction=reduction)
    assert ours <= _multistart_blt_loss(n, buffers, participation, reduction) * 1.001


@pytest.mark.parametrize("participation", [
    MinSeparation(1, 3), MinSeparation(1), MinSeparation(2), FixedEpochs(40), FixedEpochs(1),
])
@pytest.mark.parametrize("buffers", [1, 3])
def test_blt_never_fails_for_tight_schemas(participation, buffers):
    n = 40
    C = optimize_blt(n, buffers, participation, reduction="mean")
    c = C.toeplitz_coefs(n)
    assert np.all(c >= 0) and np.all(np.diff(c) <= 0)
    assert math.isfinite(loss(C, n, participation, reduction="mean"))
