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
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from privlearn._validation import check_count
from privlearn.accounting import (
    ApproxDP,
    Composed,
    Laplace,
    Mechanism,
    PureDP,
    RandomizedResponse,
    Subsampled,
)
from privlearn.auditing.bounds import (
    METHODS,
    _bound,
    _check_confidence,
    _check_delta,
    _one_run_refutable,
    _warn_if_reversed,
    _warn_if_unrefutable,
    auc,
)
from privlearn.errors import ConfigurationError, ParameterTypeError, ParameterValueError

__all__ = ["AuditResult", "ONE_RUN_METHODS", "one_run_audit"]

ONE_RUN_METHODS = ("one_run", "one_run_fdp")

#: Mechanisms whose trade-off curve is known not to be Gaussian (a pure-DP corner, or
#: Laplace's piecewise curve): the Gaussian-curve method ``"one_run_fdp"`` can report a
#: violation of their claim although they keep it.
NOT_GAUSSIAN = (Laplace, RandomizedResponse, PureDP, ApproxDP)


def _non_gaussian_parts(mechanism: Mechanism) -> list[str]:
    """The parts of ``mechanism`` (through compositions and subsampling) whose trade-off
    curve is not Gaussian, by class name."""
    if isinstance(mechanism, Composed):
        return [n for m, _ in mechanism.parts for n in _non_gaussian_parts(m)]
    if isinstance(mechanism, Subsampled):
        return _non_gaussian_parts(mechanism.base)
    return [type(mechanism).__name__] if isinstance(mechanism, NOT_GAUSSIAN) else []


