"""The built-in mechanism kinds and their registered representations.

Each kind of :mod:`privlearn.accounting.mechanisms` is registered here with
:func:`privlearn.accounting.registry.register_mechanism`, exactly as a user registers a
new kind (see the registry's module docstring and tests/accounting/test_extension.py).
Imported by :mod:`privlearn.accounting` itself, so the kinds are known as soon as the
package is. PLD pairs and the subsampled-Gaussian RDP are imported inside the functions
that build them, which keeps ``import privlearn.accounting`` light.

=====================  =======================================================================
kind                   representations (references in each function's docstring)
=====================  =======================================================================
Gaussian               pure eps ``inf``; pair ``N(1/s, 1)`` vs ``N(0, 1)`` (Balle & Wang 2018,
                       Thm 8); RDP ``alpha / (2 s^2)`` (Mironov 2017, Prop. 7); equivalent
                       Gaussian ``s``; replace-one pair ``ReplaceGaussianPair``; Poisson RDP of
                       Mironov, Talwar & Zhang 2019
Laplace                pure eps ``1/b``; pair ``Lap(1/b, 1)`` vs ``Lap(0, 1)``; RDP Mironov 2017
                       Prop. 6; replace-one pair ``ReplaceLaplacePair``; Poisson RDP Zhu &
                       Wang 2019 Thm 8; closed-form profile of one run
RandomizedResponse     pure eps ``log(p (k-1) / (1-p))``; its three-outcome pair (also as exact
                       atoms); exact RDP, also Poisson-subsampled; a local randomiser (same
                       pair at any sensitivity)
PureDP                 pure eps; binary randomized response with that epsilon (Kairouz, Oh &
                       Viswanath 2015, Thm 2.1) for the pair, the atoms and RDP (also
                       Poisson-subsampled); group privacy for scaling
ApproxDP               pure eps ``inf``; the four-outcome (eps, delta) pair (Kairouz, Oh &
                       Viswanath 2015, Thm 2.1; also as exact atoms); no RDP (delta > 0
                       bounds no Renyi divergence); group privacy for scaling
RDPMechanism           the declared pure eps and the user's RDP function (no PLD pair)
=====================  =======================================================================
"""

from __future__ import annotations

import math
import sys
from fractions import Fraction

import numpy as np

from privlearn.accounting import closed_form
from privlearn.accounting.mechanisms import (
    ApproxDP,
    Gaussian,
    Laplace,
    PureDP,
    RandomizedResponse,
    RDPMechanism,
)
from privlearn.accounting.registry import register_mechanism, upper_float
from privlearn.errors import (
    ParameterTypeError,
    ParameterValueError,
    UnsupportedMechanismError,
)

__all__: list[str] = []

_ULP = sys.float_info.epsilon


# -- Gaussian ------------------------------------------------------------------------------
def _gaussian_rdp(mechanism: Gaussian, alphas: np.ndarray) -> np.ndarray:
    """``alpha / (2 sigma^2)`` (Mironov 2017, Proposition 7 / Table II), rounded up and
    never 0 (a ``sigma`` whose square overflows made it 0: no privacy loss)."""
    from privlearn.accounting._rdp_math import gaussian_rdp_upper

    return gaussian_rdp_upper(alphas, mechanism.noise_multiplier)



def _gaussian_pair(m: Gaussian):
    from privlearn.accounting._pld_pairs import GaussianPair

    return GaussianPair(1.0 / m.noise_multiplier)


def _gaussian_replace_pair(m: Gaussian, rate: float):
    from privlearn.accounting._pld_pairs import ReplaceGaussianPair

    return ReplaceGaussianPair(1.0 / m.noise_multiplier, rate)


def _gaussian_poisson_rdp(m: Gaussian, rate: float, alphas: np.ndarray) -> np.ndarray:
    from privlearn.accounting._rdp_sampled_gaussian import subsampled_gaussian_rdp

    return subsampled_gaussian_rdp(rate, m.noise_multiplier, alphas)


