"""Conversions from Renyi DP to (epsilon, delta)-DP.

A mechanism that is (alpha, tau)-RDP for some order alpha > 1 is (epsilon, delta)-DP with

    epsilon = tau + log((alpha - 1) / alpha) - (log(delta) + log(alpha)) / (alpha - 1)   (1)

(Canonne, Kamath & Steinke 2020, Proposition 12; Balle, Barthe, Gaboardi, Hsu & Sato 2020,
Theorem 21). Solving (1) for delta gives the equivalent statement

    delta = exp((alpha - 1) (tau - epsilon)) / alpha * (1 - 1/alpha)^(alpha - 1)          (2)

(the form printed in Canonne, Kamath & Steinke 2020, Proposition 12, is
``exp((alpha-1)(tau-eps)) / (alpha-1) * (1-1/alpha)^alpha``, which is the same number since
``(1-1/alpha)^alpha / (alpha-1) = (1-1/alpha)^(alpha-1) / alpha``).

Both hold for every real alpha > 1, so the minimum over any family of orders is a valid
bound. Independently of epsilon, ``delta(epsilon) <= delta(0) = TV(P, Q)`` and

    TV(P, Q) <= sqrt(1 - exp(-KL(P || Q))) <= sqrt(1 - exp(-tau(alpha)))                  (3)

for every alpha > 1 (Bretagnolle & Huber 1979; the Renyi divergence is non-decreasing in
its order, so ``KL <= tau(alpha)``; van Erven & Harremoes 2014, Theorem 3): the delta
bound is the smaller of (2) and (3), and ``epsilon(delta) = 0`` once (3) is at most delta
(Google dp_accounting's RDP conversion uses the same bound). It matters at small
epsilon and for mechanisms with a tiny privacy loss (a huge noise multiplier), where (2)
is far looser. We minimise over a dense grid of orders (fractional near 1, geometric up to 1e6,
extended only when the optimum sits at the top of the evaluated range) and then refine
the best grid point with a bounded one-dimensional minimisation over real alpha; the
result is the minimum of the grid and refined values, so the refinement can only help.
This is how we improve on fixed order grids such as Opacus's (which stops at alpha = 63).

Numerical safety: RDP values that are NaN are treated as ``+inf`` (no information), never
as small numbers; the final epsilon is rounded *up* by a few units in the last place of
the terms that formed it, and delta is rounded up likewise.

References
----------
.. [1] Canonne, Kamath & Steinke (2020), The Discrete Gaussian for Differential Privacy,
       NeurIPS, Proposition 12.
.. [2] Balle, Barthe, Gaboardi, Hsu & Sato (2020), Hypothesis Testing Interpretations and
       Renyi Differential Privacy, AISTATS, Theorem 21.
.. [3] Mironov (2017), Renyi Differential Privacy, CSF, Proposition 3 (pure epsilon-DP
       implies (alpha, epsilon)-RDP; used for the cap at the pure epsilon).
.. [4] Bretagnolle & Huber (1979), Estimation des densites: risque minimax, Z. Wahrsch.
       Verw. Gebiete 47, Lemma 2.1 (``TV <= sqrt(1 - exp(-KL))``); van Erven & Harremoes
       (2014), Renyi Divergence and Kullback-Leibler Divergence, IEEE Trans. Inf. Theory,
       Theorem 3 (monotonicity in the order).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from scipy import optimize

from privlearn._validation import check_callable, check_nonnegative
from privlearn.accounting._queries import query_delta, query_epsilon
from privlearn.errors import ParameterTypeError, ParameterValueError

__all__ = [
    "DEFAULT_ORDERS",
    "epsilon_from_rdp",
    "delta_from_rdp",
    "rdp_to_epsilon",
    "rdp_to_epsilon_and_order",
    "rdp_to_delta",
]

_ULP = np.finfo(float).eps
_TINY = float(np.finfo(float).smallest_normal)

#: Orders evaluated first: fractional near 1, all integers to 64, geometric to 256.
DEFAULT_ORDERS: np.ndarray = np.unique(
    np.concatenate(
        [
            1.0 + np.geomspace(1e-3, 1.0, 36)[:-1],
            np.linspace(2.0, 11.0, 37),
            np.arange(12.0, 65.0),
            np.round(np.geomspace(64.0, 256.0, 9)),
        ]
    )
)
#: Blocks of larger integer orders, evaluated only while the optimum is at the top.
EXTENSION_BLOCKS: tuple[np.ndarray, ...] = (
    np.unique(np.round(np.geomspace(256.0, 4096.0, 17)))[1:],
    np.unique(np.round(np.geomspace(4096.0, 65536.0, 13)))[1:],
    np.unique(np.round(np.geomspace(65536.0, 1e6, 9)))[1:],
    # bounded curves (the limit at infinite order is the pure epsilon): the conversion
    # term log(1/delta)/(alpha - 1) keeps shrinking, so the optimum can lie far out
    np.geomspace(1e6, 1e9, 7)[1:],
    np.geomspace(1e9, 1e15, 7)[1:],
)


def _check_orders(orders: object) -> np.ndarray:
    """Orders as a float array, every one a real number > 1 (the conversions divide by
    ``alpha - 1``)."""
    try:
        a = np.asarray(orders, dtype=float)
    except (TypeError, ValueError):
        raise ParameterTypeError(
            f"orders must be an array of real numbers > 1, got {orders!r}; pass e.g. "
            "privlearn.accounting.conversion.DEFAULT_ORDERS") from None
    bad = ~(a > 1.0)
    if np.any(bad):
        raise ParameterValueError(
            f"orders must be real numbers in (1, inf), got {float(a[bad].flat[0])!r} among "
            "them; Renyi orders start above 1 (pass e.g. DEFAULT_ORDERS)")
    return a


def _check_rdp_fn(rdp_fn: object) -> None:
    check_callable("rdp_fn", rdp_fn,
                   hint="pass a vectorised function orders -> RDP values, e.g. "
                        "lambda a: a / (2 * sigma**2) for a Gaussian")


def _check_pure(pure_epsilon: object) -> float:
    return check_nonnegative("pure_epsilon", pure_epsilon, allow_inf=True,
                             hint="pass a known pure-DP epsilon, or inf when there is none")


def _check_refine(refine: object) -> bool:
    if not isinstance(refine, (bool, np.bool_)):
        raise ParameterTypeError(f"refine must be True or False, got {refine!r} "
                                 f"({type(refine).__name__}); pass a bool")
    return bool(refine)


def _clean(rdp: np.ndarray, orders: np.ndarray | None = None) -> np.ndarray:
    """RDP values as floats, NaN read as ``inf`` (no guarantee). A negative value is
    refused: a Renyi divergence is never negative, and one would make the conversion
    optimistic. With ``orders``, one value per order is required (or a single one)."""
    try:
        rdp = np.asarray(rdp, dtype=float)
    except (TypeError, ValueError):
        raise ParameterTypeError(
            f"RDP values must be real numbers, got {rdp!r}; pass one RDP value per "
            "order") from None
    if orders is not None and rdp.size != 1 and rdp.shape != np.shape(orders):
        raise ParameterValueError(
            f"rdp must have one value per order: orders has shape {np.shape(orders)}, rdp "
            f"shape {rdp.shape}; pass the RDP curve evaluated at these orders")
    if np.any(rdp < 0):
        raise ParameterValueError(
            f"RDP values must be >= 0 (a Renyi divergence is never negative), got "
            f"{float(rdp[rdp < 0].flat[0])!r}; check the RDP curve (an upper bound on "
            "the divergence at each order)")
    return np.where(np.isnan(rdp), np.inf, rdp)


def _curve_at(rdp_fn: Callable[[np.ndarray], np.ndarray], orders: np.ndarray) -> np.ndarray:
    """``rdp_fn(orders)`` as one clean float per order (:func:`_clean`): a single value
    (a constant curve, e.g. ``lambda a: 1.0``) stands for every order; ``None``, a
    wrong shape, or a ``TypeError`` of a function that is not vectorised is a typed
    error naming ``rdp_fn``."""
    orders = np.asarray(orders, dtype=float)
    try:
        rdp = rdp_fn(orders)
    except ParameterTypeError:
        raise
    except TypeError as err:
        raise ParameterTypeError(
            f"rdp_fn must be vectorised (an array of orders in, one RDP value per order "
            f"out); called with an array of orders it raised TypeError: {err}; wrap a "
            "function of one order with np.vectorize") from err
    if rdp is None:
        raise ParameterTypeError(
            "rdp_fn returned None; it must return the RDP values at the orders it is "
            "given (an array, or one real number for a constant curve)")
    rdp = _clean(rdp, orders)
    return np.full(orders.shape, float(rdp.flat[0])) if rdp.shape != orders.shape else rdp


def epsilon_from_rdp(orders: np.ndarray, rdp: np.ndarray, delta: float) -> np.ndarray:
    """Elementwise epsilon of (1) for each order (``inf`` where the RDP value is inf/NaN).

    Rounded up by a few ulps of the terms involved. Not clamped at 0. ``orders`` must be
    real numbers > 1 and ``delta`` in (0, 1] (typed errors otherwise).
    """
    a = _check_orders(orders)
    delta = query_delta(delta)
    if delta == 0.0:
        raise ParameterValueError(
            "delta must be in (0, 1] for the per-order conversion, got 0; pass a positive "
            "delta (rdp_to_epsilon answers delta 0 with the pure epsilon)")
    tau = _clean(rdp, a)
    t1 = np.log1p(-1.0 / a)
    t2 = (math.log(delta) + np.log(a)) / (a - 1.0)
    with np.errstate(invalid="ignore"):
        eps = tau + t1 - t2
        margin = 8 * _ULP * (np.abs(tau) + np.abs(t1) + np.abs(t2))
        eps = eps + margin
    return np.where(np.isfinite(tau), eps, np.inf)


def _log_delta_from_rdp(orders: np.ndarray, rdp: np.ndarray, epsilon: float) -> np.ndarray:
    """Elementwise log delta of (2), rounded up."""
    a = np.asarray(orders, dtype=float)
    tau = _clean(rdp)
    with np.errstate(invalid="ignore", over="ignore"):
        t1 = (a - 1.0) * (tau - epsilon)
        t2 = (a - 1.0) * np.log1p(-1.0 / a)
        t3 = np.log(a)
        logd = t1 + t2 - t3
        logd = logd + 8 * _ULP * (np.abs(t1) + np.abs(t2) + t3 + (a - 1.0) * abs(epsilon))
    # an epsilon so large that t1 overflows to -inf: delta 0, not -inf + inf = NaN;
    # any other NaN is read conservatively as delta 1
    logd = np.where(np.isneginf(t1), -np.inf, np.where(np.isnan(logd), np.inf, logd))
    return np.where(np.isfinite(tau), logd, np.inf)


def delta_from_rdp(orders: np.ndarray, rdp: np.ndarray, epsilon: float) -> np.ndarray:
    """Elementwise delta of (2) for each order, capped at 1 (``1`` where RDP is inf/NaN).

    ``orders`` must be real numbers > 1 and ``epsilon`` in [0, inf] (typed errors
    otherwise)."""
    orders = _check_orders(orders)
    epsilon = query_epsilon(epsilon)
    rdp = _clean(rdp, orders)
    with np.errstate(over="ignore"):
        return np.minimum(1.0, np.exp(_log_delta_from_rdp(orders, rdp, epsilon)))


RDPFunction = Callable[[np.ndarray], np.ndarray]


def _tv_bound(rdp_fn: RDPFunction) -> float:
    """Upper bound (3) of the module docstring on ``delta(0)``, the total variation
    distance: ``sqrt(1 - exp(-tau(alpha)))`` at the smallest order of the default grid
    (the curve is non-decreasing in alpha, so that order gives the best bound), rounded
    up; ``1`` when the curve is infinite or NaN there."""
    tau = float(_curve_at(rdp_fn, DEFAULT_ORDERS[:1])[0])
    if not tau < math.inf:
        return 1.0
    if tau <= 0.0:
        return 0.0
    return min(1.0, math.sqrt(-math.expm1(-tau)) * (1.0 + 8 * _ULP))


def _grid_search(
    rdp_fn: RDPFunction, objective: Callable[[np.ndarray, np.ndarray], np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Evaluate ``objective(orders, rdp_fn(orders))`` on the default grid, extending it
    with blocks of larger orders while the best order is in the top quarter of the
    evaluated range. Returns (orders, values)."""
    orders = DEFAULT_ORDERS
    values = _pruned_values(rdp_fn, objective, orders)
    for block in EXTENSION_BLOCKS:
        finite = np.isfinite(values)
        if not finite.any():
            break
        best = orders[int(np.argmin(np.where(finite, values, np.inf)))]
        if best < orders[-1] / 4.0:
            break
        new_vals = objective(block, _curve_at(rdp_fn, block))
        orders = np.concatenate([orders, block])
        values = np.concatenate([values, new_vals])
    return orders, values


