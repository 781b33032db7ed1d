"""Renyi-DP accountant.

:func:`rdp_epsilon` returns an upper bound on the Renyi-DP curve ``eps_RDP(alpha)`` of a
mechanism description; the accountant registered as ``"rdp"`` converts it to
(epsilon, delta) with :mod:`privlearn.accounting.conversion` (Canonne, Kamath & Steinke
2020, Prop. 12), minimising over a dense order grid refined over real alpha.

RDP bounds are computed by a registry keyed by mechanism type (:func:`register_rdp`), so a
new mechanism needs one registered function and no change elsewhere:

=========================  ============================================================
mechanism                  RDP bound (see each function's docstring for the reference)
=========================  ============================================================
Gaussian                   ``alpha / (2 sigma^2)`` (exact)
Laplace                    Mironov 2017 Prop. 6 (exact)
RandomizedResponse         exact Renyi divergence of k-ary randomized response
PureDP                     RDP of binary randomized response with the same epsilon
RDPMechanism               the user's function (NaN -> inf), capped by its pure epsilon
Composed                   sum of the parts, ``count * rdp`` for repeated parts
Poisson x Gaussian         Mironov, Talwar & Zhang 2019 (exact; integer and fractional)
Poisson x Laplace          Zhu & Wang 2019 Theorem 8 (the bound autodp uses)
Poisson x other            Zhu & Wang 2019 Theorem 6 (general upper bound)
fixed-size x any           Wang, Balle & Kasiviswanathan 2019 Theorem 9 (replace-one)
=========================  ============================================================

Neighbouring convention (as Google dp_accounting): Gaussian and Laplace noise multipliers
are relative to the bound ``C`` on one record's contribution (the add/remove
sensitivity). Under replace-one (fixed-size sampling) a contribution can move by ``2 C``,
so the base mechanism of the Wang-Balle-Kasiviswanathan bound is taken at sensitivity 2:
Gaussian RDP ``2 alpha / sigma^2``, Laplace at L1 sensitivity 2 (pure epsilon ``2 / b``).
PureDP and randomized response state their guarantee for the stated relation. Poisson
sampling under replace-one is not supported by this accountant (use ``"pld"``).

Every subsampled bound is also capped by the base mechanism's RDP (Renyi divergence is
jointly quasi-convex, van Erven & Harremoes 2014 Theorem 13) and by the RDP of randomized
response with the amplified pure epsilon when the base has one. Bounds computed at integer
orders are extended to real orders with the convexity of ``(alpha - 1) D_alpha`` in alpha
(van Erven & Harremoes 2014, Theorem 11) -- linear interpolation of the cumulant between
neighbouring integers is a valid upper bound -- and with monotonicity in alpha (their
Theorem 3) on (1, 2].

All sums run in log space (log-sum-exp with the maximum factored out); each result is
rounded up by a margin covering the floating-point error of the sum.

References
----------
.. [1] Mironov (2017), Renyi Differential Privacy, CSF. Prop. 3, Prop. 6, Prop. 7.
.. [2] Mironov, Talwar & Zhang (2019), Renyi Differential Privacy of the Sampled Gaussian
       Mechanism, arXiv:1908.10530, Section 3 (integer and fractional alpha).
.. [3] Zhu & Wang (2019), Poisson Subsampled Renyi Differential Privacy, ICML,
       Theorems 6 and 8.
.. [4] Wang, Balle & Kasiviswanathan (2019), Subsampled Renyi Differential Privacy and
       Analytical Moments Accountant, AISTATS, Theorem 9.
.. [5] van Erven & Harremoes (2014), Renyi Divergence and Kullback-Leibler Divergence,
       IEEE Trans. Inf. Theory, Theorems 3, 11 and 13.
.. [6] Balle, Barthe & Gaboardi (2018), Privacy Amplification by Subsampling: Tight
       Analyses via Couplings and Divergences, NeurIPS, Theorems 8 and 9 (pure epsilon).
.. [7] Kairouz, Oh & Viswanath (2015), The Composition Theorem for Differential Privacy,
       ICML, Theorem 2.1 (randomized response dominates every epsilon-DP mechanism).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import numpy as np
from scipy import special

from privlearn.accounting.accountants import (
    AccountingError,
    PrivacyBound,
    UnsupportedMechanismError,
    register_accountant,
)
from privlearn.accounting.conversion import rdp_to_delta, rdp_to_epsilon
from privlearn.accounting.mechanisms import (
    Composed,
    Gaussian,
    Laplace,
    Mechanism,
    Neighbouring,
    PureDP,
    RandomizedResponse,
    RDPMechanism,
    Sampling,
    Subsampled,
)

__all__ = [
    "rdp_epsilon",
    "pure_epsilon",
    "register_rdp",
    "register_pure_epsilon",
    "RDPAccountant",
    "clear_caches",
    "subsampled_gaussian_rdp",
    "POISSON_SUBSAMPLED_RDP",
]

_ULP = float(np.finfo(float).eps)
#: Largest integer order at which O(alpha) sums are evaluated; above it the subsampled
#: bound falls back to the (valid, looser) base-mechanism RDP.
MAX_SUM_ORDER = 1 << 17
#: Largest non-integer order evaluated with the fractional series of Mironov et al.;
#: above it the cumulant is interpolated between integers (valid by convexity).
MAX_FRACTIONAL_SERIES_ORDER = 256.0


# ----------------------------------------------------------------------------------------
# public entry points
# ----------------------------------------------------------------------------------------
def rdp_epsilon(mechanism: Mechanism, orders: float | Sequence[float]) -> float | np.ndarray:
    """Renyi-DP upper bound ``eps_RDP(alpha)`` of ``mechanism`` at each order.

    Parameters
    ----------
    mechanism : Mechanism
    orders : float or sequence of float
        Orders alpha in (1, inf]; ``inf`` gives the pure-DP epsilon (possibly ``inf``).

    Returns
    -------
    float or numpy.ndarray
        A float for a scalar order, else an array of the same shape.

    Raises
    ------
    ValueError
        If an order is not in (1, inf].
    UnsupportedMechanismError
        If no RDP bound is registered for (part of) the mechanism.
    """
    scalar = np.ndim(orders) == 0
    a = np.atleast_1d(np.asarray(orders, dtype=float))
    bad = np.isnan(a) | (a <= 1.0)
    if bad.any():
        raise ValueError(f"orders must be in (1, inf], got {a[bad][0]!r} in {orders!r}")
    flat = a.ravel()
    out = np.empty_like(flat)
    inf_mask = np.isinf(flat)
    if inf_mask.any():
        out[inf_mask] = pure_epsilon(mechanism)
    if (~inf_mask).any():
        out[~inf_mask] = _rdp(mechanism, flat[~inf_mask])
    out = out.reshape(a.shape)
    return float(out.ravel()[0]) if scalar else out


@functools.singledispatch
def _rdp(mechanism: Mechanism, alphas: np.ndarray) -> np.ndarray:
    """RDP upper bound at finite orders ``alphas > 1`` (1-D float array)."""
    raise UnsupportedMechanismError(
        f"accountant 'rdp' has no Renyi-DP bound for {type(mechanism).__name__}; "
        "register one with privlearn.accounting.rdp.register_rdp"
    )


@functools.singledispatch
def _pure(mechanism: Mechanism) -> float:
    return math.inf


def register_rdp(cls: type):
    """Decorator registering ``fn(mechanism, alphas: ndarray) -> ndarray`` for ``cls``."""
    return _rdp.register(cls)


def register_pure_epsilon(cls: type):
    """Decorator registering ``fn(mechanism) -> float`` (pure-DP epsilon) for ``cls``."""
    return _pure.register(cls)


def pure_epsilon(mechanism: Mechanism) -> float:
    """Pure-DP epsilon of the mechanism (``inf`` when it has none or none is known)."""
    return float(_pure(mechanism))


def clear_caches() -> None:
    """Clear the memoised RDP curves (for honest cold-start timings)."""
    _subsampled_gaussian_int.cache_clear()


# ----------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------
def _rr_rdp(eps: float, alphas: np.ndarray) -> np.ndarray:
    """RDP of binary randomized response with ``P(truth) = e^eps / (1 + e^eps)``.

    ``D_alpha = log(p^alpha (1-p)^(1-alpha) + (1-p)^alpha p^(1-alpha)) / (alpha - 1)``,
    the exact Renyi divergence between the two output distributions. Every eps-DP
    mechanism is a post-processing of it (Kairouz, Oh & Viswanath 2015, Thm 2.1), so by the
    data-processing inequality this bounds the RDP of every eps-DP mechanism; it is also
    at most ``eps`` (Mironov 2017, Prop. 3).
    """
    if math.isinf(eps):
        return np.full_like(alphas, np.inf)
    if eps == 0.0:
        return np.zeros_like(alphas)
    log_p = -math.log1p(math.exp(-eps))  # log(e^eps / (1 + e^eps))
    log_q = -eps + log_p  # log(1 / (1 + e^eps)), no overflow for eps > 709
    a = alphas
    val = np.logaddexp(a * log_p + (1 - a) * log_q, a * log_q + (1 - a) * log_p) / (a - 1)
    val = val * (1 + 8 * _ULP) + 8 * _ULP * eps
    return np.minimum(val, eps)


def _interpolate_integer_bound(alphas: np.ndarray, int_fn, cap_fn=None) -> np.ndarray:
    """Extend a bound known at integer orders >= 2 to real orders > 1.

    ``int_fn(ints) -> rdp`` evaluates at integer orders. For non-integer alpha > 2 the
    cumulant ``(alpha-1) eps(alpha)`` is interpolated linearly between floor and ceil
    (convexity, van Erven & Harremoes 2014 Thm 11); for alpha in (1, 2) the value at 2 is
    used (monotonicity in alpha, their Thm 3).
    """
    a = np.asarray(alphas, dtype=float)
    lo = np.where(a < 2.0, 2.0, np.floor(a))
    hi = np.where(a < 2.0, 2.0, np.ceil(a))
    need = np.unique(np.concatenate([lo, hi]))
    vals = dict(zip(need.tolist(), np.asarray(int_fn(need), dtype=float).tolist(), strict=True))
    v_lo = np.array([vals[x] for x in lo.tolist()])
    v_hi = np.array([vals[x] for x in hi.tolist()])
    out = np.where(a < 2.0, v_lo, np.inf)
    frac = a - lo
    with np.errstate(invalid="ignore"):
        cum = (1.0 - frac) * (lo - 1.0) * v_lo + frac * (hi - 1.0) * v_hi
        interp = np.where(frac == 0.0, v_lo, cum / (a - 1.0) * (1 + 4 * _ULP))
    out = np.where(a < 2.0, out, interp)
    return out


def _segments(n: np.ndarray, start: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For integer orders n, the flat index arrays (n_rep, k, segment starts) of all
    k = start..n, for segment-wise log-sum-exp."""
    n = n.astype(np.int64)
    lengths = n - start + 1
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    total = int(lengths.sum())
    n_rep = np.repeat(n, lengths)
    k = np.arange(total) - np.repeat(starts, lengths) + start
    return n_rep, k, starts