register_mechanism(
    Gaussian,
    pure_epsilon=lambda m: math.inf,
    pld_pair=_gaussian_pair,
    rdp=_gaussian_rdp,
    equivalent_gaussian=lambda m: m.noise_multiplier,
    scale_sensitivity=lambda m, factor: Gaussian(m.noise_multiplier / factor),
    pld_replace_one_pair=_gaussian_replace_pair,
    rdp_poisson_subsampled=_gaussian_poisson_rdp,
    replace_one_doubles_sensitivity=True,
)


# -- Laplace -------------------------------------------------------------------------------
def _laplace_rdp(m: Laplace, alphas: np.ndarray) -> np.ndarray:
    """Mironov (2017), Proposition 6 (see :func:`._rdp_math._laplace_rdp`), a value below
    the normal range rounded up (a huge scale underflowed it to 0: no privacy loss)."""
    from privlearn.accounting._rdp_math import _laplace_rdp as laplace_rdp
    from privlearn.accounting._rdp_math import round_up_tiny

    return round_up_tiny(laplace_rdp(m.noise_multiplier, alphas))


def _laplace_pair(m: Laplace):
    from privlearn.accounting._pld_pairs import LaplacePair

    return LaplacePair(1.0 / m.noise_multiplier)


def _laplace_replace_pair(m: Laplace, rate: float):
    from privlearn.accounting._pld_pairs import ReplaceLaplacePair

    return ReplaceLaplacePair(1.0 / m.noise_multiplier, rate)


def _laplace_poisson_rdp(m: Laplace, rate: float, alphas: np.ndarray) -> np.ndarray:
    """Zhu & Wang (2019) Theorem 8 (the bound autodp applies to the Laplace mechanism with
    ``improved_bound_flag=True``); tests check it against the exact Renyi divergences of
    the subsampled Laplace pair computed by quadrature."""
    from privlearn.accounting.rdp import poisson_subsampled_rdp

    return poisson_subsampled_rdp(m, rate, alphas, tight=True)


register_mechanism(
    Laplace,
    # 1/b rounded up (exactly 1/b when representable)
    pure_epsilon=lambda m: upper_float(1 / Fraction(m.noise_multiplier)),
    pld_pair=_laplace_pair,
    rdp=_laplace_rdp,
    scale_sensitivity=lambda m, factor: Laplace(m.noise_multiplier / factor),
    pld_replace_one_pair=_laplace_replace_pair,
    rdp_poisson_subsampled=_laplace_poisson_rdp,
    replace_one_doubles_sensitivity=True,
    # eps(delta) = max(0, 1/b + 2 log(1 - delta)) of one run, in closed form
    exact_epsilon=lambda m, delta: closed_form.laplace_epsilon(m.noise_multiplier, delta),
    exact_delta=lambda m, eps: closed_form.laplace_delta(m.noise_multiplier, eps),
)


# -- randomized response -------------------------------------------------------------------
def _randomized_response_rdp(mechanism: RandomizedResponse, alphas: np.ndarray) -> np.ndarray:
    """Exact RDP of k-ary randomized response (p = truth probability, r = (1-p)/(k-1))::

        D_alpha = log( p^alpha r^(1-alpha) + r^alpha p^(1-alpha) + (k-2) r ) / (alpha - 1)

    the Renyi divergence between the output distributions for two different inputs (all
    pairs are equivalent by symmetry; Mironov 2017 Table II gives the binary case).
    """
    from privlearn.accounting._rdp_math import _randomized_response_divergence

    p, k = mechanism.truth_probability, mechanism.num_categories
    r = (1.0 - p) / (k - 1)
    if p == r:  # p = 1/k: output independent of the input
        return np.zeros_like(alphas)
    # p - r = (k p - 1) / (k - 1) and log(p / r) = log1p((k p - 1) / (1 - p)), exactly
    # rounded from the float p (no cancellation near p = 1/k)
    excess = Fraction(k) * Fraction(p) - 1
    p_minus_r = float(excess / (k - 1))
    log_ratio = math.log1p(float(excess / (1 - Fraction(p))))
    val = _randomized_response_divergence(math.log(p), math.log(r), p_minus_r, log_ratio,
                                          (k - 2) * r, alphas)
    return np.minimum(val, _randomized_response_pure_epsilon(mechanism))


