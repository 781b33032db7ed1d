"""Renyi-DP of subsampled pure-DP mechanisms (PureDP, randomized response, and the cap
every mechanism with a pure epsilon gets), against independent references: the exact
Renyi divergences of the subsampled randomized-response pair in 60-digit arithmetic,
brute-force divergences of random valid instances, the exact privacy profile of a
composition of subsampled randomized response, and autodp's Zhu-Wang / Wang-Balle-
Kasiviswanathan bounds (which ours must never exceed)."""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import special

from privlearn.accounting import (
    Laplace,
    PureDP,
    RandomizedResponse,
    RDPMechanism,
    compose,
    subsample,
)

ORDERS = [1.01, 1.5, 2.0, 3.0, 7.5, 32.0, 256.0, 1e4, 1e7]


# ---------------------------------------------------------------------------------------
# references, written from the definitions
# ---------------------------------------------------------------------------------------
def _renyi_mp(p0, p1, alpha) -> mpmath.mpf:
    """D_alpha(P0 || P1) of finite distributions, 60 digits."""
    with mpmath.workdps(60):
        a = mpmath.mpf(alpha)
        s = mpmath.fsum(
            mpmath.mpf(x) ** a * mpmath.mpf(y) ** (1 - a)
            for x, y in zip(p0, p1, strict=True)
            if x > 0
        )
        return mpmath.log(s) / (a - 1)


def _rr_rows(p, k):
    """The two output distributions of k-ary randomized response (truth p), 60 digits."""
    with mpmath.workdps(60):
        p = mpmath.mpf(p)
        r = (1 - p) / (k - 1)
        return [p, r] + [r] * (k - 2), [r, p] + [r] * (k - 2)


def _poisson_exact(rows, q, alpha) -> float:
    """max of both directions between P and (1 - q) P + q Q, 60 digits."""
    P, Q = rows
    with mpmath.workdps(60):
        q = mpmath.mpf(q)
        M = [(1 - q) * x + q * y for x, y in zip(P, Q, strict=True)]
        return float(max(_renyi_mp(M, P, alpha), _renyi_mp(P, M, alpha)))


def _pure_rows(eps):
    with mpmath.workdps(60):
        e = mpmath.exp(mpmath.mpf(eps))
        return [e / (1 + e), 1 / (1 + e)], [1 / (1 + e), e / (1 + e)]


def _renyi(p0, p1, a):
    """D_a(P0 || P1) of float distributions, summed in 60-digit arithmetic (a float sum
    near 1 would lose the relative precision of a small divergence)."""
    return float(_renyi_mp([float(x) for x in p0], [float(y) for y in p1], a))


def _exact_eps_composed_rr(eps, q, steps, delta):
    """Exact epsilon(delta) of `steps` compositions of Poisson-subsampled binary randomized
    response (the worst case of every eps-DP mechanism): the privacy loss of each
    direction is a function of the binomial count of one outcome."""
    e = math.exp(eps)
    P = np.array([e / (1 + e), 1 / (1 + e)])
    M = (1 - q) * P + q * P[::-1]
    n = np.arange(steps + 1)
    logc = special.gammaln(steps + 1) - special.gammaln(n + 1) - special.gammaln(steps - n + 1)

    def delta_of(x, y, eps_):
        lx = logc + n * math.log(x[1]) + (steps - n) * math.log(x[0])
        ly = logc + n * math.log(y[1]) + (steps - n) * math.log(y[0])
        return float(np.sum(np.maximum(np.exp(lx) - np.exp(eps_ + ly), 0.0)))

    def dmax(eps_):
        return max(delta_of(M, P, eps_), delta_of(P, M, eps_))

    lo, hi = 0.0, steps * eps + 1.0
    if dmax(0.0) <= delta:
        return 0.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if dmax(mid) <= delta else (mid, hi)
    return lo


# ---------------------------------------------------------------------------------------
# Poisson sampling: the exact divergences
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("eps", [1e-6, 0.1, 1.0, 5.0, 40.0])
@pytest.mark.parametrize("q", [1e-9, 1e-3, 0.1, 0.5, 0.99])
def test_poisson_pure_dp_is_the_exact_subsampled_randomized_response(eps, q):
    got = subsample(PureDP(eps), q).rdp(ORDERS)
    ref = np.array([_poisson_exact(_pure_rows(eps), q, a) for a in ORDERS])
    # a valid upper bound (>= the divergence of a pair it must cover) and tight
    assert np.all(got >= ref), (got, ref)
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=0)


