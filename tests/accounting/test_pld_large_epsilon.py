"""PLD delta at a large epsilon: the grid's absolute floor (FFT and truncation allowances,
~1e-20) must not be returned when a certified bound far below it exists."""

from __future__ import annotations

import warnings

from privlearn.accounting import Gaussian, compose, subsample


def test_delta_at_large_epsilon_not_stuck_at_the_grid_floor():
    m = compose(subsample(Gaussian(1.0), rate=0.01), steps=10)
    pld = m.delta_bounds(10.0)
    rdp = m.delta_bounds(10.0, "rdp")
    # the RDP bound is certified (about 1e-39); the grid's allowance alone was 7e-20
    assert pld.upper <= rdp.upper
    assert pld.lower <= pld.upper < 1e-30


def test_delta_at_huge_epsilon_is_silent_and_tiny():
    m = compose(subsample(Gaussian(1.0), rate=0.01), steps=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = m.delta_bounds(1e300)
    assert 0.0 <= b.lower <= b.upper < 1e-300
