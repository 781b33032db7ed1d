"""Analytic Gaussian accountant against high-precision evaluation of Balle & Wang (2018)."""

from __future__ import annotations

import math

import mpmath as mp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from privlearn.accounting import (
    Gaussian,
    Laplace,
    UnsupportedMechanismError,
    compose,
    subsample,
)
from privlearn.accounting.analytic import (
    effective_noise_multiplier,
    gaussian_delta,
    gaussian_delta_bounds,
    gaussian_epsilon,
    gaussian_epsilon_bounds,
)


def _delta_mp(sigma: float, eps: float) -> mp.mpf:
    """Balle & Wang (2018), Theorem 8, in 60-digit arithmetic."""
    with mp.workdps(60):
        mu = 1 / mp.mpf(sigma)
        e = mp.mpf(eps)
        return mp.ncdf(-e / mu + mu / 2) - mp.exp(e) * mp.ncdf(-e / mu - mu / 2)


SIGMAS = [0.005, 0.05, 0.5, 1.0, 3.0, 30.0, 500.0]
DELTAS = [1e-9, 1e-7, 1e-5]


@pytest.mark.parametrize("sigma", SIGMAS)
@pytest.mark.parametrize("delta", DELTAS)
def test_epsilon_is_certified_and_tight_against_mpmath(sigma, delta):
    eps = gaussian_epsilon(sigma, delta)
    assert math.isfinite(eps) and eps > 0
    # certified: the exact delta at the returned epsilon does not exceed the target
    assert _delta_mp(sigma, eps) <= delta
    # tight: a slightly smaller epsilon violates the target
    assert _delta_mp(sigma, eps * (1 - 1e-9)) > delta
    # the certified lower bound is below the exact epsilon
    lo, hi = gaussian_epsilon_bounds(sigma, delta)
    assert hi == eps and lo <= hi * (1 + 1e-15)
    assert lo == 0.0 or _delta_mp(sigma, lo) > delta


@pytest.mark.parametrize("sigma", SIGMAS)
def test_delta_matches_mpmath(sigma):
    for eps in [0.0, 0.01, 0.5, 3.0, 40.0]:
        exact = _delta_mp(sigma, eps)
        lo, hi = gaussian_delta_bounds(sigma, eps)
        assert gaussian_delta(sigma, eps) == hi
        assert lo <= exact <= hi
        if exact > 1e-290:
            assert hi == pytest.approx(float(exact), rel=1e-9)


@pytest.mark.parametrize("sigma", [0.05, 1.0, 20.0])
def test_round_trip(sigma):
    for delta in DELTAS:
        eps = Gaussian(sigma).epsilon(delta, accountant="analytic")
        assert Gaussian(sigma).delta(eps, accountant="analytic") <= delta


def test_seed_noisy_gd_value():
    # tutorial 001: autodp's exact value for sigmas (5, 3, 4) at delta = 1e-6
    m = compose([Gaussian(5.0), Gaussian(3.0), Gaussian(4.0)])
    assert m.epsilon(1e-6, accountant="analytic") == pytest.approx(2.0677358464697515, rel=1e-7)


@settings(max_examples=25, deadline=None)
@given(
    sigma=st.floats(0.05, 50.0),
    k=st.integers(1, 10_000),
    delta=st.sampled_from(DELTAS),
)
def test_composition_of_k_gaussians_is_one_gaussian(sigma, k, delta):
    composed = compose(Gaussian(sigma), steps=k).epsilon(delta, accountant="analytic")
    single = Gaussian(sigma / math.sqrt(k)).epsilon(delta, accountant="analytic")
    assert composed == pytest.approx(single, rel=1e-9)


def test_heterogeneous_effective_noise():
    sig = np.array([5.0, 3.0, 4.0])
    m = compose([Gaussian(s) for s in sig], steps=[1, 2, 3])
    expected = 1 / math.sqrt(1 / 25 + 2 / 9 + 3 / 16)
    assert effective_noise_multiplier(m) == pytest.approx(expected, rel=1e-14)
    assert effective_noise_multiplier(Laplace(1.0)) is None


def test_delta_zero_and_unsupported():
    assert math.isinf(Gaussian(1.0).epsilon(0.0, accountant="analytic"))
    assert gaussian_delta(1.0, math.inf) == 0.0
    with pytest.raises(UnsupportedMechanismError, match="analytic"):
        subsample(Gaussian(1.0), 0.1).epsilon(1e-5, accountant="analytic")
    with pytest.raises(UnsupportedMechanismError):
        Laplace(1.0).epsilon(1e-5, accountant="analytic")


def test_a_refused_mechanism_is_named_by_the_part_analytic_cannot_account():
    """The message shows the part that is not Gaussian (its repr, with its parameters),
    not the class of the whole composition."""
    sub = subsample(Gaussian(1.1), 0.01)
    for mechanism, said in ((compose(sub, steps=100), f"{sub!r}, composed 100 times"),
                            (Laplace(2.0), f"{Laplace(2.0)!r}."),
                            (compose(Laplace(2.0), steps=1), f"{Laplace(2.0)!r}."),
                            (compose([Gaussian(1.0), compose(Laplace(2.0), steps=3)]),
                             f"{Laplace(2.0)!r}, composed 3 times")):
        with pytest.raises(UnsupportedMechanismError) as err:
            mechanism.epsilon(1e-5, accountant="analytic")
        msg = str(err.value)
        assert f"got {said}" in msg and "got Composed" not in msg
        assert "accountant='pld' or 'rdp'" in msg


