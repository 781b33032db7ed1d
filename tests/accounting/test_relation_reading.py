"""Every part of a composition is read under one neighbouring relation, by one function
(:func:`privlearn.accounting.registry.read_relation`) that every entry point goes through:
a part that is not subsampled states add/remove, so next to a replace-one part (fixed-size
sampling) it is read under replace-one, and :func:`as_replace_one` states its readings
explicitly, so that reading twice changes nothing."""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest
from scipy.stats import norm

from privlearn.accounting import (
    ApproxDP,
    Gaussian,
    Laplace,
    Neighbouring,
    PureDP,
    RandomizedResponse,
    RDPMechanism,
    as_replace_one,
    closed_form,
    compose,
    get_accountant,
    subsample,
)
from privlearn.accounting.fdp import gaussian_tradeoff, tradeoff_curve
from privlearn.accounting.registry import read_relation, stated_relations
from privlearn.accounting.serialization import dumps, loads
from privlearn.correlated.accounting import stated_under
from privlearn.errors import UnsupportedMechanismError

RO = Neighbouring.REPLACE_ONE


def _gdp_delta(mu: float, eps: float) -> float:
    """Exact delta(eps) of mu-GDP (Dong, Roth & Su 2022, Corollary 2.13)."""
    return float(norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2))


def _gdp_epsilon(mu: float, delta: float) -> float:
    lo, hi = 0.0, 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _gdp_delta(mu, mid) > delta else (lo, mid)
    return hi


# a bare Gaussian (add/remove: sensitivity C) next to a fixed-size part at rate 1
# (replace-one: the base at sensitivity 2 C). Under replace-one the bare part also moves
# by 2 C: mu = sqrt((2/2)^2 + (2/3)^2); read under add/remove it was sqrt((1/2)^2 + (2/3)^2)
MIXED_GAUSSIANS = compose([Gaussian(2.0), subsample(Gaussian(3.0), 1.0, scheme="fixed")])
MU_REPLACE_ONE = math.hypot(2 / 2.0, 2 / 3.0)


@pytest.mark.parametrize("accountant", ["pld", "analytic"])
def test_bare_gaussian_next_to_a_fixed_size_part_costs_its_replace_one_price(accountant):
    delta = 1e-6
    exact = _gdp_epsilon(MU_REPLACE_ONE, delta)
    got = MIXED_GAUSSIANS.epsilon(delta, accountant)
    assert got >= exact * (1 - 1e-9)
    assert got <= exact * (1 + 1e-6)
    assert MIXED_GAUSSIANS.delta(1.0, accountant) >= _gdp_delta(MU_REPLACE_ONE, 1.0) * (1 - 1e-9)


@pytest.mark.parametrize("accountant", ["pld", "rdp", "analytic"])
def test_direct_accountant_calls_read_the_relation_as_the_mechanism_does(accountant):
    acc = get_accountant(accountant)
    delta = 1e-6
    # the same release stated under one relation: two Gaussians at sensitivity 2 C
    explicit = compose([Gaussian(1.0), Gaussian(1.5)])
    assert acc.epsilon(MIXED_GAUSSIANS, delta).upper == pytest.approx(
        acc.epsilon(explicit, delta).upper, rel=1e-9
    )
    assert acc.delta(MIXED_GAUSSIANS, 1.0).upper == pytest.approx(
        acc.delta(explicit, 1.0).upper, rel=1e-9
    )
    assert acc.epsilon(MIXED_GAUSSIANS, delta).upper == MIXED_GAUSSIANS.epsilon(delta, accountant)


def test_direct_pld_call_on_a_poisson_and_fixed_size_composition_reads_it():
    mixed = compose(
        [subsample(Gaussian(1.0), 0.01), subsample(Gaussian(100.0), 0.001, scheme="fixed")],
        steps=[100, 1],
    )
    acc = get_accountant("pld")
    assert acc.epsilon(mixed, 1e-5).upper == mixed.epsilon(1e-5)
    assert acc.epsilon(mixed, 1e-5).upper == acc.epsilon(as_replace_one(mixed), 1e-5).upper
    assert acc.delta(mixed, 0.8).upper == mixed.delta(0.8)


def test_rdp_of_a_mixed_composition_is_the_replace_one_curve():
    # Gaussian RDP at sensitivity 2: alpha * 2^2 / (2 s^2) (Mironov 2017, Proposition 7)
    alphas = np.array([2.0, 8.0, 32.0])
    expected = alphas * 2 / 2.0**2 + alphas * 2 / 3.0**2
    np.testing.assert_allclose(MIXED_GAUSSIANS.rdp(alphas), expected, rtol=1e-12)
    np.testing.assert_allclose(
        get_accountant("rdp").rdp(MIXED_GAUSSIANS, alphas), expected, rtol=1e-12
    )


def test_tradeoff_curve_of_a_mixed_composition_is_the_replace_one_curve():
    alphas = np.linspace(0.0, 1.0, 11)
    np.testing.assert_allclose(
        tradeoff_curve(MIXED_GAUSSIANS, alphas),
        gaussian_tradeoff(MU_REPLACE_ONE, alphas),
        atol=1e-12,
    )


