"""The PLD accountant's certified lower bound where the grid's dominated pair certifies
nothing (small noise multipliers at tiny sampling rates: the grid spacing exceeds the
single-step losses near 0): the lower end is a real bound, checked against Google
dp_accounting's optimistic estimate, never 0 while the peer's value is far above 0."""

from __future__ import annotations

import functools

import pytest

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
