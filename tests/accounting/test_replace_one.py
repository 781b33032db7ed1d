"""Neighbouring relations of a description (``stated_relations``) and its replace-one
reading (``as_replace_one``), against closed forms, group privacy and dp_accounting's
replace-one accountant."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import norm

from privlearn.accounting import (
    Gaussian,
    Laplace,
    Neighbouring,
    PureDP,
    RandomizedResponse,
    RDPMechanism,
    UnsupportedMechanismError,
    as_replace_one,
    compose,
    subsample,
)
from privlearn.accounting.registry import stated_relations

AR, RO = Neighbouring.ADD_REMOVE, Neighbouring.REPLACE_ONE


def _gaussian_delta(eps: float, sigma: float, sensitivity: float) -> float:
    """Balle & Wang (2018), Theorem 8: the exact delta(eps) of N(0, sigma^2) noise on a
    query of L2 sensitivity ``sensitivity``."""
    a = sensitivity / (2 * sigma)
    b = eps * sigma / sensitivity
    return norm.cdf(a - b) - math.exp(eps) * norm.cdf(-a - b)


def test_stated_relations_read_bare_parts_as_add_remove():
    g = Gaussian(1.0)
    assert stated_relations(g) == {AR}
    assert stated_relations(PureDP(1.0)) == {AR}
    assert stated_relations(subsample(g, 0.1)) == {AR}
    assert stated_relations(subsample(g, 0.1, scheme="fixed")) == {RO}
    assert stated_relations(subsample(g, 0.1, neighbouring="remove_only")) == {
        Neighbouring.REMOVE_ONLY}
    mixed = compose([g, subsample(g, 0.1, scheme="fixed")], steps=[1, 5])
    assert stated_relations(mixed) == {AR, RO}
    assert stated_relations(compose([])) == frozenset()
    with pytest.raises(TypeError, match="Mechanism"):
        stated_relations(1.0)


@pytest.mark.parametrize("sigma", [0.7, 2.0, 8.0])
@pytest.mark.parametrize("eps", [0.1, 1.0, 3.0])
def test_a_gaussian_under_replace_one_has_twice_the_sensitivity(sigma, eps):
    """Replacing a row moves a sum of rows clipped to C by up to 2 C: the exact curve is
    the Gaussian mechanism's at sensitivity 2 (closed form)."""
    exact = _gaussian_delta(eps, sigma, 2.0)
    b = as_replace_one(Gaussian(sigma)).delta_bounds(eps)
    assert b.lower - 1e-12 <= exact <= b.upper + 1e-12
    assert b.upper == pytest.approx(exact, rel=1e-6, abs=1e-15)


def test_pure_dp_doubles_by_group_privacy():
    """Group privacy of size 2 (Dwork & Roth 2014, Section 2.3): eps becomes 2 eps."""
    assert as_replace_one(PureDP(0.4)).epsilon(0.0) == pytest.approx(0.8, rel=1e-12)
    assert as_replace_one(Laplace(2.0)).epsilon(0.0) == pytest.approx(1.0, rel=1e-12)
    # a local randomiser's guarantee is already one about any change of its input
    rr = RandomizedResponse(0.75, 2)
    assert as_replace_one(rr).epsilon(0.0) == rr.epsilon(0.0)


def test_replace_one_parts_are_unchanged_and_compositions_part_by_part():
    fixed = subsample(Gaussian(1.0), 0.1, scheme="fixed")
    assert as_replace_one(fixed) is fixed
    m = compose([Gaussian(3.0), fixed, subsample(PureDP(0.5), 0.2)], steps=[1, 4, 2])
    # a part that is not subsampled is stated under replace-one too (the whole dataset,
    # which the accountants evaluate at twice the add/remove sensitivity), so that the
    # reading holds wherever the result is evaluated
    assert as_replace_one(m) == compose(
        [subsample(Gaussian(3.0), 1.0, scheme="fixed"), fixed,
         subsample(PureDP(1.0), 0.2, neighbouring="replace_one")],
        steps=[1, 4, 2])


def test_poisson_subsampled_gaussian_matches_dp_accounting_replace_one():
    dpa = pytest.importorskip("dp_accounting")
    from dp_accounting.pld import pld_privacy_accountant

    ours = as_replace_one(compose(subsample(Gaussian(1.0), 0.01), steps=1000))
    theirs = pld_privacy_accountant.PLDAccountant(
        neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE,
        value_discretization_interval=1e-4)
    theirs.compose(dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.0)), 1000))
    b = ours.epsilon_bounds(1e-5)
    assert b.upper == pytest.approx(theirs.get_epsilon(1e-5), rel=2e-3)
    # and more than the add/remove reading of the same run
    assert b.lower > compose(subsample(Gaussian(1.0), 0.01), steps=1000).epsilon(1e-5)


