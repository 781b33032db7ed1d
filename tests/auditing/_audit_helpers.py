"""Shared helpers for the auditing tests."""

from __future__ import annotations

import numpy as np

from privlearn.accounting.fdp import gdp_mu


def ideal_scores(true_epsilon: float, delta: float, m: int, rng: np.random.Generator):
    """The ideal attack on a mu-GDP release, mu from (true_epsilon, delta): each of ``m``
    canaries is in with probability 1/2; scores N(mu, 1) if in, N(0, 1) if out."""
    mu = gdp_mu(true_epsilon, delta)
    lab = rng.random(m) < 0.5
    s = rng.normal(size=m) + mu * lab
    return s[lab], s[~lab]
