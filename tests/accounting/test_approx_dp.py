"""ApproxDP: a generic (epsilon, delta)-DP release, composed by the PLD accountant through
its four-outcome worst-case pair (Kairouz, Oh & Viswanath 2015)."""

from __future__ import annotations

import math

import pytest

from privlearn.accounting import ApproxDP, Gaussian, compose
from privlearn.accounting.serialization import dumps, loads
from privlearn.errors import UnsupportedMechanismError


def _exact_delta(eps: float, d: float, k: int, t: float) -> float:
    """k-fold composition of the (eps, d) pair: an infinite-loss outcome unless every
    step avoids its delta atom, else k-fold binary randomized response (binomial sum)."""
    p = 1 / (1 + math.exp(-eps))
    r = 1 - p
    rr = sum(math.comb(k, i) * max(0.0, p ** (k - i) * r**i - math.exp(t) * p**i * r ** (k - i))
             for i in range(k + 1))
    return 1 - (1 - d) ** k + (1 - d) ** k * rr


@pytest.mark.parametrize("eps,d,k", [(1.0, 1e-6, 1), (0.5, 1e-5, 5), (0.3, 1e-7, 20)])
def test_composition_against_the_closed_form(eps, d, k):
    m = compose(ApproxDP(eps, d), steps=k)
    for t in (0.0, 0.5 * eps * k, 0.9 * eps * k, eps * k + 1.0):
        b = m.delta_bounds(t)
        exact = _exact_delta(eps, d, k, t)
        assert b.lower <= exact * (1 + 1e-9)
        assert exact <= b.upper * (1 + 1e-9) and b.upper <= exact * 1.01 + 1e-12


def test_one_release_spends_its_own_epsilon_at_a_little_more_delta():
    assert ApproxDP(1.3, 0.99e-6).epsilon(1e-6) == pytest.approx(1.3, abs=1e-4)
    assert ApproxDP(1.3, 0.99e-6).epsilon(1e-6) >= 1.3 - 1e-4
    # composed with a Gaussian it costs more than the Gaussian alone
    g = Gaussian(2.0)
    assert compose([g, ApproxDP(0.5, 1e-7)]).epsilon(1e-5) > g.epsilon(1e-5)


def test_no_rdp_guarantee_and_storable():
    with pytest.raises(UnsupportedMechanismError):
        ApproxDP(1.0, 1e-6).epsilon(1e-5, "rdp")
    m = compose([ApproxDP(1.0, 1e-6), Gaussian(3.0)])
    assert loads(dumps(m)) == m


@pytest.mark.parametrize("eps,d", [(-1.0, 1e-6), (1.0, 0.0), (1.0, 1.0), (math.nan, 1e-6)])
def test_bad_parameters(eps, d):
    with pytest.raises(ValueError, match="dp_"):
        ApproxDP(eps, d)


def test_epsilon_at_exactly_its_delta_is_refused_not_rounded_down():
    from privlearn.errors import CertificationError

    with pytest.raises(CertificationError):
        ApproxDP(1.0, 1e-6).epsilon(1e-6)
    with pytest.raises(CertificationError):  # below the mass at infinity: nothing certifies
        ApproxDP(1.0, 1e-6).epsilon(1e-7)
