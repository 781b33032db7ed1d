"""Randomized response at (or a hair above) the uniform truth probability ``1/k``.

``RandomizedResponse(1/k, k)`` reports a uniformly random category: its output does not
depend on the input. In floats ``1/k`` is often a hair *below* the real ``1/k`` (k = 3, 6,
7, 9, ...), so the true category is then the slightly *less* likely output and the privacy
loss is ``log(r / p) > 0``, ``r = (1 - p) / (k - 1)``. Google dp_accounting's
``RandomizedResponseDpEvent(noise_parameter=1.0, num_buckets=k)`` (its RDP accountant
answers epsilon 0) converts to exactly this float.

Every answer must stay a certified, non-negative bound: at least the exact largest
privacy loss ``|log(p (k-1) / (1-p))|`` of the float ``p`` at delta 0, and a number (not a
refusal of our own internal value) at delta > 0.
"""

from __future__ import annotations

import decimal
import math
from fractions import Fraction

import numpy as np
import pytest

from privlearn.accounting import RandomizedResponse, compose, subsample

# k where float(1/k) is below the real 1/k (3, 7), equal to it (2), above it (10)
_KS = [2, 3, 6, 7, 9, 10, 1000]
_ORDERS = [1.25, 1.5, 2.0, 3.0, 10.0, 64.0]


def _exact_pure_epsilon(p: float, k: int) -> decimal.Decimal:
    """``|ln(p (k-1) / (1-p))|`` of the float ``p``, in 60-digit decimal arithmetic."""
    ratio = Fraction(p) * (k - 1) / (1 - Fraction(p))
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        value = (decimal.Decimal(ratio.numerator) / decimal.Decimal(ratio.denominator)).ln()
    return abs(value)


def _truth_probabilities(k: int) -> list[float]:
    return [1.0 / k, math.nextafter(1.0 / k, 1.0), 1.0 / k + 1e-9]


@pytest.mark.parametrize("k", _KS)
@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_near_uniform_randomized_response_is_certified_and_non_negative(
    k: int, accountant: str
) -> None:
    for p in _truth_probabilities(k):
        m = RandomizedResponse(p, k)
        exact = _exact_pure_epsilon(p, k)
        assert m.pure_epsilon >= 0.0
        assert abs(decimal.Decimal(m.pure_epsilon) - exact) <= decimal.Decimal(1e-15) * (exact + 1)
        eps0 = m.epsilon(0.0, accountant=accountant)
        assert decimal.Decimal(eps0) >= exact  # never below the exact pure epsilon
        assert eps0 <= float(exact) + 1e-14
        eps = m.epsilon(1e-6, accountant=accountant)  # a number, not a refusal
        assert 0.0 <= eps <= eps0
        assert 0.0 <= m.delta(0.0, accountant=accountant) <= 1e-6
        composed = compose(subsample(m, 0.3), steps=5)
        assert 0.0 <= composed.epsilon(1e-6, accountant=accountant)
        assert decimal.Decimal(composed.epsilon(0.0, accountant=accountant)) >= 0
    rdp = np.asarray(RandomizedResponse(1.0 / k, k).rdp(_ORDERS))
    assert np.all(rdp >= 0.0) and np.all(rdp <= 1e-14)


@pytest.mark.parametrize("k", [3, 7, 10])
@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_fully_random_dp_accounting_event_agrees_with_its_rdp_accountant(
    k: int, accountant: str
) -> None:
    dpa = pytest.importorskip("dp_accounting")
    from dp_accounting.rdp import rdp_privacy_accountant

    from privlearn.compat.dp_events import from_dp_event

    event = dpa.SelfComposedDpEvent(dpa.RandomizedResponseDpEvent(1.0, k), 10)
    peer = rdp_privacy_accountant.RdpAccountant(
        neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE
    )
    peer.compose(event)
    m = from_dp_event(event, dpa.NeighboringRelation.REPLACE_ONE)
    ours = m.epsilon(1e-6, accountant=accountant)
    assert 0.0 <= ours <= peer.get_epsilon(1e-6) + 1e-12
    assert 0.0 <= m.epsilon(0.0, accountant=accountant) <= 1e-13