def _pruned_values(
    rdp_fn: RDPFunction, objective: Callable[[np.ndarray, np.ndarray], np.ndarray],
    orders: np.ndarray,
) -> np.ndarray:
    """``objective(orders, rdp_fn(orders))`` where it can be the minimum.

    The integer orders are evaluated first (they are the cheap ones of the built-in
    curves); the others only where the objective at RDP 0 -- a lower bound, as RDP is
    non-negative and both objectives (1) and (2) are non-decreasing in it, in floating
    point too -- does not exceed the best value found. Elsewhere that lower bound stands
    in: it is above the minimum, so the minimum and its order are those of the full grid
    (the series of fractional orders near 1 converge slowly and are rarely the best)."""
    is_int = orders == np.round(orders)
    values = np.full(orders.shape, np.inf)
    if is_int.any():
        values[is_int] = objective(orders[is_int], _curve_at(rdp_fn, orders[is_int]))
    rest = np.flatnonzero(~is_int)
    if rest.size:
        lower = objective(orders[rest], np.zeros(rest.size))
        finite = values[np.isfinite(values)]
        best = float(np.min(finite)) if finite.size else math.inf
        need = ~(lower > best)
        if need.any():
            idx = rest[need]
            values[idx] = objective(orders[idx], _curve_at(rdp_fn, orders[idx]))
        values[rest[~need]] = lower[~need]
    return values


