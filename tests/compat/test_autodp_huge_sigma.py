"""A huge but valid sigma in the autodp facade is answered, not an OverflowError:
``sigma**2`` overflowed for ``sigma > 1.3e154``. The RDP of the Gaussian mechanism is
``alpha / (2 sigma^2)`` (Mironov 2017, Proposition 7): for ``sigma = 1e200`` it is
1e-400, zero to double precision."""

from __future__ import annotations

import math

from privlearn.compat.autodp import mechanism_zoo, rdp_bank


def test_rdp_gaussian_at_a_huge_sigma():
    got = rdp_bank.RDP_gaussian({"sigma": 1e200}, 2.0)
    assert 0.0 <= got <= 1e-300


def test_svt_rdp_at_a_huge_sigma_is_the_threshold_term():
    # c log(k/c) / (alpha - 1) + (c + 1) alpha / (2 sigma^2): the second term vanishes
    got = rdp_bank.RDP_gaussian_svt_cgreater1({"sigma": 1e200, "k": 10, "c": 1}, 2.0)
    assert math.isclose(got, math.log(10), rel_tol=1e-9)


def test_discrete_gaussian_at_a_huge_sigma():
    mech = mechanism_zoo.DiscreteGaussianMechanism(1e200)
    assert 0.0 <= mech.get_approxDP(1e-5) <= 1e-100
