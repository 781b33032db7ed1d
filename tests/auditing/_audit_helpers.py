"""Shared helpers for the auditing tests."""

from __future__ import annotations

import numpy as np
from scipy.special import betaincinv

from privlearn.accounting.fdp import gdp_mu


def ideal_scores(true_epsilon: float, delta: float, m: int, rng: np.random.Generator):
    """The ideal attack on a mu-GDP release, mu from (true_epsilon, delta): each of ``m``
    canaries is in with probability 1/2; scores N(mu, 1) if in, N(0, 1) if out."""
    mu = gdp_mu(true_epsilon, delta)
    lab = rng.random(m) < 0.5
    s = rng.normal(size=m) + mu * lab
    return s[lab], s[~lab]


def unit_ball_regression(n: int, coef, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` standard normal rows of ``len(coef)`` features, scaled into the unit ball, and
    targets ``X @ coef`` clipped to [-1, 1] (the estimators' bounded-data setting)."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, len(coef)))
    X /= np.maximum(1.0, np.linalg.norm(X, axis=1, keepdims=True))
    return X, np.clip(X @ np.asarray(coef, dtype=float), -1.0, 1.0)


def recording_release():
    """A ``train_and_score`` that scores each canary by its inclusion bit, and the list
    it appends ``0, 1, ...`` to on each call (whether, and how often, training ran)."""
    calls: list[int] = []

    def train_and_score(inclusion: np.ndarray) -> np.ndarray:
        calls.append(len(calls))
        return inclusion.astype(float)

    return train_and_score, calls


def cp_upper(k: np.ndarray, n: int, alpha: float) -> np.ndarray:
    """One-sided Clopper-Pearson upper bound on p from k successes in n trials."""
    k = np.asarray(k, dtype=float)
    out = np.ones_like(k)
    lt = k < n
    out[lt] = betaincinv(k[lt] + 1, n - k[lt], 1.0 - alpha)
    return out


def cp_lower(k: np.ndarray, n: int, alpha: float) -> np.ndarray:
    """One-sided Clopper-Pearson lower bound on p from k successes in n trials."""
    k = np.asarray(k, dtype=float)
    out = np.zeros_like(k)
    pos = k > 0
    out[pos] = betaincinv(k[pos], n - k[pos] + 1, alpha)
    return out
