"""Agreement with the peer accountants (Google dp_accounting, autodp) and with closed
forms on the configurations where an earlier version was optimistic, needlessly loose or
refused; the peer-based checks are skipped when the peer is not installed.
(``benchmarks/accounting_vs_peers.py`` runs the whole grid.)"""

from __future__ import annotations

import math

import pytest

from privlearn.accounting import Gaussian, RDPMechanism, compose, subsample


# ----------------------------------------------------------------------------------------
# RDP -> (epsilon, delta): the total-variation bound (Bretagnolle & Huber 1979)
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("sigma", [1.0, 10.0, 1e3])
def test_rdp_delta_at_zero_within_the_tv_bound(sigma: float) -> None:
    # Gaussian: KL = 1 / (2 sigma^2), so delta(0) = TV <= sqrt(1 - exp(-1 / (2 sigma^2)))
    bound = math.sqrt(-math.expm1(-0.5 / sigma**2))
    assert Gaussian(sigma).delta(0.0, "rdp") <= bound * (1 + 1e-6)
    # and never below the exact total variation 2 Phi(1 / (2 sigma)) - 1
    exact = math.erf(1.0 / (2.0 * sigma * math.sqrt(2.0)))
    assert Gaussian(sigma).delta(0.0, "rdp") >= exact


def test_rdp_epsilon_is_zero_once_the_tv_bound_meets_delta() -> None:
    # the curve of a Gaussian with rho = 1e-12 (tau(alpha) = rho alpha): TV <= ~1e-6, while
    # the order-wise conversion alone gives about 2 sqrt(rho log(1/delta)) > 0
    m = RDPMechanism(lambda a: 1e-12 * a)
    assert m.epsilon(1e-5, "rdp") == 0.0
    assert m.delta(0.0, "rdp") <= 1.0000001e-6
    assert m.epsilon(1e-7, "rdp") > 0.0


@pytest.mark.parametrize("q, sigma, steps", [(0.001, 0.8, 1), (0.01, 1.0, 1), (0.1, 1.0, 1),
                                             (0.001, 2.0, 100), (1.0, 1e5, 1)])
def test_rdp_delta_not_looser_than_dp_accounting(q: float, sigma: float, steps: int) -> None:
    pytest.importorskip("dp_accounting")
    from dp_accounting import dp_event
    from dp_accounting.rdp import RdpAccountant

    acc = RdpAccountant()
    acc.compose(dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps))
    m = compose(subsample(Gaussian(sigma), q), steps)
    for eps in (0.0, 0.05, 0.5, 1.0):
        peer = acc.get_delta(eps)
        ours = m.delta(eps, "rdp")
        assert ours <= peer * (1 + 1e-6) + 1e-300, (eps, ours, peer)
        assert ours >= m.delta_bounds(eps).lower  # never below the certified PLD lower bound
    assert m.epsilon(1e-5, "rdp") <= acc.get_epsilon(1e-5) * (1 + 1e-6)
