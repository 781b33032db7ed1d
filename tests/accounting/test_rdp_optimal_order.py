"""``RDPAccountant.epsilon_and_order`` against Google dp_accounting's
``get_epsilon_and_optimal_order`` (the same conversion, Canonne, Kamath & Steinke 2020,
Proposition 12): the epsilon is the RDP accountant's, the order reproduces it, and it sits
where dp_accounting's (coarser) order grid puts its optimum."""

from __future__ import annotations

import math

import numpy as np
import pytest

from privlearn.accounting import Gaussian, Laplace, compose, get_accountant, subsample
from privlearn.accounting.conversion import epsilon_from_rdp

dp_event = pytest.importorskip("dp_accounting.dp_event")
rdp_acc = pytest.importorskip("dp_accounting.rdp.rdp_privacy_accountant")


@pytest.mark.parametrize(
    "sigma,q,steps,delta",
    [(1.1, 0.01, 1000, 1e-5), (0.8, 0.004, 10000, 1e-7), (5.0, 1.0, 1, 1e-5), (2.0, 0.1, 50, 1e-9)],
)
def test_order_reproduces_the_epsilon_and_matches_dp_accounting(sigma, q, steps, delta) -> None:
    base = subsample(Gaussian(sigma), q) if q < 1 else Gaussian(sigma)
    m = compose(base, steps=steps)
    eps, alpha = get_accountant("rdp").epsilon_and_order(m, delta)
    assert eps == m.epsilon(delta, accountant="rdp")
    again = float(epsilon_from_rdp(np.array([alpha]), np.atleast_1d(m.rdp(alpha)), delta)[0])
    assert again == pytest.approx(eps, rel=1e-9)
    event = dp_event.GaussianDpEvent(sigma)
    if q < 1:
        event = dp_event.PoissonSampledDpEvent(q, event)
    acc = rdp_acc.RdpAccountant()
    acc.compose(dp_event.SelfComposedDpEvent(event, steps))
    their_eps, their_alpha = acc.get_epsilon_and_optimal_order(delta)
    assert eps <= their_eps * (1 + 1e-9)
    assert alpha == pytest.approx(float(their_alpha), rel=0.1)


def test_pure_answer_has_infinite_order() -> None:
    m = compose(Laplace(1.0), steps=3)
    assert get_accountant("rdp").epsilon_and_order(m, 0.0) == (m.epsilon(0.0, "rdp"), math.inf)
    eps, alpha = get_accountant("rdp").epsilon_and_order(m, 1e-300)  # the cap binds
    assert alpha == math.inf and eps == m.epsilon(1e-300, "rdp")
