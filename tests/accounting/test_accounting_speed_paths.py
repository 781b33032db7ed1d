"""The accountants' shortcuts for compositions of many distinct parts give the answer of
the full computation (closed forms and naive full-grid minima as references)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from privlearn.accounting import Gaussian, compose, get_accountant, subsample
from privlearn.accounting.conversion import (
    DEFAULT_ORDERS,
    delta_from_rdp,
    epsilon_from_rdp,
    rdp_to_delta,
    rdp_to_epsilon,
)
from privlearn.accounting.rdp import rdp_epsilon


def _schedule(n: int):
    return compose(
        [subsample(Gaussian(float(s)), rate=0.01) for s in np.linspace(0.8, 1.6, n)], steps=10
    )


def test_pruned_order_grid_keeps_the_full_grid_minimum() -> None:
    m = _schedule(6)
    full = rdp_epsilon(m, DEFAULT_ORDERS)
    for delta in (1e-5, 1e-2, 0.3):
        naive = float(np.min(epsilon_from_rdp(DEFAULT_ORDERS, full, delta)))
        got = rdp_to_epsilon(lambda a: rdp_epsilon(m, a), delta, refine=False)
        assert got == pytest.approx(max(naive, 0.0), rel=1e-11, abs=0.0)
    for eps in (0.5, 2.0, 8.0):
        naive = float(np.min(delta_from_rdp(DEFAULT_ORDERS, full, eps)))
        got = rdp_to_delta(lambda a: rdp_epsilon(m, a), eps, refine=False)
        assert got == pytest.approx(naive, rel=1e-9)


def test_pruned_order_grid_matches_the_gaussian_closed_form() -> None:
    # Gaussian RDP a / (2 s^2): the per-order epsilon minimised over the grid by hand
    s = 3.0
    fn = lambda a: np.asarray(a, dtype=float) / (2 * s * s)  # noqa: E731
    naive = float(np.min(epsilon_from_rdp(DEFAULT_ORDERS, fn(DEFAULT_ORDERS), 1e-5)))
    assert rdp_to_epsilon(fn, 1e-5, refine=False) == naive


def test_order_grid_skips_orders_that_cannot_be_the_minimum() -> None:
    # the slowly converging fractional orders near 1 cannot win at delta 1e-5 when an
    # integer order already gives epsilon ~ 1: they are not evaluated
    seen: list[float] = []

    def fn(a):
        a = np.asarray(a, dtype=float)
        seen.extend(a.tolist())
        return a / (2 * 4.0**2)

    rdp_to_epsilon(fn, 1e-5, refine=False)
    near_one = DEFAULT_ORDERS[DEFAULT_ORDERS < 1.5]
    # only the smallest order, for the total-variation bound (3)
    assert sum(1 for x in seen if x < 1.5) == 1 < near_one.size


def test_schedule_rdp_brackets_the_pld_bounds() -> None:
    # RDP is an upper bound: never below the PLD accountant's certified lower bound
    m = _schedule(8)
    r = get_accountant("rdp").epsilon(m, 1e-5).upper
    p = get_accountant("pld").epsilon(m, 1e-5)
    assert p.lower <= p.upper <= r
    assert math.isfinite(r)


def test_schedule_rdp_is_no_looser_than_dp_accounting() -> None:
    dp_accounting = pytest.importorskip("dp_accounting")
    sched = np.linspace(0.8, 1.6, 8)
    acct = dp_accounting.rdp.RdpAccountant()
    for s in sched:
        acct.compose(
            dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(float(s))), 10
        )
    theirs = acct.get_epsilon(1e-5)
    ours = get_accountant("rdp").epsilon(_schedule(8), 1e-5).upper
    assert ours <= theirs * (1 + 1e-9)
    assert ours >= 0.9 * theirs


def test_binary_lower_bound_window_keeps_the_full_enumeration_value() -> None:
    # one step thresholded: a binary pair (p, q) composed k times; the windowed
    # enumeration (lower bounds only) gives the full enumeration's bounds, and the full
    # enumeration's lower bound is below the exact binomial value computed directly
    from privlearn.accounting import closed_form
    from privlearn.accounting._pld_lower import _window

    p, q, k = 3e-3, 1e-3, 4000
    lp, lq, lp1, lq1 = math.log(p), math.log(q), math.log1p(-p), math.log1p(-q)
    atoms = closed_form.Atoms((lp - lq, lp1 - lq1), (lp, lp1), (lq, lq1))
    window = _window(atoms, k)
    assert window[1] - window[0] + 1 < k // 2  # fewer count vectors than k + 1
    full = closed_form._compose([(atoms, k)])
    cut = closed_form._compose([(atoms, k)], [window])
    from scipy import stats

    for eps in (0.0, 1.0, 3.0):
        # exact hockey-stick of Binomial(k, p) vs Binomial(k, q): sum (P_i - e^eps Q_i)_+
        i = np.arange(k + 1)
        exact = float(
            np.sum(
                np.maximum(stats.binom.pmf(i, k, p) - math.exp(eps) * stats.binom.pmf(i, k, q), 0.0)
            )
        )
        lo_full, lo_cut = full.delta(eps, False), cut.delta(eps, False)
        assert lo_cut <= exact * (1 + 1e-9)
        assert lo_cut == pytest.approx(lo_full, rel=1e-10)  # the allowances of n atoms
    for delta in (1e-3, 1e-5):
        assert cut.epsilon(delta, False) == pytest.approx(full.epsilon(delta, False), rel=1e-10)
        assert cut.epsilon(delta, False) <= full.epsilon(delta, True)


@pytest.mark.slow
def test_tiny_rate_million_steps_bracket_below_the_peer_estimate() -> None:
    # q = 1e-6 over 10^6 steps: dp_accounting's pessimistic PLD estimate (0.0306 at its
    # default discretisation, 0.0121 at 1e-5) is above our certified lower end
    pld = pytest.importorskip("dp_accounting.pld.privacy_loss_distribution")
    theirs = pld.from_gaussian_mechanism(0.6, sampling_prob=1e-6).self_compose(10**6)
    ref = theirs.get_epsilon_for_delta(1e-5)
    b = get_accountant("pld").epsilon(compose(subsample(Gaussian(0.6), 1e-6), steps=10**6), 1e-5)
    assert 0.0 < b.lower <= b.upper <= ref
    assert b.upper < 2.0 * b.lower


def test_memoised_subsampled_gaussian_curve_is_not_aliased() -> None:
    # the returned array is the caller's: writing to it leaves the memoised curve intact
    from privlearn.accounting.rdp import clear_caches, subsampled_gaussian_rdp

    clear_caches()
    orders = np.array([1.5, 2.0, 3.25, 8.0])
    first = subsampled_gaussian_rdp(0.02, 1.1, orders)
    kept = first.copy()
    first[:] = -1.0
    again = subsampled_gaussian_rdp(0.02, 1.1, orders)
    np.testing.assert_array_equal(again, kept)
    # the Gaussian cap a / (2 sigma^2) is never exceeded, and each value is positive
    assert np.all(again <= orders / (2 * 1.1**2)) and np.all(again > 0)
