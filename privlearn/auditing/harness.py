"""Auditing a training run in one call: draw the canaries' inclusion, train, score, bound.

:func:`one_run_audit` runs the one-run audit of Steinke, Nasr & Jagielski (2023),
"Privacy Auditing with One (1) Training Run", Algorithm 1: each of ``m`` canaries is
included in the training data independently with probability 1/2, the model is trained
once, every canary gets a score, and the scores of the included and excluded canaries
are turned into a lower confidence bound on epsilon
(:func:`privlearn.auditing.epsilon_lower_bound`). If the bound exceeds the epsilon the
accountant claims, the claim is refuted at the stated confidence: the implementation
(or its accounting) leaks more than it says.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from privlearn.auditing.bounds import (
    METHODS,
    _check_confidence,
    _check_delta,
    auc,
    epsilon_lower_bound,
)

__all__ = ["AuditResult", "ONE_RUN_METHODS", "one_run_audit"]

ONE_RUN_METHODS = ("one_run_fdp", "one_run")


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.array(a, copy=True)
    a.setflags(write=False)
    return a


@dataclass(frozen=True, eq=False)
class AuditResult:
    """Outcome of an audit.

    Attributes
    ----------
    epsilon_lower_bound : float
        Lower confidence bound on epsilon at ``delta`` from the canary scores.
    claimed_epsilon : float
        The epsilon the accountant reports for the run (``inf`` if it claims nothing).
    delta : float
    violation : bool
        ``epsilon_lower_bound > claimed_epsilon``: the claim is refuted at ``confidence``.
    method : str
    confidence : float
    scores : numpy.ndarray (read-only)
        One score per canary (higher = more likely included).
    inclusion : numpy.ndarray of bool (read-only)
        Which canaries were included in training.
    """

    epsilon_lower_bound: float
    claimed_epsilon: float
    delta: float
    violation: bool
    method: str
    confidence: float
    scores: np.ndarray = field(repr=False)
    inclusion: np.ndarray = field(repr=False)

    @property
    def n_canaries(self) -> int:
        return int(self.inclusion.size)

    @property
    def in_scores(self) -> np.ndarray:
        return self.scores[self.inclusion]

    @property
    def out_scores(self) -> np.ndarray:
        return self.scores[~self.inclusion]

    @property
    def auc(self) -> float:
        """Area under the attack's ROC curve."""
        return auc(self.in_scores, self.out_scores)

    def to_dict(self) -> dict:
        """JSON-ready summary (no per-canary arrays; ``inf`` written as ``"inf"``)."""
        def num(x: float):
            return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")

        return {
            "claimed_epsilon": num(self.claimed_epsilon),
            "epsilon_lower_bound": num(self.epsilon_lower_bound),
            "delta": self.delta,
            "method": self.method,
            "confidence": self.confidence,
            "canaries": self.n_canaries,
            "canaries_included": int(self.inclusion.sum()),
            "auc": self.auc,
            "violation": bool(self.violation),
        }


def _check_claim(name: str, value) -> float:
    try:
        e = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number (or a callable returning one), got "
                        f"{type(value).__name__}") from None
    if math.isnan(e) or e < 0:
        raise ValueError(f"{name} must be in [0, inf], got {value!r}")
    return e


def one_run_audit(
    train_and_score: Callable[[np.ndarray], object],
    n_canaries: int,
    *,
    claimed_epsilon: float | Callable[[], float],
    delta: float,
    seed: int | None = None,
    method: str = "one_run_fdp",
    confidence: float = 0.95,
) -> AuditResult:
    """Audit one training run with ``n_canaries`` canaries.

    Parameters
    ----------
    train_and_score : callable
        ``train_and_score(inclusion) -> scores``: ``inclusion`` is a boolean array of
        length ``n_canaries`` (canary ``i`` must be in the training data exactly when
        ``inclusion[i]``); it trains once and returns one finite score per canary
        (higher = more likely included).
    n_canaries : int >= 2
    claimed_epsilon : float or callable
        The epsilon the run claims at ``delta`` (e.g. ``lambda: p.accountant.epsilon(
        delta)``, evaluated after training, for the steps actually taken).
    delta : float in [0, 1)
    seed : int, optional
        Seed of the inclusion draw (default: fresh entropy).
    method : {"one_run_fdp", "one_run"}
        The one-run bounds of :func:`privlearn.auditing.epsilon_lower_bound` (the
        canaries of one run are not independent trials, so ``"clopper_pearson"`` and
        ``"gdp"`` do not apply here).
    confidence : float in (0, 1)

    Returns
    -------
    AuditResult

    Raises
    ------
    ValueError
        Bad arguments (before training), or ``train_and_score`` returned the wrong number
        of scores or non-finite scores.

    References
    ----------
    Steinke, Nasr & Jagielski (2023), "Privacy Auditing with One (1) Training Run",
    NeurIPS, Algorithm 1 and Theorem 3.1.
    """
    if not callable(train_and_score):
        raise TypeError(f"train_and_score must be callable, got {type(train_and_score).__name__}")
    if isinstance(n_canaries, bool) or not isinstance(n_canaries, int | np.integer):
        raise TypeError(f"n_canaries must be an integer, got {type(n_canaries).__name__}")
    if n_canaries < 2:
        raise ValueError(f"n_canaries must be >= 2, got {n_canaries!r} (use hundreds to "
                         "thousands: see docs/auditing.md for the power each buys)")
    d = _check_delta(delta)
    c = _check_confidence(confidence)
    if method not in ONE_RUN_METHODS:
        hint = (" (clopper_pearson and gdp assume independent trials, one training run per "
                "score: call epsilon_lower_bound on such scores directly)"
                if method in METHODS else "")
        raise ValueError(f"method must be one of {ONE_RUN_METHODS} for a one-run audit, got "
                         f"{method!r}{hint}")
    if method == "one_run_fdp" and d == 0:
        raise ValueError(f"method={method!r} needs delta in (0, 1), got delta=0")
    if not callable(claimed_epsilon):
        claim = _check_claim("claimed_epsilon", claimed_epsilon)
    rng = np.random.default_rng(seed)
    inclusion = rng.random(int(n_canaries)) < 0.5
    raw = train_and_score(inclusion.copy())
    try:
        scores = np.asarray(raw, dtype=float)
    except (TypeError, ValueError):
        raise TypeError("train_and_score must return an array of real numbers, got "
                        f"{type(raw).__name__}") from None
    if scores.shape != (n_canaries,):
        raise ValueError(f"train_and_score must return one score per canary: expected shape "
                         f"({n_canaries},), got {scores.shape}")
    if not np.all(np.isfinite(scores)):
        bad = int(np.count_nonzero(~np.isfinite(scores)))
        raise ValueError(f"train_and_score returned {bad} non-finite scores; every canary "
                         "needs a finite score")
    if callable(claimed_epsilon):
        claim = _check_claim("claimed_epsilon()", claimed_epsilon())
    bound = epsilon_lower_bound(scores[inclusion], scores[~inclusion], delta=d, method=method,
                                confidence=c)
    return AuditResult(epsilon_lower_bound=float(bound), claimed_epsilon=claim, delta=d,
                       violation=bool(bound > claim), method=method, confidence=c,
                       scores=_frozen(scores), inclusion=_frozen(inclusion))
