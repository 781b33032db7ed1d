"""A noise multiplier of 1e154 or more: ``sigma^2`` overflows to inf, and the Renyi
divergence ``alpha / (2 sigma^2)`` came out 0 -- no privacy loss at all -- so the ``"rdp"``
accountant reported ``delta(epsilon=0) = 0`` and ``epsilon = 0`` at a delta below the
mechanism's true ``delta(0)`` (optimistic), for the Gaussian, the Laplace mechanism and
their subsampled forms. The ground truths are closed forms in mpmath: Mironov (2017),
Proposition 7 (the Gaussian's RDP), the total variation distance ``delta(0)`` of the
Gaussian pair ``2 Phi(1 / (2 sigma)) - 1`` and of the Laplace pair
``1 - exp(-1 / (2 b))``, and ``q`` times it for a Poisson-subsampled pair (a mixture with
a common part of weight ``1 - q``)."""

from __future__ import annotations

import mpmath
import pytest

from privlearn.accounting import Gaussian, Laplace, subsample

SIGMAS = [1e154, 1e155, 1e200, 1e300, 1.7e308]
mpmath.mp.dps = 40


def _gaussian_tv(sigma: float, sensitivity: float = 1.0) -> mpmath.mpf:
    return 2 * mpmath.ncdf(mpmath.mpf(sensitivity) / (2 * mpmath.mpf(sigma))) - 1


@pytest.mark.parametrize("sigma", SIGMAS)
@pytest.mark.parametrize("alpha", [1.5, 2.0, 64.0])
def test_gaussian_rdp_of_a_huge_noise_is_positive_and_covers_the_closed_form(sigma, alpha):
    got = Gaussian(sigma).rdp(alpha)
    exact = mpmath.mpf(alpha) / (2 * mpmath.mpf(sigma) ** 2)
    assert got > 0 and got >= exact
    if exact > 2.3e-308:  # representable as a normal float: tight too
        assert got <= exact * (1 + 1e-12)


@pytest.mark.parametrize("sigma", SIGMAS)
def test_delta_at_zero_under_rdp_is_never_below_the_total_variation(sigma):
    q = 0.1
    cases = [
        (Gaussian(sigma), _gaussian_tv(sigma)),
        (subsample(Gaussian(sigma), q), q * _gaussian_tv(sigma)),
        # fixed-size sampling, replace-one: the base at twice its sensitivity
        (subsample(Gaussian(sigma), q, "fixed"), q * _gaussian_tv(sigma, 2.0)),
        (Laplace(sigma), -mpmath.expm1(-1 / (2 * mpmath.mpf(sigma)))),
        (subsample(Laplace(sigma), q), q * -mpmath.expm1(-1 / (2 * mpmath.mpf(sigma)))),
    ]
    for mech, tv in cases:
        assert mech.delta(0.0, "rdp") >= tv, mech


@pytest.mark.parametrize("sigma", SIGMAS)
def test_epsilon_below_the_true_delta_at_zero_is_positive(sigma):
    # at delta < delta(0) the exact epsilon is positive: 0 was optimistic
    delta = float(_gaussian_tv(sigma)) / 1000
    for accountant in ("rdp", "pld", "analytic"):
        assert Gaussian(sigma).epsilon(delta, accountant) > 0, accountant
    assert subsample(Gaussian(sigma), 0.5).epsilon(delta / 2, "rdp") > 0
