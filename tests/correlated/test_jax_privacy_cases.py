"""More of jax_privacy's ``tests/matrix_factorization`` families (``toeplitz_test``,
``buffered_toeplitz_test``, ``dense_test``, ``sensitivity_test``), ported to privlearn's
public API with their configurations and checked against closed forms, dense matrix
products and the values those tests state (no jax needed). The families already ported
are in ``test_jax_privacy_families.py``."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.signal import fftconvolve

from privlearn.correlated import (
    BandedToeplitz,
    BufferedToeplitz,
    FixedEpochs,
    MinSeparation,
    MomentumPrefixSum,
    SingleParticipation,
    Workload,
    loss,
    optimize_blt,
    per_query_error,
    sensitivity,
)
from privlearn.correlated.accounting import correlated_mechanism
from privlearn.correlated.sensitivity import MAX_DENSE_STEPS, gram_sensitivity_upper_bound
from privlearn.correlated.strategies import ToeplitzStrategy, square_root_coefs
from privlearn.errors import ParameterTypeError


def _toeplitz(c, n: int) -> np.ndarray:
    """The dense lower-triangular Toeplitz matrix with first column ``c`` (independent of
    privlearn's own ``materialize``)."""
    col = np.zeros(n)
    c = np.asarray(c, dtype=float)[:n]
    col[: c.size] = c
    return np.array([[col[i - j] if i >= j else 0.0 for j in range(n)] for i in range(n)])


def _dense_error(strategy: np.ndarray, workload: np.ndarray) -> np.ndarray:
    """Per-query squared error ``||(A C^{-1})[t, :]||^2`` from dense matrices."""
    b = workload @ np.linalg.inv(strategy)
    return (b * b).sum(axis=1)


class _Coefs(Workload):
    """A Toeplitz workload given by its leading coefficients (shorter: zero-padded;
    longer: cut), as jax_privacy's ``workload_coef``."""

    __slots__ = ("c",)

    def __init__(self, c):
        self.c = np.asarray(c, dtype=float)

    def coefs(self, n: int) -> np.ndarray:
        out = np.zeros(n)
        out[: min(n, self.c.size)] = self.c[:n]
        return out


# toeplitz_test NAMED_C_MATRIX_PARAMS (n=None: the number of coefficients)
C_PARAMS = [
    ([7.3], 3),
    ([1, 0.5, 0.2], 3),
    ([1, 0.7, 2.0], 4),
    ([1, 0.0, -0.2], 5),
    (list(np.linspace(1, 0.001, 25)), 25),
    (list(np.linspace(0.5, 2.0, 11)), 11),
]


@pytest.mark.parametrize("coefs,n", C_PARAMS)
@pytest.mark.parametrize("workload", ["default", "eye", "banded", "extra_entries"])
def test_per_query_error_against_dense(coefs, n, workload):
    w = {
        "default": None,
        "eye": _Coefs([1.0]),
        "banded": _Coefs([1, 0.9, 0.5, 0.1]),
        "extra_entries": _Coefs(np.linspace(0.99, 0.1, n + 5)),
    }[workload]
    a = np.tri(n) if w is None else _toeplitz(w.coefs(n), n)
    want = _dense_error(_toeplitz(coefs, n), a)
    err = per_query_error(BandedToeplitz(tuple(coefs)), n, w)
    np.testing.assert_allclose(err, want, rtol=1e-10, atol=1e-14)
    assert err.max() == err[-1]  # a Toeplitz workload's largest error is the last query's


def test_two_step_prefix_sum_example():
    # dense_test: A = tri(2), C = [[1, 0], [0.5, 1]] gives B = [[1, 0], [0.5, 1]]
    np.testing.assert_allclose(per_query_error(BandedToeplitz((1.0, 0.5)), 2), [1.0, 1.25])


@pytest.mark.parametrize("n", range(1, 9))
def test_mean_loss_is_sensitivity_times_dense_error_and_scale_free(n):
    coef = np.array([1.0, 0.4, 0.3, 0.1])
    want = float(np.sum(coef[:n] ** 2)) * _dense_error(_toeplitz(coef, n), np.tri(n)).mean()
    assert loss(BandedToeplitz(tuple(coef)), n) == pytest.approx(want, rel=1e-12)
    assert loss(BandedToeplitz(tuple(2.3 * coef)), n) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("n", [1, 2, 10, 100])
def test_fichtenberger_coefficients_are_the_square_root_of_prefix_sums(n):
    c = _toeplitz(square_root_coefs(n), n)
    np.testing.assert_allclose(c @ c, np.tri(n), atol=1e-12)
    # the inverse square root's coefficients, binom(2k, k) / (4^k (1 - 2k))
    inv = BandedToeplitz(tuple(square_root_coefs(5))).inverse_toeplitz_coefs(5)
    np.testing.assert_allclose(inv, [1, -1 / 2, -1 / 8, -1 / 16, -5 / 128], rtol=1e-14)


@pytest.mark.parametrize("n,epochs", [(1, 1), (2, 1), (2, 2), (10, 1), (10, 5), (10, 10)])
@pytest.mark.parametrize("bands", [2, 13, 10, 11])
def test_decreasing_toeplitz_worst_case_is_a_fixed_epoch_pattern(n, epochs, bands):
    # toeplitz_test.test_sensitivity_squared_fixed_epoch: positive decreasing
    # coefficients, min_sep = n / epochs with any participation cap >= epochs
    coef = np.linspace(1.0, 0.001, bands)
    dense = _toeplitz(coef, n)
    per = n // epochs
    want = max(np.linalg.norm(dense[:, j::per].sum(axis=1)) for j in range(per))
    C = BandedToeplitz(tuple(coef))
    for k in (epochs, epochs + 10, None):
        s = sensitivity(C, MinSeparation(per, k), n)
        assert s.exact and s.value == pytest.approx(want, rel=1e-12)
        assert s.value >= want * (1 - 1e-14)
    assert sensitivity(C, FixedEpochs(epochs), n).value == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("n", [1, 5, 50])
@pytest.mark.parametrize("k", [1, 2, 5, 50])
def test_min_sep_one_takes_the_first_columns(n, k):
    # toeplitz_test.test_sensitivity_squared_min_sep_one: sqrt(linspace) coefficients
    coef = np.sqrt(np.linspace(1.0, 0.001, n))
    want = np.linalg.norm(_toeplitz(coef, n)[:, :k].sum(axis=1))
    s = sensitivity(BandedToeplitz(tuple(coef)), MinSeparation(1, k), n)
    assert s.exact and s.value == pytest.approx(want, rel=1e-12)


# buffered_toeplitz_test BLT_TUPLES: negative decays and weights, decays at and near 1
BLT_TUPLES = [
    ((0.99,), (0.1,)),
    ((0.9, 0.5, 0.001), (0.1, 0.2, 0.5)),
    ((0.001,), (0.5,)),
    ((0.001,), (-0.1,)),
    ((0.99, -0.1), (0.01, -0.1)),
    ((0.99, -0.1), (-0.2, 0.1)),
    ((1.0,), (0.001,)),
    ((1.0, 1 - 1e-9, 0.99, 0.1), (1e-6, 1e-5, 1e-3, 1e-2)),
    (
        (0.99994829, 0.99591045, 0.76319372, -0.3667193, 0.69954866),
        (0.01202588, 0.08567775, 0.66450507, -0.00384594, -0.25671158),
    ),
    (
        (0.99999999, 0.77422499, 0.54944999, 0.32467499, 0.09989999),
        (0.00999262, 0.00999992, 0.00999996, 0.00999997, 0.00999998),
    ),
    *[((0.9, 0.9 - 10.0**-p), (0.1, 0.1)) for p in (1, 4, 8, 11)],
    *[((1 - 10.0**-p, 0.8), (0.1, 0.1)) for p in (1, 4, 8, 11)],
]


@pytest.mark.parametrize("theta,omega", BLT_TUPLES)
def test_blt_families_against_dense(theta, omega):
    blt = BufferedToeplitz(theta, omega)
    for n in (1, 2, 11, 25):
        dense = np.eye(n)
        for i in range(n):
            for j in range(i):
                dense[i, j] = sum(w * d ** (i - j - 1) for d, w in zip(theta, omega, strict=True))
        np.testing.assert_allclose(blt.materialize(n), dense, rtol=1e-12, atol=1e-15)
        inv = np.linalg.inv(dense)
        np.testing.assert_allclose(blt.inverse_toeplitz_coefs(n), inv[:, 0], rtol=1e-9, atol=1e-13)
        np.testing.assert_allclose(
            per_query_error(blt, n), _dense_error(dense, np.tri(n)), rtol=1e-9
        )
        single = np.linalg.norm(dense, axis=0).max()
        s = sensitivity(blt, SingleParticipation(), n)
        assert s.exact and single * (1 - 1e-15) <= s.value <= single * (1 + 1e-12)


def test_error_messages_name_the_strategy_classes_that_exist():
    import privlearn.correlated as correlated

    for call in (
        lambda: sensitivity(object(), SingleParticipation(), 4),
        lambda: correlated_mechanism(object(), SingleParticipation(), 1.0, steps=4),
    ):
        with pytest.raises(ParameterTypeError) as info:
            call()
        named = [w.strip("(,.").split(".")[0] for w in str(info.value).split() if "Toeplitz" in w]
        assert named and all(hasattr(correlated, name) for name in named), named


def _lower_bound(c: np.ndarray, n: int, steps: list[int], signs: list[float]) -> float:
    """``||C sum_i s_i e_i||`` for collinear contributions ``s_i`` at ``steps``: a value
    the sensitivity must reach (FFT convolution, no ``n x n`` matrix)."""
    u = np.zeros(n)
    u[steps] = signs
    return float(np.linalg.norm(fftconvolve(u, c)[:n]))


def test_signed_toeplitz_past_the_dense_size_is_bounded_not_refused():
    """jax_privacy bounds any Toeplitz ``C`` by the non-increasing majorant of ``|c|``
    (its regression case ``c = (1, 0.5, 0.8)``); a signed or non-monotone ``C`` of more
    steps than the dense rule's limit was refused. Its bound must reach every attained
    value and stay below the triangle inequality's ``k ||c||``."""
    n = MAX_DENSE_STEPS + 1
    c = np.array([1.0, 0.5, 0.8])
    s = sensitivity(BandedToeplitz(tuple(c)), MinSeparation(1, 2), n)
    # C >= 0: the best pair of steps, brute force over their gap (3 bands: gaps >= 3 give
    # 2 ||c||^2); and the majorant (1, 0.8, 0.8) at steps 0, 1 in closed form
    best = max(_lower_bound(c, 12, [0, g], [1.0, 1.0]) for g in range(1, 6))
    assert best == pytest.approx(math.sqrt(5.58), rel=1e-12)
    assert not s.exact and best <= s.value <= math.sqrt(7.44) * (1 + 1e-12)

    blt = BufferedToeplitz((0.99, -0.1), (0.01, -0.1))  # signed coefficients
    n = 10_000
    c = blt.toeplitz_coefs(n)
    assert c.min() < 0
    for schema, sep, k in ((MinSeparation(50, 20), 50, 20), (FixedEpochs(4), n // 4, 4)):
        s = sensitivity(blt, schema, n)
        assert not s.exact and math.isfinite(s.value)
        assert s.value <= k * np.linalg.norm(c) * (1 + 1e-12)
        steps = [m * sep for m in range(k)]
        for signs in ([1.0] * k, [(-1.0) ** m for m in range(k)]):
            assert s.value >= _lower_bound(c, n, steps, signs)


@pytest.mark.parametrize("n", [3, 16, 33])
def test_blt_for_every_step_participation_reaches_the_identity(n):
    # buffered_toeplitz_test.test_optimization_hard_cases: min_sep = 1 with n
    # participations makes the identity optimal (max loss n * n)
    p = MinSeparation(1, n)
    blt = optimize_blt(n, 3, p)
    assert loss(blt, n, p, reduction="max") == pytest.approx(n * n, rel=1e-2)


@pytest.mark.parametrize("buffers,k,sep", [(1, 11, 45), (2, 7, 77), (3, 2, 18), (3, 12, 28)])
def test_blt_beats_the_peer_baseline_tuned_for_other_participations(buffers, k, sep):
    # buffered_toeplitz_test.test_optimize_better_than_baseline: BLTs the peer optimised
    # for n = 1000, 2 participations, min_sep 5 must not beat ours at n = 500
    baseline = {
        1: ((0.9877027559462715,), (0.10595704738115597,)),
        2: ((0.993433070819512, 0.6342644427247973), (0.07538320617916519, 0.5144060910151949)),
        3: (
            (0.9934331427558322, 0.6342832547407998, 0.6342732636848848),
            (0.07538346317367392, 0.4808525558278832, 0.0335536865929295),
        ),
    }[buffers]
    n, p = 500, MinSeparation(sep, k)
    ours = loss(optimize_blt(n, buffers, p), n, p, reduction="max")
    assert ours < 1.001 * loss(BufferedToeplitz(*baseline), n, p, reduction="max")


@pytest.mark.parametrize(
    "n,buffers,rtol",
    [
        (10, 1, 1.04),
        (100, 3, 1.03),
        (1000, 2, 1.04),
        (10_000, 1, 1.45),
        (10_000, 3, 1.03),
        (10_000, 4, 1.03),
    ],
)
def test_blt_within_the_peer_tolerance_of_mathias_bound(n, buffers, rtol):
    # buffered_toeplitz_test.test_optimize_single_participation_near_optimal: sqrt(max
    # loss) against 1 + ln(n) / pi (Mathias 1993, Cor. 3.5), the peer's tolerances
    root = math.sqrt(loss(optimize_blt(n, buffers), n, reduction="max"))
    assert root <= rtol * (1 + math.log(n) / math.pi)


@pytest.mark.parametrize(
    "n,sep,cap,want",
    [
        (1, 1, None, 1),
        (1, 2, 3, 1),
        (5, 1, None, 5),
        (5, 2, None, 3),
        (5, 3, None, 2),
        (5, 4, None, 2),
        (5, 5, None, 1),
        (5, 6, None, 1),
        (5, 1, 2, 2),
        (5, 2, 2, 2),
        (5, 2, 4, 3),
        (4, 1, None, 4),
        (4, 2, None, 2),
        (4, 3, None, 2),
        (4, 4, None, 1),
    ],
)
def test_most_participations_under_min_separation(n, sep, cap, want):
    # sensitivity_test.test_minsep_true_max_participations, and the identity's
    # sensitivity is its square root
    p = MinSeparation(sep, cap)
    assert p.participations(n) == want
    s = sensitivity(BandedToeplitz((1.0,)), p, n)
    assert s.exact and math.sqrt(want) <= s.value <= math.sqrt(want) * (1 + 1e-12)


@pytest.mark.parametrize("n,buffers,rtol", [(100, 3, 1.001), (1000, 4, 1.001), (1000, 3, 1.005)])
def test_blt_approaches_the_square_root_max_loss(n, buffers, rtol):
    # the square root of the prefix sums (jax_privacy's optimal_max_error_strategy_coefs;
    # Fichtenberger et al. 2023) has max loss (sum_k r_k^2)^2: its column norm and its
    # last query's error are both sum_k r_k^2. A few buffers come within a fraction of a
    # percent of it (Dvijotham et al. 2024, Section 5)
    r = np.array([math.comb(2 * k, k) / 4**k for k in range(n)])
    want = float(np.sum(r * r)) ** 2
    sqrt = BandedToeplitz(tuple(square_root_coefs(n)))
    assert loss(sqrt, n, reduction="max") == pytest.approx(want, rel=1e-12)
    assert loss(optimize_blt(n, buffers), n, reduction="max") <= rtol * want


class _BandedInverse(ToeplitzStrategy):
    """A strategy given by its banded inverse ``C^{-1}`` (jax_privacy's banded inverse
    Toeplitz strategies): a user-defined subclass of the public base class."""

    __slots__ = ("noise",)

    def __init__(self, noise):
        self.noise = np.asarray(noise, dtype=float)

    @property
    def bands(self) -> None:
        return None

    def toeplitz_coefs(self, n: int) -> np.ndarray:
        e0 = np.zeros(n)
        e0[0] = 1.0
        return np.linalg.solve(_toeplitz(self.noise, n), e0)


@pytest.mark.parametrize("k", [1, 2, 4, 8, 16])
def test_banded_inverse_square_root_min_sep_sensitivity(k):
    # toeplitz_test.test_banded_inverse_sensitivity_squared_matches_toeplitz: C^{-1} the
    # first 8 coefficients of sqrt(1 - x), -binom(2j, j) / (4^j (2j - 1)); C is then
    # non-negative and non-increasing, and the exact rule agrees with [CC23b] Alg. 4 on
    # the dense C^T C (exact for such C), up to the latter's rounding allowance
    n, sep = 128, 128 // k
    noise = [-math.comb(2 * j, j) / (4**j * (2 * j - 1)) for j in range(8)]
    assert noise[:5] == [1, -1 / 2, -1 / 8, -1 / 16, -5 / 128]
    strategy = _BandedInverse(noise)
    s = sensitivity(strategy, MinSeparation(sep, k), n)
    dense = gram_sensitivity_upper_bound(_toeplitz(strategy.toeplitz_coefs(n), n), sep, k)
    assert s.exact and s.value == pytest.approx(dense, rel=1e-10)


def _momentum_sgd_matrix(n: int, momentum: float) -> np.ndarray:
    """The iterates of heavy-ball SGD at a constant learning rate as a matrix, by running
    the recursion of jax_privacy's ``momentum_sgd_matrix`` on each unit gradient:
    ``buf <- momentum * buf + g_t``, ``x_t = x_{t-1} + buf``."""
    out = np.zeros((n, n))
    for u in range(n):
        buf = x = 0.0
        for t in range(n):
            buf = momentum * buf + (t == u)
            x += buf
            out[t, u] = x
    return out


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9, 1.0])
def test_momentum_workload_is_the_momentum_recursion(momentum):
    # streaming_matrix_test.test_momentum_cooldown_integration at a constant learning rate
    n = 12
    a = _momentum_sgd_matrix(n, momentum)
    w = MomentumPrefixSum(momentum)
    np.testing.assert_allclose(_toeplitz(w.coefs(n), n), a, rtol=1e-13)
    blt = BufferedToeplitz((0.9, 0.5), (0.2, 0.1))
    want = _dense_error(blt.materialize(n), a)
    np.testing.assert_allclose(per_query_error(blt, n, w), want, rtol=1e-10)