@pytest.mark.parametrize(("p", "k"), [(0.6, 2), (0.75, 2), (0.9, 2), (0.5, 3), (0.9, 5)])
@pytest.mark.parametrize("q", [1e-4, 0.01, 0.3])
def test_poisson_randomized_response_is_exact(p, k, q):
    got = subsample(RandomizedResponse(p, k), q).rdp(ORDERS)
    ref = np.array([_poisson_exact(_rr_rows(p, k), q, a) for a in ORDERS])
    assert np.all(got >= ref), (got, ref)
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=0)


def test_any_pure_base_gets_the_randomized_response_cap():
    # a Laplace base and a user curve with a declared pure epsilon are covered by the
    # subsampled randomized response with the same epsilon (and never exceed it)
    orders = [2.0, 8.0, 64.0, 1e3]
    for b, q in [(0.5, 0.01), (1.0, 0.1), (2.0, 0.5)]:
        cap = subsample(PureDP(1.0 / b), q).rdp(orders)
        assert np.all(subsample(Laplace(b), q).rdp(orders) <= cap)
    user = RDPMechanism(lambda a: 10.0, name="loose", pure_epsilon=0.5)
    got = subsample(user, 0.01).rdp(orders)
    np.testing.assert_array_equal(got, subsample(PureDP(0.5), 0.01).rdp(orders))


