"""The PLD accountant's certified lower bound where the grid's dominated pair certifies
nothing (small noise multipliers at tiny sampling rates: the grid spacing exceeds the
single-step losses near 0): the lower end is a real bound, checked against Google
dp_accounting's optimistic estimate, never 0 while the peer's value is far above 0."""

from __future__ import annotations

import functools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from privlearn.accounting import Gaussian, compose, subsample

SIGMA, Q, STEPS, DELTA, EPS = 0.3, 1e-5, 100, 1e-5, 1.0


@functools.cache
def _peer(pessimistic: bool):
    from dp_accounting.pld import privacy_loss_distribution as pld

    return pld.from_gaussian_mechanism(
        SIGMA,
        sampling_prob=Q,
        value_discretization_interval=1e-3,
        pessimistic_estimate=pessimistic,
        use_connect_dots=pessimistic,
    ).self_compose(STEPS)


@pytest.mark.parametrize(
    "scheme, sigma",
    [("poisson", SIGMA), pytest.param("fixed", 2 * SIGMA, marks=pytest.mark.slow)],
)
def test_lower_bound_is_informative_at_a_tiny_rate(scheme: str, sigma: float) -> None:
    # the lower ends were 0.0 (epsilon) and 0.0 (delta) while the exact epsilon is ~1.34;
    # fixed-size sampling at twice the noise multiplier attains the same one-direction
    # composition (the record +C, every other -C), so the peer's value bounds it too
    pytest.importorskip("dp_accounting")
    low, up = _peer(False), _peer(True)
    m = compose(subsample(Gaussian(sigma), Q, scheme=scheme), STEPS)
    b = m.epsilon_bounds(DELTA)
    assert b.lower <= b.upper
    assert b.lower <= up.get_epsilon_for_delta(DELTA)  # certified: below the peer's bound
    assert b.lower >= 0.9 * low.get_epsilon_for_delta(DELTA)  # and not vacuous
    d = m.delta_bounds(EPS)
    assert d.lower <= d.upper
    assert d.lower <= up.get_delta_for_epsilon(EPS)
    assert d.lower >= 0.9 * low.get_delta_for_epsilon(EPS)


def _log_uniform(lo: float, hi: float):
    return st.floats(math.log(lo), math.log(hi)).map(math.exp)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sigma=_log_uniform(0.3, 3.0),
    q=_log_uniform(1e-5, 1e-2),
    steps=st.integers(1, 200),
    delta=_log_uniform(1e-10, 1e-3),
    relation=st.sampled_from(["add_remove", "replace_one"]),
)
def test_certified_bracket_holds_the_peers_value(sigma, q, steps, delta, relation) -> None:
    # randomized: the certified bracket [lower, upper] contains the exact epsilon, so it
    # meets dp_accounting's [optimistic, pessimistic] interval, and the lower end is a
    # real bound (at least half the peer's optimistic value), never the vacuous 0
    pytest.importorskip("dp_accounting")
    from dp_accounting import privacy_accountant as pa
    from dp_accounting.pld import privacy_loss_distribution as pld

    rel = (
        pa.NeighboringRelation.ADD_OR_REMOVE_ONE
        if relation == "add_remove"
        else pa.NeighboringRelation.REPLACE_ONE
    )
    peer = [
        pld.from_gaussian_mechanism(
            sigma,
            sampling_prob=q,
            neighboring_relation=rel,
            value_discretization_interval=1e-3,
            pessimistic_estimate=p,
            use_connect_dots=p,
        )
        .self_compose(steps)
        .get_epsilon_for_delta(delta)
        for p in (False, True)
    ]
    b = compose(subsample(Gaussian(sigma), q, neighbouring=relation), steps).epsilon_bounds(delta)
    assert b.lower <= b.upper
    assert b.upper >= peer[0] * (1 - 2e-3) - 1e-9, (b, peer)
    assert b.lower <= peer[1] * (1 + 2e-3) + 1e-9, (b, peer)
    assert b.lower >= 0.5 * peer[0], (b, peer)
