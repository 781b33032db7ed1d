"""Certified discretisation and FFT composition of privacy loss distributions (private).

The implementation is split along its jobs:

* :mod:`._pld_grid` -- one step's pair on a uniform loss grid: the dominating
  ("connect the dots") and dominated grid pairs;
* :mod:`._pld_tails` -- Chernoff bounds: the composition window and the mass outside it;
* :mod:`._pld_fft` -- FFT composition with certified floating-point error terms.

This module re-exports their names for :mod:`privlearn.accounting.pld` and the tests.
"""

from __future__ import annotations

from privlearn.accounting._pld_fft import (
    ComposedPLD,
    compose_fft,
    compose_fft_tilted,
    discounted_tail_sums,
    shared_uppers,
    tilt_pmfs,
)
from privlearn.accounting._pld_grid import (
    MAX_STEP_POINTS,
    StepPMF,
    U,
    discretize,
    discretize_symmetrised,
    loss_range,
    loss_scale,
)
from privlearn.accounting._pld_tails import chernoff_window, log_mgf, tail_bounds

__all__ = [
    "MAX_STEP_POINTS",
    "U",
    "StepPMF",
    "ComposedPLD",
    "chernoff_window",
    "compose_fft",
    "compose_fft_tilted",
    "tilt_pmfs",
    "shared_uppers",
    "discounted_tail_sums",
    "discretize",
    "discretize_symmetrised",
    "log_mgf",
    "loss_range",
    "loss_scale",
    "tail_bounds",
]
