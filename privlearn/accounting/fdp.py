"""f-DP trade-off curves (hypothesis-testing privacy) and Gaussian DP.

A mechanism ``M`` is *f-DP* (Dong, Roth & Su 2022, "Gaussian Differential Privacy",
JRSS-B, Definition 2.3) when every test of "the record is out" (``D``) against "the
record is in" (``D'``) with type I error (false positive rate) ``alpha`` has type II
error (false negative rate) at least ``f(alpha)``. Equivalently the best true positive
rate of any membership attack at false positive rate ``alpha`` is ``1 - f(alpha)``.

* :func:`gaussian_tradeoff`: ``mu``-GDP, ``G_mu(alpha) = Phi(Phi^{-1}(1 - alpha) - mu)``
  (Dong, Roth & Su 2022, Definition 2.7); the Gaussian mechanism with noise multiplier
  ``sigma`` is exactly ``1/sigma``-GDP and ``k`` of them compose to
  ``sqrt(sum 1/sigma_i^2)``-GDP (their Corollary 3.3).
* :func:`tradeoff_curve`: the curve a :mod:`privlearn.accounting` mechanism is certified
  to satisfy. From a privacy profile ``delta(eps)`` (every ``(eps, delta(eps))`` holds)
  the mechanism is ``f``-DP with
  ``f(alpha) = sup_eps max(0, 1 - delta(eps) - e^eps alpha, e^-eps (1 - delta(eps) - alpha))``
  (Dong, Roth & Su 2022, Proposition 2.12, with both orders of the pair). Evaluated on a
  finite grid of ``eps`` with the accountant's *certified upper bounds* on
  ``delta(eps)``, this is a lower envelope of the exact curve: a valid (pessimistic)
  curve, never an optimistic one. Plain Gaussians and their compositions get the exact
  closed form.
* :func:`gdp_delta`, :func:`gdp_epsilon`, :func:`gdp_mu`: the exact (eps, delta) profile
  of ``mu``-GDP, ``delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``
  (Dong, Roth & Su 2022, Corollary 2.13; Balle & Wang 2018, Theorem 8), and its inverses.

NumPy/SciPy only (``scipy.special``; ``scipy.stats`` is never imported, see
``tests/test_layering.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction

import numpy as np
from scipy.special import ndtr, ndtri

from privlearn._validation import check_delta, check_nonnegative
from privlearn.accounting.mechanisms import Mechanism
from privlearn.accounting.registry import equivalent_gaussian, upper_float
from privlearn.errors import (
    AccountingError,
    CertificationError,
    ParameterTypeError,
    ParameterValueError,
)

__all__ = [
    "gaussian_tradeoff",
    "gdp_delta",
    "gdp_epsilon",
    "gdp_mu",
    "gdp_mu_interval",
    "gdp_epsilon_interval",
    "gaussian_mu",
    "tradeoff_curve",
    "tradeoff_from_profile",
]


def _reals(name: str, values, hint: str) -> np.ndarray:
    """``values`` as a float array, refusing what is not an array of real numbers (a
    string, ``None``, booleans, complex numbers) with a :class:`ParameterTypeError`."""
    try:
        raw = np.asarray(values)
    except (TypeError, ValueError):  # pragma: no cover - a ragged nested sequence
        raw = np.asarray(values, dtype=object)
    if raw.dtype.kind not in "iuf":
        raise ParameterTypeError(
            f"{name} must be a real number or an array of real numbers, got {values!r} "
            f"({type(values).__name__}); {hint}")
    return raw.astype(float)


def _alphas(alphas) -> np.ndarray:
    hint = "pass false positive rates in [0, 1], e.g. numpy.linspace(0, 1, 101)"
    a = _reals("alphas", alphas, hint)
    if a.size == 0 or not np.all(np.isfinite(a)) or np.any((a < 0) | (a > 1)):
        raise ParameterValueError(
            f"alphas (false positive rates) must be a non-empty array of finite values in "
            f"[0, 1], got {alphas!r}; {hint}")
    return a


def _scalar(value: object) -> object:
    """A 0-d NumPy array as the number it holds (the validators take numbers)."""
    return value.item() if isinstance(value, np.ndarray) and value.ndim == 0 else value


def _check_mu(mu) -> float:
    return check_nonnegative("mu", _scalar(mu),
                             hint="pass the Gaussian DP parameter, e.g. 1.0 (1 / sigma)")


def _check_gdp_delta(delta) -> float:
    d = check_delta("delta", _scalar(delta), hint="pass a delta in (0, 1), e.g. 1e-5")
    if d == 0.0:
        raise ParameterValueError(
            "delta must be in (0, 1) for mu-GDP, got 0.0: mu-GDP with mu > 0 is not "
            "(epsilon, 0)-DP for any finite epsilon; pass a positive delta, e.g. 1e-5")
    return d


def gaussian_tradeoff(mu: float, alphas) -> np.ndarray:
    """Trade-off curve of ``mu``-GDP: ``G_mu(alpha) = Phi(Phi^{-1}(1 - alpha) - mu)``.

    Dong, Roth & Su (2022), "Gaussian Differential Privacy", Definition 2.7. The best
    true positive rate at false positive rate ``alpha`` is ``1 - G_mu(alpha)``.

    Parameters
    ----------
    mu : float >= 0
    alphas : array_like of floats in [0, 1]

    Returns
    -------
    numpy.ndarray of the same shape as ``alphas``.
    """
    m = _check_mu(mu)
    a = _alphas(alphas)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = ndtr(ndtri(1.0 - a) - m)
    out = np.where(a <= 0, 1.0, np.where(a >= 1, 0.0, out))
    return out


def gdp_delta(mu: float, epsilon: float) -> float:
    """``delta(epsilon)`` of ``mu``-GDP (Dong, Roth & Su 2022, Corollary 2.13):
    ``Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``, evaluated in the log domain and
    rounded *up* by a bound on the floating-point error (a certified upper bound, as
    :func:`privlearn.accounting.analytic.gaussian_delta`; the plain evaluation could be
    ~1e-9 relative below the exact value where the difference cancels)."""
    return _gdp_delta_bounds(mu, epsilon)[1]


def _gdp_delta_bounds(mu: float, epsilon: float) -> tuple[float, float]:
    """Certified ``(lower, upper)`` on the exact ``delta(epsilon)`` of ``mu``-GDP."""
    m = _check_mu(mu)
    e = check_nonnegative("epsilon", _scalar(epsilon), allow_inf=True,
                          hint="pass an epsilon >= 0, e.g. 1.0")
    if m == 0 or math.isinf(e):
        return 0.0, 0.0
    from privlearn.accounting.analytic import gdp_delta_bounds

    return gdp_delta_bounds(m, e)


def _checked_delta_bounds(mu: float, epsilon: float) -> tuple[float, float]:
    """:func:`_gdp_delta_bounds` for a ``mu`` and an ``epsilon`` already checked (finite
    ``mu >= 0``, ``epsilon >= 0``): the same numbers without checking them again, for the
    searches below, which evaluate it a hundred times or more per query (the checks cost
    more than the evaluation)."""
    if mu == 0 or math.isinf(epsilon):
        return 0.0, 0.0
    from privlearn.accounting.analytic import _gdp_delta_bounds as bounds

    return bounds(mu, epsilon)


def _crossing(below: Callable[[float], bool], hi: float, limit: float, rtol: float,
              what: str) -> tuple[float, float]:
    """``(lo, hi)`` around the point where the monotone predicate ``below`` (True left of
    it, False right of it) switches, ``hi - lo <= rtol max(1, hi)``: ``hi`` is doubled
    from its start until ``below(hi)`` is False, then the bracket ``[lo, hi]`` (``lo``
    from 0) is bisected."""
    lo = 0.0
    while below(hi):
        lo, hi = hi, 2 * hi
        if hi > limit:  # pragma: no cover - far outside any privacy guarantee
            raise AccountingError(f"{what}: no crossing below {limit:g}")
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if below(mid):
            lo = mid
        else:
            hi = mid
        if hi - lo <= rtol * max(1.0, hi):
            break
    return lo, hi


def gdp_epsilon_interval(mu: float, delta: float) -> tuple[float, float]:
    """``(lo, hi)`` bracketing the exact ``epsilon`` of ``mu``-GDP at ``delta``
    (``gdp_delta(mu, lo) >= delta >= gdp_delta(mu, hi)``, width <= 1e-10 relative).

    :func:`gdp_epsilon` returns ``hi`` (for guarantees); empirical lower bounds use
    ``lo`` (:mod:`privlearn.auditing`), so neither is ever optimistic.
    """
    m = _check_mu(mu)
    d = _check_gdp_delta(delta)
    if m == 0 or _gdp_delta_bounds(m, 0.0)[1] <= d:
        return 0.0, 0.0
    what = f"gdp_epsilon for mu={m}, delta={d}"
    start = max(1.0, m * m)
    # hi: the certified upper delta is <= d there; lo: the certified lower delta is > d
    hi = _crossing(lambda e: _checked_delta_bounds(m, e)[1] > d, start, 1e6, 1e-10, what)[1]
    lo = _crossing(lambda e: _checked_delta_bounds(m, e)[0] > d, start, 1e6, 1e-10, what)[0]
    return min(lo, hi), hi


def gdp_epsilon(mu: float, delta: float) -> float:
    """Smallest ``epsilon`` with ``gdp_delta(mu, epsilon) <= delta`` (bisection to
    ``1e-10`` relative, rounded *up*: an upper bound on the exact value).

    Raises
    ------
    ValueError
        ``delta`` outside ``(0, 1)`` (``mu``-GDP with ``mu > 0`` is not ``(eps, 0)``-DP
        for any finite ``eps``).
    """
    return gdp_epsilon_interval(mu, delta)[1]


def gdp_mu_interval(epsilon: float, delta: float) -> tuple[float, float]:
    """``(lo, hi)`` bracketing the ``mu`` for which ``mu``-GDP has ``delta(epsilon) =
    delta`` exactly (``gdp_delta(lo, eps) <= delta <= gdp_delta(hi, eps)``, width
    <= 1e-12 relative)."""
    e = check_nonnegative("epsilon", _scalar(epsilon), hint="pass an epsilon >= 0, e.g. 1.0")
    d = _check_gdp_delta(delta)
    what = f"gdp_mu for epsilon={e}, delta={d}"
    # lo: the certified upper delta is < d there; hi: the certified lower delta is >= d
    lo = _crossing(lambda mu: _checked_delta_bounds(mu, e)[1] < d, 1.0, 1e4, 1e-12, what)[0]
    hi = _crossing(lambda mu: _checked_delta_bounds(mu, e)[0] < d, 1.0, 1e4, 1e-12, what)[1]
    return lo, max(lo, hi)


def gdp_mu(epsilon: float, delta: float) -> float:
    """The ``mu`` for which ``mu``-GDP has ``delta(epsilon) = delta`` (the GDP curve
    through the ``(epsilon, delta)`` corner), rounded *down*: ``gdp_mu(eps, delta)``-GDP
    is ``(eps, delta)``-DP. Dong, Roth & Su (2022), Corollary 2.13."""
    return gdp_mu_interval(epsilon, delta)[0]


def gaussian_mu(mechanism: Mechanism) -> float | None:
    """``mu`` of a mechanism that is exactly ``mu``-GDP: one whose parts all have an
    equivalent Gaussian in the mechanism registry (plain Gaussians and their
    compositions: ``sqrt(sum_i k_i / sigma_i^2)``-GDP, Dong, Roth & Su 2022, Corollary
    3.3), ``1 / sigma`` of :func:`privlearn.accounting.registry.equivalent_gaussian`
    rounded up (a larger ``mu`` is the pessimistic side); None for any other mechanism
    (subsampled, Laplace, ...)."""
    sigma = equivalent_gaussian(mechanism)
    if sigma is None:
        return None
    return upper_float(1 / Fraction(sigma))


def tradeoff_from_profile(epsilons, deltas, alphas) -> np.ndarray:
    """Lower envelope of the trade-off curve implied by the ``(epsilon_j, delta_j)``
    guarantees: ``max_j max(0, 1 - delta_j - e^eps_j alpha, e^-eps_j (1 - delta_j - alpha))``
    (Dong, Roth & Su 2022, Proposition 2.12; Kairouz, Oh & Viswanath 2015, Theorem 2.1).
    """
    a = _alphas(alphas)
    hint = "pass the profile's points: epsilons >= 0 and the deltas in [0, 1] they hold at"
    eps = _reals("epsilons", epsilons, hint).reshape(-1)
    dl = _reals("deltas", deltas, hint).reshape(-1)
    if eps.size == 0 or eps.shape != dl.shape:
        raise ParameterValueError(
            "epsilons and deltas must be non-empty and of equal length, got "
            f"{eps.size} and {dl.size} values; {hint}")
    if np.any(~np.isfinite(eps) | (eps < 0)):
        raise ParameterValueError(
            f"epsilons must be finite and >= 0, got {epsilons!r}; {hint}")
    if np.any(~(dl >= 0) | (dl > 1)):
        raise ParameterValueError(f"deltas must be in [0, 1], got {deltas!r}; {hint}")
    flat = a.reshape(-1, 1)
    e = np.exp(eps)[None, :]
    one_minus = (1.0 - dl)[None, :]
    f = np.maximum(one_minus - e * flat, (one_minus - flat) / e)
    return np.maximum(f.max(axis=1), 0.0).reshape(a.shape)


def _default_top_epsilon(mechanism: Mechanism, accountant: str) -> float:
    """Top of the default epsilon grid: ``epsilon(1e-12)``, or, where the accountant
    cannot certify that delta (privacy-loss mass at infinity at or above it, e.g. an
    :class:`~privlearn.accounting.ApproxDP` part), the first of ``1, 2, 4, ...`` at
    which the certified ``delta(eps)`` stops decreasing: the profile is flat (the mass
    at infinity) beyond it. Any top gives a valid curve (the envelope of certified
    points); this one also keeps it tight."""
    try:
        return mechanism.epsilon(1e-12, accountant=accountant)
    except CertificationError:
        pass
    top, last = 1.0, mechanism.delta(1.0, accountant=accountant)
    for _ in range(64):
        nxt = mechanism.delta(2.0 * top, accountant=accountant)
        top *= 2.0
        if not nxt < last * (1.0 - 1e-9):
            break
        last = nxt
    return top


def tradeoff_curve(mechanism: Mechanism, alphas, *, epsilons=None,
                   accountant: str = "pld") -> np.ndarray:
    """Trade-off curve ``f(alpha)`` that ``mechanism`` is certified to satisfy.

    Exact for Gaussians and compositions of Gaussians (``mu``-GDP, closed form). For any
    other mechanism it is the lower envelope :func:`tradeoff_from_profile` of the
    accountant's privacy profile ``delta(eps)`` on a grid of ``epsilons``: since each
    ``delta(eps)`` is a certified upper bound, the returned curve is below the exact
    curve everywhere (it never understates what an attacker can achieve). A finer grid
    gives a tighter envelope.

    Parameters
    ----------
    mechanism : privlearn.accounting.Mechanism
    alphas : array_like of floats in [0, 1]
        False positive rates.
    epsilons : array_like, optional
        Grid of epsilons (default: 0 and 200 points up to ``epsilon(1e-12)``, denser
        near 0; where delta 1e-12 is below what the accountant certifies, e.g. below the
        mass at infinity of an ``ApproxDP`` part, up to where ``delta(eps)`` stops
        decreasing).
    accountant : str
        Accountant used for ``delta(eps)`` (default ``"pld"``).

    Returns
    -------
    numpy.ndarray
        ``f(alpha)``, the smallest false negative rate at each false positive rate;
        ``1 - f`` is the best true positive rate (the "accountant's ROC").
    """
    if not isinstance(mechanism, Mechanism):
        raise ParameterTypeError(f"mechanism must be a privlearn.accounting Mechanism, got "
                        f"{type(mechanism).__name__}")
    a = _alphas(alphas)
    mu = gaussian_mu(mechanism)
    if mu is not None:
        return gaussian_tradeoff(mu, a)
    if epsilons is None:
        top = _default_top_epsilon(mechanism, accountant)
        if not math.isfinite(top):
            raise ParameterValueError("the mechanism has no finite epsilon at delta=1e-12; give an "
                             "explicit grid of epsilons")
        epsilons = np.concatenate([[0.0], top * np.linspace(0.0, 1.0, 201)[1:] ** 1.5])
    eps = _reals("epsilons", epsilons, "pass a grid of epsilons >= 0, or leave it out").reshape(-1)
    deltas = np.array([mechanism.delta(float(e), accountant=accountant) for e in eps])
    return tradeoff_from_profile(eps, deltas, a)