def _refine(
    rdp_fn: RDPFunction,
    objective: Callable[[np.ndarray, np.ndarray], np.ndarray],
    orders: np.ndarray,
    values: np.ndarray,
) -> float:
    """Bounded 1-D minimisation of the objective over real alpha between the neighbours of
    the best grid order. Returns the best value found (grid or refined)."""
    return _refine_with_order(rdp_fn, objective, orders, values)[0]


def _refine_with_order(
    rdp_fn: RDPFunction,
    objective: Callable[[np.ndarray, np.ndarray], np.ndarray],
    orders: np.ndarray,
    values: np.ndarray,
) -> tuple[float, float]:
    """:func:`_refine`'s value and the order attaining it (``nan`` when every value is
    infinite)."""
    finite = np.isfinite(values)
    if not finite.any():
        return math.inf, math.nan
    idx_sorted = np.argsort(orders)
    o = orders[idx_sorted]
    v = np.where(np.isfinite(values[idx_sorted]), values[idx_sorted], np.inf)
    i = int(np.argmin(v))
    best = float(v[i])
    lo = o[i - 1] if i > 0 else 1.0 + (o[0] - 1.0) / 10.0
    hi = o[i + 1] if i + 1 < len(o) else o[i] * 2.0

    def f(t: float) -> float:
        a = 1.0 + math.exp(t)
        val = objective(np.array([a]), _curve_at(rdp_fn, np.array([a])))[0]
        return float(val) if np.isfinite(val) else 1e300

    res = optimize.minimize_scalar(
        f,
        bounds=(math.log(lo - 1.0), math.log(hi - 1.0)),
        method="bounded",
        options={"xatol": 1e-9, "maxiter": 100},
    )
    # Bounds computed at integer orders and interpolated in between have kinks at the
    # integers, where the minimum often sits: also try the integers around the optimum.
    a_star = 1.0 + math.exp(float(res.x))
    cands = [a_star] + [x for x in (math.floor(a_star), math.ceil(a_star)) if x >= 2.0]
    vals = objective(np.array(cands), _curve_at(rdp_fn, np.array(cands)))
    vals = np.where(np.isfinite(vals), vals, np.inf)
    j = int(np.argmin(vals))
    if float(vals[j]) < best:
        return float(vals[j]), float(cands[j])
    return best, float(o[i])


