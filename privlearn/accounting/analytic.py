"""Exact privacy curve of the Gaussian mechanism and of compositions of Gaussians.

The k-fold (possibly heterogeneous) composition of Gaussian mechanisms with noise
multipliers ``sigma_i`` has exactly the privacy curve of one Gaussian mechanism with
``sigma = (sum_i sigma_i^-2)^(-1/2)`` (Dong, Roth & Su 2022, Corollary 3.3: mu-GDP
composes as mu = sqrt(sum mu_i^2)), and the curve of a single Gaussian is (Balle & Wang
2018, Theorem 8)::

    delta(eps) = Phi(-eps/mu + mu/2) - exp(eps) * Phi(-eps/mu - mu/2),   mu = 1/sigma.

Both directions are evaluated in log space (``scipy.special.log_ndtr``) so that neither
overflow nor cancellation occurs for mu from 1e-4 to 1e3. ``epsilon(delta)`` is found by
bracketing and bisection on this monotone function and rounded *up*: the returned
epsilon always satisfies ``delta(epsilon) <= delta`` as evaluated.

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

from privlearn.accounting.accountants import (
    AccountingError,
    PrivacyBound,
    UnsupportedMechanismError,
    register_accountant,
)
from privlearn.accounting.mechanisms import Composed, Gaussian, Mechanism

__all__ = [
    "gaussian_delta",
    "gaussian_epsilon",
    "effective_noise_multiplier",
    "AnalyticGaussianAccountant",
]


def gaussian_delta(noise_multiplier: float, epsilon: float) -> float:
    """Exact delta(epsilon) of the Gaussian mechanism (Balle & Wang 2018, Thm 8).

    Computed as ``Phi(a) * (1 - exp(eps + log Phi(b) - log Phi(a)))`` with
    ``a = -eps/mu + mu/2``, ``b = -eps/mu - mu/2``, in log space.
    """
    if math.isinf(epsilon):
        return 0.0
    mu = 1.0 / noise_multiplier
    a = -epsilon / mu + mu / 2.0
    b = -epsilon / mu - mu / 2.0
    log_pa = float(special.log_ndtr(a))
    log_pb = float(special.log_ndtr(b))
    r = epsilon + log_pb - log_pa  # log of the ratio of the two terms, <= 0
    if r >= 0.0:
        return 0.0
    return float(math.exp(log_pa) * -math.expm1(r))


def gaussian_epsilon(noise_multiplier: float, delta: float) -> float:
    """Smallest epsilon with ``gaussian_delta(noise_multiplier, epsilon) <= delta``.

    Rounded up: the result satisfies the inequality as evaluated in floating point.
    Returns ``inf`` for ``delta == 0`` (the Gaussian mechanism has no pure-DP guarantee).
    """
    if delta <= 0.0:
        return math.inf
    if gaussian_delta(noise_multiplier, 0.0) <= delta:
        return 0.0
    mu = 1.0 / noise_multiplier
    hi = max(1.0, mu * mu / 2.0 + mu * 10.0)
    while gaussian_delta(noise_multiplier, hi) > delta:
        hi *= 2.0
        if hi > 1e12:
            raise AccountingError("analytic Gaussian: epsilon bracket exceeded 1e12")
    f = lambda e: math.log(max(gaussian_delta(noise_multiplier, e), 1e-300)) - math.log(delta)  # noqa: E731
    eps = optimize.brentq(f, 0.0, hi, xtol=1e-15, rtol=4 * np.finfo(float).eps, maxiter=500)
    # round up until the certified inequality holds
    step = max(abs(eps), 1.0) * 1e-15
    for _ in range(200):
        if gaussian_delta(noise_multiplier, eps) <= delta:
            return float(eps)
        eps += step
        step *= 2.0
    raise AccountingError("analytic Gaussian: could not certify epsilon")  # pragma: no cover


def effective_noise_multiplier(mechanism: Mechanism) -> float | None:
    """If ``mechanism`` is a Gaussian or a composition of Gaussians, the noise multiplier
    of the single equivalent Gaussian, ``(sum_i k_i / sigma_i^2)^(-1/2)``; else None."""
    if isinstance(mechanism, Gaussian):
        return mechanism.noise_multiplier
    if isinstance(mechanism, Composed) and all(isinstance(m, Gaussian) for m, _ in mechanism.parts):
        total = math.fsum(k / (m.noise_multiplier**2) for m, k in mechanism.parts)
        return 1.0 / math.sqrt(total)
    return None


class AnalyticGaussianAccountant:
    """Exact accountant for Gaussian mechanisms and their compositions (no subsampling)."""

    name = "analytic"

    def _sigma(self, mechanism: Mechanism) -> float:
        sigma = effective_noise_multiplier(mechanism)
        if sigma is None:
            raise UnsupportedMechanismError(
                "accountant 'analytic' is exact only for Gaussian mechanisms and their "
                f"compositions (no subsampling); got {type(mechanism).__name__}. "
                "Use accountant='pld' or 'rdp'."
            )
        return sigma

    def epsilon(self, mechanism: Mechanism, delta: float) -> PrivacyBound:
        eps = gaussian_epsilon(self._sigma(mechanism), delta)
        return PrivacyBound(upper=eps, lower=eps, accountant=self.name)

    def delta(self, mechanism: Mechanism, epsilon: float) -> PrivacyBound:
        d = gaussian_delta(self._sigma(mechanism), epsilon)
        return PrivacyBound(upper=d, lower=d, accountant=self.name)


register_accountant(AnalyticGaussianAccountant())
