"""Calibration: find the parameter of a mechanism family that meets a privacy budget.

One routine serves every parameter and every accountant: it takes a factory
``parameter -> Mechanism`` and a target (epsilon, delta), detects whether epsilon grows or
shrinks with the parameter, and bisects. The result is rounded on the safe side, so the
mechanism built from the returned parameter has ``epsilon(delta) <= target``:

* a noise multiplier (epsilon decreasing in it) is rounded up;
* a number of steps or a sampling rate (epsilon increasing in it) is rounded down.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from privlearn._validation import check_count, check_delta, check_positive, check_real
from privlearn.accounting.mechanisms import DEFAULT_ACCOUNTANT, Mechanism
from privlearn.errors import (
    CalibrationError,
    CertificationError,
    ParameterTypeError,
    ParameterValueError,
    PrivacyLossOverflowError,
)

__all__ = ["calibrate", "CalibrationError"]


def _unreachable_message(target: float, delta: float, param: float, eps: float) -> str:
    """Why a target no parameter up to ``param`` meets is refused, and what to try."""
    if math.isinf(eps) and delta == 0.0:
        return (f"target epsilon={target} unreachable at delta=0: epsilon is infinite for "
                f"every parameter tried (up to {param:g}), so the mechanism has no pure-DP "
                "guarantee (e.g. Gaussian noise); give a delta > 0, or a mechanism with a "
                "pure-DP guarantee (e.g. Laplace noise)")
    return (f"target epsilon={target} unreachable at delta={delta:g}: epsilon is still "
            f"{eps:g} at the parameter {param:g} (searched up to 1e12); loosen the target "
            "(a larger epsilon or delta), or pass bounds=(lower, upper) if the parameter "
            "should be searched elsewhere")


def calibrate(
    factory: Callable[[float], Mechanism],
    epsilon: float,
    delta: float,
    *,
    bounds: tuple[float, float] | None = None,
    accountant: str = DEFAULT_ACCOUNTANT,
    integer: bool = False,
    rtol: float = 1e-6,
    max_evaluations: int = 200,
) -> float:
    """Parameter ``x`` such that ``factory(x).epsilon(delta) <= epsilon``, as tight as
    ``rtol`` allows.

    Parameters
    ----------
    factory : callable
        Maps the parameter (noise multiplier, number of steps, sampling rate, ...) to a
        :class:`~privlearn.accounting.mechanisms.Mechanism`. Epsilon must be monotone in
        the parameter (increasing or decreasing; the direction is detected, from delta
        at the common epsilon where epsilon is the same at both probes, e.g. 0).
    epsilon : float > 0
        Target epsilon.
    delta : float in [0, 1)
        Target delta.
    bounds : (float, float), optional
        Search interval for the parameter. Default: the positive reals, searched
        geometrically outward from 1 (use explicit bounds for a rate, e.g. ``(1e-9, 1)``).
    accountant : str
        Accountant used for every evaluation (default ``"pld"``).
    integer : bool
        Restrict the parameter to integers (e.g. number of steps).
    rtol : float in (0, 1)
        Relative width of the final bracket (ignored when ``integer``); a width below
        the floating-point spacing stops at adjacent floats.
    max_evaluations : int >= 1
        Evaluations of ``factory(x).epsilon`` allowed before giving up.

    Returns
    -------
    float (or int when ``integer``)
        The parameter on the feasible side of the bracket: when epsilon decreases with
        the parameter, the smallest feasible value found (rounded up); when it increases,
        the largest (rounded down).

    Raises
    ------
    CalibrationError
        If no value in ``bounds`` meets the target (a parameter at which no epsilon can
        be certified, e.g. ``delta`` below the mass at infinity of its
        :class:`ApproxDP` parts, counts as missing it; the message then says why).

    Examples
    --------
    >>> from privlearn.accounting import Gaussian, calibrate, compose, subsample
    >>> q, T = 256 / 60000, 14040
    >>> sigma = calibrate(lambda x: compose(subsample(Gaussian(x), rate=q), steps=T),
    ...                   epsilon=3.0, delta=1e-5)
    """
    target = check_positive("epsilon", epsilon)
    delta = check_delta("delta", delta)
    if not callable(factory):
        raise ParameterTypeError(f"factory must be callable, got {factory!r}")
    rtol_hint = "pass a relative tolerance in (0, 1), e.g. 1e-6"
    rtol = check_real("rtol", rtol, hint=rtol_hint)
    if not 0.0 < rtol < 1.0:
        raise ParameterValueError(f"rtol must be in (0, 1), got {rtol!r}; {rtol_hint}")
    max_evaluations = check_count("max_evaluations", max_evaluations, minimum=1,
                                  hint="pass a positive integer, e.g. 200")
    if not isinstance(integer, bool):
        raise ParameterTypeError(
            f"integer must be True or False, got {integer!r} ({type(integer).__name__}); "
            "pass integer=True to search integers (a number of steps)")
    cache: dict[float, float] = {}
    n_eval = 0

    def eps_of(x: float) -> float:
        nonlocal n_eval
        if x not in cache:
            n_eval += 1
            if n_eval > max_evaluations:
                raise CalibrationError(
                    f"calibration did not converge in {max_evaluations} evaluations"
                )
            try:
                mechanism = factory(int(x) if integer else x)
            except ParameterValueError as err:
                if bounds is not None:
                    raise
                raise CalibrationError(
                    f"the factory refuses the parameter {x:g}, which the search without "
                    f"bounds tries (it starts at 1 and 2 and moves geometrically): {err}. "
                    "Pass bounds=(lower, upper) inside the range the factory accepts, "
                    "e.g. bounds=(1e-9, 1.0) for a sampling rate") from err
            if not callable(getattr(mechanism, "epsilon", None)):
                raise ParameterTypeError(
                    f"factory must return a privlearn Mechanism (an object with an "
                    f"epsilon(delta, accountant) method), got {mechanism!r} "
                    f"({type(mechanism).__name__}) for the parameter {x!r}; return e.g. "
                    "compose(subsample(Gaussian(x), rate=q), steps=T)")
            try:
                cache[x] = float(mechanism.epsilon(delta, accountant))
            except PrivacyLossOverflowError:
                # a privacy loss too large to represent (an epsilon above 1e12, or
                # infinite): counted as infeasible, so the search moves to more noise; a
                # huge target is then met by the largest epsilon that can be certified
                # (never by a parameter whose epsilon is unknown)
                cache[x] = math.inf
            except CertificationError as err:
                # no finite epsilon is certified at this parameter (e.g. delta at or below
                # the mass at infinity of the (epsilon, delta)-DP parts, which a sampling
                # rate moves): infeasible too, so that the search goes on to parameters
                # that can be certified; kept to say why if none can
                cache[x] = math.inf
                refusal[:] = [err]
        return cache[x]

    refusal: list[CertificationError] = []

    def unreachable(message: str) -> CalibrationError:
        if not refusal:
            return CalibrationError(message)
        err = CalibrationError(f"{message} (the accountant could not certify it: "
                               f"{refusal[0]})")
        err.__cause__ = refusal[0]  # as ``raise ... from``: the cause says what to try
        return err

    def feasible(x: float) -> bool:
        return eps_of(x) <= target

    def decreases(a: float, b: float) -> bool:
        """Whether epsilon decreases from ``a`` to ``b > a``. Where both epsilons are
        equal (e.g. both 0: a tiny sampling rate keeps every short run within delta),
        the direction is read from ``delta`` at that epsilon, which still moves there;
        equal in both, the parameter is taken as a noise scale (decreasing)."""
        e_a, e_b = eps_of(a), eps_of(b)
        if e_a != e_b or not math.isfinite(e_a):
            return e_a >= e_b
        try:  # delta at the common epsilon (<= the target delta for both)
            d_a, d_b = (_delta_of(factory(int(x) if integer else x), e_a, accountant)
                        for x in (a, b))
        except (ArithmeticError, ValueError):
            return True
        return d_a is None or d_b is None or d_a >= d_b

    if bounds is not None:
        if isinstance(bounds, str | bytes) or not hasattr(bounds, "__len__") or len(
                bounds) != 2:
            raise ParameterTypeError(
                f"bounds must be a pair (lower, upper) of real numbers, got {bounds!r}; "
                "pass e.g. bounds=(1e-9, 1.0) for a rate")
        lo, hi = (check_real("bounds[0]", bounds[0]), check_real("bounds[1]", bounds[1]))
        if not lo < hi:
            raise ParameterValueError(f"bounds must satisfy lower < upper, got {bounds!r}")
        if integer:
            lo, hi = math.ceil(lo), math.floor(hi)
        e_lo, e_hi = eps_of(lo), eps_of(hi)
        decreasing = decreases(lo, hi)
        if decreasing:
            if not feasible(hi):
                raise unreachable(
                    f"target epsilon={target} unreachable: epsilon at the upper bound "
                    f"{hi} is {e_hi} (delta={delta:g}); raise the upper bound of "
                    "bounds, or loosen the target (a larger epsilon or delta)"
                )
            if feasible(lo):
                return lo
        else:
            if not feasible(lo):
                raise unreachable(
                    f"target epsilon={target} unreachable: epsilon at the lower bound "
                    f"{lo} is {e_lo} (delta={delta:g}); lower the lower bound of bounds, "
                    "or loosen the target (a larger epsilon or delta)"
                )
            if feasible(hi):
                return hi
    else:
        # Detect the direction around 1, then expand geometrically.
        decreasing = decreases(1.0, 2.0)
        if decreasing:
            hi = 1.0
            while not feasible(hi):
                hi *= 2.0
                if hi > 1e12:
                    raise unreachable(_unreachable_message(target, delta, hi / 2.0,
                                                                eps_of(hi / 2.0)))
            lo = hi / 2.0
            floor = 1.0 if integer else 1e-12
            while lo >= floor and feasible(lo):
                lo /= 2.0
            if lo < floor:
                # every parameter halved down to the floor is feasible. Only a checked
                # one is returned: epsilon decreases in the parameter, so the halved,
                # unchecked lo can exceed the target
                if integer:
                    return 1  # 2 lo = 1 was checked (hi, or in the loop)
                if feasible(lo):
                    return lo
                # else lo (infeasible) and hi (feasible) bracket the target: bisect
        else:
            lo = 1.0
            if not feasible(lo):
                while not feasible(lo):
                    lo /= 2.0
                    if lo < (1.0 if integer else 1e-12):
                        raise unreachable(
                            f"target epsilon={target} unreachable for any positive parameter"
                            f" (delta={delta:g}): epsilon grows with the parameter and is "
                            f"still {eps_of(lo * 2.0):g} at {lo * 2.0:g}; loosen the target "
                            "(a larger epsilon or delta)"
                        )
                hi = lo * 2.0
            else:
                hi = 2.0
                while feasible(hi):
                    lo = hi
                    hi *= 2.0
                    if hi > 1e15:
                        return lo
        if integer:
            lo, hi = math.floor(lo), math.ceil(hi)

    # Invariant: exactly one of lo/hi is feasible (hi if decreasing, lo otherwise).
    if not integer and lo > 0:
        lo, hi = _brent_refine(eps_of, target, lo, hi, decreasing, rtol)
        lo, hi = _tightest_bracket(cache, target, lo, hi, decreasing)
    while True:
        if integer:
            if hi - lo <= 1:
                break
            mid = (lo + hi) // 2
        else:
            if hi - lo <= rtol * abs(hi):
                break
            mid = math.sqrt(lo * hi) if lo > 0 else 0.5 * (lo + hi)
            if not lo < mid < hi:  # adjacent floats: rtol is below their spacing
                break
        if feasible(mid) == decreasing:
            hi = mid
        else:
            lo = mid
    result = hi if decreasing else lo
    return int(result) if integer else float(result)


def _delta_of(mechanism: object, epsilon: float, accountant: str) -> float | None:
    """``mechanism.delta(epsilon, accountant)``, or None for an object without a delta
    method (a factory may return any object with an ``epsilon(delta, accountant)``)."""
    fn = getattr(mechanism, "delta", None)
    return float(fn(epsilon, accountant)) if callable(fn) else None


def _brent_refine(
    eps_of: Callable[[float], float],
    target: float,
    lo: float,
    hi: float,
    decreasing: bool,
    rtol: float,
) -> tuple[float, float]:
    """Shrink the bracket [lo, hi] with Brent's method on log(epsilon) vs log(parameter).

    epsilon is close to a power law in the parameter, so this needs far fewer
    evaluations than bisection. The returned bracket keeps the invariant of the caller
    (the feasible end is ``hi`` when ``decreasing``, else ``lo``) -- every end is checked
    by an actual evaluation, so the final answer remains certified even if the accountant
    is not perfectly smooth.
    """
    from scipy import optimize  # lazily: keeps ``import privlearn.accounting`` light

    log_t = math.log(target)

    def g(u: float) -> float:
        e = eps_of(math.exp(u))
        if e <= 0.0:
            return -1e3
        if math.isinf(e):
            return 1e3
        return math.log(e) - log_t

    a, b = math.log(lo), math.log(hi)
    try:
        root = optimize.brentq(g, a, b, xtol=rtol / 4.0, rtol=4 * np.finfo(float).eps)
    except (ValueError, RuntimeError):
        return lo, hi  # no sign change seen (flat/inf regions): plain bisection decides
    half = rtol / 2.0
    inner, outer = (root - half, root + half) if decreasing else (root + half, root - half)
    # ``outer`` should be feasible and ``inner`` infeasible; verify both by evaluation.
    x_out, x_in = math.exp(outer), math.exp(inner)
    if lo < x_out < hi and eps_of(x_out) <= target:
        if decreasing:
            hi = x_out
        else:
            lo = x_out
        if lo < x_in < hi and eps_of(x_in) > target:
            if decreasing:
                lo = x_in
            else:
                hi = x_in
    return lo, hi


def _tightest_bracket(
    evaluated: dict[float, float], target: float, lo: float, hi: float, decreasing: bool
) -> tuple[float, float]:
    """The narrowest bracket inside ``[lo, hi]`` whose ends were both evaluated: the
    feasible end (``hi`` when ``decreasing``, else ``lo``) moved to the evaluated
    parameter nearest the other end with ``epsilon <= target``, then the infeasible end
    to the evaluated parameter nearest it with ``epsilon > target``. Keeps the caller's
    invariant; only evaluated parameters become ends, so the answer stays one whose
    epsilon was computed. Where epsilon jitters in the parameter (a certified bound's
    grid moves with it, e.g. the tilted PLD at delta 1e-12, by about 1e-5 relative),
    Brent's two checks around its root can both fail, and bisection would otherwise
    start again from the wide bracket (17 more evaluations)."""
    inside = [(x, e) for x, e in evaluated.items() if lo < x < hi]
    ok = [x for x, e in inside if e <= target]
    if decreasing:
        if ok:
            hi = min(ok)
        bad = [x for x, e in inside if e > target and x < hi]
        if bad:
            lo = max(bad)
    else:
        if ok:
            lo = max(ok)
        bad = [x for x, e in inside if e > target and x > lo]
        if bad:
            hi = min(bad)
    return lo, hi
