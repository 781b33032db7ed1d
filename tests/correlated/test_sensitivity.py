"""Sensitivity against brute force over every participation pattern (small n)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from privlearn.correlated import (
    BandedToeplitz,
    BufferedToeplitz,
    FixedEpochs,
    Identity,
    MinSeparation,
    SingleParticipation,
    sensitivity,
)
from privlearn.correlated._toeplitz import materialize
from privlearn.correlated.sensitivity import gram_sensitivity_upper_bound, vector_sensitivity


def _patterns(n: int, sep: int, k: int):
    """Every non-empty index set of at most k indices pairwise >= sep apart."""
    for size in range(1, k + 1):
        for combo in itertools.combinations(range(n), size):
            if all(b - a >= sep for a, b in zip(combo, combo[1:], strict=False)):
                yield list(combo)


def _brute_force(c_matrix: np.ndarray, patterns) -> tuple[float, float]:
    """(lower, upper) on sens^2 from the definition: ``max_pi max_{s in {+-1}^pi} s^T
    X_pi s`` is attained by collinear contributions (a lower bound, exact when X >= 0), and
    ``sum |X_pi|`` bounds every choice of unit contributions."""
    x = c_matrix.T @ c_matrix
    lo = hi = 0.0
    for pi in patterns:
        sub = x[np.ix_(pi, pi)]
        hi = max(hi, float(np.abs(sub).sum()))
        for signs in itertools.product((1.0, -1.0), repeat=len(pi) - 1):
            s = np.array((1.0, *signs))
            lo = max(lo, float(s @ sub @ s))
    return lo, hi


nonincreasing = st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6).map(
    lambda xs: tuple(sorted(xs, reverse=True))
).filter(lambda c: c[0] > 0.05)


@settings(max_examples=40)
@given(coefs=nonincreasing, n=st.integers(4, 9), sep=st.integers(1, 4), k=st.integers(1, 4))
def test_nonincreasing_toeplitz_equals_brute_force(coefs, n, sep, k):
    C = BandedToeplitz(coefs)
    s = sensitivity(C, MinSeparation(sep, k), n)
    lo, hi = _brute_force(C.materialize(n), _patterns(n, sep, k))
    assert s.exact
    assert hi == pytest.approx(lo, rel=1e-12)  # C >= 0: collinear contributions are worst
    assert s.value**2 == pytest.approx(lo, rel=1e-12)
    assert s.value**2 >= lo * (1 - 1e-14)  # up to the float error of the brute force


@settings(max_examples=40)
@given(
    coefs=st.lists(st.floats(-1.0, 1.0), min_size=1, max_size=4).filter(lambda c: c[0] > 0.1),
    n=st.integers(4, 9),
    extra=st.integers(0, 2),
    k=st.integers(1, 4),
)
def test_banded_signed_equals_brute_force(coefs, n, extra, k):
    # b <= min_sep: exact for any signs (the columns of two participations are orthogonal)
    C = BandedToeplitz(tuple(coefs))
    sep = C.bands + extra
    s = sensitivity(C, MinSeparation(sep, k), n)
    lo, hi = _brute_force(C.materialize(n), _patterns(n, sep, k))
    assert s.exact and hi == pytest.approx(lo, rel=1e-12)
    assert s.value**2 == pytest.approx(lo, rel=1e-12) and s.value**2 >= lo * (1 - 1e-14)


@settings(max_examples=40)
@given(
    coefs=st.lists(st.floats(-1.0, 1.0), min_size=2, max_size=6).filter(lambda c: c[0] > 0.1),
    n=st.integers(4, 9),
    sep=st.integers(1, 3),
    k=st.integers(2, 4),
)
def test_signed_upper_bound_is_valid(coefs, n, sep, k):
    C = BandedToeplitz(tuple(coefs))
    s = sensitivity(C, MinSeparation(sep, k), n)
    lo, _ = _brute_force(C.materialize(n), _patterns(n, sep, k))
    assert s.value**2 >= lo * (1 - 1e-12)  # never below an attained value


@settings(max_examples=30)
@given(coefs=st.lists(st.floats(-1.0, 1.0), min_size=1, max_size=6).filter(
    lambda c: c[0] > 0.1), per_epoch=st.integers(1, 4), epochs=st.integers(1, 3))
def test_fixed_epochs_against_its_patterns(coefs, per_epoch, epochs):
    n = per_epoch * epochs
    C = BandedToeplitz(tuple(coefs))
    s = sensitivity(C, FixedEpochs(epochs), n)
    patterns = [list(range(j, n, per_epoch)) for j in range(per_epoch)]
    lo, hi = _brute_force(C.materialize(n), patterns)
    assert lo * (1 - 1e-12) <= s.value**2 <= hi * (1 + 1e-9)
    if all(c >= 0 for c in coefs):
        assert s.exact and s.value**2 == pytest.approx(lo, rel=1e-12)


def test_identity_is_sqrt_participations():
    for n, sep, k in [(10, 1, None), (10, 3, None), (100, 7, 5)]:
        s = sensitivity(Identity(), MinSeparation(sep, k), n)
        want = math.sqrt(MinSeparation(sep, k).participations(n))
        assert s.exact and want <= s.value <= want * (1 + 1e-12)
    assert sensitivity(Identity(), SingleParticipation(), 50).value == pytest.approx(1.0)


def test_blt_closed_form_limit():
    C = BufferedToeplitz((0.99, 0.7), (0.05, 0.2))
    s = sensitivity(C, SingleParticipation(), 5000).value
    assert s == pytest.approx(C.limit_max_column_norm(), rel=1e-9)
    # finite n: at most the limit, up to the certified rounding (~ n * 2^-52)
    assert s <= C.limit_max_column_norm() * (1 + 1e-11)


def test_vector_sensitivity_matches_enumeration():
    rng = np.random.default_rng(3)
    for _ in range(20):
        x = rng.normal(size=rng.integers(3, 10))
        sep, k = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        best = max([0.0] + [x[p].sum() for p in _patterns(x.size, sep, k)])
        assert vector_sensitivity(x, sep, k) == pytest.approx(best, abs=1e-12)


def test_gram_bound_is_exact_for_banded():
    C = BandedToeplitz((1.0, -0.6, 0.3)).materialize(30)
    sep = 3
    exact = sensitivity(BandedToeplitz((1.0, -0.6, 0.3)), MinSeparation(sep, 4), 30).value
    assert gram_sensitivity_upper_bound(C, sep, 4) == pytest.approx(exact, rel=1e-12)


def test_fixed_epochs_refuses_a_ragged_run():
    with pytest.raises(ValueError, match="multiple of epochs=3"):
        sensitivity(Identity(), FixedEpochs(3), 10)


def test_wrong_types_are_named():
    with pytest.raises(TypeError, match="participation must be"):
        sensitivity(Identity(), "min_sep", 10)
    with pytest.raises(ValueError, match="min_sep must be an integer >= 1"):
        MinSeparation(0)
    with pytest.raises(ValueError, match="coefs\\[0\\] must be > 0"):
        BandedToeplitz((0.0, 1.0))
    with pytest.raises(ValueError, match="buf_decay must be in \\[-1, 1\\]"):
        BufferedToeplitz((1.5,), (0.1,))


def test_materialize_matches_definition():
    C = BufferedToeplitz((0.8,), (0.3,))
    m = C.materialize(5)
    for i in range(5):
        for j in range(5):
            want = 0.0 if i < j else (1.0 if i == j else 0.3 * 0.8 ** (i - j - 1))
            assert m[i, j] == pytest.approx(want, rel=1e-15)
    assert np.allclose(materialize([1, 2], 3), [[1, 0, 0], [2, 1, 0], [0, 2, 1]])


@pytest.mark.parametrize("theta,omega", [((0.99, -0.1), (0.01, -0.1)), ((0.5, -0.9), (0.3, 0.2))])
@pytest.mark.parametrize("sep,k", [(1, 3), (2, 3), (3, 2)])
def test_blt_with_a_negative_decay_is_never_below_an_attained_value(theta, omega, sep, k):
    """A negative decay (jax_privacy's BLTs have them) gives signed coefficients: the
    general rule applies, and no participation pattern attains more."""
    C = BufferedToeplitz(theta, omega)
    n = 8
    s = sensitivity(C, MinSeparation(sep, k), n)
    lo, _ = _brute_force(C.materialize(n), _patterns(n, sep, k))
    assert s.value**2 >= lo * (1 - 1e-12)
    single = sensitivity(C, MinSeparation(n), n)
    assert single.exact and single.value == pytest.approx(np.linalg.norm(C.toeplitz_coefs(n)))


class _TooSlow(Exception):
    pass


@pytest.fixture
def time_limit(stopwatch):
    """``with time_limit(s):`` raises :class:`_TooSlow` if the block took more than ``s``
    seconds of work (the ``stopwatch``'s measure: the smaller of wall and CPU time, so a
    loaded machine does not fail it), and stops it (SIGALRM) once it has run ``5 s`` of
    wall time, so a quadratic algorithm fails instead of running for hours: the
    sensitivity of a long run must come in time to calibrate it (tens of evaluations),
    not in quadratic time."""
    import contextlib
    import signal

    @contextlib.contextmanager
    def limit(seconds: float):
        def fire(signum, frame):
            raise _TooSlow(f"still running after {5 * seconds} s of wall time")

        old = signal.signal(signal.SIGALRM, fire)
        signal.setitimer(signal.ITIMER_REAL, 5 * seconds)
        try:
            with stopwatch() as took:
                yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        if took.seconds > seconds:
            raise _TooSlow(f"took {took.seconds:.1f} s, more than {seconds} s")

    return limit


def test_exact_rules_are_linear_in_steps(time_limit):
    n = 1_000_000
    sqrt4 = BandedToeplitz.square_root(4)
    with time_limit(30.0):
        ident = sensitivity(Identity(), MinSeparation(1), n)  # DP-SGD, every step
        banded = sensitivity(sqrt4, MinSeparation(4), n)  # 4 bands, 4 apart
        spaced = sensitivity(sqrt4, MinSeparation(2), n)  # non-increasing, 2 apart
        epochs = sensitivity(sqrt4, FixedEpochs(1000), n)
    assert ident.exact and math.sqrt(n) <= ident.value <= math.sqrt(n) * (1 + 1e-9)
    # every column of a 4-banded C with ||c|| = 1 has norm 1 (n is a multiple of 4)
    assert banded.exact and 500.0 <= banded.value <= 500.0 * (1 + 1e-9)
    # C u for u = e_0 + e_2 + ...: entry t sums c_j over j = t, t-2, ... (the first k)
    c = np.asarray(sqrt4.coefs)
    head = np.array([c[0], c[1], c[0] + c[2], c[1] + c[3]])
    tail = (c[0] + c[2]) ** 2 + (c[1] + c[3]) ** 2
    want = math.sqrt(float(head[:2] @ head[:2]) + tail * (n - 2) / 2)
    assert spaced.exact and spaced.value == pytest.approx(want, rel=1e-9)
    assert spaced.value >= want * (1 - 1e-12)
    # 1000 epochs of 1000 steps, 4 bands: the record's columns are disjoint, each norm 1
    assert epochs.exact and 1000**0.5 <= epochs.value <= 1000**0.5 * (1 + 1e-9)


def test_general_bound_is_fast_for_long_runs(time_limit):
    # a BLT with a negative decay takes the dense rule of [CC23b] Alg. 4 (n <= 8192)
    C = BufferedToeplitz((0.9, -0.3), (0.2, 0.1))
    n, sep = 2048, 4
    with time_limit(20.0):
        s = sensitivity(C, MinSeparation(sep), n)
    assert not s.exact
    # every pattern's contributions, all equal, attain at least the bound's lower end
    u = np.zeros(n)
    u[::sep] = 1.0
    attained = float(np.linalg.norm(C.materialize(n) @ u))
    assert attained <= s.value <= math.sqrt(np.abs(C.materialize(n)).sum(axis=0) @
                                            np.abs(C.materialize(n)).sum(axis=0))


@settings(max_examples=40)
@given(x=st.lists(st.floats(-2.0, 2.0), min_size=1, max_size=10), sep=st.integers(1, 4),
       extra=st.integers(0, 3))
def test_vector_sensitivity_without_a_binding_count(x, sep, extra):
    # as many participations as the separation allows (or more): every pattern counts
    x = np.asarray(x)
    k = -(-x.size // sep) + extra
    best = max([0.0] + [x[p].sum() for p in _patterns(x.size, sep, k)])
    assert vector_sensitivity(x, sep, k) == pytest.approx(best, abs=1e-12)


@settings(max_examples=40)
@given(coefs=nonincreasing, n=st.integers(1, 60), sep=st.integers(1, 12), k=st.integers(1, 30))
def test_spaced_sum_matches_the_shifted_columns(coefs, n, sep, k):
    # C u for the pattern 0, sep, ..., (k-1) sep, summed column by column
    C = BandedToeplitz(coefs)
    u = np.zeros(n)
    u[: sep * k : sep] = 1.0
    want = float(np.linalg.norm(C.materialize(n) @ u))
    s = sensitivity(C, MinSeparation(sep, k), n)
    assert s.exact and want * (1 - 1e-12) <= s.value <= want * (1 + 1e-9)


@settings(max_examples=30)
@given(coefs=st.lists(st.floats(-1.0, 1.0), min_size=1, max_size=4).filter(
    lambda c: c[0] > 0.1), extra=st.integers(0, 2), epochs=st.integers(2, 3))
def test_fixed_epochs_with_at_most_an_epoch_of_bands_is_exact(coefs, extra, epochs):
    # b <= steps per epoch: the columns of one record's steps are orthogonal, whatever
    # the signs, so the sensitivity is the best pattern's column norms (exact)
    C = BandedToeplitz(tuple(coefs))
    per_epoch = C.bands + extra
    n = per_epoch * epochs
    s = sensitivity(C, FixedEpochs(epochs), n)
    lo, hi = _brute_force(C.materialize(n), [list(range(j, n, per_epoch))
                                             for j in range(per_epoch)])
    assert s.exact and hi == pytest.approx(lo, rel=1e-12)
    assert s.value**2 == pytest.approx(lo, rel=1e-12) and s.value**2 >= lo * (1 - 1e-14)


def test_fixed_epochs_of_a_signed_banded_strategy_past_the_dense_size():
    # sqrt(k) ||c|| in closed form (each of the k columns whole): no dense Gram needed,
    # so a long run is neither refused nor only bounded
    from privlearn.correlated.sensitivity import MAX_DENSE_STEPS

    coefs = (1.0, -0.3, 0.1)
    n = 2 * (MAX_DENSE_STEPS // 2 + 1000)
    s = sensitivity(BandedToeplitz(coefs), FixedEpochs(2), n)
    want = math.sqrt(2 * sum(c * c for c in coefs))
    assert s.exact and s.value == pytest.approx(want, rel=1e-14) and s.value >= want


@settings(max_examples=30)
@given(coefs=st.lists(st.floats(-1.0, 1.0), min_size=2, max_size=8).filter(
    lambda c: c[0] > 0.1 and min(c) < 0), per_epoch=st.integers(1, 6),
    epochs=st.integers(2, 4))
def test_signed_fixed_epochs_bound_is_its_definition(coefs, per_epoch, epochs):
    # the bound max_j sum |C^T C| over the pattern j, j + b, ... from the dense product
    n = per_epoch * epochs
    C = BandedToeplitz(tuple(coefs))
    x = np.abs(C.materialize(n).T @ C.materialize(n))
    want = max(x[np.ix_(p, p)].sum() for p in (list(range(j, n, per_epoch))
                                               for j in range(per_epoch)))
    s = sensitivity(C, FixedEpochs(epochs), n)
    assert s.value == pytest.approx(math.sqrt(want), rel=1e-12)
    assert s.value >= math.sqrt(want) * (1 - 1e-14)


@pytest.mark.slow
def test_general_bound_at_its_largest_size(time_limit):
    # the dense rule's largest n: seconds (an O(n^2) Toeplitz Gram, one pass per row)
    from privlearn.correlated.sensitivity import MAX_DENSE_STEPS

    C = BufferedToeplitz((0.9, -0.3), (0.2, 0.1))
    with time_limit(60.0):
        s = sensitivity(C, MinSeparation(4), MAX_DENSE_STEPS)
    small = sensitivity(C, MinSeparation(4), 2048)
    assert not s.exact and s.value > small.value


def test_banded_rules_do_not_grow_with_steps(time_limit):
    # a banded C's columns are known from its b coefficients: no O(n) array, even for
    # 10^12 steps (the amplified accounting of a long run asks for its column norm)
    n = 10**12
    c = np.array([1.0, -0.5, 0.3])
    C = BandedToeplitz(tuple(c))
    with time_limit(10.0):
        one = sensitivity(C, SingleParticipation(), n)
        every = sensitivity(Identity(), MinSeparation(1), n)
        spaced = sensitivity(C, MinSeparation(7, 10**9), n)
        last = sensitivity(C, MinSeparation(3), 10)  # steps 0, 3, 6, 9: the last cut
    norm2 = float(c @ c)
    assert one.exact and math.sqrt(norm2) <= one.value <= math.sqrt(norm2) * (1 + 1e-12)
    assert every.exact and 1e6 <= every.value <= 1e6 * (1 + 1e-12)
    want = math.sqrt(1e9 * norm2)
    assert spaced.exact and want <= spaced.value <= want * (1 + 1e-12)
    want = math.sqrt(3 * norm2 + 1.0)
    assert last.exact and want <= last.value <= want * (1 + 1e-12)


def test_trailing_zero_coefficients_are_no_bands():
    # (1, -0.5, 0, 0) is 2-banded: under MinSeparation(2) its participations' columns are
    # orthogonal, so the exact banded rule applies (not the general upper bound)
    C = BandedToeplitz((1.0, -0.5, 0.0, 0.0))
    n = 7
    s = sensitivity(C, MinSeparation(2), n)
    lo, hi = _brute_force(C.materialize(n), _patterns(n, 2, 4))
    assert s.exact and math.sqrt(lo) <= s.value <= math.sqrt(lo) * (1 + 1e-12)


def _attained(x: np.ndarray, seed: int = 0) -> float:
    """``<X, V V^T>`` for unit rows ``V`` found by block-coordinate ascent (each row set
    to the best unit vector given the others): a value some choice of clipped
    contributions of any dimension attains, so a valid sensitivity is at least it. For
    the PSD ``X = (C^T C)[pi, pi]`` it converges to the semidefinite programme's value
    ``max {<X, G> : G psd, diag(G) <= 1}``, the sensitivity of the pattern itself, which
    the sign vectors of :func:`_brute_force` can miss for signed ``C``."""
    p = x.shape[0]
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((p, p))
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    for _ in range(80):
        for i in range(p):
            g = x[i] @ v - x[i, i] * v[i]
            norm = np.linalg.norm(g)
            if norm > 0:
                v[i] = g / norm
    return float(np.sum(x * (v @ v.T)))


def _maximal(patterns, n: int, sep: int, k: int):
    """The patterns no index can be added to (a sub-pattern attains no more: g_i = 0)."""
    for pi in patterns:
        if len(pi) < k and any(
            all(abs(i - j) >= sep for j in pi) for i in range(n) if i not in pi):
            continue
        yield pi


@pytest.mark.slow  # about 1 s a strategy
@pytest.mark.parametrize("strategy", [
    BandedToeplitz((1.0, -0.7, 0.4)),
    BandedToeplitz((0.5, 1.0, -0.3, 0.8)),
    BufferedToeplitz((0.99, -0.1), (0.01, -0.1)),
    BufferedToeplitz((0.9, -0.6), (-0.5, 0.4)),
], ids=repr)
def test_signed_strategies_against_every_unit_contribution(strategy):
    """Signed coefficients, where the sign vectors are not the worst contributions: each
    returned value is at least what unit contributions of any dimension attain on every
    allowed pattern, and equal to it where it says it is exact (single participation, a
    banded C with at most min_sep or one epoch of bands)."""
    n = 8
    x = strategy.materialize(n).T @ strategy.materialize(n)
    schemas = [SingleParticipation(), MinSeparation(1, 3), MinSeparation(2), MinSeparation(3),
               MinSeparation(4, 2), FixedEpochs(2), FixedEpochs(4)]
    for schema in schemas:
        if isinstance(schema, FixedEpochs):
            per = n // schema.epochs
            patterns = [list(range(j, n, per)) for j in range(per)]
        else:
            sep = n if isinstance(schema, SingleParticipation) else schema.min_sep
            k = schema.participations(n)
            patterns = list(_maximal(_patterns(n, sep, k), n, sep, k))
        attained = max(_attained(x[np.ix_(pi, pi)]) for pi in patterns)
        s = sensitivity(strategy, schema, n)
        assert s.value**2 >= attained * (1 - 1e-12), schema
        if s.exact:
            assert s.value**2 == pytest.approx(attained, rel=1e-9), schema


@settings(max_examples=40)
@given(coefs=st.lists(st.floats(-1.0, 1.0), min_size=1, max_size=6).filter(
    lambda c: c[0] > 0.1), per_epoch=st.integers(1, 4), epochs=st.integers(1, 3),
    cut=st.integers(0, 3))
def test_fixed_epochs_with_a_last_epoch_cut_short_against_its_patterns(
        coefs, per_epoch, epochs, cut):
    # one order of per_epoch batches passed over until n: record j takes part in the
    # steps j + m b < n (brute force over those patterns)
    n = max((epochs - 1) * per_epoch + 1, epochs * per_epoch - cut)
    C = BandedToeplitz(tuple(coefs))
    s = sensitivity(C, FixedEpochs(epochs, epoch_length=per_epoch), n)
    patterns = [list(range(j, n, per_epoch)) for j in range(min(per_epoch, n))]
    lo, hi = _brute_force(C.materialize(n), patterns)
    assert lo * (1 - 1e-12) <= s.value**2 <= hi * (1 + 1e-9)
    if all(c >= 0 for c in coefs) or len(coefs) <= per_epoch:
        assert s.exact and s.value**2 == pytest.approx(lo, rel=1e-12)


def test_fixed_epochs_with_an_epoch_length_refuses_steps_outside_its_last_epoch():
    with pytest.raises(ValueError, match=r"steps must be in \(6, 9\]"):
        sensitivity(Identity(), FixedEpochs(3, epoch_length=3), 10)
    with pytest.raises(ValueError, match="epoch_length=4"):  # the message's suggestion
        sensitivity(Identity(), FixedEpochs(3), 10)
    assert sensitivity(Identity(), FixedEpochs(3, epoch_length=4), 10).value ** 2 == (
        pytest.approx(3.0))


def test_one_order_is_accounted_no_higher_mid_epoch_than_at_its_end():
    """The fixed order of shuffled_epochs stopped within a pass releases a prefix of the
    whole passes' rows: its sensitivity is never above theirs. Accounted as b-min-
    separation mid-epoch, this signed strategy's bound at 5 steps (1.69) was above its
    exact two-epoch value at 6 (1.64), so the epsilon fell at the epoch's end."""
    from privlearn.correlated.sampling import SAMPLINGS

    law, cycle = SAMPLINGS["shuffled_epochs"], 3
    C = BandedToeplitz((1.0, -0.1, -0.4, -0.1, 0.3))
    values = [sensitivity(C, law.describe(60, 1 / cycle, n, cycle), n).value
              for n in range(1, 3 * cycle + 1)]
    assert all(a <= b for a, b in zip(values, values[1:], strict=False)), values
