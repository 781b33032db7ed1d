"""RDP of the autodp facade's exponential and discrete Gaussian mechanisms against the
values of autodp's own mechanism_zoo and of Google dp_accounting's RDP tests
(rdp/rdp_privacy_accountant_test.py: test_compute_rdp_exponential_mechanism,
test_discrete_gaussian_rdp)."""

from __future__ import annotations

import pytest

from privlearn.compat.autodp import mechanism_zoo


def test_exponential_mechanism_rdp_is_the_minimum_of_its_descriptions() -> None:
    # eps = 1: described as 1-DP and as 1/8-zCDP (bounded range); autodp reports the
    # pointwise minimum: 0.125 alpha where that is smaller (0.125000000125 at alpha
    # 1 + 1e-9, 0.25 at alpha 2). An earlier facade reported the pure-DP curve alone
    # (0.462 and 0.735), a valid but looser bound than autodp's and than its docstring.
    em = mechanism_zoo.ExponentialMechanism(1.0)
    kl = em.get_RDP(1 + 1e-9)
    # dp_accounting's exact bounded-range KL is 0.123301561: never below it
    assert 0.123301561 <= kl <= 0.125 * (1 + 1e-9) + 1e-15
    assert em.get_RDP(2.0) == pytest.approx(0.25, rel=1e-12)
    # order 1000: dp_accounting 1.0 (the pure epsilon); the 1-DP curve is a bit below
    assert 0.99 <= em.get_RDP(1000.0) <= 1.0
    # carried through RenyiDP into another facade mechanism
    other = mechanism_zoo.Mechanism()
    other.propagate_updates(em.RenyiDP, "RDP")
    assert other.get_RDP(2.0) == pytest.approx(0.25, rel=1e-12)


def test_discrete_gaussian_rdp() -> None:
    # dp_accounting: DiscreteGaussianDpEvent(sigma 5, sensitivity 2) has RDP
    # alpha sensitivity^2 / (2 sigma^2) (Canonne, Kamath & Steinke 2020, Theorem 14);
    # the facade's sigma is per unit sensitivity
    alpha, sigma, sens = 3.14159, 5.0, 2.0
    dgm = mechanism_zoo.DiscreteGaussianMechanism(sigma / sens)
    assert dgm.get_RDP(alpha) == pytest.approx(alpha * sens**2 / (2 * sigma**2), rel=1e-12)
