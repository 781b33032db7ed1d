"""Monte-Carlo *estimates* of epsilon for mechanisms no certified accountant covers.

Balls-in-bins sampling with a correlated-noise strategy (a BLT, or a banded strategy used
with its amplification) has no known certified accounting. Its privacy can only be
*estimated* by sampling the privacy loss of its dominating pair (Choquette-Choo et al.
2025, MMCC; Chua et al. 2025). Such a number is never an epsilon in privlearn's sense:

* :class:`BallsInBinsMatrixMechanism` is a registered kind with no PLD or RDP
  representation, so every accountant -- and therefore
  :func:`~privlearn.accounting.calibrate`, the ledger and the autodp facade -- refuses it
  (:class:`~privlearn.accounting.UnsupportedMechanismError`);
* :func:`estimate_epsilon` returns an :class:`EpsilonEstimate` (value, confidence interval,
  number of samples), a different type from every certified result, whose ``str`` says
  "estimate";
* :func:`calibrate_estimate` is the explicit opt-in for choosing a noise multiplier from
  estimates; it returns a :class:`NoiseEstimate` saying so.

The pair: with the record in bin ``j`` (probability ``1/b``) the release is
``C u_j + sigma z`` (``u_j`` the indicator of the steps ``j, j + b, ...``), without it
``sigma z``. Remove: ``P = (1/b) sum_j N(C u_j, sigma^2 I)``, ``Q = N(0, sigma^2 I)``; add:
the pair swapped. ``delta(eps) = E_P[(1 - e^(eps - L))_+]`` (remove) and
``E_Q[(1 - e^(eps + L))_+]`` (add) are means of ``[0, 1]``-valued samples; the estimate's
interval is the pointwise normal interval of those means.

References
----------
.. [MMCC] Choquette-Choo, Ganesh, Haque, Steinke & Thakurta (2025), Near Exact Privacy
       Amplification for Matrix Mechanisms, ICLR.
.. [BnB] Chua, Ghazi, Harrison, Kumar, Manurangsi, Sinha & Zhang (2025), Balls-and-Bins
       Sampling for DP-SGD, AISTATS.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from privlearn._validation import check_count, check_delta, check_positive, check_probability
from privlearn.accounting.mechanisms import Mechanism
from privlearn.accounting.registry import (
    declare_representation,
    register_mechanism,
    representation_of,
)
from privlearn.errors import ParameterTypeError, ParameterValueError

__all__ = [
    "BallsInBinsMatrixMechanism",
    "EpsilonEstimate",
    "NoiseEstimate",
    "calibrate_estimate",
    "estimate_epsilon",
]


#: The most samples :func:`estimate_epsilon` draws per direction: 10**8 (minutes per
#: estimate); 10**9 ran for hours over 16 GB of arrays and 2**63 was refused only for its
#: memory.
MAX_SAMPLES = 10**8


@dataclass(frozen=True)
class BallsInBinsMatrixMechanism(Mechanism):
    """A Toeplitz matrix-factorization mechanism with balls-in-bins sampling, accounted
    with its amplification. Only :func:`estimate_epsilon` evaluates it (an estimate).

    Parameters
    ----------
    noise_multiplier : float > 0
    strategy_coefs : tuple of float
        First column of the Toeplitz strategy ``C`` (at least ``steps`` long, or padded
        with zeros; a banded strategy's ``b`` coefficients).
    steps : int >= 1
    cycle_length : int >= 1
        Number of bins: a record participates in steps ``j, j + b, ...``.
    """

    noise_multiplier: float
    strategy_coefs: tuple[float, ...]
    steps: int
    cycle_length: int

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "noise_multiplier", check_positive("noise_multiplier", self.noise_multiplier)
        )
        coefs = tuple(float(c) for c in self.strategy_coefs)
        if not coefs or not all(math.isfinite(c) for c in coefs) or coefs[0] == 0.0:
            raise ParameterValueError(
                f"strategy_coefs must be finite with a non-zero first entry, got {coefs[:5]!r}"
            )
        object.__setattr__(self, "strategy_coefs", coefs)
        object.__setattr__(self, "steps", check_count("steps", self.steps, minimum=1))
        object.__setattr__(
            self, "cycle_length", check_count("cycle_length", self.cycle_length, minimum=1)
        )
        if self.cycle_length > self.steps:
            raise ParameterValueError(
                f"cycle_length must be at most steps={self.steps}, got {self.cycle_length}"
            )


def _to_dict(m: BallsInBinsMatrixMechanism) -> dict[str, Any]:
    return {
        "noise_multiplier": m.noise_multiplier,
        "strategy_coefs": list(m.strategy_coefs),
        "steps": m.steps,
        "cycle_length": m.cycle_length,
    }


def _from_dict(d: dict[str, Any]) -> BallsInBinsMatrixMechanism:
    keys = {"noise_multiplier", "strategy_coefs", "steps", "cycle_length"}
    if not isinstance(d, dict) or set(d) != keys:
        raise ParameterValueError(
            f"a BallsInBinsMatrixMechanism is stored with fields {sorted(keys)}")
    return BallsInBinsMatrixMechanism(
        d["noise_multiplier"], tuple(d["strategy_coefs"]), d["steps"], d["cycle_length"]
    )


# No pld_pair, no rdp: every accountant refuses it (no certified accounting exists).
declare_representation(
    "monte_carlo_estimable",
    "fn(m) -> True: the kind can only be estimated by estimate_epsilon (no certified "
    "bound); what an uncertified Monte-Carlo estimate is asked of")
register_mechanism(
    BallsInBinsMatrixMechanism, pure_epsilon=lambda m: math.inf,
    to_dict=_to_dict, from_dict=_from_dict, monte_carlo_estimable=lambda m: True,
)


@dataclass(frozen=True)
class EpsilonEstimate:
    """A Monte-Carlo *estimate* of epsilon -- not a certified bound.

    Attributes
    ----------
    value : float
        The point estimate.
    lower, upper : float
        Pointwise ``confidence`` interval (normal approximation of the delta estimates).
    confidence : float
    samples : int
        Samples drawn for each neighbouring direction.
    delta : float
    method : str
    """

    value: float
    lower: float
    upper: float
    confidence: float
    samples: int
    delta: float
    method: str

    certified = False

    def __str__(self) -> str:
        return (
            f"epsilon estimate {self.value:.4g} (Monte-Carlo, {self.confidence:.0%} interval "
            f"[{self.lower:.4g}, {self.upper:.4g}], {self.samples} samples, delta="
            f"{self.delta:g}); an estimate, not a certified bound"
        )


def _losses(
    m: BallsInBinsMatrixMechanism, samples: int, seed: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """Privacy-loss samples ``L = log dP/dQ`` under ``P`` and under ``Q`` (remove pair)."""
    from scipy import special  # lazily: keeps ``import privlearn.accounting`` light

    n, b, sigma = m.steps, m.cycle_length, m.noise_multiplier
    c = np.zeros(n)
    k = min(n, len(m.strategy_coefs))
    c[:k] = m.strategy_coefs[:k]
    size = 1 << int(2 * n - 1).bit_length()
    fc = np.fft.rfft(c, size)
    # mean_j = C u_j / sigma (u_j: the steps j, j + b, ... of bin j)
    u = np.zeros((b, n))
    for j in range(b):
        u[j, j::b] = 1.0
    means = np.fft.irfft(np.fft.rfft(u, size, axis=1) * fc, size, axis=1)[:, :n] / sigma
    half_sq = 0.5 * np.einsum("ij,ij->i", means, means)
    gram = means @ means.T
    rng = np.random.default_rng(seed)
    try:
        out_p, out_q = np.empty(samples), np.empty(samples)
    except (ValueError, MemoryError):  # beyond NumPy's largest array, or this memory
        raise ParameterValueError(
            f"samples must fit in memory (two arrays of that many floats, "
            f"{16 * samples / 2**30:.3g} GiB), got {samples!r}; pass fewer, e.g. 100000"
        ) from None
    chunk = max(1, min(samples, 2**22 // n))
    for start in range(0, samples, chunk):
        stop = min(samples, start + chunk)
        proj_q = rng.standard_normal((stop - start, n)) @ means.T  # <y, mean_j>, y ~ Q
        proj_p = proj_q + gram[rng.integers(0, b, size=stop - start)]  # y + mean_pick ~ P
        out_q[start:stop] = special.logsumexp(proj_q - half_sq, axis=1) - math.log(b)
        out_p[start:stop] = special.logsumexp(proj_p - half_sq, axis=1) - math.log(b)
    return out_p, out_q


def _delta_curves(
    lp: np.ndarray, lq: np.ndarray, eps: float
) -> tuple[float, float, float, float]:
    """(delta_remove, se_remove, delta_add, se_add) at ``eps``."""
    rem = -np.expm1(np.minimum(eps - lp, 0.0))  # (1 - e^(eps - L))_+
    add = -np.expm1(np.minimum(eps + lq, 0.0))  # (1 - e^(eps + L))_+
    n = lp.size
    return (float(rem.mean()), float(rem.std(ddof=1) / math.sqrt(n)),
            float(add.mean()), float(add.std(ddof=1) / math.sqrt(n)))


def estimate_epsilon(
    mechanism: BallsInBinsMatrixMechanism,
    delta: float,
    *,
    samples: int = 100_000,
    confidence: float = 0.95,
    seed: int | None = 0,
) -> EpsilonEstimate:
    """Monte-Carlo estimate of epsilon at ``delta`` (module docstring): an
    :class:`EpsilonEstimate`, never a certified bound.

    Parameters
    ----------
    mechanism : BallsInBinsMatrixMechanism
    delta : float in (0, 1)
    samples : int
        Samples per direction (the interval shrinks as ``1 / sqrt(samples)``), in
        [100, 10**8].
    confidence : float in (0, 1)
    seed : int >= 0 or None
        The same seed gives the same estimate (common random numbers across calls, which
        also makes :func:`calibrate_estimate` monotone in practice).
    """
    if representation_of(mechanism, "monte_carlo_estimable") is None:
        raise ParameterTypeError(
            f"mechanism must be a BallsInBinsMatrixMechanism, got {type(mechanism).__name__}; "
            "certified mechanisms are evaluated with mechanism.epsilon(delta)"
        )
    delta = check_delta("delta", delta)
    if delta == 0.0:
        raise ParameterValueError("delta must be in (0, 1) for an estimate, got 0.0")
    samples = check_count(
        "samples", samples, minimum=100, maximum=MAX_SAMPLES,
        max_hint="10**6 samples take seconds, and the interval shrinks only as "
                 "1 / sqrt(samples); pass fewer, e.g. samples=100000 (the default)")
    confidence = check_probability("confidence", confidence)
    if not 0.0 < confidence < 1.0:
        raise ParameterValueError(f"confidence must be in (0, 1), got {confidence!r}")
    if seed is not None:  # NumPy's own refusals were bare (a float, -1, a string)
        seed = check_count("seed", seed, minimum=0, integral_floats=False,
                           hint="pass an int >= 0 such as 0, or None for fresh entropy")
    from scipy import special

    z = float(special.ndtri(0.5 + confidence / 2.0))
    lp, lq = _losses(mechanism, samples, seed)

    def solve(shift: float) -> float:
        """Smallest eps with max(delta_remove, delta_add) + shift * se <= delta."""
        def excess(e: float) -> float:
            dr, sr, da, sa = _delta_curves(lp, lq, e)
            return max(dr + shift * sr, da + shift * sa) - delta
        if excess(0.0) <= 0.0:
            return 0.0
        hi = 1.0
        while excess(hi) > 0.0:
            hi *= 2.0
            if hi > 1e4:
                return math.inf
        lo = 0.0
        for _ in range(80):
            mid = 0.5 * (lo + hi)
            lo, hi = (lo, mid) if excess(mid) <= 0.0 else (mid, hi)
        return hi

    return EpsilonEstimate(
        value=solve(0.0), lower=solve(-z), upper=solve(z), confidence=confidence,
        samples=samples, delta=delta,
        method="Monte-Carlo privacy loss of the balls-in-bins matrix-mechanism pair (MMCC)",
    )


@dataclass(frozen=True)
class NoiseEstimate:
    """A noise multiplier chosen from Monte-Carlo estimates (not a certified calibration)."""

    noise_multiplier: float
    estimate: EpsilonEstimate

    certified = False


def calibrate_estimate(
    factory: Callable[[float], BallsInBinsMatrixMechanism],
    epsilon: float,
    delta: float,
    *,
    use_upper: bool = True,
    samples: int = 20_000,
    seed: int = 0,
    rtol: float = 1e-3,
) -> NoiseEstimate:
    """The explicit opt-in for calibrating on estimates: the smallest noise multiplier
    (to ``rtol``) whose estimated epsilon -- its upper interval end when ``use_upper`` --
    is at most ``epsilon``. Same seed for every evaluation (common random numbers)."""
    target = check_positive("epsilon", epsilon)

    def est(x: float) -> EpsilonEstimate:
        return estimate_epsilon(factory(x), delta, samples=samples, seed=seed)

    def ok(e: EpsilonEstimate) -> bool:
        return (e.upper if use_upper else e.value) <= target

    hi = 1.0
    while not ok(est(hi)):
        hi *= 2.0
        if hi > 1e6:
            raise ParameterValueError(
                f"target epsilon={target} unreachable (noise multiplier > 1e6)")
    lo = hi / 2.0
    while ok(est(lo)):
        hi, lo = lo, lo / 2.0
        if lo < 1e-6:
            break
    while hi - lo > rtol * hi:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if ok(est(mid)) else (mid, hi)
    return NoiseEstimate(hi, est(hi))
