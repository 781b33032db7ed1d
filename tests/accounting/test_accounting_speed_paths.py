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