@settings(max_examples=60, deadline=None)
@given(
    eps=st.floats(0.01, 8.0),
    q=st.floats(1e-4, 0.99),
    alpha=st.floats(1.01, 500.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_poisson_bound_dominates_random_pure_dp_pairs(eps, q, alpha, seed):
    """Any eps-DP pair (A, B) -- here binary randomized response post-processed by a
    random channel -- subsampled, in both directions, is below the bound."""
    rng = np.random.default_rng(seed)
    e = math.exp(eps)
    kernel = rng.dirichlet(np.full(rng.integers(2, 6), 0.5), size=2)  # 2 -> n outcomes
    a_dist = np.array([e, 1.0]) / (1 + e) @ kernel
    b_dist = np.array([1.0, e]) / (1 + e) @ kernel
    mix = (1 - q) * a_dist + q * b_dist
    truth = max(_renyi(mix, a_dist, alpha), _renyi(a_dist, mix, alpha))
    assert subsample(PureDP(eps), q).rdp(alpha) >= truth * (1 - 1e-9) - 1e-15


@settings(max_examples=25, deadline=None)
@given(
    eps=st.sampled_from([0.1, 0.5, 1.0, 2.0]),
    q=st.sampled_from([0.001, 0.01, 0.1, 0.5]),
    steps=st.integers(1, 400),
    delta=st.sampled_from([1e-3, 1e-5, 1e-8]),
)
def test_rdp_epsilon_is_above_the_exact_epsilon_of_the_composition(eps, q, steps, delta):
    m = compose(subsample(PureDP(eps), q), steps)
    got = m.epsilon(delta, accountant="rdp")
    assert got >= _exact_eps_composed_rr(eps, q, steps, delta) - 1e-9


@settings(max_examples=40, deadline=None)
@given(
    eps=st.floats(0.01, 5.0),
    q1=st.floats(1e-5, 1.0),
    q2=st.floats(1e-5, 1.0),
    scheme=st.sampled_from(["poisson", "fixed"]),
)
def test_monotone_in_rate(eps, q1, q2, scheme):
    lo, hi = sorted((q1, q2))
    orders = [1.5, 2.0, 5.0, 40.0, 1e4]
    a = subsample(PureDP(eps), lo, scheme=scheme).rdp(orders)
    b = subsample(PureDP(eps), hi, scheme=scheme).rdp(orders)
    assert np.all(a <= b * (1 + 1e-12))


@settings(max_examples=10, deadline=None)
@given(
    p=st.sampled_from([0.6, 0.75, 0.9]),
    q=st.sampled_from([0.001, 0.01, 0.1]),
    s1=st.integers(1, 20000),
    s2=st.integers(1, 20000),
)
def test_monotone_in_steps(p, q, s1, s2):
    lo, hi = sorted((s1, s2))
    base = subsample(RandomizedResponse(p, 2), q)
    assert compose(base, lo).epsilon(1e-5, accountant="rdp") <= compose(base, hi).epsilon(
        1e-5, accountant="rdp"
    )


# ---------------------------------------------------------------------------------------
# fixed-size sampling without replacement, replace-one
# ---------------------------------------------------------------------------------------
def _vertex_triples(eps, exact=False):
    """Explicit triples (A, B, B') of pairwise eps-close distributions: 3-ary randomized
    response, its complement, and the two-point cases A = B' and A = B (60-digit
    entries with ``exact``, else floats)."""
    with mpmath.workdps(60):
        c = mpmath.exp(mpmath.mpf(eps))
        rr3 = [[c / (c + 2) if i == j else 1 / (c + 2) for i in range(3)] for j in range(3)]
        anti = [
            [1 / (2 * c + 1) if i == j else c / (2 * c + 1) for i in range(3)] for j in range(3)
        ]
        two, owt = [c / (1 + c), 1 / (1 + c)], [1 / (1 + c), c / (1 + c)]
        out = [rr3, anti, [two, owt, two], [two, two, owt]]
    if exact:
        return out
    return [[np.array([float(x) for x in row]) for row in t] for t in out]


def _fixed_truth(triple, q, alpha):
    """Both directions between (1-q) A + q B and (1-q) A + q B', 60 digits."""
    with mpmath.workdps(60):
        q = mpmath.mpf(q)
        a, b, b2 = ([mpmath.mpf(x) for x in row] for row in triple)
        x0 = [(1 - q) * u + q * v for u, v in zip(a, b, strict=True)]
        x1 = [(1 - q) * u + q * v for u, v in zip(a, b2, strict=True)]
        return float(max(_renyi_mp(x0, x1, alpha), _renyi_mp(x1, x0, alpha)))


@pytest.mark.parametrize("eps", [0.1, 1.0, 3.0])
@pytest.mark.parametrize("q", [0.001, 0.05, 0.5])
def test_fixed_size_pure_dp_is_attained(eps, q):
    orders = [1.5, 2.0, 3.0, 8.0, 32.0, 200.0]
    got = subsample(PureDP(eps), q, scheme="fixed").rdp(orders)
    best = np.array(
        [max(_fixed_truth(t, q, a) for t in _vertex_triples(eps, exact=True)) for a in orders]
    )
    assert np.all(got >= best * (1 - 1e-12))
    # the bound is attained by one of these mechanisms (before: Wang-Balle-Kasiviswanathan
    # Theorem 9, up to ~3x above)
    np.testing.assert_allclose(got, best, rtol=1e-8)


@settings(max_examples=60, deadline=None)
@given(
    eps=st.floats(0.01, 6.0),
    q=st.floats(1e-3, 0.99),
    alpha=st.floats(1.01, 300.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_fixed_bound_dominates_random_triples(eps, q, alpha, seed):
    """Random valid triples: a random mixture (on disjoint outcomes) of the vertex triples
    and of a smooth triple, post-processed by a random channel -- pairwise eps-closeness
    survives both operations."""
    rng = np.random.default_rng(seed)
    parts = _vertex_triples(eps)
    ell = rng.uniform(-eps / 2, eps / 2, size=(3, 4))
    smooth = np.exp(ell) / np.exp(ell).sum(axis=1, keepdims=True)
    parts.append(tuple(smooth))
    w = rng.dirichlet(np.ones(len(parts)))
    triple = [np.concatenate([wi * t[j] for wi, t in zip(w, parts, strict=True)]) for j in range(3)]
    kernel = rng.dirichlet(np.full(rng.integers(2, 7), 0.3), size=triple[0].size)
    triple = [x @ kernel for x in triple]
    truth = _fixed_truth(triple, q, alpha)
    # (float masses summing to 1 within ~1e-16: the reference is good to ~1e-16 absolute)
    got = subsample(PureDP(eps), q, scheme="fixed").rdp(alpha)
    assert got >= truth * (1 - 1e-9) - 1e-15


# ---------------------------------------------------------------------------------------
# autodp: ours is never looser
# ---------------------------------------------------------------------------------------
def _autodp_rdp(base, q, poisson, improved, orders):
    tz = pytest.importorskip("autodp.transformer_zoo")
    if not poisson:
        base.neighboring = "replace_one"
    m = tz.AmplificationBySampling(PoissonSampling=poisson)(base, q, improved_bound_flag=improved)
    return np.array([m.RenyiDP(a) for a in orders])


def _check_not_looser_than_autodp(kind, value, q):
    mz = pytest.importorskip("autodp.mechanism_zoo")
    orders = [2, 3, 5, 10, 32]
    if kind == "pure":
        ours, theirs = PureDP(value), lambda: mz.PureDP_Mechanism(eps=value)
    else:
        ours, theirs = RandomizedResponse(value, 2), lambda: mz.RandresponseMechanism(p=value)
    got = subsample(ours, q).rdp(orders)
    for improved in (False, True):  # Zhu & Wang's general and tight bounds
        ref = _autodp_rdp(theirs(), q, True, improved, orders)
        assert np.all(got <= ref * (1 + 1e-7)), (ours, q, improved, got, ref)
    got = subsample(ours, q, scheme="fixed").rdp(orders)
    ref = _autodp_rdp(theirs(), q, False, False, orders)  # WBK Theorem 9
    assert np.all(got <= ref * (1 + 1e-7)), (ours, q, "fixed", got, ref)


@pytest.mark.parametrize(
    ("kind", "value", "q"), [("pure", 1.0, 0.001), ("pure", 0.1, 0.1), ("rr", 0.75, 0.01)]
)
def test_never_looser_than_autodp(kind, value, q):
    _check_not_looser_than_autodp(kind, value, q)


@pytest.mark.slow
@pytest.mark.parametrize("q", [0.001, 0.01, 0.1, 0.5])
@pytest.mark.parametrize(
    ("kind", "value"),
    [("pure", e) for e in [0.1, 0.5, 1, 2]] + [("rr", p) for p in [0.6, 0.75, 0.9]],
)
def test_never_looser_than_autodp_grid(kind, value, q):
    _check_not_looser_than_autodp(kind, value, q)


# ---------------------------------------------------------------------------------------
# numerical edges
# ---------------------------------------------------------------------------------------
def test_rate_one_is_the_base_curve():
    from privlearn.accounting._rdp_math import _rr_rdp
    from privlearn.accounting._rdp_pure_subsampled import (
        fixed_pure_dp_rdp,
        poisson_pure_dp_rdp,
    )

    a = np.array(ORDERS)
    for eps in [0.01, 1.0, 20.0]:
        np.testing.assert_array_equal(subsample(PureDP(eps), 1.0).rdp(a), PureDP(eps).rdp(a))
        # the formulas themselves reduce to randomized response at q = 1
        np.testing.assert_allclose(poisson_pure_dp_rdp(eps, 1.0, a), _rr_rdp(eps, a), rtol=1e-10)
        np.testing.assert_allclose(fixed_pure_dp_rdp(eps, 1.0, a), _rr_rdp(eps, a), rtol=1e-10)


def test_extreme_inputs_never_optimistic():
    from privlearn.accounting._rdp_pure_subsampled import (
        fixed_pure_dp_rdp,
        poisson_pure_dp_rdp,
    )

    a = np.array([1.0001, 2.0, 1e5, 1e9, 1e15])
    for eps, q in [(1e-8, 1e-12), (0.5, 1e-15), (30.0, 1e-6), (600.0, 0.3)]:
        got = subsample(PureDP(eps), q).rdp(a)
        assert np.all(np.isfinite(got) & (got > 0))
        for alpha, g in zip(a[:3], got[:3], strict=True):
            assert g >= _poisson_exact(_pure_rows(eps), q, alpha)
    # beyond the float range of e^eps, or an underflowing excess: no claim (inf), never
    # 0 or nan; the caller's other bounds (here: eps itself) then apply
    assert np.all(np.isposinf(poisson_pure_dp_rdp(800.0, 0.1, a)))
    assert np.all(np.isposinf(fixed_pure_dp_rdp(800.0, 0.1, a)))
    tiny = poisson_pure_dp_rdp(1e-100, 1e-100, np.array([2.0]))
    assert not np.any(np.isnan(tiny)) and np.all(tiny > 0)
    big = subsample(PureDP(800.0), 0.1).rdp([2.0, 1e6])
    assert np.all(np.isfinite(big) & (big > 0) & (big <= PureDP(800.0).rdp([2.0, 1e6])))


def _eps_of_pair(x0, x1, delta):
    """Exact epsilon(delta) of one release of the pair (x0, x1), both directions."""

    def dmax(e):
        return max(
            float(np.sum(np.maximum(x0 - math.exp(e) * x1, 0.0))),
            float(np.sum(np.maximum(x1 - math.exp(e) * x0, 0.0))),
        )

    lo, hi = 0.0, 50.0
    if dmax(0.0) <= delta:
        return 0.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if dmax(mid) <= delta else (mid, hi)
    return lo


@pytest.mark.parametrize(
    ("eps", "q", "delta"),
    [(0.1, 0.5, 1e-3), (0.5, 0.01, 1e-5), (2.0, 0.1, 1e-5), (2.0, 0.001, 1e-3)],
)
def test_fixed_size_one_step_epsilon_is_above_every_instance(eps, q, delta):
    """One fixed-size step: the RDP-derived epsilon is at least the exact epsilon(delta)
    of each explicit instance (A, B, B'), which the subsampled mechanism can be."""
    got = subsample(PureDP(eps), q, scheme="fixed").epsilon(delta, accountant="rdp")
    for a, b, b2 in _vertex_triples(eps):
        x0, x1 = (1 - q) * a + q * b, (1 - q) * a + q * b2
        assert got >= _eps_of_pair(x0, x1, delta) - 1e-12