def _randomized_response_poisson_rdp(mechanism: RandomizedResponse, rate: float,
                                     alphas: np.ndarray) -> np.ndarray:
    """Exact RDP of Poisson-subsampled k-ary randomized response (add/remove): the larger
    Renyi divergence, in either direction, between the three-outcome pair ``P = (p, r,
    (k-2) r)``, ``Q = (r, p, (k-2) r)`` and its mixture ``(1 - q) P + q Q``, at every
    real order (see :mod:`._rdp_pure_subsampled`; at integer orders the binomial
    expansion of Zhu & Wang 2019, Section 3, attained by this pair)."""
    from privlearn.accounting._rdp_pure_subsampled import poisson_randomized_response_rdp

    p, k = mechanism.truth_probability, mechanism.num_categories
    r = (1.0 - p) / (k - 1)
    p_minus_r = float((Fraction(k) * Fraction(p) - 1) / (k - 1))  # no cancellation
    out = poisson_randomized_response_rdp(p, r, p_minus_r, (k - 2) * r, rate, alphas)
    return np.minimum(out, _randomized_response_rdp(mechanism, alphas))


def _randomized_response_pair(m: RandomizedResponse):
    from privlearn.accounting._pld_pairs import randomized_response_pair

    return randomized_response_pair(m.truth_probability, m.num_categories)


def _randomized_response_pure_epsilon(m: RandomizedResponse) -> float:
    """``log(p (k-1) / (1-p))`` (Kairouz, Oh & Viswanath 2016), rounded up by the error of
    its evaluation: a few ulps of the logarithm's argument, i.e. ~``4 u`` absolute."""
    eps = m.pure_epsilon
    return eps + 4.0 * _ULP * (abs(eps) + 1.0) if eps > 0 else eps


register_mechanism(
    RandomizedResponse,
    pure_epsilon=_randomized_response_pure_epsilon,
    pld_pair=_randomized_response_pair,
    rdp=_randomized_response_rdp,
    # a local randomiser: any change of one record's input changes one output, whatever
    # the relation, so the same pair dominates at any sensitivity
    scale_sensitivity=lambda m, factor: m,
    rdp_poisson_subsampled=_randomized_response_poisson_rdp,
    pld_atoms=lambda m: closed_form.randomized_response_atoms(m.truth_probability,
                                                              m.num_categories),
)


# -- generic pure DP -----------------------------------------------------------------------
def _pure_dp_rdp(mechanism: PureDP, alphas: np.ndarray) -> np.ndarray:
    """RDP of binary randomized response with the same epsilon (dominating pair; Kairouz,
    Oh & Viswanath 2015 Thm 2.1), which is also at most epsilon (Mironov 2017, Prop. 3)."""
    from privlearn.accounting._rdp_math import _rr_rdp

    return _rr_rdp(mechanism.pure_epsilon, alphas)



def _pure_dp_poisson_rdp(mechanism: PureDP, rate: float, alphas: np.ndarray) -> np.ndarray:
    """Exact RDP of Poisson-subsampled binary randomized response with the same epsilon,
    which dominates every Poisson-subsampled epsilon-DP mechanism (Kairouz, Oh &
    Viswanath 2015, Thm 2.1, and data processing; see :mod:`._rdp_pure_subsampled`)."""
    from privlearn.accounting._rdp_pure_subsampled import poisson_pure_dp_rdp

    return poisson_pure_dp_rdp(mechanism.pure_epsilon, rate, alphas)


def _pure_dp_pair(m: PureDP):
    from privlearn.accounting._pld_pairs import pure_dp_pair

    return pure_dp_pair(m.pure_epsilon)


register_mechanism(
    PureDP,
    pure_epsilon=lambda m: m.pure_epsilon,
    pld_pair=_pure_dp_pair,
    rdp=_pure_dp_rdp,
    rdp_poisson_subsampled=_pure_dp_poisson_rdp,
    # group privacy: an eps-DP mechanism is (factor * eps)-DP for records that move its
    # input factor times as far (Dwork & Roth 2014, Section 2.3)
    scale_sensitivity=lambda m, factor: PureDP(factor * m.pure_epsilon),
    pld_atoms=lambda m: closed_form.pure_dp_atoms(m.pure_epsilon),
    stated_dp=lambda m: (m.pure_epsilon, 0.0),
)


