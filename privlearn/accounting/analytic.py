"""Exact privacy curve of the Gaussian mechanism and of compositions of Gaussians.

The k-fold (possibly heterogeneous) composition of Gaussian mechanisms with noise
multipliers ``sigma_i`` has exactly the privacy curve of one Gaussian mechanism with
``sigma = (sum_i sigma_i^-2)^(-1/2)`` (Dong, Roth & Su 2022, Corollary 3.3: mu-GDP
composes as mu = sqrt(sum mu_i^2)), and the curve of a single Gaussian is (Balle & Wang
2018, Theorem 8)::

    delta(eps) = Phi(-eps/mu + mu/2) - exp(eps) * Phi(-eps/mu - mu/2),   mu = 1/sigma.

Both directions are evaluated in log space (``scipy.special.log_ndtr``) so that neither
overflow nor cancellation occurs for mu from 1e-4 to 1e3. ``epsilon(delta)`` is found by
bracketing and bisection on this monotone function and rounded *up*: every evaluation
carries a bound on its floating-point error, and the returned epsilon satisfies
``delta(epsilon) <= delta`` even after adding that error (certified, not merely as
evaluated). ``*_bounds`` functions return certified (lower, upper) pairs.

References
----------
.. [1] Balle & Wang (2018), Improving the Gaussian Mechanism for Differential Privacy:
       Analytical Calibration and Optimal Denoising, ICML, Theorem 8.
.. [2] Dong, Roth & Su (2022), Gaussian Differential Privacy, JRSS-B, Corollary 3.3.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize, special

from privlearn._validation import check_nonnegative
from privlearn.accounting._queries import query_delta, query_epsilon
from privlearn.accounting._types import PrivacyBound
from privlearn.accounting.accountants import register_accountant
from privlearn.accounting.mechanisms import Composed, Mechanism
from privlearn.accounting.registry import equivalent_gaussian, read_relation
from privlearn.errors import (
    CertificationError,
    ParameterTypeError,
    PrivacyLossOverflowError,
    UnsupportedMechanismError,
)

__all__ = [
    "gaussian_delta",
    "gaussian_delta_bounds",
    "gdp_delta_bounds",
    "gaussian_epsilon",
    "gaussian_epsilon_bounds",
    "effective_noise_multiplier",
    "AnalyticGaussianAccountant",
]


_ULP = float(np.finfo(float).eps)
_TINY = float(np.finfo(float).smallest_normal)

_SIGMA_HINT = ("pass the noise standard deviation divided by the sensitivity, e.g. 1.0 "
               "(inf for no privacy loss)")


def _check_sigma(noise_multiplier: object) -> float:
    """The public functions' noise multiplier: a number in [0, inf] (0, no noise, is
    what a combined noise multiplier below the floats rounds down to)."""
    return check_nonnegative("noise_multiplier", noise_multiplier, allow_inf=True,
                             hint=_SIGMA_HINT)


def _gaussian_delta_and_error(
    mu: float, epsilon: float
) -> tuple[float, float, float]:
    """Balle & Wang (2018), Theorem 8, as evaluated in floating point, together with a
    bound on the relative error of that evaluation.

    ``delta = Phi(a) * (1 - exp(r))`` with ``a = -eps/mu + mu/2``, ``b = -eps/mu - mu/2``,
    ``r = eps + log Phi(b) - log Phi(a) <= 0``. The error bound propagates the rounding of
    ``a`` and ``b`` through ``d log Phi(x) / dx <= |x| + 1`` (Mills-ratio bound), a few ulps
    for each ``log_ndtr``/``exp``, and the conditioning ``e^r / (1 - e^r) <= 1/|r|`` of
    ``1 - e^r``; it is then multiplied by 4 for safety.

    Returns ``(delta, relative_error, upper)`` where ``upper >= Phi(a) >= delta`` is a
    cruder certified bound that stays valid when the relative error is large.
    ``mu = 1 / noise_multiplier`` (the GDP parameter).
    """
    a = -epsilon / mu + mu / 2.0
    b = -epsilon / mu - mu / 2.0
    log_pa = float(special.log_ndtr(a))
    if log_pa == -math.inf:  # Phi(a) < exp(-1e308): delta <= Phi(a) is below every float
        return 0.0, 0.0, 0.0
    log_pb = float(special.log_ndtr(b))
    r = epsilon + log_pb - log_pa  # log of the ratio of the two terms, <= 0
    da = 2.0 * _ULP * (abs(epsilon / mu) + mu + abs(a))  # rounding of a and b
    err_a = 4.0 * _ULP * (abs(log_pa) + 1.0) + (abs(a) + 1.0) * da
    crude = math.exp(min(log_pa + 4.0 * err_a, 0.0))
    if r >= 0.0:  # impossible in exact arithmetic (delta > 0): rounding dominates
        return 0.0, math.inf, crude
    err_b = 4.0 * _ULP * (abs(log_pb) + 1.0) + (abs(b) + 1.0) * da
    err_r = 2.0 * _ULP * (abs(epsilon) + abs(log_pa) + abs(log_pb)) + err_a + err_b
    rel = 4.0 * (err_a + err_r / abs(r) + 4.0 * _ULP)
    return float(math.exp(log_pa) * -math.expm1(r)), rel, crude


def gaussian_delta_bounds(noise_multiplier: float, epsilon: float) -> tuple[float, float]:
    """Certified ``(lower, upper)`` bounds on the exact delta(epsilon) of the Gaussian
    mechanism (Balle & Wang 2018, Thm 8), bracketing the floating-point evaluation by its
    error bound.

    Parameters
    ----------
    noise_multiplier : float in [0, inf]
        0 (no noise) gives delta 1 at every finite epsilon.
    epsilon : float in [0, inf]

    Raises
    ------
    ParameterTypeError, ParameterValueError
        For a value that is not a number or outside the range above (NaN included).
    """
    noise_multiplier = _check_sigma(noise_multiplier)
    epsilon = query_epsilon(epsilon)
    if math.isinf(epsilon) or math.isinf(noise_multiplier):  # no privacy loss beyond eps
        return 0.0, 0.0
    if not noise_multiplier >= 1e-300:
        # 1 / sigma is beyond floats (or there is no noise): Phi(a) = 1 and
        # exp(eps) Phi(b) < exp(eps - 1e600 / 8) are both within rounding of 1 and 0, so
        # delta(eps) = 1 to working precision for every finite eps (exactly 1 without noise)
        return 1.0 - 4.0 * _ULP, 1.0
    return gdp_delta_bounds(1.0 / noise_multiplier, epsilon)


def gdp_delta_bounds(mu: float, epsilon: float) -> tuple[float, float]:
    """:func:`gaussian_delta_bounds` in the GDP parameter ``mu = 1 / noise_multiplier``:
    certified ``(lower, upper)`` on ``Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``
    (Dong, Roth & Su 2022, Corollary 2.13).

    Parameters
    ----------
    mu : float in [0, inf), finite
        0 (no privacy loss) gives delta 0.
    epsilon : float in [0, inf]

    Raises
    ------
    ParameterTypeError, ParameterValueError
        For a value that is not a number or outside the range above (NaN included).
    """
    mu = check_nonnegative(
        "mu", mu, hint="pass the Gaussian DP parameter mu = 1 / noise_multiplier, e.g. 1.0")
    epsilon = query_epsilon(epsilon)
    if mu == 0.0 or math.isinf(epsilon):  # no privacy loss, or none beyond epsilon
        return 0.0, 0.0
    return _gdp_delta_bounds(mu, epsilon)


def _gdp_delta_bounds(mu: float, epsilon: float) -> tuple[float, float]:
    """:func:`gdp_delta_bounds` for a checked ``mu`` finite and > 0 and ``epsilon``
    finite and >= 0."""
    # delta(0) = 2 Phi(mu/2) - 1 = erf(mu / (2 sqrt 2)), to a few ulps (no cancellation);
    # delta(eps) <= delta(0) bounds the cases where the difference below cancels (a huge
    # noise multiplier: mu/2 and -mu/2 give the same log Phi)
    d0 = float(special.erf(mu / (2.0 * math.sqrt(2.0))))
    if epsilon == 0.0:
        return d0 * (1.0 - 8.0 * _ULP), max(min(1.0, d0 * (1.0 + 8.0 * _ULP)), _TINY)
    d, rel, crude = _gaussian_delta_and_error(mu, epsilon)
    d0_up = d0 * (1.0 + 8.0 * _ULP)
    if rel < 1.0:
        lower, upper = d * (1.0 - rel), min(1.0, crude, d0_up, d * (1.0 + rel))
    else:  # the fine evaluation is unreliable: fall back on delta <= min(Phi(a), delta(0))
        lower, upper = 0.0, min(1.0, crude, d0_up)
    if upper < _TINY:
        # the exact value is positive but below the normal floating-point range: round
        # up to the smallest normal float rather than returning an optimistic zero
        upper = _TINY
    return lower, upper


def gaussian_delta(noise_multiplier: float, epsilon: float) -> float:
    """Exact delta(epsilon) of the Gaussian mechanism (Balle & Wang 2018, Thm 8), rounded
    up by a bound on the floating-point error (a certified upper bound).

    Computed as ``Phi(a) * (1 - exp(eps + log Phi(b) - log Phi(a)))`` with
    ``a = -eps/mu + mu/2``, ``b = -eps/mu - mu/2``, in log space.
    """
    return gaussian_delta_bounds(noise_multiplier, epsilon)[1]


def gaussian_epsilon_bounds(noise_multiplier: float, delta: float) -> tuple[float, float]:
    """Certified ``(lower, upper)`` bounds on the exact epsilon(delta) of the Gaussian
    mechanism: ``upper`` satisfies ``delta_upper(upper) <= delta`` and ``lower`` satisfies
    ``delta_lower(lower) > delta`` (or is 0), with the bounds of
    :func:`gaussian_delta_bounds`. Returns ``(inf, inf)`` for ``delta == 0``.

    ``noise_multiplier`` must be in [0, inf] and ``delta`` in [0, 1]; anything else (NaN,
    a string) raises :class:`~privlearn.errors.ParameterTypeError` or
    :class:`~privlearn.errors.ParameterValueError`.
    """
    noise_multiplier = _check_sigma(noise_multiplier)
    delta = query_delta(delta)
    if delta <= 0.0:
        return math.inf, math.inf
    if not noise_multiplier >= 1e-300:  # 1 / sigma^2 is beyond floats (or no noise)
        raise PrivacyLossOverflowError(
            f"analytic Gaussian: noise multiplier {noise_multiplier:g} is so small that "
            "epsilon cannot be represented (essentially non-private)")
    mu = 1.0 / noise_multiplier
    # delta(0) = 2 Phi(mu / 2) - 1 <= mu / sqrt(2 pi) < 0.4 mu: no loss beyond delta at
    # all (exactly epsilon 0), also where the evaluation below cancels (mu below 1e-8)
    if 0.4 * mu <= delta or gaussian_delta(noise_multiplier, 0.0) <= delta:
        return 0.0, 0.0
    # a valid upper bound everywhere: the Renyi DP conversion at its best real order,
    # mu^2 / 2 + mu sqrt(2 log(1 / delta)) (Mironov 2017, Proposition 3), rounded up; it
    # answers where the evaluation below cannot certify (delta below the normal floats,
    # delta(0) cancelling to below its error bound for noise multipliers near 1e8)
    rdp = (mu * mu / 2.0 + mu * math.sqrt(-2.0 * math.log(delta))) * (1.0 + 1e-12)
    if not math.isfinite(rdp) or rdp > 1e12:
        raise PrivacyLossOverflowError(
            f"analytic Gaussian: epsilon of noise multiplier {noise_multiplier:g} at delta "
            f"{delta:g} is above 1e12 or cannot be represented (essentially non-private)")
    hi = max(1.0, mu * mu / 2.0 + mu * 10.0)
    while gaussian_delta(noise_multiplier, hi) > delta:
        hi *= 2.0
        if hi > 1e12:  # beyond the bound above: the evaluation cannot certify
            return 0.0, float(rdp)

    def f(e: float) -> float:
        d = _gaussian_delta_and_error(1.0 / noise_multiplier, e)[0]
        return math.log(max(d, 1e-300)) - math.log(delta)

    if not f(0.0) > 0.0 >= f(hi):  # no bracket (the evaluation cancels)
        return 0.0, float(rdp)
    eps = optimize.brentq(f, 0.0, hi, xtol=1e-15, rtol=4 * np.finfo(float).eps, maxiter=500)
    # round up until the certified inequality holds
    upper = eps
    step = max(abs(eps), 1e-3) * 1e-14
    for _ in range(200):
        if gaussian_delta_bounds(noise_multiplier, upper)[1] <= delta:
            break
        upper += step
        step *= 2.0
    else:  # pragma: no cover
        raise CertificationError("analytic Gaussian: could not certify epsilon")
    lower = eps
    step = max(abs(eps), 1e-3) * 1e-14
    for _ in range(200):
        if lower <= 0.0:
            lower = 0.0
            break
        if gaussian_delta_bounds(noise_multiplier, lower)[0] > delta:
            break
        lower -= step
        step *= 2.0
    else:  # pragma: no cover
        raise CertificationError("analytic Gaussian: could not certify a lower epsilon")
    return float(max(lower, 0.0)), float(min(upper, rdp))


def gaussian_epsilon(noise_multiplier: float, delta: float) -> float:
    """Smallest epsilon whose certified delta (:func:`gaussian_delta`, an upper bound on
    the exact value) is at most ``delta``; hence a certified upper bound on the exact
    epsilon(delta). Returns ``inf`` for ``delta == 0`` (the Gaussian mechanism has no
    pure-DP guarantee).
    """
    return gaussian_epsilon_bounds(noise_multiplier, delta)[1]


def effective_noise_multiplier(mechanism: Mechanism) -> float | None:
    """If ``mechanism`` is a Gaussian or a composition of Gaussians (of kinds with an
    ``equivalent_gaussian``), the noise multiplier of the single equivalent Gaussian,
    ``(sum_i k_i / sigma_i^2)^(-1/2)`` (rounded down); else None.

    Same as :func:`privlearn.accounting.registry.equivalent_gaussian` (kept as the
    historical name).
    """
    if not isinstance(mechanism, Mechanism):
        raise ParameterTypeError(
            f"mechanism must be a privlearn Mechanism, got {mechanism!r} "
            f"({type(mechanism).__name__}); pass e.g. Gaussian(noise_multiplier=1.0) "
            "from privlearn.accounting")
    return equivalent_gaussian(mechanism)


class AnalyticGaussianAccountant:
    """Exact accountant for Gaussian mechanisms and their compositions (no subsampling)."""

    name = "analytic"

    def _sigma(self, mechanism: Mechanism) -> float:
        # read under one neighbouring relation (the registry's reading, as every accountant)
        mechanism = read_relation(mechanism)
        sigma = equivalent_gaussian(mechanism)
        if sigma is None:
            parts = mechanism.parts if isinstance(mechanism, Composed) else ((mechanism, 1),)
            part, k = next(((m, k) for m, k in parts if equivalent_gaussian(m) is None),
                           (mechanism, 1))
            times = f", composed {k} times" if k > 1 else ""
            raise UnsupportedMechanismError(
                "accountant 'analytic' is exact only for Gaussian mechanisms and their "
                f"compositions, without subsampling; got {part!r}{times}. "
                "Use accountant='pld' or 'rdp'."
            )
        return sigma

    def epsilon(self, mechanism: Mechanism, delta: float) -> PrivacyBound:
        lo, hi = gaussian_epsilon_bounds(self._sigma(mechanism), delta)
        return PrivacyBound(upper=hi, lower=lo, accountant=self.name)

    def delta(self, mechanism: Mechanism, epsilon: float) -> PrivacyBound:
        lo, hi = gaussian_delta_bounds(self._sigma(mechanism), epsilon)
        return PrivacyBound(upper=hi, lower=lo, accountant=self.name)


register_accountant(AnalyticGaussianAccountant())
