"""Dense (non-Toeplitz) strategies: :class:`DenseStrategy` and :func:`optimize_dense`.

Checked against closed forms (``n = 1, 2`` by hand), an independent computation of the
single-participation optimum (the fixed point of Denisov et al. 2022, Section 3, by
eigendecompositions, sharing no code with the L-BFGS of the optimiser), brute force over
every participation pattern for the sensitivity, ``C^{-1} z`` for the online noise, and
privlearn's own Toeplitz optimisers (the dense optimum is never worse).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from test_sensitivity import _brute_force, _patterns

from privlearn.correlated import (
    DenseStrategy,
    FixedEpochs,
    MinSeparation,
    MomentumPrefixSum,
    Participation,
    SingleParticipation,
    dense_sensitivity,
    loss,
    optimize_banded_toeplitz,
    optimize_blt,
    optimize_dense,
    per_query_error,
    sensitivity,
)
from privlearn.correlated.noise import CorrelatedNoise
from privlearn.errors import ConfigurationError, ParameterTypeError, ParameterValueError


def _random_dense(rng: np.random.Generator, n: int, signed: bool) -> np.ndarray:
    c = np.tril(rng.normal(size=(n, n)))
    if not signed:
        c = np.abs(c)
    c[np.diag_indices(n)] = np.abs(np.diag(c)) + 0.1
    return c


def _naive_error(c: np.ndarray, a: np.ndarray) -> np.ndarray:
    b = a @ np.linalg.inv(c)
    return (b * b).sum(axis=1)


# -- closed forms ---------------------------------------------------------------------------
def test_one_step_is_the_identity():
    c = optimize_dense(1, show_progress=False)
    assert c.materialize().tolist() == [[1.0]]
    assert loss(c, 1) == pytest.approx(1.0, rel=1e-12)


def test_two_steps_single_participation_by_hand():
    # X = [[1, x], [x, 1]], tr(A^T A X^{-1}) = (3 - 2x) / (1 - x^2), minimal at
    # x^2 - 3x + 1 = 0: x = (3 - sqrt 5) / 2; C = [[sqrt(1 - x^2), 0], [x, 1]]
    x = (3.0 - math.sqrt(5.0)) / 2.0
    c = optimize_dense(2, show_progress=False).materialize()
    np.testing.assert_allclose(c, [[math.sqrt(1 - x * x), 0.0], [x, 1.0]], atol=1e-6)
    expected = (3.0 - 2.0 * x) / (1.0 - x * x) / 2.0
    assert loss(optimize_dense(2, show_progress=False), 2) == pytest.approx(expected, rel=1e-9)


def test_two_steps_two_epochs_by_hand():
    # X = diag(d0, d1) with d0 + d1 = 1 (one record takes part in both steps):
    # 2/d0 + 1/d1 is minimal at d ~ (sqrt 2, 1), the loss (1 + sqrt 2)^2 / 2
    part = FixedEpochs(2)
    c = optimize_dense(2, part, show_progress=False)
    d = np.diag(c.materialize().T @ c.materialize())
    np.testing.assert_allclose(d, np.array([math.sqrt(2), 1.0]) / (1 + math.sqrt(2)), atol=1e-7)
    assert loss(c, 2, part) == pytest.approx((1 + math.sqrt(2)) ** 2 / 2, rel=1e-9)
    s = sensitivity(c, part, 2)
    assert s.exact and s.value == pytest.approx(1.0, abs=1e-12)


def _fixed_point_optimum(n: int, a: np.ndarray, iterations: int = 3000) -> float:
    """Denisov et al. 2022, Section 3: the optimum of ``tr(G X^{-1})`` under
    ``diag(X) = 1`` is ``X = V^{-1/2} (V^{1/2} G V^{1/2})^{1/2} V^{-1/2}`` at the fixed
    point ``v = diag((V^{1/2} G V^{1/2})^{1/2})``; returns the mean error there."""
    g = a.T @ a
    v = np.diag(g).copy()
    for _ in range(iterations):
        root = np.sqrt(v)
        w, q = np.linalg.eigh(root[:, None] * g * root[None, :])
        sq = (q * np.sqrt(np.maximum(w, 0.0))) @ q.T
        v_new = np.diag(sq).copy()
        if np.max(np.abs(v_new - v)) < 1e-15 * np.max(v):
            break
        v = v_new
    x = sq / np.sqrt(np.outer(v, v))
    return float(np.trace(g @ np.linalg.inv(x))) / n


@pytest.mark.parametrize("n", [3, 6, 12])
def test_single_participation_matches_the_fixed_point(n):
    a = np.tri(n)
    expected = _fixed_point_optimum(n, a)
    c = optimize_dense(n, show_progress=False)
    assert loss(c, n) == pytest.approx(expected, rel=1e-7)


def test_momentum_workload_matches_the_fixed_point():
    n, beta = 8, 0.9
    lag = np.subtract.outer(np.arange(n), np.arange(n))
    a = np.where(lag >= 0, np.cumsum(beta ** np.arange(n))[np.abs(lag)], 0.0)
    w = MomentumPrefixSum(beta)
    c = optimize_dense(n, workload=w, show_progress=False)
    assert loss(c, n, workload=w) == pytest.approx(_fixed_point_optimum(n, a), rel=1e-7)


def test_single_participation_against_a_generic_minimiser():
    # scipy over every lower-triangular C (columns normalised: the sensitivity is 1)
    from scipy import optimize

    n = 4
    a = np.tri(n)
    rows, cols = np.tril_indices(n)

    def f(p):
        c = np.zeros((n, n))
        c[rows, cols] = p
        c = c / np.linalg.norm(c, axis=0)
        return _naive_error(c, a).mean()

    best = min(
        optimize.minimize(f, np.eye(n)[rows, cols] + 0.1 * s, method="BFGS").fun
        for s in np.random.default_rng(0).normal(size=(3, rows.size))
    )
    assert loss(optimize_dense(n, show_progress=False), n) == pytest.approx(best, rel=1e-5)


# -- sensitivity against brute force ---------------------------------------------------------
def _check_against_brute_force(c: np.ndarray, value: float, exact: bool, patterns) -> None:
    lo, hi = _brute_force(c, patterns)
    assert value * value >= lo * (1 - 1e-12)
    if exact:
        assert value * value <= lo * (1 + 1e-8)


@pytest.mark.parametrize("seed", range(6))
def test_fixed_epochs_sensitivity_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(6, 15))
    epochs = int(rng.integers(2, 5))
    per = -(-n // epochs)
    if (epochs - 1) * per >= n:
        epochs -= 1
    c = _random_dense(rng, n, signed=seed % 2 == 0)
    s = sensitivity(DenseStrategy(c), FixedEpochs(epochs, epoch_length=per), n)
    _check_against_brute_force(c, s.value, s.exact, [list(range(j, n, per)) for j in range(per)])
    if seed % 2:  # C >= 0: X >= 0, so the bound is attained
        assert s.exact


@pytest.mark.parametrize("seed", range(6))
def test_min_separation_sensitivity_against_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(6, 15))
    sep, k = int(rng.integers(1, 5)), int(rng.integers(2, 4))
    c = _random_dense(rng, n, signed=seed % 2 == 0)
    s = sensitivity(DenseStrategy(c), MinSeparation(sep, k), n)
    _check_against_brute_force(c, s.value, s.exact, list(_patterns(n, sep, k)))


@pytest.mark.parametrize(
    "part", [FixedEpochs(2), FixedEpochs(4), MinSeparation(3), SingleParticipation()]
)
def test_optimised_sensitivity_is_one_and_exact(part):
    n = 12
    c = optimize_dense(n, part, show_progress=False)
    s = sensitivity(c, part, n)
    k = part.participations(n) if isinstance(part, MinSeparation) else 1
    assert s.exact
    assert s.value == pytest.approx(math.sqrt(k), rel=1e-10)
    assert s.value >= math.sqrt(k) * (1 - 1e-12)
    if isinstance(part, MinSeparation):
        patterns = list(_patterns(n, part.min_sep, part.participations(n)))
    elif isinstance(part, FixedEpochs):
        per = part.steps_per_epoch(n)
        patterns = [list(range(j, n, per)) for j in range(per)]
    else:
        patterns = [[j] for j in range(n)]
    _check_against_brute_force(c.materialize(), s.value, s.exact, patterns)


def test_sensitivity_of_a_prefix_is_that_of_the_leading_block():
    c = _random_dense(np.random.default_rng(7), 10, signed=True)
    s = sensitivity(DenseStrategy(c), FixedEpochs(2), 6)
    assert s.value == sensitivity(DenseStrategy(c[:6, :6]), FixedEpochs(2), 6).value


def test_unknown_schema_is_refused():
    class Every(Participation):
        def participations(self, steps):
            return steps

    with pytest.raises(ParameterTypeError, match="no sensitivity bound is known"):
        dense_sensitivity(DenseStrategy(np.eye(3)), Every(), 3)
    with pytest.raises(ParameterTypeError, match="optimize_dense"):
        optimize_dense(3, Every(), show_progress=False)


# -- error and noise ---------------------------------------------------------------------------
def test_per_query_error_is_the_row_norms_of_a_c_inverse():
    c = _random_dense(np.random.default_rng(3), 9, signed=True)
    strategy = DenseStrategy(c)
    np.testing.assert_allclose(per_query_error(strategy, 9), _naive_error(c, np.tri(9)), rtol=1e-10)
    np.testing.assert_allclose(
        per_query_error(strategy, 5), _naive_error(c[:5, :5], np.tri(5)), rtol=1e-10
    )


def test_online_noise_is_c_inverse_z_and_stops_at_n():
    rng = np.random.default_rng(4)
    n = 7
    c = _random_dense(rng, n, signed=True)
    z = rng.normal(size=(n, 2, 3))
    gen = CorrelatedNoise(DenseStrategy(c).recurrence(), shape=(2, 3))
    assert gen.buffers.shape == (n, 2, 3)  # every draw is kept
    noise = np.stack([gen.step(zt) for zt in z])
    expected = np.linalg.solve(c, z.reshape(n, -1)).reshape(z.shape)
    np.testing.assert_allclose(noise, expected, rtol=1e-10, atol=1e-12)
    with pytest.raises(ConfigurationError, match="defined for 7 steps"):
        gen.step(z[0])


def test_invalid_matrices_are_refused():
    with pytest.raises(ParameterValueError, match="lower-triangular"):
        DenseStrategy([[1.0, 0.5], [0.0, 1.0]])
    with pytest.raises(ParameterValueError, match="positive diagonal"):
        DenseStrategy([[1.0, 0.0], [0.5, -1.0]])
    with pytest.raises(ParameterValueError, match="square"):
        DenseStrategy(np.ones((2, 3)))
    with pytest.raises(ParameterValueError, match="finite"):
        DenseStrategy([[np.nan]])
    strategy = DenseStrategy(np.eye(3))
    with pytest.raises(ParameterValueError, match="n must be in"):
        strategy.materialize(4)
    with pytest.raises(ValueError):
        strategy.matrix[0, 0] = 2.0  # read-only
    assert strategy == DenseStrategy(np.eye(3)) and hash(strategy) == hash(DenseStrategy(np.eye(3)))


def test_optimiser_refusals():
    with pytest.raises(ParameterValueError, match="reduction must be 'mean'"):
        optimize_dense(4, reduction="max")
    with pytest.raises(ParameterValueError, match="steps must be in"):
        optimize_dense(100_000)


# -- against privlearn's Toeplitz optimisers and jax_privacy ---------------------------------------
@pytest.mark.parametrize(
    "n,part",
    [
        (16, SingleParticipation()),
        (16, FixedEpochs(4)),
        (32, FixedEpochs(2)),
        (24, MinSeparation(3)),
    ],
)
def test_never_worse_than_the_best_toeplitz(n, part):
    dense = loss(optimize_dense(n, part, show_progress=False), n, part)
    if isinstance(part, SingleParticipation):
        per = n
    elif isinstance(part, MinSeparation):
        per = part.min_sep
    else:
        per = part.steps_per_epoch(n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bands or buffers the optimum leaves unused
        toeplitz = [
            optimize_banded_toeplitz(n, b, part, show_progress=False) for b in sorted({2, per, n})
        ]
        toeplitz.append(optimize_blt(n, 4, part, reduction="mean", show_progress=False))
    best = min(loss(c, n, part) for c in toeplitz)
    assert dense <= best * (1 + 1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("n,epochs", [(8, 1), (12, 3), (16, 4)])
def test_parity_with_jax_privacy_dense(n, epochs):
    pytest.importorskip("jax_privacy")
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    from jax_privacy.matrix_factorization import dense
    from jax_privacy.matrix_factorization import sensitivity as jsens

    c_peer = np.asarray(dense.optimize(n, epochs=epochs))
    err = float(np.mean(dense.per_query_error(strategy_matrix=jnp.asarray(c_peer))))
    sens = float(jsens.fixed_epoch_sensitivity(jnp.asarray(c_peer), epochs))
    peer = err * sens * sens
    part = FixedEpochs(epochs)
    ours = loss(optimize_dense(n, part, show_progress=False), n, part)
    # the same convex problem: equal optima (jax_privacy stops at a projected gradient
    # of 1e-3, so it may be slightly above)
    assert ours <= peer * (1 + 1e-9)
    assert ours >= peer * (1 - 1e-4)
    # and privlearn's loss of the peer's matrix is the peer's
    assert loss(DenseStrategy(np.tril(c_peer)), n, part) == pytest.approx(peer, rel=1e-9)


def test_accounting_uses_the_dense_sensitivity():
    from privlearn.correlated.accounting import correlated_mechanism
    from privlearn.correlated.sampling import BallsInBinsSampler

    c = DenseStrategy(_random_dense(np.random.default_rng(5), 12, signed=True))
    part = FixedEpochs(3)
    # the dense sensitivity, raised by the float32 rounding of the computed inverse the
    # noise applies and of its inner products over up to 12 draws (gamma_13 || |C| |A| ||,
    # about 13 * 2^-24 * 213 = 1.6e-4 for this C of condition number ~200)
    m = correlated_mechanism(c, part, 2.0, steps=12)
    s = sensitivity(c, part, 12).value
    assert s < m.sensitivity <= s * (1 + 1e-3)
    sampler = BallsInBinsSampler(dataset_size=100, steps=12, cycle_length=4)
    m = correlated_mechanism(c, sampler, 2.0)
    s = sensitivity(c, MinSeparation(4, 3), 12).value
    assert s < m.sensitivity <= s * (1 + 1e-3)
    with pytest.raises(ParameterTypeError, match="Toeplitz strategy"):
        correlated_mechanism(c, sampler, 2.0, amplified=True)


def test_best_pattern_attains_the_vector_sensitivity():
    from privlearn.correlated.sensitivity import _best_pattern, vector_sensitivity

    rng = np.random.default_rng(9)
    for _ in range(200):
        n = int(rng.integers(1, 12))
        x, sep, k = rng.random(n), int(rng.integers(1, 4)), int(rng.integers(1, 5))
        p = _best_pattern(x, sep, k)
        assert len(p) <= k and np.all(np.diff(p) >= sep)
        assert x[p].sum() == pytest.approx(vector_sensitivity(x, sep, k), rel=1e-12)


def test_more_steps_than_the_strategy_are_refused():
    c = DenseStrategy(np.eye(4))
    with pytest.raises(ParameterValueError, match=r"steps must be in \[1, 4\]"):
        sensitivity(c, SingleParticipation(), 5)
    with pytest.raises(ParameterValueError, match=r"steps must be in \[1, 4\]"):
        per_query_error(c, 5)
    with pytest.raises(ParameterValueError, match=r"n must be in \[1, 4\]"):
        c.inverse(5)


def test_progress_bar_and_reuse(capsys):
    from privlearn.correlated import PrefixSum

    optimize_dense.cache_clear()
    quiet = optimize_dense(24, FixedEpochs(2), show_progress=False)
    assert capsys.readouterr() == ("", "")
    assert optimize_dense(24, FixedEpochs(2), PrefixSum()) is quiet  # reused
    optimize_dense.cache_clear()
    loud = optimize_dense(24, FixedEpochs(2), show_progress=True)
    out, err = capsys.readouterr()
    assert out == "" and "optimising a dense strategy for 24 steps" in err
    assert loud == quiet and loud is not quiet


def test_inverse_rows_are_those_of_the_inverse():
    c = _random_dense(np.random.default_rng(11), 8, signed=True)
    strategy = DenseStrategy(c)
    inv = np.linalg.inv(c)
    np.testing.assert_allclose(strategy.inverse(), inv, rtol=1e-10, atol=1e-12)
    for t in range(8):
        np.testing.assert_allclose(strategy.inverse_row(t), inv[t, : t + 1], rtol=1e-10, atol=1e-12)