@settings(max_examples=25, deadline=None)
@given(sigma=st.floats(0.5, 20.0), rate=st.one_of(st.just(1.0), st.floats(0.001, 0.999)),
       steps=st.integers(1, 50),
       eps=st.floats(0.05, 4.0))
def test_replace_one_reading_lies_between_the_relation_and_group_privacy(
        sigma, rate, steps, eps):
    """Never cheaper than the add/remove reading, never looser than group privacy of size
    2 applied to the exact add/remove curve of a Gaussian, (2 eps, (1 + e^eps) delta)."""
    step = Gaussian(sigma) if rate == 1.0 else subsample(Gaussian(sigma), rate)
    m = compose(step, steps=steps)
    ro = as_replace_one(m)
    assert ro.epsilon(1e-5) >= m.epsilon_bounds(1e-5).lower
    if rate == 1.0:  # exact curves on both sides
        composed = sigma / math.sqrt(steps)
        group = (1 + math.exp(eps)) * _gaussian_delta(eps, composed, 1.0)
        assert ro.delta(2 * eps) <= group + 1e-12


def test_one_sided_parts_and_kinds_without_a_sensitivity_scale_are_refused():
    with pytest.raises(UnsupportedMechanismError, match="one-sided"):
        as_replace_one(subsample(Gaussian(1.0), 0.1, neighbouring="add_only"))
    with pytest.raises(UnsupportedMechanismError, match="scale_sensitivity"):
        as_replace_one(RDPMechanism(lambda a: a / 2.0, name="custom"))


# ----------------------------------------------------------------------------------------
# fixed-size sampling (without replacement) under replace-one: the +-1 pair of Poisson
# sampling does not dominate it
# ----------------------------------------------------------------------------------------
def _wor_attack_delta(eps: float, q: float, sigma: float) -> float:
    """delta(eps) of ``((1-q) N(0, s^2) + q N(2, s^2), N(0, s^2))``, which fixed-size
    sampling under replace-one attains: a sum of clipped contributions (C = 1) over a
    batch of m drawn from n records, the record +1 in D and -1 in D', every other record
    -1; D' gives N(-m, s^2) always, D gives N(-m + 2, s^2) when its record is drawn
    (probability q = m/n), else N(-m, s^2). The loss is increasing in x, so delta is the
    mass above the crossing point x*, in closed form."""
    x = 1.0 + 0.5 * sigma**2 * math.log((math.exp(eps) - 1.0 + q) / q)
    return ((1 - q) * norm.sf(x / sigma) + q * norm.sf((x - 2.0) / sigma)
            - math.exp(eps) * norm.sf(x / sigma))


@pytest.mark.parametrize("q, sigma", [(0.01, 1.0), (0.1, 1.0), (0.004, 1.1), (0.5, 4.0)])
@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_fixed_size_replace_one_gaussian_covers_the_attained_pair(q, sigma, accountant):
    m = subsample(Gaussian(sigma), q, scheme="fixed")
    for delta in (1e-8, 1e-5, 1e-2):
        eps = m.epsilon(delta, accountant)
        assert _wor_attack_delta(eps, q, sigma) <= delta * (1 + 1e-9)
    if accountant == "pld":  # and the PLD answer is that pair's (tight)
        eps = m.epsilon(1e-5)
        assert _wor_attack_delta(eps * (1 - 1e-3), q, sigma) > 1e-5


@pytest.mark.parametrize("q, b, steps", [(0.1, 0.5, 1), (0.01, 2.0, 1), (0.05, 1.0, 100)])
def test_fixed_size_replace_one_laplace_pure_epsilon_is_the_attained_one(q, b, steps):
    # the same attack with Laplace noise: the likelihood ratio reaches (1-q) + q e^{2/b}
    # (x >= 2), at every step at once with positive probability
    m = compose(subsample(Laplace(b), q, scheme="fixed"), steps)
    attained = steps * math.log1p(q * math.expm1(2.0 / b))
    for accountant in ("pld", "rdp"):
        assert m.epsilon(0.0, accountant) >= attained * (1 - 1e-12)
    assert m.epsilon(0.0) <= attained * (1 + 1e-9)
