"""Calibration: the result meets the target, is tight, and rounds on the safe side."""

from __future__ import annotations

import math

import pytest

from privlearn.accounting import (
    CalibrationError,
    Gaussian,
    Laplace,
    calibrate,
    compose,
    subsample,
)
from privlearn.accounting.analytic import gaussian_epsilon


def test_noise_multiplier_meets_target_and_is_tight_analytic():
    k, eps, delta = 50, 1.0, 1e-5
    x = calibrate(lambda s: compose(Gaussian(s), k), eps, delta, accountant="analytic", rtol=1e-7)
    assert compose(Gaussian(x), k).epsilon(delta, "analytic") <= eps
    assert compose(Gaussian(x * (1 - 1e-5)), k).epsilon(delta, "analytic") > eps
    # composition of k Gaussians = one Gaussian with sigma / sqrt(k)
    assert gaussian_epsilon(x / math.sqrt(k), delta) <= eps


def test_noise_multiplier_rdp_subsampled():
    q, T, eps, delta = 256 / 60000, 1000, 1.0, 1e-5

    def f(s):
        return compose(subsample(Gaussian(s), q), T)

    x = calibrate(f, eps, delta, accountant="rdp")
    assert f(x).epsilon(delta, "rdp") <= eps
    assert f(x * (1 - 1e-5)).epsilon(delta, "rdp") > eps


def test_steps_integer_rounded_down():
    eps, delta = 2.0, 1e-5

    def f(t):
        return compose(subsample(Gaussian(1.0), 0.01), int(t))

    t = calibrate(f, eps, delta, accountant="rdp", integer=True)
    assert isinstance(t, int)
    assert f(t).epsilon(delta, "rdp") <= eps
    assert f(t + 1).epsilon(delta, "rdp") > eps


@pytest.mark.parametrize("accountant, bounds", [("rdp", None), ("pld", (1, 100))])
def test_steps_found_when_short_runs_all_cost_zero(accountant, bounds):
    # at q = 1e-6 one and two steps (and, by the PLD, a hundred) are all (0, 1e-5)-DP:
    # the direction (epsilon increases with the steps) is read from delta at that
    # epsilon, not taken to be a noise scale's, which made the answer 1 step
    eps, delta = 1.0, 1e-5

    def f(t):
        return compose(subsample(Gaussian(1.0), 1e-6), int(t))

    ends = (1, 2) if bounds is None else bounds
    assert all(f(t).epsilon(delta, accountant) == 0.0 for t in ends)
    t = calibrate(f, eps, delta, accountant=accountant, integer=True, bounds=bounds)
    if bounds is not None:
        assert t == 100  # every count in the bounds is feasible: the largest
        return
    assert f(t).epsilon(delta, accountant) <= eps < f(t + 1).epsilon(delta, accountant)


def test_steps_with_bounds():
    def f(t):
        return compose(Laplace(10.0), int(t))

    # pure DP: T / b <= 1.05 -> T = 10
    t = calibrate(f, 1.05, 0.0, accountant="rdp", integer=True, bounds=(1, 1000))
    assert t == 10


def test_rate_with_bounds_rounded_down():
    eps, delta, T = 1.5, 1e-6, 500

    def f(q):
        return compose(subsample(Gaussian(1.2), q), T)

    q = calibrate(f, eps, delta, accountant="rdp", bounds=(1e-6, 1.0), rtol=1e-7)
    assert 1e-6 < q < 1.0
    assert f(q).epsilon(delta, "rdp") <= eps
    assert f(min(1.0, q * (1 + 1e-5))).epsilon(delta, "rdp") > eps


def test_rate_upper_bound_feasible_returns_bound():
    def f(q):
        return subsample(Gaussian(50.0), q)

    assert calibrate(f, 1.0, 1e-5, accountant="rdp", bounds=(1e-3, 1.0)) == 1.0


def test_unreachable_target_raises():
    def f(q):
        return compose(subsample(Gaussian(0.5), q), 10_000)

    with pytest.raises(CalibrationError, match="unreachable"):
        calibrate(f, 0.01, 1e-5, accountant="rdp", bounds=(0.5, 1.0))
    # Laplace cannot reach epsilon below T / b at delta = 0 with b <= 10
    with pytest.raises(CalibrationError, match="unreachable"):
        calibrate(lambda b: compose(Laplace(b), 100), 1.0, 0.0, accountant="rdp", bounds=(1, 10))


