"""The PLD accountant with step counts beyond 64-bit integers (Python ints >= 2^63).

A count that large makes no exact enumeration possible (counts beyond 2^53 are not
floats, and the rounding allowance of such a composition exceeds 100%), so the binary
post-processing lower bound must give up quietly: the certified upper end stands (the
Renyi-DP bound the PLD accountant falls back to at such counts) and never a bare
``TypeError`` from a NumPy object array. Checked against the central limit theorem for
Poisson-subsampled Gaussians (Bu, Dong, Long & Su 2020, Theorem 4:
``mu = q sqrt(T (e^{1/sigma^2} - 1))``), which is accurate to well under 1% at 10^18
expected participations, and against monotonicity in the number of steps.
"""

from __future__ import annotations

import math

import pytest

from privlearn.accounting import (
    DiscreteLaplace,
    Gaussian,
    Laplace,
    PureDP,
    RandomizedResponse,
    compose,
    subsample,
)
from privlearn.accounting.fdp import gdp_epsilon

_BASES = [Gaussian(1.0), Laplace(1.0), RandomizedResponse(0.7), PureDP(1.0), DiscreteLaplace(1.0)]


_CASES = [(b, steps, 3.0 / math.sqrt(steps)) for b in _BASES for steps in (2**64, 10**30)]
# the tiny rate at which the lower bound's enumeration met counts beyond int64
_CASES += [(Gaussian(1.0), steps, 1e-12) for steps in (2**64, 10**30)]


@pytest.mark.parametrize("base, steps, rate", _CASES, ids=str)
def test_huge_step_counts_are_certified_not_a_crash(base, steps: int, rate: float) -> None:
    # (rate 3 / sqrt(steps): a central-limit mu of 3 or more, an epsilon of a few)
    m = compose(subsample(base, rate), steps=steps)
    bound = m.epsilon_bounds(1e-5)
    assert math.isfinite(bound.upper) and bound.upper >= 0.0
    assert bound.lower is None or 0.0 <= bound.lower <= bound.upper
    assert bound.upper <= m.epsilon(1e-5, accountant="rdp") * (1 + 1e-12)
    fewer = compose(subsample(base, rate), steps=steps // 10).epsilon(1e-5)
    assert fewer <= bound.upper


@pytest.mark.slow
def test_two_to_the_53_steps_is_answered_not_refused() -> None:
    # (the lower bound's rounding allowance overflowed: PrivacyLossOverflowError)
    m = compose(subsample(Gaussian(1.0), 1e-12), steps=2**53)
    assert 0.0 < m.epsilon(1e-5) <= m.epsilon(1e-5, accountant="rdp") * (1 + 1e-12)


@pytest.mark.slow
def test_delta_at_a_huge_step_count_falls_back_to_rdp() -> None:
    # (the recomputation of the low frequencies overflows: the RDP bound answers, as for
    # epsilon, instead of an AccountingError)
    m = compose(subsample(Gaussian(1.0), 3.0 / 2**32), steps=2**64)
    eps = m.epsilon(1e-5)
    assert 0.0 <= m.delta(eps) <= m.delta(eps, accountant="rdp") * (1 + 1e-12)
    assert m.delta(eps) <= 1e-5 * (1 + 1e-9)


def test_huge_step_count_gaussian_matches_the_central_limit() -> None:
    q, sigma, steps = 1e-12, 1.0, 10**30
    eps = compose(subsample(Gaussian(sigma), q), steps=steps).epsilon(1e-5)
    mu = q * math.sqrt(steps * math.expm1(1.0 / sigma**2))
    assert gdp_epsilon(mu, 1e-5) <= eps <= 1.01 * gdp_epsilon(mu, 1e-5)
