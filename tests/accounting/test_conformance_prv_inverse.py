"""prv_accountant's tests/test_discrete_privacy_random_variable.py: the privacy curve and
its inverse agree (``delta(epsilon(delta)) == delta``), through privlearn's certified
brackets: the delta at the upper epsilon is at most the target, the delta at the lower
epsilon at least the target, and both within the bracket's own width of it.

prv_accountant checks its estimate against the target with pytest.approx (relative 1e-6)
for a Poisson-subsampled Gaussian (q 1e-3, sigma 1) and an (0.01, 1e-8)-DP mechanism,
each composed 100 times.
"""

from __future__ import annotations

import pytest

from privlearn.accounting import ApproxDP, Gaussian, compose, subsample


@pytest.mark.parametrize(
    "mechanism, delta",
    [
        *[("sampled_gaussian", d) for d in (1e-5, 1e-6, 1e-7)],
        *[("approx_dp", d) for d in (1e-3, 1e-4, 1e-5)],
    ],
)
def test_inverse_privacy_curve(mechanism: str, delta: float) -> None:
    if mechanism == "sampled_gaussian":
        m = compose(subsample(Gaussian(1.0), 1e-3), 100)
    else:
        m = compose(ApproxDP(0.01, 1e-8), 100)
    b = m.epsilon_bounds(delta)
    assert b.lower <= b.upper <= b.lower * (1 + 1e-3)
    at_upper = m.delta_bounds(b.upper)
    at_lower = m.delta_bounds(b.lower)
    # the certified epsilon meets the target; the lower one does not undercut it
    assert at_upper.lower <= at_upper.upper <= delta * (1 + 1e-12)
    assert at_lower.upper >= delta * (1 - 1e-12)
    # and the curve is inverted to the bracket's width (prv_accountant: relative 1e-6 on
    # its estimate)
    assert at_upper.upper == pytest.approx(delta, rel=1e-3)
    assert at_lower.lower == pytest.approx(delta, rel=1e-3)


def test_inverse_privacy_curve_beyond_the_loss_grid() -> None:
    # a step whose privacy loss exceeds the grid's range (noise 5e-4: losses beyond 1e6):
    # epsilon falls back to the RDP accountant's certified value; delta at that epsilon
    # raised PrivacyLossOverflowError instead of doing the same
    m = compose(subsample(Gaussian(5e-4), 0.1), 100)
    eps = m.epsilon(1e-5)
    b = m.delta_bounds(eps)
    assert b.accountant == "rdp"
    assert b.lower <= b.upper <= 1e-5 * (1 + 1e-9)
    assert b.upper == m.delta(eps, "rdp")
    # with the fallback off, the refusal stays
    from privlearn.accounting.pld import PLDAccountant
    from privlearn.errors import PrivacyLossOverflowError

    with pytest.raises(PrivacyLossOverflowError):
        PLDAccountant(fallback=False).delta(m, eps)