def _rr_pair(eps: float) -> tuple[np.ndarray, np.ndarray]:
    p = math.exp(eps) / (1 + math.exp(eps))
    return np.array([p, 1 - p]), np.array([1 - p, p])


def _brute_force_delta(epsilons: list[float], eps: float) -> float:
    """delta(eps) of the composition of eps_i-DP worst-case pairs, outcome by outcome
    (Kairouz, Oh & Viswanath 2015, Theorem 2.1: randomized response dominates)."""
    pairs = [_rr_pair(e) for e in epsilons]
    total = 0.0
    for outcome in itertools.product(range(2), repeat=len(pairs)):
        p = math.prod(pr[0][o] for pr, o in zip(pairs, outcome, strict=True))
        q = math.prod(pr[1][o] for pr, o in zip(pairs, outcome, strict=True))
        total += max(0.0, p - math.exp(eps) * q)
    return total


def test_bare_pure_dp_next_to_a_fixed_size_part_matches_brute_force():
    # PureDP(0.5) states add/remove: 1.0 under replace-one (group privacy of 2); the
    # fixed-size part at rate 1 states its 0.4 under replace-one
    mixed = compose([PureDP(0.5), subsample(PureDP(0.4), 1.0, scheme="fixed")], steps=[3, 1])
    for eps in (0.5, 1.5, 2.5):
        exact = _brute_force_delta([1.0, 1.0, 1.0, 0.4], eps)
        got = mixed.delta(eps)
        assert got >= exact * (1 - 1e-9)
        assert closed_form.delta_bounds(mixed, eps)[1] >= exact * (1 - 1e-9)
        assert got <= exact * (1 + 1e-6) + 1e-15


def test_poisson_and_bare_parts_next_to_a_fixed_size_part_match_dp_accounting():
    dpa = pytest.importorskip("dp_accounting")
    from dp_accounting.pld import pld_privacy_accountant

    sigma_bare, sigma, q, steps, delta = 4.0, 1.0, 0.01, 100, 1e-5
    mixed = compose(
        [
            Gaussian(sigma_bare),
            subsample(Gaussian(sigma), q),
            subsample(Gaussian(100.0), 0.001, scheme="fixed"),
        ],
        steps=[1, steps, 1],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc = pld_privacy_accountant.PLDAccountant(
            neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE,
            value_discretization_interval=1e-3,
        )
        acc.compose(dpa.GaussianDpEvent(sigma_bare))
        acc.compose(
            dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)
        )
        reference = acc.get_epsilon(delta)
    # the fixed-size part is nearly free: the total is the reference, a little above
    got = mixed.epsilon(delta)
    assert reference * (1 - 1e-3) <= got <= reference * 1.02


@pytest.mark.parametrize(
    "m",
    [
        Gaussian(1.3),
        Laplace(2.0),
        PureDP(0.7),
        RandomizedResponse(0.8, 3),
        subsample(Gaussian(1.0), 0.01),
        subsample(PureDP(1.0), 0.05, scheme="fixed", neighbouring="add_remove"),
        compose(
            [
                Gaussian(2.0),
                subsample(Laplace(3.0), 0.1),
                subsample(Gaussian(1.0), 0.2, scheme="fixed"),
            ]
        ),
    ],
)
def test_as_replace_one_states_replace_one_and_is_idempotent(m):
    r = as_replace_one(m)
    assert stated_relations(r) == {RO}
    assert as_replace_one(r) == r
    assert read_relation(r) == r
    assert loads(dumps(r)) == r
    assert stated_under(m, RO) == r


@pytest.mark.parametrize(
    ("bare", "doubled"),
    [
        (Gaussian(1.3), Gaussian(0.65)),
        (Laplace(2.0), Laplace(1.0)),
        (PureDP(0.7), PureDP(1.4)),
    ],
)
@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_replace_one_reading_of_a_bare_part_costs_the_part_at_twice_its_sensitivity(
    bare, doubled, accountant
):
    # (group privacy of 2, exact for these kinds: the pair at twice the shift / epsilon)
    for steps in (1, 5):
        r, d = compose(as_replace_one(bare), steps), compose(doubled, steps)
        assert r.epsilon_bounds(1e-6, accountant) == d.epsilon_bounds(1e-6, accountant)
        assert r.delta_bounds(0.5, accountant) == d.delta_bounds(0.5, accountant)


def _approx_dp_and_gaussian_delta(e: float, d: float, mu: float, eps: float) -> float:
    """Exact delta(eps) of the (e, d) four-outcome pair (Kairouz, Oh & Viswanath 2015,
    Theorem 2.1) composed with mu-GDP: sum over the pair's outcomes i of
    ``p_i * delta_G(eps - loss_i)`` (the hockey-stick of a product pair), the outcome of
    loss +inf contributing its whole mass ``d``."""
    w = (1 - d) / (1 + math.exp(e))
    return d + w * math.exp(e) * _gdp_delta(mu, eps - e) + w * _gdp_delta(mu, eps + e)