def test_calibration_input_validation():
    with pytest.raises(ValueError, match=r"epsilon must be in \(0, inf\).*-1"):
        calibrate(lambda s: Gaussian(s), -1.0, 1e-5)
    with pytest.raises(ValueError, match=r"delta must be in \[0, 1\).*2"):
        calibrate(lambda s: Gaussian(s), 1.0, 2.0)
    with pytest.raises(ValueError, match="bounds"):
        calibrate(lambda s: Gaussian(s), 1.0, 1e-5, bounds=(2.0, 1.0))


# ----------------------------------------------------------------------------------------
# the tolerance and the search's own parameters: validated, and the bisection always stops
# ----------------------------------------------------------------------------------------
def _within(seconds: int, fn):
    """``fn()``, failing (not hanging) if it has not returned after ``seconds``."""
    import signal

    def on_alarm(*_):
        raise TimeoutError(f"calibrate did not return within {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        return fn()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_rtol_below_the_float_spacing_stops_at_adjacent_floats():
    # no bracket of floats is narrower than their spacing (~2e-16 relative): the search
    # stops there, with the feasible end, instead of bisecting the same point forever
    from closed_forms import exact_gaussian_sigma

    x = _within(20, lambda: calibrate(lambda s: Gaussian(s), 1.0, 1e-5,
                                      accountant="analytic", rtol=1e-20))
    assert Gaussian(x).epsilon(1e-5, "analytic") <= 1.0
    assert abs(x / exact_gaussian_sigma(1.0, 1e-5) - 1.0) < 1e-9


@pytest.mark.parametrize("rtol", [0.0, -1e-6, math.nan, math.inf, 1.0, "1e-6", None])
def test_bad_rtol_is_refused_naming_it(rtol):
    from privlearn.errors import ParameterTypeError, ParameterValueError

    with pytest.raises((ParameterValueError, ParameterTypeError), match=r"rtol.*got"):
        _within(20, lambda: calibrate(lambda s: Gaussian(s), 1.0, 1e-5, rtol=rtol))


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_evaluations=0), "max_evaluations"), (dict(max_evaluations=2.5), "max_evaluations"),
    (dict(max_evaluations=None), "max_evaluations"), (dict(bounds=(1.0,)), "bounds"),
    (dict(bounds=5.0), "bounds"), (dict(integer="yes"), "integer")])
def test_bad_search_parameters_are_refused_naming_them(kwargs, name):
    from privlearn.errors import ParameterTypeError, ParameterValueError

    with pytest.raises((ParameterValueError, ParameterTypeError), match=rf"{name}.*got"):
        _within(20, lambda: calibrate(lambda s: Gaussian(s), 1.0, 1e-5, **kwargs))


def test_a_gaussian_at_delta_zero_is_refused_saying_it_has_no_pure_dp_guarantee():
    """Gaussian noise has no pure-DP guarantee (epsilon is infinite at delta=0 for every
    noise multiplier): the refusal says so and what to pass instead, where it only said
    'unreachable (param > 1e12)'."""
    from privlearn.accounting import CalibrationError, Gaussian, Laplace

    with pytest.raises(CalibrationError, match=r"delta=0.*no pure-DP guarantee.*delta > 0"):
        calibrate(Gaussian, epsilon=1.0, delta=0.0)
    # a mechanism with a pure-DP guarantee calibrates at delta=0 (Laplace: b = 1 / epsilon)
    assert calibrate(Laplace, epsilon=1.0, delta=0.0) == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize("true_sigma", [1.2, 1.7])
def test_noise_scale_below_the_search_floor_is_checked_not_halved_blindly(true_sigma):
    # A noise std in absolute units with a tiny sensitivity (1e-12): the feasible stds
    # reach below the search floor 1e-12. The result must meet the target (the exact
    # analytic Gaussian epsilon, Balle & Wang 2018) and be tight, not a halved value
    # that was never evaluated (it returned 9.09e-13, i.e. noise multiplier 0.909).
    sens, delta = 1e-12, 1e-5
    target = gaussian_epsilon(true_sigma, delta)
    std = calibrate(lambda s: Gaussian(s / sens), target, delta, accountant="analytic")
    assert gaussian_epsilon(std / sens, delta) <= target
    assert std / sens == pytest.approx(true_sigma, rel=1e-4)


def test_constant_feasible_family_returns_a_checked_parameter():
    seen = []

    def factory(s):
        seen.append(s)
        return Gaussian(10.0)

    x = calibrate(factory, 1.0, 1e-5)
    assert x in seen


def test_factory_that_returns_no_mechanism_is_a_typed_error():
    from privlearn.errors import ParameterTypeError

    with pytest.raises(ParameterTypeError, match="factory must return"):
        calibrate(lambda s: 1.0 / s, 1.0, 1e-5)