def _warn_if_not_gaussian(mechanism: Mechanism | None, method: str, delta: float,
                          stacklevel: int) -> None:
    """One ``UserWarning`` when the Gaussian-curve method audits a mechanism known to
    have another curve: recommend ``method='one_run'``."""
    if method != "one_run_fdp" or mechanism is None:
        return
    if not isinstance(mechanism, Mechanism):
        raise ParameterTypeError(
            f"mechanism must be a privlearn Mechanism (or a callable returning one), got "
            f"{type(mechanism).__name__}")
    parts = sorted(set(_non_gaussian_parts(mechanism)))
    if not parts:
        return
    warnings.warn(
        f"method='one_run_fdp' tests the Gaussian trade-off curve through (epsilon, "
        f"delta={delta:g}), but the audited mechanism contains {', '.join(parts)}, whose "
        "curve is not Gaussian: an honest mechanism can be reported as a violation. Use "
        "method='one_run' (Steinke, Nasr & Jagielski 2023), valid for every (epsilon, "
        "delta)-DP mechanism", UserWarning, stacklevel=stacklevel + 1)


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
    seed : int or None
        The seed of the inclusion draw (drawn from fresh entropy and recorded here when
        none was given, so that every audit can be repeated).
    """

    epsilon_lower_bound: float
    claimed_epsilon: float
    delta: float
    violation: bool
    method: str
    confidence: float
    scores: np.ndarray = field(repr=False)
    inclusion: np.ndarray = field(repr=False)
    seed: int | None = None

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
        """Area under the attack's ROC curve; ``nan`` when every canary was drawn in, or
        none (a valid outcome of the one-run game, with no ROC)."""
        if self.inclusion.all() or not self.inclusion.any():
            return math.nan
        return auc(self.in_scores, self.out_scores)

    def to_dict(self) -> dict:
        """JSON-ready summary (no per-canary arrays; ``inf`` written as ``"inf"``, an AUC
        with no ROC -- every canary on one side -- as None)."""
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
            "auc": None if math.isnan(self.auc) else self.auc,
            "violation": bool(self.violation),
            "seed": self.seed,
        }


def _check_claim(name: str, value) -> float:
    try:
        if isinstance(value, bool | str | bytes):  # float() would read True as 1, "2" as 2
            raise TypeError
        e = float(value)
    except (TypeError, ValueError):
        raise ParameterTypeError(f"{name} must be a real number (or a callable returning one), got "
                        f"{type(value).__name__}") from None
    if math.isnan(e) or e < 0:
        raise ParameterValueError(f"{name} must be in [0, inf], got {value!r}")
    return e


def _check_seed(seed) -> int:
    """``seed`` as an int >= 0; ``None`` draws one from fresh entropy (returned, so that
    the audit records it and can be repeated)."""
    if seed is None:
        return int(np.random.SeedSequence().generate_state(1, dtype=np.uint32)[0])
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise ParameterTypeError(f"seed must be None or an integer >= 0, got {type(seed).__name__} "
                        f"{seed!r}; pass e.g. seed=0 to make the audit repeatable")
    if seed < 0:
        raise ParameterValueError(
            f"seed must be None or an integer >= 0, got {int(seed)}; pass e.g. "
            "seed=0 (None draws one from fresh entropy and records it)")
    return int(seed)


#: The most canaries an audit takes: it holds a few arrays of ``n_canaries`` numbers
#: (inclusion, scores; one parameter per canary in the DP-SGD audit), so more would not
#: fit in memory, and NumPy's integers stop at 2**63 (a larger count was a TypeError).
MAX_CANARIES = 10**9

_CANARIES_HINT = ("use hundreds to thousands of canaries (the guide 'auditing privacy "
                  "empirically', section 'How many canaries buy how much power', has the "
                  "power each number buys)")


#: The most DP-SGD steps :func:`privlearn.auditing.torch.audit_dpsgd` (``privlearn audit
#: dpsgd --steps``) trains: its work is proportional to the steps (a few milliseconds each
#: with a thousand canaries on one CPU core, after a noise calibration for that many
#: steps), so a larger count would run for hours; the one-run audits this harness
#: reproduces train tens to thousands of steps. (Its memory does not grow with the
#: steps: each canary's score is summed as the run goes.)
MAX_AUDIT_STEPS = 10_000


def check_audit_steps(name: str, steps) -> int:
    """``steps`` as an int in [1, :data:`MAX_AUDIT_STEPS`], or a clear error naming
    ``name`` (``"steps"``, or ``"--steps"`` from the shell), before any calibration."""
    v = check_count(name, steps, minimum=1, hint=f"pass a number of steps in [1, "
                    f"{MAX_AUDIT_STEPS:_}], e.g. 50")
    if v > MAX_AUDIT_STEPS:
        raise ParameterValueError(
            f"{name} must be an integer in [1, {MAX_AUDIT_STEPS:_}], got {v} (the audit "
            "calibrates the noise for that many steps and trains every one); audit a run "
            "of tens to thousands of steps, or compute the epsilon of a longer run alone "
            "with `privlearn epsilon`")
    return v


def _check_n_canaries(n_canaries) -> int:
    """``n_canaries`` as an int in [2, :data:`MAX_CANARIES`], or a clear error (shared by
    every audit entry point, checked before any training)."""
    n = check_count("n_canaries", n_canaries, minimum=2, integral_floats=False,
                    hint=_CANARIES_HINT)
    if n > MAX_CANARIES:
        raise ParameterValueError(
            f"n_canaries must be an integer in [2, {MAX_CANARIES:_}], got {n_canaries!r}; "
            + _CANARIES_HINT)
    return n


def _available_memory() -> int | None:
    """Bytes of memory this machine can give a new allocation now: ``MemAvailable`` of
    ``/proc/meminfo`` (Linux), else the physical memory, else None (unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def check_audit_memory(needed: int, what: str, fix: str) -> None:
    """Refuse, before any calibration or training, an audit whose arrays alone would
    take more than the memory available now (:func:`_available_memory`): ``needed`` is
    a lower bound on the bytes the request holds at once, ``what`` names the parameters
    it grows with and ``fix`` says what to do. Raises :class:`ParameterValueError` (the
    alternative was a MemoryError, or the kernel killing the process, after the work)."""
    available = _available_memory()
    if available is not None and needed > available:
        raise ParameterValueError(
            f"{what} needs at least {needed:,} bytes ({needed / 2**30:,.1f} GiB) of memory "
            f"and {available:,} bytes ({available / 2**30:,.1f} GiB) are available; {fix}")


def _warn_if_claim_unrefutable(claim: float, inclusion: np.ndarray, delta: float,
                               method: str, confidence: float) -> None:
    """Warn (:class:`UserWarning`) when no outcome of the audit can refute ``claim``: the
    bound of a perfect attack (every included canary scored above every excluded one,
    given the drawn inclusion) does not exceed it, so the verdict is "no violation"
    whatever the run leaks (a planted bug included)."""
    if not math.isfinite(claim):
        return
    n_in = int(inclusion.sum())
    n_out = inclusion.size - n_in
    if _one_run_refutable(n_in, n_out, claim, delta, 1.0 - confidence,
                          method == "one_run_fdp") is not False:
        return  # refutable, or not even epsilon = 0 is (the warning before training said so)
    ceiling = _bound(np.ones(n_in), np.zeros(n_out), delta, method, confidence)
    warnings.warn(
        f"no outcome of this audit can refute the claim epsilon={claim:g}: with "
        f"{inclusion.size} canaries ({method}, delta={delta:g}, confidence={confidence:g}) "
        f"even a perfect attack bounds epsilon by {ceiling:.4g} at most, so the verdict is "
        "'no violation' whatever the run leaks; audit a smaller claim or use more canaries "
        "(the guide 'auditing privacy empirically', section 'How many canaries buy how "
        "much power')", UserWarning, stacklevel=3)


def one_run_audit(
    train_and_score: Callable[[np.ndarray], object],
    n_canaries: int,
    *,
    claimed_epsilon: float | Callable[[], float],
    delta: float,
    seed: int | None = None,
    method: str = "one_run",
    confidence: float = 0.95,
    mechanism: Mechanism | Callable[[], Mechanism] | None = None,
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
        Hundreds to thousands in practice: with few canaries no outcome can refute
        anything (a warning says so before training).
    claimed_epsilon : float or callable
        The epsilon the run claims at ``delta`` (e.g. ``lambda: p.accountant.epsilon(
        delta)``, evaluated after training, for the steps actually taken).
    delta : float in [0, 1)
    seed : int >= 0, optional
        Seed of the inclusion draw (default: one drawn from fresh entropy, recorded in
        the result's ``seed``).
    method : {"one_run", "one_run_fdp"}
        The one-run bounds of :func:`privlearn.auditing.epsilon_lower_bound`. The
        default, ``"one_run"``, is valid for every ``(epsilon, delta)``-DP mechanism.
        ``"one_run_fdp"`` is tighter but tests the *Gaussian* trade-off curve through
        ``(epsilon, delta)``: a mechanism that is ``(epsilon, delta)``-DP with another
        curve (randomized response, Laplace noise, DP-SGD with few steps) can be reported
        as a violation although it keeps its claim. (The canaries of one run are not
        independent trials, so ``"clopper_pearson"`` and ``"gdp"`` do not apply here.)
    confidence : float in (0, 1)
    mechanism : Mechanism or callable, optional
        The audited mechanism, if known (or a callable returning it, evaluated after
        training like ``claimed_epsilon``). Used only to warn, once per audit
        (``UserWarning``), when ``method="one_run_fdp"`` audits a mechanism whose
        trade-off curve is known not to be Gaussian (a part that is
        :data:`NOT_GAUSSIAN`: Laplace, randomized response, pure DP), recommending
        ``method="one_run"``. :func:`~privlearn.auditing.audit_estimator` passes the
        estimator's ``mechanism_``.

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
        raise ParameterTypeError(
            f"train_and_score must be callable, got {type(train_and_score).__name__}")
    n_canaries = _check_n_canaries(n_canaries)
    d = _check_delta(delta)
    c = _check_confidence(confidence)
    if method not in ONE_RUN_METHODS:
        hint = (" (clopper_pearson and gdp assume independent trials, one training run per "
                "score: call epsilon_lower_bound on such scores directly)"
                if method in METHODS else "")
        raise ParameterValueError(
            f"method must be one of {ONE_RUN_METHODS} for a one-run audit, got "
            f"{method!r}{hint}")
    if method == "one_run_fdp" and d == 0:
        raise ConfigurationError(f"method={method!r} needs delta in (0, 1), got delta=0 (or use "
                         "method='one_run', valid at delta=0)")
    if not callable(claimed_epsilon):
        claim = _check_claim("claimed_epsilon", claimed_epsilon)
    if not callable(mechanism):  # known now: say so before training
        _warn_if_not_gaussian(mechanism, method, d, stacklevel=2)
    seed = _check_seed(seed)  # drawn and recorded when None: the audit can be repeated
    _warn_if_unrefutable(n_canaries, d, c, method, stacklevel=3)
    rng = np.random.default_rng(seed)
    inclusion = rng.random(n_canaries) < 0.5
    if not callable(claimed_epsilon):  # known now: say so before training
        _warn_if_claim_unrefutable(claim, inclusion, d, method, c)
    raw = train_and_score(inclusion.copy())
    if raw is None:
        raise ParameterTypeError(
            "train_and_score returned None; it must return one score per canary (an array "
            f"of {n_canaries} floats, higher = more likely included)")
    if hasattr(raw, "detach") and hasattr(raw, "cpu"):  # a torch tensor (grad, device)
        raw = raw.detach().cpu().numpy()
    try:
        if np.asarray(raw).dtype.kind in "mM":  # NumPy would read them as floats
            raise TypeError
        scores = np.asarray(raw, dtype=float)
    except (TypeError, ValueError):
        raise ParameterTypeError("train_and_score must return an array of real numbers, "
                                 f"one score per canary, got {type(raw).__name__}") from None
    if scores.shape != (n_canaries,):
        raise ParameterValueError(
            f"train_and_score must return one score per canary: expected shape "
            f"({n_canaries},), got {scores.shape}")
    if not np.all(np.isfinite(scores)):
        bad = int(np.count_nonzero(~np.isfinite(scores)))
        raise ParameterValueError(f"train_and_score returned {bad} non-finite scores; every canary "
                         "needs a finite score")
    if callable(claimed_epsilon):
        claim = _check_claim("claimed_epsilon()", claimed_epsilon())
        _warn_if_claim_unrefutable(claim, inclusion, d, method, c)
    if callable(mechanism):
        _warn_if_not_gaussian(mechanism(), method, d, stacklevel=2)
    # an empty side (every canary in, or none) is a valid outcome of the guessing game
    bound = _bound(scores[inclusion], scores[~inclusion], d, method, c)
    _warn_if_reversed(scores[inclusion], scores[~inclusion], d, method, c, bound,
                      stacklevel=3)
    return AuditResult(epsilon_lower_bound=float(bound), claimed_epsilon=claim, delta=d,
                       violation=bool(bound > claim), method=method, confidence=c,
                       scores=_frozen(scores), inclusion=_frozen(inclusion), seed=seed)