def test_bounds_are_exact():
    b = Gaussian(1.3).epsilon_bounds(1e-6, accountant="analytic")
    assert b.accountant == "analytic"
    assert b.lower <= b.upper <= b.lower * (1 + 1e-9)


@pytest.mark.parametrize(("sigma", "delta"), [
    (1e20, 1e-5), (1e300, 1e-300), (3e8, 1e-300), (1e4, 1e-300), (1.0, 5e-324),
    (1e-6, 1e-300), (0.5, 1e-300), (1.7976931348623157e308, 1e-5)])
def test_extreme_noise_and_delta_are_certified_against_mpmath(sigma, delta):
    """Far noise and delta (where the float evaluation cancels or underflows): the
    upper bound is still valid against 100-digit arithmetic, never optimistic, and at
    most the Renyi DP conversion's mu^2/2 + mu sqrt(2 log(1/delta))."""
    lo, hi = gaussian_epsilon_bounds(sigma, delta)
    with mp.workdps(100):
        mu = 1 / mp.mpf(sigma)
        e = mp.mpf(hi)
        exact_delta = mp.ncdf(-e / mu + mu / 2) - mp.exp(e) * mp.ncdf(-e / mu - mu / 2)
        assert exact_delta <= delta
        assert hi <= (mu * mu / 2 + mu * mp.sqrt(-2 * mp.log(delta))) * (1 + 1e-9)
        if lo > 0:
            e = mp.mpf(lo)
            assert mp.ncdf(-e / mu + mu / 2) - mp.exp(e) * mp.ncdf(-e / mu - mu / 2) > delta


@pytest.mark.parametrize("sigma", [1e-300, 5e-324, 1e-7])
def test_noise_too_small_to_represent_is_a_typed_refusal(sigma):
    from privlearn.errors import PrivacyLossOverflowError

    with pytest.raises(PrivacyLossOverflowError, match="essentially non-private"):
        gaussian_epsilon_bounds(sigma, 1e-5)
    with pytest.raises(PrivacyLossOverflowError):
        compose(Gaussian(sigma), steps=3).epsilon(1e-5)


@pytest.mark.parametrize("sigma", [1e-300, 1e-160, 3.7, 1e160, 1e300,
                                   1.7976931348623157e308])
@pytest.mark.parametrize("count", [1, 2, 0.5])
def test_combined_gaussian_over_the_whole_float_range(sigma, count):
    """(sum c / sigma^2)^(-1/2) exactly, rounded down to a float (less noise is the
    conservative side), for noise multipliers whose 1/sigma^2 is beyond floats."""
    from fractions import Fraction

    from privlearn.accounting.registry import combine_gaussians

    s = combine_gaussians([(sigma, count)])
    total = Fraction(count) / Fraction(sigma) ** 2
    assert Fraction(s) ** 2 * total <= 1
    if s < 1e308:  # tight (else the largest float is the answer)
        assert Fraction(s * (1 + 1e-15)) ** 2 * total > 1


@pytest.mark.parametrize("fn", [gaussian_delta, gaussian_delta_bounds])
@pytest.mark.parametrize("sigma, eps, err, names", [
    (-1, 1.0, "ParameterValueError", "noise_multiplier"),
    (float("nan"), 1.0, "ParameterValueError", "noise_multiplier"),
    ("1", 1.0, "ParameterTypeError", "noise_multiplier"),
    (None, 1.0, "ParameterTypeError", "noise_multiplier"),
    (1.0, -0.5, "ParameterValueError", "epsilon"),
    (1.0, float("nan"), "ParameterValueError", "epsilon"),
    (1.0, "1", "ParameterTypeError", "epsilon"),
])
def test_delta_functions_refuse_bad_input_with_typed_errors(fn, sigma, eps, err, names):
    import privlearn.errors as errors

    with pytest.raises(getattr(errors, err), match=names) as info:
        fn(sigma, eps)
    assert "got" in str(info.value) and ";" in str(info.value)  # value received, a hint


@pytest.mark.parametrize("fn", [gaussian_epsilon, gaussian_epsilon_bounds])
@pytest.mark.parametrize("sigma, delta, err, names", [
    (-1.0, 1e-5, "ParameterValueError", "noise_multiplier"),
    (1.0, float("nan"), "ParameterValueError", "delta"),
    (1.0, 1.5, "ParameterValueError", "delta"),
    (1.0, -1e-5, "ParameterValueError", "delta"),
    (1.0, "1e-5", "ParameterTypeError", "delta"),
])
def test_epsilon_functions_refuse_bad_input_with_typed_errors(fn, sigma, delta, err, names):
    import privlearn.errors as errors

    with pytest.raises(getattr(errors, err), match=names):
        fn(sigma, delta)


@pytest.mark.parametrize("eps", [0.0, 1.0, 50.0])
def test_no_noise_has_delta_one(eps):
    """Without noise the outputs on neighbours are two distinct point masses: delta(eps)
    is exactly 1 at every finite epsilon (it used to divide by zero)."""
    lo, hi = gaussian_delta_bounds(0.0, eps)
    assert hi == 1.0 and lo <= 1.0
    assert gaussian_delta(0, eps) == 1.0


def test_effective_noise_multiplier_refuses_a_non_mechanism():
    from privlearn.errors import ParameterTypeError

    with pytest.raises(ParameterTypeError, match="mechanism"):
        effective_noise_multiplier("gaussian")
    assert effective_noise_multiplier(Gaussian(2.0)) == 2.0
