"""The public step-by-step accountant: only steps that can have run enter its history.

A step recorded with values no sampler or optimizer can have used (a negative noise
multiplier, a sampling rate outside (0, 1], ...) used to be stored as it was and made
every later ``epsilon()`` raise; a saved history with a negative or fractional step
count was loaded as it was (``steps`` then disagreed with the epsilon), and loading a
history over one that already had steps dropped them.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torch")

from privlearn.accounting import Gaussian, compose, subsample  # noqa: E402
from privlearn.errors import (  # noqa: E402
    ConfigurationError,
    ParameterTypeError,
    ParameterValueError,
)
from privlearn.torch import PrivacyAccountant  # noqa: E402

DELTA = 1e-5


def _ten_steps() -> PrivacyAccountant:
    acct = PrivacyAccountant()
    for _ in range(10):
        acct.record_step(noise_multiplier=1.0, sampling_rate=0.1, max_grad_norm=1.0)
    return acct


@pytest.mark.parametrize("step, name", [
    (dict(noise_multiplier=-1.0, sampling_rate=0.1, max_grad_norm=1.0), "noise_multiplier"),
    (dict(noise_multiplier=math.nan, sampling_rate=0.1, max_grad_norm=1.0),
     "noise_multiplier"),
    (dict(noise_multiplier=math.inf, sampling_rate=0.1, max_grad_norm=1.0),
     "noise_multiplier"),
    (dict(noise_multiplier=1.0, sampling_rate=1.5, max_grad_norm=1.0), "sampling_rate"),
    (dict(noise_multiplier=1.0, sampling_rate=0.0, max_grad_norm=1.0), "sampling_rate"),
    (dict(noise_multiplier=1.0, sampling_rate=-0.1, max_grad_norm=1.0), "sampling_rate"),
    (dict(noise_multiplier=1.0, sampling_rate=0.1, max_grad_norm=-1.0), "max_grad_norm"),
    (dict(noise_multiplier=1.0, sampling_rate=0.1, max_grad_norm=0.0), "max_grad_norm"),
    (dict(noise_multiplier=1.0, sampling_rate=0.1, max_grad_norm=math.inf), "max_grad_norm"),
])
def test_record_step_refuses_a_step_that_cannot_have_run(step, name):
    acct = _ten_steps()
    before = acct.epsilon(DELTA)
    with pytest.raises(ParameterValueError, match=name):
        acct.record_step(**step)
    assert acct.steps == 10 and len(acct.segments) == 1
    assert acct.epsilon(DELTA) == before  # still computable, and unchanged


def test_record_step_refuses_a_value_of_the_wrong_type():
    acct = PrivacyAccountant()
    with pytest.raises(ParameterTypeError, match="noise_multiplier"):
        acct.record_step(noise_multiplier="1.0", sampling_rate=0.1, max_grad_norm=1.0)
    assert acct.steps == 0


def test_record_step_without_noise_or_clipping_is_an_infinite_epsilon():
    acct = _ten_steps()
    acct.record_step(noise_multiplier=0.0, sampling_rate=0.1, max_grad_norm=math.inf)
    assert acct.steps == 11 and acct.epsilon(DELTA) == math.inf


def test_recorded_steps_are_the_composed_subsampled_gaussian():
    """The history's epsilon is the composition of its steps (built independently)."""
    acct = _ten_steps()
    for _ in range(5):
        acct.record_step(noise_multiplier=2.0, sampling_rate=0.2, max_grad_norm=0.5)
    ref = compose([subsample(Gaussian(noise_multiplier=1.0), rate=0.1),
                   subsample(Gaussian(noise_multiplier=2.0), rate=0.2)], steps=[10, 5])
    assert acct.steps == 15
    assert acct.epsilon(DELTA) == pytest.approx(ref.epsilon(DELTA, accountant="pld"),
                                                rel=1e-9)


@pytest.mark.parametrize("kwargs, name", [(dict(scheme="shuffle"), "scheme"),
                                          (dict(accountant="gdp"), "accountant")])