def rdp_to_epsilon(
    rdp_fn: RDPFunction,
    delta: float,
    *,
    pure_epsilon: float = math.inf,
    refine: bool = True,
) -> float:
    """Certified epsilon(delta) from an RDP curve, minimised over orders.

    Parameters
    ----------
    rdp_fn : callable
        Vectorised ``orders -> RDP upper bounds`` (array in, array out), valid for every
        real order > 1.
    delta : float in [0, 1)
    pure_epsilon : float
        A known pure-DP epsilon; the result never exceeds it. For ``delta == 0`` it is the
        answer (``inf`` when unknown).
    refine : bool
        Refine the best grid order by bounded minimisation over real alpha.

    Returns
    -------
    float
        ``min(pure_epsilon, max(0, min_alpha eps_alpha))`` with ``eps_alpha`` from (1) of the
        module docstring (Canonne, Kamath & Steinke 2020, Prop. 12; Balle et al. 2020,
        Thm 21); rounded up.

    Raises
    ------
    ParameterTypeError, ParameterValueError
        For a non-callable ``rdp_fn``, a ``delta`` outside [0, 1] (NaN included), a
        ``pure_epsilon`` outside [0, inf] or a ``refine`` that is not a bool.
    """
    return rdp_to_epsilon_and_order(rdp_fn, delta, pure_epsilon=pure_epsilon,
                                    refine=refine)[0]