# -- generic approximate DP ----------------------------------------------------------------
def _approx_dp_pair(m: ApproxDP):
    from privlearn.accounting._pld_pairs import ApproxDPPair

    return ApproxDPPair(m.dp_epsilon, m.dp_delta)


def _approx_dp_group(m: ApproxDP, factor: float) -> ApproxDP:
    """``m`` for inputs up to ``factor`` records apart: group privacy of size
    ``k = ceil(factor)``, ``(k eps, delta (1 + e^eps + ... + e^((k-1) eps)))``, e.g.
    ``(2 eps, (1 + e^eps) delta)`` for a replacement (two add/remove steps).

    Group privacy (Dwork & Roth 2014, Section 2.3; Vadhan 2017, Lemma 2.2), by the
    chaining argument those proofs use: applying ``P[M(x_{i-1}) in S] <= e^eps
    P[M(x_i) in S] + delta`` along ``x_0, ..., x_k`` (each step one add/remove) gives
    ``P[M(x_0) in S] <= e^(k eps) P[M(x_k) in S] + sum_{i<k} e^(i eps) delta``, at most
    the ``k e^((k-1) eps) delta`` of the textbook statement. Both terms are rounded up.
    ``factor <= 1`` returns ``m`` (its own guarantee covers one record).

    Raises
    ------
    UnsupportedMechanismError
        When the group delta is not below 1 (no guarantee is left to state).
    """
    if factor <= 1.0:
        return m
    k = math.ceil(factor)
    eps, delta = m.dp_epsilon, m.dp_delta
    group_eps = math.nextafter(k * eps, math.inf) if k != 2 else 2.0 * eps  # 2 eps: exact
    growth = math.fsum(math.exp(i * eps) for i in range(k))
    group_delta = delta * growth * (1.0 + 8.0 * k * _ULP)  # exp, sum and product rounding
    if not group_delta < 1.0:
        raise UnsupportedMechanismError(
            f"{m!r} read for inputs {k} records apart (group privacy, e.g. a replacement "
            f"under add/remove) has delta = {group_delta!r}, which must be below 1: no "
            "guarantee is left; state the release's guarantee under the relation in use "
            "(e.g. subsample(ApproxDP(...), 1.0, scheme='fixed') for replace-one)"
        )
    return ApproxDP(group_eps, group_delta)


register_mechanism(
    ApproxDP,
    pure_epsilon=lambda m: math.inf,  # delta > 0: no pure guarantee
    pld_pair=_approx_dp_pair,
    # group privacy: (k eps, (1 + ... + e^((k-1) eps)) delta) for inputs k records apart
    scale_sensitivity=_approx_dp_group,
    # the same pair as exact atoms (closed-form composition with the other finite kinds)
    pld_atoms=lambda m: closed_form.approx_dp_atoms(m.dp_epsilon, m.dp_delta),
    stated_dp=lambda m: (m.dp_epsilon, m.dp_delta),
)


# -- a mechanism known only through its RDP curve ------------------------------------------
def _user_rdp(mechanism: RDPMechanism, alphas: np.ndarray) -> np.ndarray:
    """The user's function, evaluated order by order; NaN is treated as ``inf`` (no
    guarantee) and the result is capped by the RDP of randomized response with the
    declared pure epsilon (Mironov 2017, Prop. 3; Kairouz, Oh & Viswanath 2015)."""
    from privlearn.accounting._rdp_math import _rr_rdp

    out = np.empty_like(alphas)
    for i, a in enumerate(alphas.tolist()):
        v = mechanism.rdp_function(a)
        try:
            v = float(v)
        except (TypeError, ValueError):
            raise ParameterTypeError(
                f"rdp_function of {mechanism.name!r} must return a real number, "
                f"got {v!r} at alpha={a!r}"
            ) from None
        if math.isnan(v):
            v = math.inf
        if v < 0:
            raise ParameterValueError(
                f"rdp_function of {mechanism.name!r} must return values in [0, inf], "
                f"got {v!r} at alpha={a!r}"
            )
        out[i] = v
    if math.isfinite(mechanism.pure_epsilon):
        out = np.minimum(out, _rr_rdp(mechanism.pure_epsilon, alphas))
    return out



register_mechanism(
    RDPMechanism,
    pure_epsilon=lambda m: float(m.pure_epsilon),
    rdp=_user_rdp,
)
