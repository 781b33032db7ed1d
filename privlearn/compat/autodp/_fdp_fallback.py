"""TEMPORARY fallback for :func:`privlearn.accounting.fdp.tradeoff_curve`.

LEAD: delete this module at merge once ``privlearn/accounting/fdp.py`` (auditing branch)
is on main; :func:`tradeoff_curve` below then never runs (the facade imports the real one
first). It mirrors that function's contract and signature exactly:

* plain Gaussians and compositions of them: exact ``mu``-GDP curve
  ``G_mu(alpha) = Phi(Phi^{-1}(1 - alpha) - mu)`` (Dong, Roth & Su 2022, Definition 2.7
  and Corollary 3.3);
* anything else: the lower envelope of the certified privacy profile on a grid of
  epsilons, ``max_j max(0, 1 - delta_j - e^eps_j alpha, e^-eps_j (1 - delta_j - alpha))``
  (Dong, Roth & Su 2022, Proposition 2.12), never above the true curve.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import ndtr, ndtri

from privlearn.accounting import Mechanism
from privlearn.accounting.analytic import effective_noise_multiplier

__all__ = ["tradeoff_curve", "tradeoff_from_profile"]


def tradeoff_from_profile(epsilons, deltas, alphas) -> np.ndarray:
    a = np.asarray(alphas, dtype=float)
    eps = np.asarray(epsilons, dtype=float).reshape(1, -1)
    one_minus = 1.0 - np.asarray(deltas, dtype=float).reshape(1, -1)
    flat = a.reshape(-1, 1)
    f = np.maximum(one_minus - np.exp(eps) * flat, (one_minus - flat) * np.exp(-eps))
    return np.maximum(f.max(axis=1), 0.0).reshape(a.shape)


def tradeoff_curve(
    mechanism: Mechanism, alphas, *, epsilons=None, accountant: str = "pld"
) -> np.ndarray:
    a = np.asarray(alphas, dtype=float)
    if a.size == 0 or not np.all(np.isfinite(a)) or np.any((a < 0) | (a > 1)):
        raise ValueError(f"alphas (false positive rates) must be in [0, 1], got {alphas!r}")
    sigma = effective_noise_multiplier(mechanism)
    if sigma is not None:
        mu = 1.0 / sigma
        return ndtr(ndtri(1.0 - a) - mu)
    if epsilons is None:
        top = mechanism.epsilon(1e-12, accountant=accountant)
        if not math.isfinite(top):
            raise ValueError("the mechanism has no finite epsilon at delta=1e-12")
        epsilons = np.concatenate([[0.0], top * np.linspace(0.0, 1.0, 201)[1:] ** 1.5])
    eps = np.asarray(epsilons, dtype=float).reshape(-1)
    deltas = np.array([mechanism.delta(float(e), accountant=accountant) for e in eps])
    return tradeoff_from_profile(eps, deltas, a)