def rdp_to_epsilon_and_order(
    rdp_fn: RDPFunction,
    delta: float,
    *,
    pure_epsilon: float = math.inf,
    refine: bool = True,
) -> tuple[float, float]:
    """:func:`rdp_to_epsilon` and the order it is attained at (Google dp_accounting's
    ``get_epsilon_and_optimal_order``, Opacus's ``get_privacy_spent``).

    Returns
    -------
    (float, float)
        The epsilon of :func:`rdp_to_epsilon` (the same number) and the Renyi order
        ``alpha`` whose conversion (1) gives it; ``inf`` when the pure epsilon is the
        answer (the ``alpha -> inf`` limit: ``delta = 0``, or the cap binding), and the
        smallest grid order when epsilon is 0 by the total-variation bound (3).
    """
    _check_rdp_fn(rdp_fn)
    delta = query_delta(delta)
    pure_epsilon = _check_pure(pure_epsilon)
    refine = _check_refine(refine)
    if delta <= 0.0:
        return float(pure_epsilon), math.inf
    if _tv_bound(rdp_fn) <= delta:  # (3): already (0, delta)-DP
        return 0.0, float(DEFAULT_ORDERS[0])
    objective = lambda a, r: epsilon_from_rdp(a, r, delta)  # noqa: E731
    orders, values = _grid_search(rdp_fn, objective)
    if refine:
        best, order = _refine_with_order(rdp_fn, objective, orders, values)
    else:
        i = int(np.argmin(values))
        best, order = float(values[i]), float(orders[i])
    if pure_epsilon <= best:
        return float(pure_epsilon), math.inf
    return float(max(0.0, best)), order


def rdp_to_delta(
    rdp_fn: RDPFunction,
    epsilon: float,
    *,
    pure_epsilon: float = math.inf,
    refine: bool = True,
) -> float:
    """Certified delta(epsilon) from an RDP curve, minimised over orders.

    Returns ``0`` when ``epsilon >= pure_epsilon``; otherwise
    ``min(1, min_alpha delta_alpha, sqrt(1 - exp(-tau(alpha_min))))`` with
    ``delta_alpha`` from (2) of the module docstring (Canonne, Kamath & Steinke 2020,
    Proposition 12) and the last term from (3) (Bretagnolle & Huber 1979), rounded up.

    ``epsilon`` and ``pure_epsilon`` must be in [0, inf], ``rdp_fn`` callable and
    ``refine`` a bool; anything else (NaN, a string) raises
    :class:`~privlearn.errors.ParameterTypeError` or
    :class:`~privlearn.errors.ParameterValueError`.
    """
    _check_rdp_fn(rdp_fn)
    epsilon = query_epsilon(epsilon)
    pure_epsilon = _check_pure(pure_epsilon)
    refine = _check_refine(refine)
    if epsilon >= pure_epsilon:
        return 0.0
    objective = lambda a, r: _log_delta_from_rdp(a, r, epsilon)  # noqa: E731
    orders, values = _grid_search(rdp_fn, objective)
    best = _refine(rdp_fn, objective, orders, values) if refine else float(np.min(values))
    tv = _tv_bound(rdp_fn)
    if not math.isfinite(best):
        return tv
    if tv == 0.0:  # a zero divergence: the distributions coincide
        return 0.0
    delta = min(1.0, tv, math.exp(best) * (1.0 + 4 * _ULP))
    # a positive bound below the floating-point range is rounded up, never to zero
    return float(max(delta, _TINY))