def _logsumexp(x: np.ndarray, axis: int | None = None) -> np.ndarray | float:
    """``log(sum(exp(x)))`` with the maximum factored out (``-inf`` for no terms)."""
    x = np.asarray(x, dtype=float)
    if x.size == 0:
        return -math.inf
    m = np.max(x, axis=axis, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        out = np.log(np.sum(np.exp(x - m_safe), axis=axis, keepdims=True)) + m_safe
    out = np.where(np.isposinf(m), np.inf, out)
    out = np.squeeze(out, axis=axis) if axis is not None else out.reshape(())
    return float(out) if out.ndim == 0 else out


def _segment_logsumexp(x: np.ndarray, starts: np.ndarray) -> np.ndarray:
    m = np.maximum.reduceat(x, starts)
    lengths = np.diff(np.concatenate([starts, [len(x)]]))
    m_safe = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        s = np.add.reduceat(np.exp(x - np.repeat(m_safe, lengths)), starts)
        out = m_safe + np.log(s)
    return np.where(np.isposinf(m), np.inf, out)


def _log_binom(n: np.ndarray, k: np.ndarray) -> np.ndarray:
    """log C(n, k) for integers 0 <= k <= n, accurate (via betaln) for large n."""
    return -np.log1p(n) - special.betaln(n - k + 1.0, k + 1.0)


def _sum_margin(logsum: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Upper bound on the floating-point error of a log-sum-exp of ``count`` terms."""
    return _ULP * (2.0 * np.log2(count + 1.0) + 8.0) + 4.0 * _ULP * np.abs(logsum)


# ----------------------------------------------------------------------------------------
# base mechanisms
# ----------------------------------------------------------------------------------------
@_rdp.register
def _(mechanism: Gaussian, alphas: np.ndarray) -> np.ndarray:
    """``alpha / (2 sigma^2)`` (Mironov 2017, Proposition 7 / Table II)."""
    s = mechanism.noise_multiplier
    return alphas / (2.0 * s * s) * (1 + 2 * _ULP)


def _laplace_rdp(b: float, alphas: np.ndarray) -> np.ndarray:
    """Mironov (2017), Proposition 6 (Table II), for scale b and sensitivity 1::

        eps(alpha) = log( alpha/(2 alpha - 1) exp((alpha-1)/b)
                          + (alpha-1)/(2 alpha - 1) exp(-alpha/b) ) / (alpha - 1)

    evaluated with ``logaddexp``; capped at its alpha -> inf limit ``1/b``.
    """
    a = alphas
    t1 = np.log(a / (2 * a - 1)) + (a - 1) / b
    t2 = np.log((a - 1) / (2 * a - 1)) - a / b
    val = np.logaddexp(t1, t2) / (a - 1)
    val = val + 8 * _ULP * (np.abs(t1) + np.abs(t2) + 1.0) / (a - 1)
    return np.minimum(val, 1.0 / b)


@_rdp.register
def _(mechanism: Laplace, alphas: np.ndarray) -> np.ndarray:
    return _laplace_rdp(mechanism.noise_multiplier, alphas)


@_rdp.register
def _(mechanism: RandomizedResponse, alphas: np.ndarray) -> np.ndarray:
    """Exact RDP of k-ary randomized response (p = truth probability, r = (1-p)/(k-1))::

        D_alpha = log( p^alpha r^(1-alpha) + r^alpha p^(1-alpha) + (k-2) r ) / (alpha - 1)

    the Renyi divergence between the output distributions for two different inputs (all
    pairs are equivalent by symmetry; Mironov 2017 Table II gives the binary case).
    """
    p, k = mechanism.truth_probability, mechanism.num_categories
    r = (1.0 - p) / (k - 1)
    if p == r:  # p = 1/k: output independent of the input
        return np.zeros_like(alphas)
    a = alphas
    lp, lr = math.log(p), math.log(r)
    terms = [a * lp + (1 - a) * lr, a * lr + (1 - a) * lp]
    if k > 2:
        terms.append(np.full_like(a, math.log((k - 2) * r)))
    val = _logsumexp(np.stack(terms), axis=0) / (a - 1)
    val = val + 8 * _ULP * (np.abs(terms[0]) + np.abs(terms[1]) + 1.0) / (a - 1)
    return np.minimum(np.maximum(val, 0.0), mechanism.pure_epsilon)


@_rdp.register
def _(mechanism: PureDP, alphas: np.ndarray) -> np.ndarray:
    """RDP of binary randomized response with the same epsilon (dominating pair; Kairouz,
    Oh & Viswanath 2015 Thm 2.1), which is also at most epsilon (Mironov 2017, Prop. 3)."""
    return _rr_rdp(mechanism.pure_epsilon, alphas)


@_rdp.register
def _(mechanism: RDPMechanism, alphas: np.ndarray) -> np.ndarray:
    """The user's function, evaluated order by order; NaN is treated as ``inf`` (no
    guarantee) and the result is capped by the RDP of randomized response with the
    declared pure epsilon (Mironov 2017, Prop. 3; Kairouz, Oh & Viswanath 2015)."""
    out = np.empty_like(alphas)
    for i, a in enumerate(alphas.tolist()):
        v = mechanism.rdp_function(a)
        try:
            v = float(v)
        except (TypeError, ValueError):
            raise TypeError(
                f"rdp_function of {mechanism.name!r} must return a real number, "
                f"got {v!r} at alpha={a!r}"
            ) from None
        if math.isnan(v):
            v = math.inf
        if v < 0:
            raise ValueError(
                f"rdp_function of {mechanism.name!r} must return values in [0, inf], "
                f"got {v!r} at alpha={a!r}"
            )
        out[i] = v
    if math.isfinite(mechanism.pure_epsilon):
        out = np.minimum(out, _rr_rdp(mechanism.pure_epsilon, alphas))
    return out


@_rdp.register
def _(mechanism: Composed, alphas: np.ndarray) -> np.ndarray:
    """Adaptive composition adds RDP (Mironov 2017, Proposition 1); ``count`` identical
    parts contribute ``count * rdp``."""
    total = np.zeros_like(alphas)
    for m, k in mechanism.parts:
        with np.errstate(invalid="ignore"):
            total = total + k * _rdp(m, alphas)
    return total


@_pure.register
def _(mechanism: Laplace) -> float:
    return 1.0 / mechanism.noise_multiplier


@_pure.register
def _(mechanism: RandomizedResponse) -> float:
    return mechanism.pure_epsilon


@_pure.register
def _(mechanism: PureDP) -> float:
    return mechanism.pure_epsilon


@_pure.register
def _(mechanism: RDPMechanism) -> float:
    return float(mechanism.pure_epsilon)


@_pure.register
def _(mechanism: Composed) -> float:
    """Basic composition of pure DP (Dwork & Roth 2014, Theorem 3.14)."""
    return math.fsum(k * _pure(m) for m, k in mechanism.parts)


@_pure.register
def _(mechanism: Subsampled) -> float:
    """``log(1 + q (e^eps - 1))`` for Poisson/add-remove and fixed-size/replace-one
    (Balle, Barthe & Gaboardi 2018, Theorems 8 and 9 with delta = 0); rounded up."""
    eps = _pure(_effective_base(mechanism))
    if math.isinf(eps):
        return math.inf
    if not _supported_pair(mechanism):
        return math.inf
    q = mechanism.rate
    return math.log1p(q * math.expm1(eps)) * (1 + 4 * _ULP)


# ----------------------------------------------------------------------------------------
# subsampling
# ----------------------------------------------------------------------------------------
def _effective_base(m: Subsampled) -> Mechanism:
    """The base mechanism with its parameter relative to the neighbouring relation of
    ``m``. Gaussian and Laplace noise multipliers are relative to one record's
    contribution bound (the add/remove sensitivity); under replace-one a record's
    contribution can move by twice that, so the base runs at half the noise multiplier
    (Gaussian RDP ``2 alpha / sigma^2``, Laplace at L1 sensitivity 2). PureDP and
    RandomizedResponse state their guarantee for the stated relation (unchanged)."""
    if m.neighbouring is Neighbouring.REPLACE_ONE:
        if isinstance(m.base, Gaussian):
            return Gaussian(m.base.noise_multiplier / 2.0)
        if isinstance(m.base, Laplace):
            return Laplace(m.base.noise_multiplier / 2.0)
    return m.base


def _supported_pair(m: Subsampled) -> bool:
    # one-sided relations (add-only / remove-only) are bounded by the add/remove RDP
    one_sided = (Neighbouring.ADD_REMOVE, Neighbouring.REMOVE_ONLY, Neighbouring.ADD_ONLY)
    return (m.scheme is Sampling.POISSON and m.neighbouring in one_sided) or (
        m.scheme is Sampling.FIXED and m.neighbouring is Neighbouring.REPLACE_ONE
    )


def _poisson_gaussian(base: Gaussian, q: float, alphas: np.ndarray) -> np.ndarray:
    return subsampled_gaussian_rdp(q, base.noise_multiplier, alphas)


def _poisson_laplace(base: Laplace, q: float, alphas: np.ndarray) -> np.ndarray:
    # Zhu & Wang (2019) Theorem 8 (the bound autodp applies to the Laplace mechanism with
    # improved_bound_flag=True); tests check it against the exact Renyi divergences of the
    # subsampled Laplace pair computed by quadrature.
    return _interpolate_integer_bound(
        alphas, functools.partial(_poisson_generic_int, base, q, True)
    )


#: Poisson-subsampled (add/remove) bounds tighter than the general one, keyed by the type
#: of the base mechanism: ``fn(base, rate, alphas) -> rdp``. Extend by adding entries.
POISSON_SUBSAMPLED_RDP: dict[type, Callable[[Mechanism, float, np.ndarray], np.ndarray]] = {
    Gaussian: _poisson_gaussian,
    Laplace: _poisson_laplace,
}


@_rdp.register
def _(mechanism: Subsampled, alphas: np.ndarray) -> np.ndarray:
    """Subsampled mechanisms.

    * Poisson sampling, add/remove: a specialised bound from
      :data:`POISSON_SUBSAMPLED_RDP` (Gaussian: Mironov, Talwar & Zhang 2019, exact;
      Laplace: Zhu & Wang 2019, Thm 8), else Zhu & Wang (2019), Theorem 6.
    * fixed-size sampling without replacement, replace-one: Wang, Balle &
      Kasiviswanathan (2019), Theorem 9, with a Gaussian / Laplace base at twice its
      add/remove sensitivity (:func:`_effective_base`).
    * other combinations raise :class:`UnsupportedMechanismError`.

    All are capped by the base RDP (joint quasi-convexity of the Renyi divergence, van
    Erven & Harremoes 2014, Thm 13) and, when the base is pure DP, by the RDP of randomized
    response with the amplified pure epsilon. ``rate == 1`` gives the base mechanism.
    """
    base, q = _effective_base(mechanism), mechanism.rate
    if not _supported_pair(mechanism):
        raise UnsupportedMechanismError(
            f"accountant 'rdp' supports Poisson sampling with add/remove neighbouring and "
            f"fixed-size sampling with replace-one neighbouring; got scheme="
            f"{mechanism.scheme.value!r}, neighbouring={mechanism.neighbouring.value!r}"
        )
    base_rdp = _rdp(base, alphas)
    if q == 1.0:
        return base_rdp
    if mechanism.scheme is Sampling.POISSON:
        special_fn = POISSON_SUBSAMPLED_RDP.get(type(base))
        if special_fn is not None:
            out = special_fn(base, q, alphas)
        else:
            out = _interpolate_integer_bound(
                alphas, functools.partial(_poisson_generic_int, base, q, False)
            )
    else:
        out = _interpolate_integer_bound(alphas, functools.partial(_fixed_generic_int, base, q))
    out = np.minimum(out, base_rdp)
    eps_pure = _pure(mechanism)
    if math.isfinite(eps_pure):
        out = np.minimum(out, _rr_rdp(eps_pure, alphas))
    return out


def _base_rdp_at_integers(base: Mechanism, n_max: int) -> np.ndarray:
    """Base RDP at orders 2..n_max (index j-2), with ``(j-1) eps(j)`` finite-checked."""
    js = np.arange(2, n_max + 1, dtype=float)
    return _clean_nan(_rdp(base, js))


def _clean_nan(x: np.ndarray) -> np.ndarray:
    return np.where(np.isnan(x), np.inf, x)


def _poisson_generic_int(base: Mechanism, q: float, tight: bool, ns: np.ndarray) -> np.ndarray:
    """Zhu & Wang (2019) bound for the Poisson-subsampled ``base`` at integer orders n >= 2::

        (n-1) eps'(n) <= log{ (1-q)^(n-1) (1 + (n-1) q)
                              + C(n,2) q^2 (1-q)^(n-2) e^{eps(2)}
                              + c * sum_{l=3}^{n} C(n,l) q^l (1-q)^(n-l) e^{(l-1) eps(l)} }

    with c = 3 (Theorem 6, general upper bound, any mechanism) or c = 1 (Theorem 8, the
    tight bound for mechanisms satisfying its condition, such as the Laplace mechanism;
    this is the bound autodp uses with ``improved_bound_flag=True``).
    Orders above :data:`MAX_SUM_ORDER` get ``inf`` (the caller caps by the base RDP).
    """
    ns = np.asarray(ns, dtype=float)
    out = np.full(ns.shape, np.inf)
    ok = ns <= MAX_SUM_ORDER
    if not ok.any():
        return out
    n_ok = ns[ok]
    eps_int = _base_rdp_at_integers(base, int(n_ok.max()))
    n_rep, k, starts = _segments(n_ok, start=2)
    log_q, log_1q = math.log(q), math.log1p(-q)
    with np.errstate(invalid="ignore"):
        cgf = (k - 1) * eps_int[(k - 2).astype(np.int64)]
        terms = _log_binom(n_rep, k) + k * log_q + (n_rep - k) * log_1q + cgf
    if not tight:
        terms = terms + np.where(k >= 3, math.log(3.0), 0.0)
    rest = _segment_logsumexp(terms, starts)
    first = (n_ok - 1) * log_1q + np.log1p((n_ok - 1) * q)
    log_a = np.logaddexp(first, rest)
    log_a = log_a + _sum_margin(log_a, n_ok)
    out[ok] = np.maximum(log_a, 0.0) / (n_ok - 1)
    return out


def _fixed_generic_int(base: Mechanism, q: float, ns: np.ndarray) -> np.ndarray:
    """Wang, Balle & Kasiviswanathan (2019), Theorem 9, sampling a fixed-size subset
    without replacement (ratio q = m/n), replace-one neighbouring, integer orders n >= 2::

        (n-1) eps'(n) <= log( 1 + q^2 C(n,2) min{ 4 (e^{eps(2)} - 1),
                                                  e^{eps(2)} min{2, (e^{eps(inf)} - 1)^2} }
                              + sum_{j=3}^{n} q^j C(n,j) e^{(j-1) eps(j)}
                                              min{2, (e^{eps(inf)} - 1)^j} )
    """
    ns = np.asarray(ns, dtype=float)
    out = np.full(ns.shape, np.inf)
    ok = ns <= MAX_SUM_ORDER
    if not ok.any():
        return out
    n_ok = ns[ok]
    eps_int = _base_rdp_at_integers(base, int(n_ok.max()))
    eps_inf = _pure(base)
    # log(e^{eps_inf} - 1): -inf if eps_inf == 0, inf if eps_inf == inf
    if eps_inf == 0.0:
        log_em1 = -math.inf
    elif eps_inf > 700.0:
        log_em1 = eps_inf if math.isfinite(eps_inf) else math.inf
    else:
        log_em1 = math.log(math.expm1(eps_inf))
    e2 = float(eps_int[0])
    if math.isinf(e2):
        log_two = math.inf
    elif e2 == 0.0:
        log_two = -math.inf
    else:
        log_two = min(
            math.log(4.0) + e2 + math.log(-math.expm1(-e2)),  # log 4 (e^{eps(2)} - 1)
            e2 + min(math.log(2.0), 2.0 * log_em1),
        )
    n_rep, k, starts = _segments(n_ok, start=2)
    log_q = math.log(q)
    with np.errstate(invalid="ignore"):
        cgf = (k - 1) * eps_int[(k - 2).astype(np.int64)]
        higher = cgf + np.minimum(math.log(2.0), k * log_em1)
        terms = _log_binom(n_rep, k) + k * log_q + np.where(k == 2, log_two, higher)
    rest = _segment_logsumexp(terms, starts)
    log_a = np.logaddexp(0.0, rest)
    log_a = log_a + _sum_margin(log_a, n_ok)
    out[ok] = np.maximum(log_a, 0.0) / (n_ok - 1)
    return out


# -- Poisson-subsampled Gaussian (Mironov, Talwar & Zhang 2019) ---------------------------
def subsampled_gaussian_rdp(q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """RDP of the Poisson-subsampled Gaussian mechanism (add/remove neighbouring).

    ``eps(alpha) = log(A_alpha) / (alpha - 1)`` with ``A_alpha`` the alpha-th moment of the
    likelihood ratio of ``(1-q) N(0, sigma^2) + q N(1, sigma^2)`` to ``N(0, sigma^2)``
    (Mironov, Talwar & Zhang 2019, Section 3):

    * integer alpha: ``A = sum_{k=0}^{alpha} C(alpha,k) (1-q)^(alpha-k) q^k
      exp((k^2 - k) / (2 sigma^2))`` (their Section 3.3), exact;
    * fractional alpha <= :data:`MAX_FRACTIONAL_SERIES_ORDER`: their two-series expansion
      (Section 3.3, "fractional alpha"; as ``_compute_log_a_frac`` in TF-Privacy/Opacus),
      summed until the terms of the tail, which alternates in sign with decreasing
      magnitude, fall below ``exp(-50)``; the first omitted terms are added as an error
      bound. If the series cannot be summed reliably the interpolation below is used;
    * larger fractional alpha: linear interpolation of ``(alpha-1) eps(alpha)`` between
      neighbouring integers (valid by convexity, van Erven & Harremoes 2014 Thm 11).

    Results are rounded up by a bound on the floating-point error of the sums.
    """
    alphas = np.asarray(alphas, dtype=float)
    out = np.empty_like(alphas)
    is_int = alphas == np.round(alphas)
    if is_int.any():
        out[is_int] = _sg_int(q, sigma, alphas[is_int])
    frac_idx = np.flatnonzero(~is_int)
    if frac_idx.size:
        interp_needed = []
        for i in frac_idx.tolist():
            a = float(alphas[i])
            v = _sg_frac(q, sigma, a) if a <= MAX_FRACTIONAL_SERIES_ORDER else None
            if v is None:
                interp_needed.append(i)
            else:
                out[i] = v
        if interp_needed:
            idx = np.array(interp_needed)
            out[idx] = _interpolate_integer_bound(alphas[idx], lambda ns: _sg_int(q, sigma, ns))
    return out


def _sg_int(q: float, sigma: float, ns: np.ndarray) -> np.ndarray:
    ns = np.asarray(ns, dtype=float)
    key = tuple(ns.tolist())
    return np.array(_subsampled_gaussian_int(q, sigma, key))


@functools.lru_cache(maxsize=256)
def _subsampled_gaussian_int(q: float, sigma: float, ns: tuple[float, ...]) -> tuple:
    n = np.asarray(ns, dtype=float)
    out = np.full(n.shape, np.inf)
    big = n > MAX_SUM_ORDER
    out[big] = n[big] / (2 * sigma * sigma)  # base mechanism's RDP: valid, looser
    ok = ~big
    if ok.any():
        n_ok = n[ok]
        n_rep, k, starts = _segments(n_ok, start=0)
        terms = (
            _log_binom(n_rep, k)
            + (n_rep - k) * math.log1p(-q)
            + k * math.log(q)
            + (k * k - k) / (2.0 * sigma * sigma)
        )
        log_a = _segment_logsumexp(terms, starts)
        log_a = log_a + _sum_margin(log_a, n_ok)
        out[ok] = np.minimum(np.maximum(log_a, 0.0) / (n_ok - 1), n_ok / (2 * sigma * sigma))
    return tuple(out.tolist())


def _sg_frac(q: float, sigma: float, alpha: float) -> float | None:
    """Fractional-alpha series of Mironov, Talwar & Zhang (2019), Section 3.3.

    ``A_alpha = sum_{i>=0} binom(alpha, i) (s0_i + s1_i)`` with (``j = alpha - i``,
    ``z0 = sigma^2 log(1/q - 1) + 1/2``)::

        s0_i = q^i (1-q)^j exp((i^2 - i) / (2 sigma^2)) Phi((z0 - i) / sigma)
        s1_i = q^j (1-q)^i exp((j^2 - j) / (2 sigma^2)) Phi((j - z0) / sigma)

    For i > alpha the coefficients alternate in sign; once the magnitudes decrease, the
    tail is bounded by its first term, which we add. Terms are summed until that bound is
    below 1e-10 of log A (or 2^16 terms). Returns None when the series cannot be summed
    reliably (the caller then uses a valid interpolation bound).
    """
    s2 = sigma * sigma
    z0 = s2 * math.log(1.0 / q - 1.0) + 0.5
    log_q, log_1q = math.log(q), math.log1p(-q)
    lgam_a = special.gammaln(alpha + 1.0)
    n_terms = int(math.ceil(alpha)) + 1024
    while True:
        i = np.arange(n_terms + 1, dtype=float)
        j = alpha - i
        log_c = lgam_a - special.gammaln(i + 1.0) - special.gammaln(j + 1.0)
        sign = special.gammasgn(j + 1.0)  # sign of binom(alpha, i)
        ls0 = (
            log_c
            + i * log_q
            + j * log_1q
            + (i * i - i) / (2 * s2)
            + special.log_ndtr((z0 - i) / sigma)
        )
        ls1 = (
            log_c
            + j * log_q
            + i * log_1q
            + (j * j - j) / (2 * s2)
            + special.log_ndtr((j - z0) / sigma)
        )
        lc = np.logaddexp(ls0, ls1)  # log |c_i|
        if np.isnan(lc).any() or np.isposinf(lc).any():
            return None
        body, sg, tail = lc[:-1], sign[:-1], float(lc[-1])
        decreasing = bool(lc[-1] <= lc[-2] <= lc[-3])
        pos = _logsumexp(body[sg > 0])
        neg = _logsumexp(body[sg < 0])
        if neg >= pos - 1e-3:  # heavy cancellation: do not trust the difference
            return None
        log_a = pos + math.log1p(-math.exp(neg - pos)) if neg > -math.inf else pos
        if decreasing and tail < math.log(1e-10 * max(log_a, 1e-300)):
            break
        if n_terms >= 1 << 16:
            if decreasing:
                break
            return None
        n_terms *= 4
    # add the tail bound, then the floating-point error of the sums and the cancellation
    log_a = float(np.logaddexp(log_a, tail))
    r = math.exp(neg - pos)
    log_a += _ULP * (2.0 * math.log2(n_terms) + 8.0) * (1.0 + r) / (1.0 - r) + 4 * _ULP * abs(log_a)
    if not math.isfinite(log_a):
        return None
    return min(max(log_a, 0.0) / (alpha - 1.0), alpha / (2 * s2))


# ----------------------------------------------------------------------------------------
# the accountant
# ----------------------------------------------------------------------------------------
class RDPAccountant:
    """Renyi-DP accountant: RDP curve (:func:`rdp_epsilon`) converted to (epsilon, delta)
    by :func:`privlearn.accounting.conversion.rdp_to_epsilon` / ``rdp_to_delta``
    (Canonne, Kamath & Steinke 2020, Prop. 12), capped by the pure epsilon when known.

    Provides upper bounds only (``PrivacyBound.lower is None``).
    """

    name = "rdp"

    def _curve(self, mechanism: Mechanism):
        # fail early (and with the accountant's message) on unsupported mechanisms
        _rdp(mechanism, np.array([2.0]))
        return lambda a: _rdp(mechanism, np.asarray(a, dtype=float))

    def epsilon(self, mechanism: Mechanism, delta: float) -> PrivacyBound:
        pure = pure_epsilon(mechanism)
        if delta == 0.0:
            if not isinstance(mechanism, Mechanism):
                raise TypeError(f"mechanism must be a Mechanism, got {mechanism!r}")
            self._curve(mechanism)
            return PrivacyBound(upper=pure, lower=None, accountant=self.name)
        eps = rdp_to_epsilon(self._curve(mechanism), delta, pure_epsilon=pure)
        if math.isnan(eps):  # pragma: no cover - defensive
            raise AccountingError("rdp: epsilon evaluated to NaN")
        return PrivacyBound(upper=eps, lower=None, accountant=self.name)

    def delta(self, mechanism: Mechanism, epsilon: float) -> PrivacyBound:
        pure = pure_epsilon(mechanism)
        d = rdp_to_delta(self._curve(mechanism), epsilon, pure_epsilon=pure)
        if math.isnan(d):  # pragma: no cover - defensive
            raise AccountingError("rdp: delta evaluated to NaN")
        return PrivacyBound(upper=d, lower=None, accountant=self.name)


register_accountant(RDPAccountant())