def test_unknown_scheme_or_accountant_refused_when_built(kwargs, name):
    with pytest.raises(ParameterValueError, match=name):
        PrivacyAccountant(**kwargs)


@pytest.mark.parametrize("segment", [
    [1.0, 0.1, 1.0, -5],      # a negative count: steps and epsilon disagreed
    [1.0, 0.1, 1.0, 0],       # a segment of no steps
    [1.0, 0.1, 1.0, 2.7],     # a fractional count (was truncated to 2)
    [-1.0, 0.1, 1.0, 3],      # a noise multiplier no step can have used
    [1.0, 1.5, 1.0, 3],       # a sampling rate above 1
])
def test_load_state_dict_refuses_a_history_that_cannot_have_run(segment):
    state = _ten_steps().state_dict()
    state["segments"].append(segment)
    fresh = PrivacyAccountant()
    with pytest.raises((ParameterValueError, ParameterTypeError)):
        fresh.load_state_dict(state)
    assert fresh.steps == 0 and fresh.segments == ()


def test_load_state_dict_into_an_accountant_with_steps_is_refused():
    """Loading an older history over a longer one would drop steps from epsilon."""
    saved = _ten_steps().state_dict()
    acct = _ten_steps()
    for _ in range(5):
        acct.record_step(noise_multiplier=1.0, sampling_rate=0.1, max_grad_norm=1.0)
    before = acct.epsilon(DELTA)
    with pytest.raises(ConfigurationError, match="no steps"):
        acct.load_state_dict(saved)
    assert acct.steps == 15 and acct.epsilon(DELTA) == before


def test_state_round_trip_keeps_steps_and_epsilon():
    acct = _ten_steps()
    acct.record_step(noise_multiplier=2.0, sampling_rate=0.1, max_grad_norm=1.0)
    fresh = PrivacyAccountant()
    fresh.load_state_dict(acct.state_dict())
    assert fresh.segments == acct.segments and fresh.steps == 11
    assert fresh.epsilon(DELTA) == acct.epsilon(DELTA)


@pytest.mark.parametrize("history", ["none", "noiseless", "noisy"])
@pytest.mark.parametrize("delta, error", [
    (-1e-5, ParameterValueError), (1.5, ParameterValueError), (math.nan, ParameterValueError),
    ("1e-5", ParameterTypeError), (None, ParameterTypeError)])
def test_epsilon_refuses_a_bad_delta_whatever_the_history(history, delta, error):
    """A delta outside [0, 1] is refused, naming it, before any step and after a step
    without noise too (it answered 0 and inf there, as if the delta were valid)."""
    acct = PrivacyAccountant()
    if history != "none":
        acct.record_step(noise_multiplier=0.0 if history == "noiseless" else 1.0,
                         sampling_rate=0.1, max_grad_norm=1.0)
    with pytest.raises(error, match="delta"):
        acct.epsilon(delta)


def test_room_past_2_to_the_40_steps_is_a_checked_count():
    # the doubling search stops past 2**40 steps: what it returns must itself be within
    # the cap (it returned 2**40, never evaluated, with f(2**40) = 2**0.4 > 1 here)
    from privlearn.torch.accountant import _largest_within

    def f(k):
        return k / 2**39.6

    room = _largest_within(f, 1.0)
    assert f(room) <= 1.0
    assert room >= 2**39


@pytest.mark.parametrize("corrupt", [
    lambda st: st.pop("segments"),
    lambda st: st.pop("scheme"),
    lambda st: st.pop("accountant"),
    lambda st: st.__setitem__("segments", [[1.0, 0.1, 1.0]]),  # a row missing its count
    lambda st: st.__setitem__("segments", 7),
])
def test_load_state_dict_names_a_missing_or_malformed_entry(corrupt):
    """A truncated or hand-edited state is refused with a typed error (it raised a bare
    KeyError, TypeError or unpacking ValueError), and nothing is loaded."""
    state = _ten_steps().state_dict()
    corrupt(state)
    fresh = PrivacyAccountant()
    with pytest.raises((ParameterTypeError, ParameterValueError), match="state"):
        fresh.load_state_dict(state)
    assert fresh.steps == 0 and fresh.segments == ()
