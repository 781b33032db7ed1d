"""Hypothesis properties across the accountant's methods (closed forms, the PLD grid, the
screened calibration).

* adding a step to a composition never lowers epsilon: the larger composition's
  certified upper bound is never below the smaller one's certified lower bound, also
  where adding the step moves the answer from one method to another (a Gaussian step
  takes a composition of pure-DP, randomized-response and (eps, delta) steps off its
  closed form onto the grid; an (eps, delta) step takes Gaussians off their analytic
  curve);
* calibration round trip, for a noise multiplier (epsilon decreasing) and a number of
  steps (increasing): the returned parameter meets the target, and the next one does not.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from privlearn.accounting import (
    ApproxDP,
    Gaussian,
    Laplace,
    PureDP,
    RandomizedResponse,
    calibrate,
    compose,
    subsample,
)

SMALL = settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _log_uniform(lo: float, hi: float):
    return st.floats(math.log(lo), math.log(hi)).map(math.exp)


_step = st.one_of(
    st.builds(PureDP, st.floats(0.01, 1.0)),
    st.builds(RandomizedResponse, st.floats(0.51, 0.8)),
    st.builds(ApproxDP, st.floats(0.01, 1.0), _log_uniform(1e-12, 1e-8)),
    st.builds(Laplace, _log_uniform(1.0, 20.0)),
    st.builds(Gaussian, _log_uniform(1.0, 20.0)),
    st.builds(lambda s, q: subsample(Gaussian(s), q), _log_uniform(0.7, 5.0),
              _log_uniform(1e-3, 0.1)),
)


@SMALL
@given(parts=st.lists(st.tuples(_step, st.integers(1, 20)), min_size=1, max_size=3),
       extra=st.tuples(_step, st.integers(1, 20)), delta=_log_uniform(1e-7, 1e-3))
def test_adding_a_step_never_lowers_epsilon(parts, extra, delta) -> None:
    small = compose([m for m, _ in parts], steps=[k for _, k in parts])
    big = compose([m for m, _ in parts] + [extra[0]], steps=[k for _, k in parts] + [extra[1]])
    a, b = small.epsilon_bounds(delta), big.epsilon_bounds(delta)
    for x in (a, b):
        assert math.isfinite(x.upper) and x.upper >= 0.0
        assert x.lower is None or 0.0 <= x.lower <= x.upper
    a_low = a.lower if a.lower is not None else 0.0
    assert b.upper >= a_low * (1 - 1e-12), (parts, extra, delta, a, b)


@SMALL
@given(q=_log_uniform(1e-3, 1.0), steps=st.integers(1, 300), eps=_log_uniform(0.2, 10.0),
       delta=_log_uniform(1e-9, 1e-4))
def test_calibrated_noise_multiplier_round_trip(q, steps, eps, delta) -> None:
    def factory(s):
        return compose(subsample(Gaussian(s), q), steps)

    s = calibrate(factory, eps, delta, rtol=1e-5)
    assert factory(s).epsilon(delta) <= eps
    assert factory(s * (1 - 1e-4)).epsilon(delta) > eps


@pytest.mark.slow
@SMALL
@given(q=_log_uniform(1e-3, 0.1), s=_log_uniform(0.8, 5.0), eps=_log_uniform(0.5, 8.0))
def test_calibrated_steps_round_trip(q, s, eps) -> None:
    def factory(k):
        return compose(subsample(Gaussian(s), q), k)

    lo = factory(1).epsilon(1e-5)
    if lo > eps:
        return  # one step already exceeds the target
    k = calibrate(factory, eps, 1e-5, integer=True, bounds=(1, 10**6))
    assert factory(k).epsilon(1e-5) <= eps
    if k < 10**6:
        assert factory(k + 1).epsilon(1e-5) > eps
