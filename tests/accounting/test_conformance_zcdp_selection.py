"""ZCDP and RepeatAndSelect kinds against Google dp_accounting's ZCDpEvent and
RepeatAndSelectDpEvent (RDP accountant), and against closed forms.

Ratios are privlearn / dp_accounting epsilon (both certified upper bounds; below 1 means
privlearn is tighter). Measured worst ratios (seeded grids below): ZCDP 1.0000 (dp_accounting
minimises over a fixed order grid, privlearn refines over real orders), RepeatAndSelect
1.0005 (the truncated negative binomial's gamma is taken on the conservative side).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import norm

from privlearn.accounting import (
    ZCDP,
    Gaussian,
    Laplace,
    RepeatAndSelect,
    UnsupportedMechanismError,
    compose,
    subsample,
)
from privlearn.accounting.repeat_select import _expected_runs, _gamma_below
from privlearn.accounting.serialization import mechanism_from_dict, mechanism_to_dict

dp_event = pytest.importorskip("dp_accounting.dp_event")
rdp_acc = pytest.importorskip("dp_accounting.rdp.rdp_privacy_accountant")


def _dpa_epsilon(event, delta: float) -> float:
    acc = rdp_acc.RdpAccountant()
    acc.compose(event)
    return float(acc.get_epsilon(delta))


def _gaussian_delta(sigma: float, eps: float) -> float:
    """The exact privacy profile of the Gaussian mechanism (Balle & Wang 2018, Thm 8)."""
    return float(
        norm.cdf(-eps * sigma + 0.5 / sigma) - math.exp(eps) * norm.cdf(-eps * sigma - 0.5 / sigma)
    )


# -- ZCDP ----------------------------------------------------------------------------------
def _zcdp_grid():
    rng = np.random.default_rng(20261130)
    for _ in range(24):
        yield (
            float(10 ** rng.uniform(-3, 0.7)),
            float(rng.choice([0.0, 0.0, 0.01, 0.2])),
            int(rng.choice([1, 7, 100])),
            float(10 ** -rng.uniform(3, 10)),
        )


def test_zcdp_against_dp_accounting_and_the_gaussian_lower_bound() -> None:
    worst = 0.0
    for rho, xi, k, delta in _zcdp_grid():
        ours = compose(ZCDP(rho, xi), steps=k).epsilon(delta, accountant="rdp")
        theirs = _dpa_epsilon(dp_event.SelfComposedDpEvent(dp_event.ZCDpEvent(rho, xi), k), delta)
        worst = max(worst, ours / theirs)
        if xi == 0.0:
            # the Gaussian with rho = 1 / (2 sigma^2) is rho-zCDP, so every certified
            # epsilon for the class is at least the Gaussian's exact one
            sigma = 1.0 / math.sqrt(2.0 * rho * k)
            assert _gaussian_delta(sigma, ours) <= delta, (rho, k, delta)
    assert worst <= 1.0 + 1e-6, worst


def test_zcdp_curve_is_the_definition() -> None:
    alphas = np.array([1.01, 2.0, 7.5, 1e4])
    got = ZCDP(0.3, 0.02).rdp(alphas)
    exact = 0.02 + 0.3 * alphas
    assert np.all(got >= exact) and np.allclose(got, exact, rtol=1e-14, atol=0)
    # pure zCDP with rho = 0 is xi-DP (the order -> inf limit); otherwise no pure epsilon
    assert ZCDP(0.0, 0.25).epsilon(0.0, accountant="rdp") == 0.25
    assert ZCDP(0.1).epsilon(0.0, accountant="rdp") == math.inf


def test_subsampled_zcdp_is_not_below_the_subsampled_gaussian() -> None:
    # the Gaussian with the same rho is in the class: its optimistic PLD epsilon
    # (dp_accounting) is a lower bound for any certified bound of subsampled rho-zCDP
    pld = pytest.importorskip("dp_accounting.pld.privacy_loss_distribution")
    for rho, q, steps in [(0.5, 0.01, 1000), (0.1, 0.05, 200)]:
        sigma = 1.0 / math.sqrt(2.0 * rho)
        ours = compose(subsample(ZCDP(rho), q), steps=steps).epsilon(1e-5, accountant="rdp")
        lower = pld.from_gaussian_mechanism(
            sigma, sampling_prob=q, pessimistic_estimate=False, value_discretization_interval=1e-3
        ).self_compose(steps)
        assert ours >= lower.get_epsilon_for_delta(1e-5)


def test_zcdp_group_privacy_and_refusals() -> None:
    # fixed-size sampling under add/remove reads the base two records apart: 4 rho
    # (Bun & Steinke 2016, group privacy)
    m = subsample(ZCDP(0.1), 1.0, scheme="fixed", neighbouring="add_remove")
    assert float(m.rdp(3.0)) >= 4 * 0.1 * 3.0
    assert float(m.rdp(3.0)) == pytest.approx(4 * 0.1 * 3.0, rel=1e-12)
    with pytest.raises(UnsupportedMechanismError, match="xi > 0"):
        subsample(ZCDP(0.1, 0.01), 1.0, scheme="fixed", neighbouring="add_remove").rdp(3.0)
    with pytest.raises(UnsupportedMechanismError, match="accountant='rdp'"):
        ZCDP(0.1).epsilon(1e-6)  # a curve, not a dominating pair: the PLD refuses it
    with pytest.raises(ValueError, match="rho"):
        ZCDP(-1.0)
    m = compose([ZCDP(0.1, 0.01), subsample(Gaussian(1.0), 0.01)], steps=[2, 10])
    assert mechanism_from_dict(mechanism_to_dict(m)) == m


# -- RepeatAndSelect -----------------------------------------------------------------------
_CASES = [  # (sigma, q, steps): the base run
    (1.0, 0.01, 1000),
    (2.0, 1.0, 10),
    (5.0, 1.0, 1),
    (1.2, 0.004, 5000),
]


@pytest.mark.parametrize("sigma,q,steps", _CASES)
def test_repeat_and_select_against_dp_accounting(sigma: float, q: float, steps: int) -> None:
    base_event = (
        dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma))
        if q < 1
        else dp_event.GaussianDpEvent(sigma)
    )
    base = subsample(Gaussian(sigma), q) if q < 1 else Gaussian(sigma)
    run, run_event = compose(base, steps=steps), dp_event.SelfComposedDpEvent(base_event, steps)
    worst = 0.0
    for mean in (1.5, 10.0, 100.0):
        for shape in (0.0, 0.5, 1.0, 3.0, math.inf):
            acc = rdp_acc.RdpAccountant()
            acc.compose(dp_event.RepeatAndSelectDpEvent(run_event, mean, shape))
            for delta in (1e-5, 1e-8):
                ours = RepeatAndSelect(run, mean, shape).epsilon(delta, accountant="rdp")
                worst = max(worst, ours / acc.get_epsilon(delta))
    assert worst <= 1.002, worst


def test_repeat_and_select_of_one_run_is_the_run() -> None:
    run = compose(subsample(Gaussian(1.0), 0.02), steps=300)
    for shape in (0.0, 1.0, 3.0):  # K >= 1 with mean 1: exactly one run
        assert RepeatAndSelect(run, 1.0, shape).epsilon(1e-6, "rdp") == run.epsilon(1e-6, "rdp")
    # a Poisson K of mean 1 can be 2 or more (or 0): Theorem 6, as dp_accounting has it
    acc = rdp_acc.RdpAccountant()
    event = dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(0.02, dp_event.GaussianDpEvent(1.0)), 300
    )
    acc.compose(dp_event.RepeatAndSelectDpEvent(event, 1.0, math.inf))
    ours = RepeatAndSelect(run, 1.0, math.inf).epsilon(1e-6, "rdp")
    assert ours == pytest.approx(acc.get_epsilon(1e-6), rel=2e-3)
    assert ours > run.epsilon(1e-6, "rdp")


def test_repeat_and_select_curve_is_monotone_and_above_the_run() -> None:
    run = compose(Laplace(2.0), steps=3)
    alphas = np.concatenate([1.0 + np.geomspace(1e-3, 1.0, 20), np.linspace(2, 300, 97)])
    for shape in (0.0, 1.0, 2.5, math.inf):
        curve = RepeatAndSelect(run, 20.0, shape).rdp(alphas)
        assert np.all(np.diff(curve) >= 0), shape
        assert np.all(curve >= run.rdp(alphas)), shape


@pytest.mark.parametrize("eta", [0.0, 0.3, 1.0, 4.0])
@pytest.mark.parametrize("mean", [1.0 + 1e-6, 2.0, 37.0, 1e5])
def test_gamma_is_on_the_conservative_side(eta: float, mean: float) -> None:
    # E[K] decreases in gamma, so E[K](gamma) >= mean means gamma is at most the exact
    # one and the log(1/gamma) term of Theorem 2 is never under-stated; dp_accounting
    # returns its own conservative gamma, which ours must not exceed by more than rounding
    gamma = _gamma_below(eta, mean)
    assert _expected_runs(eta, gamma) >= mean
    theirs = rdp_acc._gamma_truncated_negative_binomial(eta, mean)
    assert gamma <= theirs * (1 + 1e-6)


def test_repeat_and_select_refusals_and_storage() -> None:
    with pytest.raises(UnsupportedMechanismError, match="add/remove"):
        RepeatAndSelect(compose(subsample(Gaussian(1.0), 0.1, scheme="fixed"), steps=3), 5, 1)
    with pytest.raises(UnsupportedMechanismError, match="add/remove"):
        RepeatAndSelect(subsample(Gaussian(1.0), 0.1, neighbouring="remove_only"), 5, 1)
    with pytest.raises(ValueError, match="mean"):
        RepeatAndSelect(Gaussian(1.0), 0.5, 1)
    with pytest.raises(ValueError, match="shape"):
        RepeatAndSelect(Gaussian(1.0), 5, -1)
    with pytest.raises(UnsupportedMechanismError, match="accountant='rdp'"):
        RepeatAndSelect(Gaussian(1.0), 5, 1).epsilon(1e-6)
    # a selection composed with a fixed-size (replace-one) part has no replace-one reading
    mixed = compose(
        [RepeatAndSelect(Gaussian(3.0), 5, 1), subsample(Gaussian(1.0), 0.1, scheme="fixed")]
    )
    with pytest.raises(UnsupportedMechanismError):
        mixed.epsilon(1e-6, accountant="rdp")
    m = compose(
        [
            RepeatAndSelect(compose(subsample(Gaussian(1.0), 0.01), steps=50), 8.0, math.inf),
            Gaussian(4.0),
        ]
    )
    back = mechanism_from_dict(mechanism_to_dict(m))
    assert back == m and back.epsilon(1e-6, "rdp") == m.epsilon(1e-6, "rdp")


def test_selection_over_runs_that_release_nothing_is_accepted_and_tiny():
    """An empty composition is 0-DP under every neighbouring relation: it was refused
    with a garbled message ("stated under ;"); its selection is Theorem 2's bound with a
    zero curve, positive and below any real run's."""
    from privlearn.accounting import Gaussian, RepeatAndSelect, compose, subsample

    nothing = RepeatAndSelect(compose([]), 2.0, 1.0).epsilon(1e-6, accountant="rdp")
    run = compose(subsample(Gaussian(50.0), 0.01), steps=1)
    some = RepeatAndSelect(run, 2.0, 1.0).epsilon(1e-6, accountant="rdp")
    assert 0.0 < nothing < some
