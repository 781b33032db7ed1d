"""autodp-compatible ``privacy_calibrator`` (autodp's legacy calibration API).

Same names, signatures and returned parameter dictionaries as autodp's; every noise
level is calibrated with privlearn's certified accountants, so it is never larger than
autodp's (autodp converts RDP; privlearn uses the exact Gaussian curve, the PLD
accountant for Laplace and randomized response compositions and subsampling, and the
RDP accountant for a user-supplied RDP function).

References
----------
Balle & Wang (2018), Improving the Gaussian Mechanism for Differential Privacy, ICML,
Theorem 8 (analytic Gaussian); Li, Qardaji & Su (2012), On Sampling, Anonymization, and
Differential Privacy, ASIACCS, Theorem 1 (amplification of (eps, delta) by subsampling);
Dwork & Roth (2014), The Algorithmic Foundations of Differential Privacy, Theorem A.1
(classical Gaussian mechanism).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from scipy.optimize import brentq

from privlearn.accounting import (
    Gaussian,
    Laplace,
    RandomizedResponse,
    RDPMechanism,
    calibrate,
    compose,
    subsample,
)
from privlearn.compat.autodp._missing import missing
from privlearn.compat.autodp.autodp_core import as_float
from privlearn.errors import AutodpCalibrationError, CalibrationError, ParameterValueError

__all__ = [
    "subsample_epsdelta",
    "subsample_epsdelta_inverse",
    "subsample_epsdelta_get_prob",
    "RDP_mech",
    "subsampled_RDP_mech_get_prob",
    "gaussian_mech",
    "laplace_mech",
    "randresponse_mech",
    "classical_gaussian_mech",
    "ana_gaussian_mech",
]


def _check(eps: Any, delta: Any, *, delta_zero: bool = False) -> tuple[float, float]:
    e, d = as_float("eps", eps), as_float("delta", delta)
    if not e > 0:
        raise ParameterValueError(
            f"eps must be in (0, inf), got {eps!r}: pass a positive target epsilon"
        )
    if not (0 <= d <= 1) or (d == 0 and not delta_zero):
        rng = "[0, 1]" if delta_zero else "(0, 1]"
        raise ParameterValueError(
            f"delta must be in {rng}, got {delta!r}: pass a small positive delta, e.g. 1e-5"
        )
    return e, d


_U = 2.0**-52  # the float spacing at 1 (twice the unit roundoff)


def _log_expm1(x: float) -> float:
    """``log(e^x - 1)`` for ``x > 0`` without overflow (``-inf`` at 0)."""
    return x + math.log(-math.expm1(-x)) if x > 0 else -math.inf


def _amplified_upper(eps: float, prob: float) -> float:
    """``log(1 + prob (e^eps - 1))`` rounded up: at least the exact value (plain floats
    carry a relative error of a few ulps, the log-space form for ``eps > 700`` an
    absolute one of a few ulps of its terms)."""
    if prob == 0 or eps == 0:
        return 0.0
    if eps <= 700.0:
        return math.log1p(prob * math.expm1(eps)) * (1.0 + 8.0 * _U)
    big = math.log(prob) + _log_expm1(eps)  # log(prob (e^eps - 1))
    val = big + math.log1p(math.exp(-big)) if big > 0 else math.log1p(math.exp(big))
    return val * (1.0 + 16.0 * _U * (abs(math.log(prob)) + eps + abs(big) + 2.0))


def _check_prob(prob: Any, name: str = "prob") -> float:
    q = as_float(name, prob)
    if not 0 < q <= 1:
        raise ParameterValueError(
            f"{name} must be in (0, 1], got {prob!r}; pass the sampling probability "
            "(batch size / dataset size)")
    return q


def subsample_epsdelta(eps: Any, delta: Any, prob: Any) -> tuple[float, float]:
    """``(log(1 + prob (e^eps - 1)), prob delta)``: an (eps, delta)-DP mechanism on a
    Poisson subsample of rate ``prob`` (Li, Qardaji & Su 2012, Theorem 1), both rounded
    up (the guarantee is never understated by floating point)."""
    e, d, q = as_float("eps", eps), as_float("delta", delta), as_float("prob", prob)
    if q == 0:
        return 0.0, 0.0
    return _amplified_upper(e, q), min(1.0, q * d * (1.0 + 2.0 * _U))


def subsample_epsdelta_inverse(eps: Any, delta: Any, prob: Any) -> tuple[float, float]:
    """The base ``(eps0, delta0)`` whose subsampled guarantee is ``(eps, delta)``, rounded
    down: ``subsample_epsdelta(eps0, delta0, prob)`` is exactly at most ``(eps, delta)``
    (Li, Qardaji & Su 2012, Theorem 1, inverted)."""
    e, d = as_float("eps", eps), as_float("delta", delta)
    q = _check_prob(prob)
    if not e > 0:
        return 0.0, min(d / q * (1.0 - 2.0 * _U), 1.0)
    ratio = math.expm1(e) / q if e <= 700.0 else math.inf
    if math.isfinite(ratio):
        e0 = math.log1p(ratio) * (1.0 - 8.0 * _U)
    else:  # log space: log((e^eps - 1) / prob) overflows floats
        big = _log_expm1(e) - math.log(q)
        e0 = big + math.log1p(math.exp(-big))
        e0 = max(0.0, e0 - 8.0 * _U * (e0 + abs(math.log(q)) + e + 2.0))
    for _ in range(4096):  # certified: the amplified value, rounded up, meets eps
        if _amplified_upper(e0, q) <= e:
            break
        e0 = math.nextafter(e0, 0.0)
    return e0, min(d / q * (1.0 - 2.0 * _U), 1.0)


def subsample_epsdelta_get_prob(eps_target: Any, delta_target: Any, eps_base: Any,
                                delta_base: Any) -> float:
    """The largest rate at which ``(eps_base, delta_base)`` amplifies to the target,
    rounded down (the amplified guarantee is exactly within the target)."""
    et, dt = as_float("eps_target", eps_target), as_float("delta_target", delta_target)
    eb, db = as_float("eps_base", eps_base), as_float("delta_base", delta_base)
    if not et > 0 or not eb > 0:
        raise ParameterValueError(
            f"eps_target and eps_base must be > 0, got eps_target={eps_target!r}, "
            f"eps_base={eps_base!r}; pass the privacy parameters of the target and of "
            "the base mechanism")
    q = min(1.0, math.exp(_log_expm1(et) - _log_expm1(eb)))
    if db > 0:
        q = min(q, dt / db * (1.0 - 2.0 * _U))
    for _ in range(4096):  # certified: the amplified value, rounded up, meets eps_target
        if q <= 0 or _amplified_upper(eb, q) <= et:
            break
        q = math.nextafter(q, 0.0)
    return q


_MIN_PROB = 1e-12
"""Smallest sampling probability :func:`subsampled_RDP_mech_get_prob` searches."""


def _feasible_root(f: Callable[[float], float], a: float, b: float) -> float:
    """A point ``x`` of ``[a, b]`` with ``f(x) <= 0`` next to where ``f`` changes sign
    (``f(a)`` and ``f(b)`` have opposite signs), ``f(x) = epsilon(x) - target``.

    Brent's root is within its tolerance of the crossing but on either side of it, and
    epsilon need not be continuous (the RDP accountant's epsilon jumps from 0 where its
    bound on delta at epsilon 0 crosses the target delta), so the root is checked and,
    when infeasible, the bracket between it and the feasible end is bisected on
    feasibility until adjacent to the crossing: the parameter returned always meets the
    target by an actual evaluation.
    """
    fa = f(a)
    root = brentq(f, a, b)
    if f(root) <= 0:
        return root
    good, bad = (a, root) if fa <= 0 else (b, root)
    for _ in range(200):
        mid = 0.5 * (good + bad)
        if not min(good, bad) < mid < max(good, bad) or abs(bad - good) <= 1e-12 * abs(good):
            break
        if f(mid) <= 0:
            good = mid
        else:
            bad = mid
    return good


def _rdp_epsilon(rdp: Callable[[float], float], delta: float, k: int, prob: float) -> float:
    base = RDPMechanism(rdp)
    if 0 < prob < 1:
        base = subsample(base, prob)
    return compose(base, steps=k).epsilon(delta, "rdp")


def RDP_mech(rdp_func: Callable, eps: Any, delta: Any, param_name: str, params: dict,  # noqa: N802
             bounds=(0, math.inf), k: int = 1, prob: float = 1.0) -> dict:
    """Calibrate ``params[param_name]`` so that ``k`` runs of the mechanism with RDP
    ``rdp_func(params, alpha)`` (each on a Poisson subsample of rate ``prob`` if
    ``prob < 1``) are ``(eps, delta)``-DP by the RDP accountant; ``params`` is updated
    in place and returned (autodp's behaviour)."""
    e, d = _check(eps, delta)
    lo_b, hi_b = float(bounds[0]), float(bounds[1])

    def f(x: float) -> float:
        params[param_name] = x
        return _rdp_epsilon(lambda a, p=dict(params): rdp_func(p, a), d, int(k), prob) - e

    a, b = min(hi_b, max(1.0, lo_b)), max(lo_b, min(2.0, hi_b))
    for _ in range(100):
        fa, fb = f(a), f(b)
        if math.copysign(1, fa) != math.copysign(1, fb):
            break
        a, b = max(a / 2, lo_b), min(b * 2, hi_b)
    else:
        raise CalibrationError(
            f"infeasible privacy parameters: no {param_name} in bounds ({lo_b}, {hi_b}) makes "
            "this RDP function (eps, delta)-DP; widen bounds or raise eps/delta"
        )
    root = _feasible_root(f, a, b)
    params[param_name] = root
    return params


def subsampled_RDP_mech_get_prob(rdp_func: Callable, eps: Any, delta: Any, params: dict,
                                 k: int = 1) -> float:
    """The largest subsampling rate at which ``k`` runs are ``(eps, delta)``-DP."""
    e, d = _check(eps, delta)

    def f(q: float) -> float:
        return _rdp_epsilon(lambda a: rdp_func(params, a), d, int(k), q) - e

    if f(1.0) <= 0:
        return 1.0
    if f(_MIN_PROB) > 0:
        raise AutodpCalibrationError(
            f"infeasible privacy parameters: {int(k)} runs exceed eps={e!r} at delta={d!r} "
            f"even at sampling probability {_MIN_PROB:g}; raise eps or delta, or use "
            "fewer runs")
    return _feasible_root(f, _MIN_PROB, 1.0)


def gaussian_mech(eps: Any, delta: Any, k: int = 1, prob: float = 1.0) -> dict:
    """``{'sigma': s}``: the smallest Gaussian noise multiplier such that ``k`` runs (on
    Poisson subsamples of rate ``prob``) are ``(eps, delta)``-DP (exact Gaussian curve
    without subsampling, the PLD accountant with it)."""
    e, d = _check(eps, delta)
    q, k = as_float("prob", prob), int(k)

    def mech(s: float):
        base = Gaussian(s) if q >= 1 else subsample(Gaussian(s), q)
        return compose(base, steps=k)

    return {"sigma": float(calibrate(mech, e, d))}


def laplace_mech(eps: Any, delta: Any, k: int = 1, prob: float = 1.0) -> dict:
    """``{'b': b}`` for the Laplace mechanism (``b = k / eps`` at ``delta = 0``)."""
    e, d = _check(eps, delta, delta_zero=True)
    q, k = as_float("prob", prob), int(k)

    def mech(b: float):
        base = Laplace(b) if q >= 1 else subsample(Laplace(b), q)
        return compose(base, steps=k)

    # k runs of Laplace(k / eps) are (eps, 0)-DP; k / eps is rounded up until the
    # accountant certifies it (k * (1 / b) can round to a float above eps)
    binf = k / e
    while compose(Laplace(binf), steps=k).epsilon(0.0) > e:
        binf = math.nextafter(binf, math.inf)
    if d == 0:
        return {"b": binf}
    b = float(calibrate(mech, e, d))
    return {"b": binf if binf < b and mech(binf).epsilon(d) <= e else b}


def randresponse_mech(eps: Any, delta: Any, k: int = 1, prob: float = 1.0) -> dict:
    """``{'p': p}``: the largest truthful-answer probability of binary randomized
    response such that ``k`` runs are ``(eps, delta)``-DP."""
    e, d = _check(eps, delta, delta_zero=True)
    q, k = as_float("prob", prob), int(k)
    if d >= 1:
        return {"p": 1.0}
    # k runs at p = 1 / (1 + e^{-eps/k}) are (eps, 0)-DP; p is rounded down until the
    # accountant certifies it (log(p / (1 - p)) can round to a float above eps / k)
    pinf = 1.0 / (1.0 + math.exp(-e / k))
    while compose(RandomizedResponse(pinf), steps=k).epsilon(0.0) > e:
        pinf = math.nextafter(pinf, 0.0)
    if d == 0:
        return {"p": pinf}

    def eps_of(p: float) -> float:
        base = RandomizedResponse(p) if q >= 1 else subsample(RandomizedResponse(p), q)
        return compose(base, steps=k).epsilon(d)

    lo, hi = pinf, 1.0 - 1e-12
    while eps_of(lo) > e:  # the certified bound at d may carry a rounding allowance
        lo = math.nextafter(lo, 0.0)
    if eps_of(hi) <= e:
        return {"p": hi}
    for _ in range(100):  # bisection on p (epsilon increases with p)
        mid = 0.5 * (lo + hi)
        if eps_of(mid) <= e:
            lo = mid
        else:
            hi = mid
    return {"p": lo}


def classical_gaussian_mech(eps: Any, delta: Any) -> dict | float:
    """``{'sigma': sqrt(2 log(1.25/delta)) / eps}`` (Dwork & Roth 2014, Theorem A.1; valid
    for ``0 < eps <= 1``). For comparisons only: :func:`ana_gaussian_mech` is smaller."""
    e, d = as_float("eps", eps), as_float("delta", delta)
    if not 0 < e <= 1:
        raise ParameterValueError(
            f"eps must satisfy 0 < eps <= 1 for the classical Gaussian mechanism, got {eps!r}; "
            "use gaussian_mech or ana_gaussian_mech"
        )
    if d <= 0:
        return math.inf
    if d >= 1:
        return 0
    return {"sigma": math.sqrt(2.0 * math.log(1.25 / d)) / e}


def ana_gaussian_mech(epsilon: Any, delta: Any, tol: float = 1e-12) -> dict:
    """``{'sigma': s}``: the analytic Gaussian mechanism (Balle & Wang 2018, Theorem 8),
    the smallest ``s`` with ``delta(epsilon) <= delta`` on the exact curve (certified,
    rounded up; ``tol`` is accepted for compatibility)."""
    e, d = _check(epsilon, delta)
    return {"sigma": float(calibrate(lambda s: Gaussian(s), e, d))}


def __getattr__(name: str) -> Any:
    raise missing("privacy_calibrator", name, __all__)
