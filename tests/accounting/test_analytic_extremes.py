"""The exact Gaussian delta at a huge noise multiplier: no cancelled difference may turn
into a bound of 1/2 or 1 where delta is astronomically small."""

from __future__ import annotations

import math

import pytest

from privlearn.accounting import Gaussian, compose
from privlearn.accounting.analytic import gaussian_delta_bounds


@pytest.mark.parametrize("sigma", [1.0, 1e3, 1e10, 1e16, 1e300])
def test_delta_at_zero_epsilon_is_erf(sigma):
    # delta(0) = 2 Phi(1/(2 sigma)) - 1 = erf(1 / (2 sqrt(2) sigma)) (Balle & Wang 2018,
    # Thm 8 at eps = 0); at sigma = 1e16 the difference form gave the bound 0.5
    exact = math.erf(1.0 / sigma / (2.0 * math.sqrt(2.0)))
    lo, up = gaussian_delta_bounds(sigma, 0.0)
    assert lo <= exact <= up <= exact * (1 + 1e-14)


@pytest.mark.parametrize("sigma,eps", [(1e16, 1e-20), (1e300, 1e-12), (1e300, 1.0)])
def test_delta_at_huge_noise_is_tiny(sigma, eps):
    lo, up = gaussian_delta_bounds(sigma, eps)
    assert 0.0 <= lo <= up <= math.erf(1.0 / sigma / (2.0 * math.sqrt(2.0))) * (1 + 1e-14) + 3e-308


def test_composed_huge_noise_delta_not_one():
    # 1e9 releases at noise multiplier 1e300: effective noise 3e295, delta(1) ~ 0 (was 1.0)
    b = compose(Gaussian(1e300), steps=10**9).delta_bounds(1.0)
    assert b.upper < 1e-300


@pytest.mark.parametrize("scheme", ["poisson", "fixed"])
def test_subsampled_gaussian_at_huge_noise_is_zero_without_warnings(scheme):
    # mu = 1/sigma so small that the privacy loss threshold x / mu overflows: the tails
    # are exact (0 and 1) and the run, whose delta(0) <= erf(1/(2 sqrt 2 sigma)) per step
    # is far below 1e-5, has epsilon 0; no overflow warning (the CLI printed it on every
    # `privlearn budget show` of a ledger holding such a release)
    import warnings

    from privlearn.accounting import subsample

    m = compose(subsample(Gaussian(1e308), 0.1, scheme=scheme), steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bound = m.epsilon_bounds(1e-5, "pld")
    assert bound.upper == 0.0 and bound.lower == 0.0