def test_approx_dp_part_next_to_a_fixed_size_part_is_read_by_group_privacy():
    # ApproxDP(1, 1e-6) states add/remove; a replacement is two add/remove steps, so it
    # is (2, (1 + e) 1e-6)-DP under replace-one (group privacy of 2); the fixed-size
    # Gaussian(3) at rate 1 is mu = 2/3 GDP under replace-one. Before the ApproxDP kind had
    # a replace-one reading this composition was refused.
    e, d = 1.0, 1e-6
    mixed = compose([ApproxDP(e, d), subsample(Gaussian(3.0), 1.0, scheme="fixed")])
    base = as_replace_one(ApproxDP(e, d)).base
    assert base.dp_epsilon == 2 * e
    group_delta = (1 + math.exp(e)) * d
    assert group_delta <= base.dp_delta <= group_delta * (1 + 1e-12)
    for eps in (0.5, 2.5, 4.0):
        exact = _approx_dp_and_gaussian_delta(2 * e, group_delta, 2 / 3, eps)
        b = mixed.delta_bounds(eps, "pld")
        assert exact <= b.upper <= exact * (1 + 1e-2) + 1e-12
        assert get_accountant("pld").delta(mixed, eps).upper >= exact
    # the certified epsilon: at least the stated reading's exact one, at most basic
    # composition of (2, (1 + e) 1e-6) with the Gaussian's exact epsilon at the rest
    target = 1e-5
    got = mixed.epsilon(target)
    assert _approx_dp_and_gaussian_delta(2 * e, group_delta, 2 / 3, got) <= target
    basic = 2 * e + _gdp_epsilon(2 / 3, target - group_delta * (1 + 1e-12))
    assert got <= basic
    # and never below what the Gaussian part alone costs under replace-one
    assert got >= _gdp_epsilon(2 / 3, target)


def test_rdp_mechanism_next_to_a_fixed_size_part_is_still_refused():
    # an opaque RDP curve has no certified replace-one reading in privlearn
    rdp_only = RDPMechanism(lambda a: a / 8.0, name="custom")
    mixed = compose([rdp_only, subsample(Gaussian(1.0), 0.1, scheme="fixed")])
    with pytest.raises(UnsupportedMechanismError, match="no replace-one reading"):
        mixed.epsilon(1e-5, "rdp")


def test_approx_dp_group_reading_beyond_delta_one_is_refused():
    # (5, 0.01) for a replacement: (1 + e^5) 0.01 > 1 leaves no guarantee to state
    mixed = compose([ApproxDP(5.0, 0.01), subsample(Gaussian(1.0), 0.1, scheme="fixed")])
    with pytest.raises(UnsupportedMechanismError, match="must be below 1"):
        mixed.epsilon(0.5)


def test_stated_under_reads_a_pure_dp_part_under_replace_one():
    # PureDP(0.7) states add/remove; under replace-one it is 1.4-DP, not 0.7
    assert stated_under(PureDP(0.7), RO).epsilon(0.0) == pytest.approx(1.4, rel=1e-12)


def test_one_relation_compositions_are_not_read():
    for m in (
        compose([Gaussian(1.0), subsample(Gaussian(1.0), 0.1)]),
        compose(
            [
                subsample(Gaussian(1.0), 0.1, scheme="fixed"),
                subsample(PureDP(1.0), 1.0, scheme="fixed"),
            ]
        ),
    ):
        assert read_relation(m) is m


def test_bare_and_fixed_size_parts_match_dp_accounting_rdp_replace_one():
    # dp_accounting's RDP accountant under REPLACE_ONE takes a noise multiplier relative
    # to the replace-one sensitivity (2 C here): Gaussian(s) is its GaussianDpEvent(s / 2)
    dpa = pytest.importorskip("dp_accounting")
    from dp_accounting.rdp import rdp_privacy_accountant

    orders = [2.0, 4.0, 8.0, 16.0, 32.0]
    n, b = 10_000, 100
    mixed = compose(
        [Gaussian(4.0), subsample(Gaussian(2.0), b / n, scheme="fixed")], steps=[1, 100]
    )
    acc = rdp_privacy_accountant.RdpAccountant(
        orders=orders, neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE
    )
    acc.compose(dpa.GaussianDpEvent(2.0))
    acc.compose(
        dpa.SelfComposedDpEvent(
            dpa.SampledWithoutReplacementDpEvent(n, b, dpa.GaussianDpEvent(1.0)), 100
        )
    )
    reference = np.asarray(acc._rdp)
    ours = mixed.rdp(orders)
    assert np.all(ours >= reference * (1 - 1e-9))
    np.testing.assert_allclose(ours, reference, rtol=1e-6)
    assert mixed.epsilon(1e-5, "rdp") >= acc.get_epsilon(1e-5) * (1 - 1e-9)
