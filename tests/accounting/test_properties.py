"""Property tests (Hypothesis): monotonicity, interval consistency and cross-accountant
validity of the analytic, rdp and pld accountants.

Monotonicity is a property of the exact privacy curve. For each accountant we check that
its certified interval is consistent with it: with more privacy loss (smaller noise,
larger rate, more steps, smaller delta) the upper bound may not drop below the other
case's lower bound, and the upper bound itself is monotone up to the accountant's own
resolution (1e-9 relative for analytic/rdp, the reported upper-lower gap for pld).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from privlearn.accounting import (
    Gaussian,
    Laplace,
    UnsupportedMechanismError,
    compose,
    subsample,
)

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])

sigmas = st.floats(0.6, 5.0)
rates = st.sampled_from([0.001, 256 / 60000, 0.01, 0.05, 0.1])
steps = st.integers(1, 3000)
deltas = st.sampled_from([1e-8, 1e-6, 1e-5, 1e-3])


def _bounds(m, delta, accountant):
    try:
        b = m.epsilon_bounds(delta, accountant=accountant)
    except UnsupportedMechanismError:
        pytest.skip(f"{accountant} does not support {m!r}")
    lower = b.lower if b.lower is not None else 0.0
    assert b.upper >= lower
    return lower, b.upper


def _check_monotone(more, less, delta, accountant, rel=1e-9):
    """``more`` leaks at least as much as ``less``."""
    lo_m, up_m = _bounds(more, delta, accountant)
    lo_l, up_l = _bounds(less, delta, accountant)
    assert up_m >= lo_l
    slack = max(rel * up_l, up_l - lo_l, up_m - lo_m)
    assert up_m >= up_l - slack


def _sub(sigma, q, t):
    return compose(subsample(Gaussian(sigma), q), t)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@SETTINGS
@given(s1=sigmas, s2=sigmas, q=rates, t=steps, delta=deltas)
def test_monotone_in_sigma(accountant, s1, s2, q, t, delta):
    assume(abs(s1 - s2) > 1e-6)
    lo, hi = sorted([s1, s2])
    _check_monotone(_sub(lo, q, t), _sub(hi, q, t), delta, accountant)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@SETTINGS
@given(s=sigmas, q1=rates, q2=rates, t=steps, delta=deltas)
def test_monotone_in_rate(accountant, s, q1, q2, t, delta):
    assume(q1 != q2)
    lo, hi = sorted([q1, q2])
    _check_monotone(_sub(s, hi, t), _sub(s, lo, t), delta, accountant)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@SETTINGS
@given(s=sigmas, q=rates, t1=steps, t2=steps, delta=deltas)
def test_monotone_in_steps(accountant, s, q, t1, t2, delta):
    assume(t1 != t2)
    lo, hi = sorted([t1, t2])
    _check_monotone(_sub(s, q, hi), _sub(s, q, lo), delta, accountant)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@SETTINGS
@given(s=sigmas, q=rates, t=steps, d1=deltas, d2=deltas)
def test_monotone_in_delta(accountant, s, q, t, d1, d2):
    assume(d1 != d2)
    m = _sub(s, q, t)
    small, large = sorted([d1, d2])
    lo_s, up_s = _bounds(m, small, accountant)
    lo_l, up_l = _bounds(m, large, accountant)
    assert up_s >= lo_l
    assert up_s >= up_l - max(1e-9 * up_l, up_l - lo_l, up_s - lo_s)


@SETTINGS
@given(s1=st.floats(0.05, 100.0), s2=st.floats(0.05, 100.0), k=st.integers(1, 10_000))
def test_analytic_monotone_in_sigma_and_steps(s1, s2, k):
    assume(abs(s1 - s2) > 1e-9 * max(s1, s2))
    lo, hi = sorted([s1, s2])
    _check_monotone(compose(Gaussian(lo), k), compose(Gaussian(hi), k), 1e-6, "analytic")
    _check_monotone(compose(Gaussian(lo), k + 1), compose(Gaussian(lo), k), 1e-6, "analytic")


@SETTINGS
@given(s=sigmas, q=rates, t=steps, delta=deltas)
def test_rdp_upper_bound_is_valid_against_pld_lower_bound(s, q, t, delta):
    m = _sub(s, q, t)
    rdp_up = m.epsilon(delta, accountant="rdp")
    lo, up = _bounds(m, delta, "pld")
    # two certified methods: RDP's upper bound can never be below PLD's lower bound
    assert rdp_up >= lo


# The explicit examples are far-tail cases that once took ~17 s and returned the trivial
# interval [0, 1] (NaN in the direct low-frequency recomputation of a single step).
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(s=3.0, q=0.001, t=1, delta=1e-8)
@example(s=0.3, q=0.001, t=1, delta=1e-8)
@given(s=sigmas, q=rates, t=steps, delta=deltas)
def test_pld_delta_at_rdp_epsilon_is_within_target(s, q, t, delta):
    m = _sub(s, q, t)
    rdp_up = m.epsilon(delta, accountant="rdp")
    # the delta direction agrees: at RDP's epsilon, PLD's (certified) delta is <= target
    assert m.delta(rdp_up, accountant="pld") <= delta * (1 + 1e-6)


@SETTINGS
@given(s=st.floats(0.2, 50.0), k=st.integers(1, 1000), delta=deltas)
def test_rdp_never_below_exact_gaussian(s, k, delta):
    m = compose(Gaussian(s), k)
    exact_lo, _ = _bounds(m, delta, "analytic")
    assert m.epsilon(delta, accountant="rdp") >= exact_lo


@SETTINGS
@given(b=st.floats(0.5, 20.0), q=rates, t=st.integers(1, 2000), delta=deltas)
def test_subsampled_laplace_rdp_consistent_with_pld(b, q, t, delta):
    m = compose(subsample(Laplace(b), q), t)
    rdp_up = m.epsilon(delta, accountant="rdp")
    lo, _ = _bounds(m, delta, "pld")
    assert rdp_up >= lo
    assert rdp_up <= t * math.log1p(q * math.expm1(1 / b)) * (1 + 1e-12)  # pure-DP cap
