"""f-DP trade-off curves against closed forms and the accountants' own numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy.stats import norm

from privlearn.accounting import Gaussian, PureDP, compose, subsample
from privlearn.accounting.fdp import (
    gaussian_mu,
    gaussian_tradeoff,
    gdp_delta,
    gdp_epsilon,
    gdp_epsilon_interval,
    gdp_mu,
    tradeoff_curve,
    tradeoff_from_profile,
)

ALPHAS = np.concatenate([[0.0], np.geomspace(1e-6, 1.0, 60)])


@pytest.mark.parametrize("mu", [0.0, 0.3, 1.0, 2.5, 6.0])
def test_gaussian_tradeoff_closed_form(mu):
    # Dong, Roth & Su (2022), Def. 2.7: the type II error of the Neyman-Pearson test of
    # N(0, 1) against N(mu, 1) at type I error alpha
    a = ALPHAS[(ALPHAS > 0) & (ALPHAS < 1)]
    expect = norm.cdf(norm.ppf(1 - a) - mu)
    np.testing.assert_allclose(gaussian_tradeoff(mu, a), expect, rtol=1e-10, atol=1e-14)
    assert gaussian_tradeoff(mu, [0.0])[0] == 1.0 and gaussian_tradeoff(mu, [1.0])[0] == 0.0


def test_gaussian_tradeoff_is_a_tradeoff_function():
    f = gaussian_tradeoff(1.3, ALPHAS)
    assert np.all(np.diff(f) <= 1e-15)  # non-increasing
    assert np.all(f <= 1 - ALPHAS + 1e-15)  # below the random-guess line
    # symmetric (Dong, Roth & Su 2022): f = f^{-1}, so f(f(a)) = a
    inner = gaussian_tradeoff(1.3, ALPHAS[1:-1])
    np.testing.assert_allclose(gaussian_tradeoff(1.3, inner), ALPHAS[1:-1], rtol=1e-6)


@pytest.mark.parametrize("sigma", [0.5, 1.0, 3.0])
@pytest.mark.parametrize("eps", [0.0, 0.5, 2.0, 8.0])
def test_gdp_delta_matches_analytic_gaussian(sigma, eps):
    # the analytic accountant is exact for the Gaussian mechanism (Balle & Wang 2018)
    exact = Gaussian(sigma).delta(eps, accountant="analytic")
    assert gdp_delta(1 / sigma, eps) == pytest.approx(exact, rel=1e-7, abs=1e-15)


@pytest.mark.parametrize("mu", [0.2, 1.0, 3.0])
@pytest.mark.parametrize("delta", [1e-3, 1e-5, 1e-9])
def test_gdp_epsilon_and_mu_are_inverse(mu, delta):
    lo, hi = gdp_epsilon_interval(mu, delta)
    assert lo <= hi and gdp_delta(mu, lo) >= delta >= gdp_delta(mu, hi)
    assert gdp_epsilon(mu, delta) == hi
    assert gdp_mu(hi, delta) == pytest.approx(mu, rel=1e-8)
    assert gdp_delta(gdp_mu(2.0, delta), 2.0) <= delta


def test_gaussian_mu_of_compositions():
    assert gaussian_mu(Gaussian(2.0)) == 0.5
    assert gaussian_mu(compose(Gaussian(2.0), steps=4)) == pytest.approx(1.0)
    assert gaussian_mu(compose([Gaussian(1.0), Gaussian(2.0)], steps=[1, 4])) == pytest.approx(
        math.sqrt(2.0))
    assert gaussian_mu(subsample(Gaussian(1.0), 0.1)) is None
    np.testing.assert_allclose(tradeoff_curve(compose(Gaussian(2.0), steps=4), ALPHAS),
                               gaussian_tradeoff(1.0, ALPHAS))


def test_profile_envelope_is_below_and_close_to_the_exact_gaussian_curve():
    mu = 1.0
    eps = np.linspace(0, 10, 801)
    env = tradeoff_from_profile(eps, [gdp_delta(mu, e) for e in eps], ALPHAS)
    exact = gaussian_tradeoff(mu, ALPHAS)
    assert np.all(env <= exact + 1e-12)  # a valid (pessimistic) curve
    assert np.max(exact - env) < 5e-3  # and a tight one on a fine grid


@pytest.mark.parametrize("eps", [0.5, 2.0])
def test_pure_dp_curve_is_exact(eps):
    # an eps-DP mechanism: f(a) = max(0, 1 - e^eps a, e^-eps (1 - a))
    # (Dong, Roth & Su 2022, Eq. (5); Kairouz, Oh & Viswanath 2015)
    f = tradeoff_curve(PureDP(eps), ALPHAS, epsilons=[0.0, eps, 2 * eps])
    expect = np.maximum.reduce([np.zeros_like(ALPHAS), 1 - math.exp(eps) * ALPHAS,
                                math.exp(-eps) * (1 - ALPHAS)])
    np.testing.assert_allclose(f, expect, atol=1e-12)


def test_subsampled_curve_is_valid_against_every_profile_point():
    m = compose(subsample(Gaussian(1.0), 0.1), steps=50)
    f = tradeoff_curve(m, ALPHAS)
    assert np.all(np.diff(f) <= 1e-12) and np.all((f >= 0) & (f <= 1 - ALPHAS + 1e-12))
    # the envelope is the maximum of the curves of its grid points (each certified
    # (eps, delta(eps)) is a guarantee), and a finer grid only raises it
    grid = [0.0, 0.3, 1.0, 3.0]
    coarse = tradeoff_curve(m, ALPHAS, epsilons=grid)
    for e in grid:
        d = m.delta(e)
        single = np.maximum(0, np.maximum(1 - d - math.exp(e) * ALPHAS,
                                          math.exp(-e) * (1 - d - ALPHAS)))
        assert np.all(coarse >= single - 1e-12)
    fine = tradeoff_curve(m, ALPHAS, epsilons=np.linspace(0, 3.0, 61))
    assert np.all(fine >= coarse - 1e-12)
    # and it is less private than no subsampling at all (q = 1, the same sigma and steps),
    # up to the envelope's own shortfall: its grid ends at epsilon(1e-12), so at alpha = 0
    # it is 1 - delta(top) = 1 - 1e-12 where the exact curve is 1
    assert np.all(f >= gaussian_tradeoff(math.sqrt(50), ALPHAS) - 2e-12)


@given(st.floats(0.01, 8.0), st.floats(0.0, 1.0))
def test_gaussian_tradeoff_monotone_in_mu(mu, a):
    assert gaussian_tradeoff(mu * 1.1, [a])[0] <= gaussian_tradeoff(mu, [a])[0] + 1e-15


@pytest.mark.parametrize("bad", [[-0.1], [1.5], [np.nan], []])
def test_bad_alphas(bad):
    with pytest.raises(ValueError, match="alphas"):
        gaussian_tradeoff(1.0, bad)


def test_bad_arguments():
    with pytest.raises(ValueError, match="mu"):
        gaussian_tradeoff(-1.0, [0.5])
    with pytest.raises(ValueError, match="delta"):
        gdp_epsilon(1.0, 0.0)
    with pytest.raises(TypeError, match="Mechanism"):
        tradeoff_curve("gaussian", [0.5])


# every public function refuses a value of the wrong type or outside its range with a typed
# error naming the parameter and the value received (a string or a bool is not a number)
@pytest.mark.parametrize("call, name", [
    (lambda: gdp_delta("1.0", 1.0), "mu"), (lambda: gdp_delta(True, 1.0), "mu"),
    (lambda: gdp_delta(1.0, "1.0"), "epsilon"), (lambda: gdp_delta(1.0, None), "epsilon"),
    (lambda: gdp_delta(1.0, -1.0), "epsilon"), (lambda: gdp_delta(math.nan, 1.0), "mu"),
    (lambda: gdp_epsilon("1.0", 1e-5), "mu"), (lambda: gdp_epsilon(1.0, None), "delta"),
    (lambda: gdp_epsilon(1.0, 1.0), "delta"), (lambda: gdp_epsilon(1.0, math.nan), "delta"),
    (lambda: gdp_mu("1.0", 1e-5), "epsilon"), (lambda: gdp_mu(True, 1e-5), "epsilon"),
    (lambda: gdp_mu(1.0, [1e-5]), "delta"), (lambda: gdp_mu(1.0, 0.0), "delta"),
    (lambda: gaussian_tradeoff("1.0", [0.1]), "mu"),
    (lambda: gaussian_tradeoff(1.0, "0.5"), "alphas"),
    (lambda: gaussian_tradeoff(1.0, [True]), "alphas"),
    (lambda: gaussian_tradeoff(1.0, [0.1 + 1j]), "alphas"),
    (lambda: tradeoff_from_profile("1.0", [1e-5], [0.1]), "epsilons"),
    (lambda: tradeoff_from_profile([1.0], [-1e-5], [0.1]), "deltas"),
    (lambda: tradeoff_from_profile([math.inf], [1e-5], [0.1]), "epsilons"),
    (lambda: tradeoff_curve(PureDP(1.0), [0.1], epsilons="1.0"), "epsilons")])
def test_bad_values_are_refused_naming_the_parameter(call, name):
    from privlearn.errors import ParameterTypeError, ParameterValueError

    with pytest.raises((ParameterTypeError, ParameterValueError), match=rf"^{name}\b.*got"):
        call()


def test_numpy_scalars_are_numbers():
    assert gdp_delta(np.float64(1.0), np.array(1.0)) == gdp_delta(1.0, 1.0)
    assert gdp_mu(np.float32(1.0), np.float64(1e-5)) == gdp_mu(1.0, 1e-5)
