"""Renyi-DP accountant.

:func:`rdp_epsilon` returns an upper bound on the Renyi-DP curve ``eps_RDP(alpha)`` of a
mechanism description; the accountant registered as ``"rdp"`` converts it to
(epsilon, delta) with :mod:`privlearn.accounting.conversion` (Canonne, Kamath & Steinke
2020, Prop. 12), minimising over a dense order grid refined over real alpha.

The RDP curve of each mechanism kind is its ``rdp`` function in the mechanism registry
(:mod:`privlearn.accounting.registry`; the built-in ones are in
:mod:`privlearn.accounting._builtin_kinds`), so a new mechanism needs one registered function
and no change here; subsampling and composition are derived here from the kinds' curves:

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
Poisson x PureDP / RR      exact divergences of subsampled randomized response
Poisson x other            Zhu & Wang 2019 Theorem 6 (general upper bound)
fixed-size x any           Wang, Balle & Kasiviswanathan 2019 Theorem 9 (replace-one)
fixed-size x pure DP       exact worst case over pairwise eps-close triples
=========================  ============================================================

Neighbouring convention (as Google dp_accounting): Gaussian and Laplace noise multipliers
are relative to the bound ``C`` on one record's contribution (the add/remove
sensitivity). Under replace-one (fixed-size sampling) a contribution can move by ``2 C``,
so the base mechanism of the Wang-Balle-Kasiviswanathan bound is taken at sensitivity 2:
Gaussian RDP ``2 alpha / sigma^2``, Laplace at L1 sensitivity 2 (pure epsilon ``2 / b``).
PureDP and randomized response state their guarantee for the stated relation. Poisson
sampling under replace-one is not supported by this accountant (use ``"pld"``).

Every subsampled bound is also capped by the base mechanism's RDP (Renyi divergence is
jointly quasi-convex, van Erven & Harremoes 2014 Theorem 13) and, when the base has a pure
epsilon, by the exact RDP of the same subsampling applied to randomized response with that
epsilon, which dominates every such base (Kairouz, Oh & Viswanath 2015, Theorem 2.1, and
the data-processing inequality; :mod:`privlearn.accounting._rdp_pure_subsampled`).
Bounds computed at integer orders are extended to real orders with the convexity of
``(alpha - 1) D_alpha`` in alpha (van Erven & Harremoes 2014, Theorem 11) -- linear
interpolation of the cumulant between neighbouring integers is a valid upper bound -- and
with monotonicity in alpha (their Theorem 3) on (1, 2].

All sums run in log space (log-sum-exp with the maximum factored out) over exact
log-binomials; a Renyi moment ``A >= 1`` is summed as its excess ``A - 1`` over
non-negative terms wherever the bound allows (sampled Gaussian, Zhu-Wang, Wang-Balle-
Kasiviswanathan), and the closed forms (Laplace, randomized response) are written without
first-order cancellation, so a divergence near 0 keeps its relative precision. Each term
and each result is rounded up by a bound on its floating-point error.

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
import numbers
from collections.abc import Callable, Sequence

import numpy as np

from privlearn.accounting._pld_rdp_cap import clear_cache as _clear_cap_cache
from privlearn.accounting._queries import query_delta, query_epsilon
from privlearn.accounting._rdp_math import (
    _FLOAT_MIN,
    MAX_FRACTIONAL_SERIES_ORDER,
    MAX_SUM_ORDER,
    _clean_nan,
    _interpolate_integer_bound,
    _log1p_of_log,
    _log_binom,
    _log_expm1,
    _rr_rdp,
    _segment_logsumexp,
    _segments,
    _sum_margin,
    _term_margin,
)
from privlearn.accounting._rdp_pure_subsampled import (
    fixed_pure_dp_rdp,
    poisson_pure_dp_rdp,
)
from privlearn.accounting._rdp_sampled_gaussian import clear_cache as _clear_sg_cache
from privlearn.accounting._rdp_sampled_gaussian import subsampled_gaussian_rdp
from privlearn.accounting._rdp_wor_gaussian import _log_binomials, gaussian_log_forward_differences
from privlearn.accounting._types import PrivacyBound
from privlearn.accounting.accountants import register_accountant
from privlearn.accounting.conversion import rdp_to_delta, rdp_to_epsilon, rdp_to_epsilon_and_order
from privlearn.accounting.mechanisms import (
    Composed,
    Mechanism,
    Neighbouring,
    Sampling,
    Subsampled,
)
from privlearn.accounting.registry import (
    equivalent_gaussian,
    lookup,
    read_relation,
    relation_base,
    representation_of,
)
from privlearn.accounting.registry import pure_epsilon as _registry_pure_epsilon
from privlearn.errors import (
    AccountingError,
    ParameterTypeError,
    ParameterValueError,
    UnsupportedMechanismError,
)

__all__ = [
    "rdp_epsilon",
    "pure_epsilon",
    "RDPAccountant",
    "clear_caches",
    "subsampled_gaussian_rdp",
    "poisson_subsampled_rdp",
    "MAX_SUM_ORDER",
    "MAX_FRACTIONAL_SERIES_ORDER",
]


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
    a = _real_orders(orders)
    scalar = a.ndim == 0
    a = np.atleast_1d(a)
    bad = np.isnan(a) | (a <= 1.0)
    if bad.any():
        raise ParameterValueError(
            f"orders must be in (1, inf], got {float(a[bad][0])!r} in {orders!r}; Renyi "
            "orders start above 1 (e.g. 2, 8, 32)")
    flat = a.ravel()
    out = np.empty_like(flat)
    inf_mask = np.isinf(flat)
    if inf_mask.any():
        out[inf_mask] = pure_epsilon(mechanism)
    if (~inf_mask).any():
        out[~inf_mask] = _rdp(mechanism, flat[~inf_mask])
    out = out.reshape(a.shape)
    return float(out.ravel()[0]) if scalar else out



def _real_orders(orders: object) -> np.ndarray:
    """``orders`` as a float array; a string, ``None``, a bool or an array holding one
    is a :class:`ParameterTypeError` (``np.asarray("2", dtype=float)`` would read the
    string ``"2"`` as the order 2, and ``True`` as the order 1)."""
    try:
        flat = np.ravel(np.asarray(orders, dtype=object))
    except (TypeError, ValueError):
        flat = None
    if flat is None or not all(isinstance(x, numbers.Real) and not isinstance(x, bool)
                               for x in flat):
        raise ParameterTypeError(
            f"orders must be a real number > 1 or an array of them, got {orders!r} "
            f"({type(orders).__name__}); pass e.g. 2.0 or [2, 4, 8, 16, 32]")
    return np.asarray(orders, dtype=float)


def _rdp(mechanism: Mechanism, alphas: np.ndarray) -> np.ndarray:
    """RDP upper bound at finite orders ``alphas > 1`` (1-D float array)."""
    if isinstance(mechanism, Composed):
        return _composed_rdp(mechanism, alphas)
    if isinstance(mechanism, Subsampled):
        return _subsampled_rdp(mechanism, alphas)
    return lookup("rdp", mechanism, accountant="rdp")(mechanism, alphas)


def pure_epsilon(mechanism: Mechanism) -> float:
    """Pure-DP epsilon of the mechanism (``inf`` when it has none or none is known).

    The shared definition :func:`privlearn.accounting.registry.pure_epsilon` (rounded up).
    """
    return _registry_pure_epsilon(mechanism)


def clear_caches() -> None:
    """Clear the memoised RDP curves and bounds (for honest cold-start timings)."""
    _clear_sg_cache()
    gaussian_log_forward_differences.cache_clear()
    _log_binomials.cache_clear()
    _clear_cap_cache()


# ----------------------------------------------------------------------------------------
# composition and subsampling, derived from the kinds' curves
# ----------------------------------------------------------------------------------------
def _composed_rdp(mechanism: Composed, alphas: np.ndarray) -> np.ndarray:
    """Adaptive composition adds RDP (Mironov 2017, Proposition 1); ``count`` identical
    parts contribute ``count * rdp``, every part read under one neighbouring relation
    (:func:`privlearn.accounting.registry.read_relation`)."""
    total = np.zeros_like(alphas)
    for m, k in read_relation(mechanism).parts:
        with np.errstate(invalid="ignore", over="ignore"):  # inf: no finite bound
            total = total + k * _rdp(m, alphas)
    return total


def _supported_pair(m: Subsampled) -> bool:
    # one-sided relations (add-only / remove-only) are bounded by the add/remove RDP
    one_sided = (Neighbouring.ADD_REMOVE, Neighbouring.REMOVE_ONLY, Neighbouring.ADD_ONLY)
    return (m.scheme is Sampling.POISSON and m.neighbouring in one_sided) or (
        m.scheme is Sampling.FIXED and m.neighbouring is Neighbouring.REPLACE_ONE
    )


def poisson_subsampled_rdp(
    base: Mechanism, rate: float, alphas: np.ndarray, *, tight: bool = False
) -> np.ndarray:
    """Zhu & Wang (2019) bound for the Poisson-subsampled ``base`` at real orders:
    Theorem 6 (any mechanism), or Theorem 8 with ``tight`` (mechanisms satisfying its
    condition, such as the Laplace mechanism); see :func:`_poisson_generic_int`. Below
    the normal range the sums lose their relative rounding margins (a positive divergence
    underflowed to 0 would claim no privacy loss): there the base's RDP, an upper bound
    (joint quasi-convexity, van Erven & Harremoes 2014, Thm 13), is returned."""
    out = _interpolate_integer_bound(
        alphas, functools.partial(_poisson_generic_int, base, rate, tight)
    )
    return _base_where_underflowed(out, base, alphas)


def _base_where_underflowed(out: np.ndarray, base: Mechanism, alphas: np.ndarray) -> np.ndarray:
    """``out`` (a subsampled curve), with the base's RDP (rounded up, never 0) wherever it
    is below the normal range or NaN."""
    out = np.asarray(out, dtype=float)
    under = ~(out >= _FLOAT_MIN)
    if not under.any():
        return out
    return np.where(under, _rdp(base, np.asarray(alphas, dtype=float)), out)


def _subsampled_rdp(mechanism: Subsampled, alphas: np.ndarray) -> np.ndarray:
    """Subsampled mechanisms.

    * Poisson sampling, add/remove: the kind's ``rdp_poisson_subsampled`` (Gaussian:
      Mironov, Talwar & Zhang 2019, exact; Laplace: Zhu & Wang 2019, Thm 8), else Zhu &
      Wang (2019), Theorem 6.
    * fixed-size sampling without replacement, replace-one: Wang, Balle &
      Kasiviswanathan (2019), Theorem 9, with a Gaussian / Laplace base at twice its
      add/remove sensitivity (:func:`privlearn.accounting.registry.relation_base`).
    * other combinations raise :class:`UnsupportedMechanismError`.

    All are capped by the base RDP (joint quasi-convexity of the Renyi divergence, van
    Erven & Harremoes 2014, Thm 13) and, when the base has a pure epsilon, by the exact
    RDP of the subsampled randomized-response pair with that epsilon
    (:func:`._rdp_pure_subsampled.poisson_pure_dp_rdp` /
    :func:`._rdp_pure_subsampled.fixed_pure_dp_rdp`), which dominates the subsampled base.
    ``rate == 1`` gives the base mechanism.
    """
    if mechanism.rate == 1.0:  # every scheme runs the base at its relation's sensitivity
        return _rdp(relation_base(mechanism, accountant="rdp"), alphas)
    if not _supported_pair(mechanism):
        raise UnsupportedMechanismError(
            f"accountant 'rdp' supports Poisson sampling with add/remove neighbouring and "
            f"fixed-size sampling with replace-one neighbouring; got scheme="
            f"{mechanism.scheme.value!r}, neighbouring={mechanism.neighbouring.value!r}"
        )
    base, q = relation_base(mechanism, accountant="rdp"), mechanism.rate
    base_rdp = _rdp(base, alphas)
    if q == 1.0:
        return base_rdp
    special_fn = (representation_of(base, "rdp_poisson_subsampled")
                  if mechanism.scheme is Sampling.POISSON else None)
    if special_fn is not None:  # rounds its values below the normal range up itself
        out = special_fn(base, q, alphas)
    else:
        if mechanism.scheme is Sampling.POISSON:
            out = poisson_subsampled_rdp(base, q, alphas, tight=False)
        else:
            # Theorem 27 of Wang, Balle & Kasiviswanathan (2019) for a Gaussian base
            sigma = equivalent_gaussian(base)
            log_pv = (gaussian_log_forward_differences(sigma)
                      if sigma is not None and 0.0 < sigma < math.inf else None)
            out = _interpolate_integer_bound(
                alphas, functools.partial(_fixed_generic_int, base, q, log_pv=log_pv))
            out = _base_where_underflowed(out, base, alphas)  # as the Poisson bound
    out = np.minimum(out, base_rdp)
    eps_base = pure_epsilon(base)
    if math.isfinite(eps_base):
        # the base is a post-processing of randomized response with its pure epsilon:
        # the exact divergences of that pair, subsampled (tighter than randomized
        # response with the amplified epsilon, which it implies)
        pure_fn = (poisson_pure_dp_rdp if mechanism.scheme is Sampling.POISSON
                   else fixed_pure_dp_rdp)
        out = np.minimum(out, pure_fn(eps_base, q, alphas))
    eps_pure = pure_epsilon(mechanism)
    if math.isfinite(eps_pure):
        out = np.minimum(out, _rr_rdp(eps_pure, alphas))
    # a bound that underflowed below the normal range (a huge noise: the pure-DP pair's
    # divergences of a tiny epsilon) would claim no privacy loss: the base's RDP there
    return _base_where_underflowed(out, base, alphas)


def _base_rdp_at_integers(base: Mechanism, n_max: int) -> np.ndarray:
    """Base RDP at orders 2..n_max (index j-2), with ``(j-1) eps(j)`` finite-checked."""
    js = np.arange(2, n_max + 1, dtype=float)
    return _clean_nan(_rdp(base, js))


def _sum_over_integer_orders(
    base: Mechanism,
    ns: np.ndarray,
    log_terms: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray],
) -> np.ndarray:
    """``eps'(n) = log(1 + sum_k exp(log_terms)) / (n - 1)`` at integer orders ``ns >= 2``,
    the form of the subsampling bounds below: ``log_terms(eps_int, n_rep, k)`` gives, for
    every order ``n_rep`` and summation index ``k = 2..n`` (flattened, one segment per
    order), the log of the bound's ``k``-th term above 1, with ``eps_int[j - 2]`` the base
    RDP at order ``j``. Orders above :data:`MAX_SUM_ORDER` get ``inf`` (the caller caps by
    the base RDP)."""
    ns = np.asarray(ns, dtype=float)
    out = np.full(ns.shape, np.inf)
    ok = ns <= MAX_SUM_ORDER
    if not ok.any():
        return out
    n_ok = ns[ok]
    eps_int = _base_rdp_at_integers(base, int(n_ok.max()))
    n_rep, k, starts = _segments(n_ok, start=2)
    rest = _segment_logsumexp(log_terms(eps_int, n_rep, k), starts)
    out[ok] = _log1p_of_log(rest + _sum_margin(rest, n_ok)) / (n_ok - 1)
    return out


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
    return _sum_over_integer_orders(
        base, ns, functools.partial(_poisson_log_terms, q, tight))


def _poisson_log_terms(q: float, tight: bool, eps_int: np.ndarray, n_rep: np.ndarray,
                       k: np.ndarray) -> np.ndarray:
    """The log terms of :func:`_poisson_generic_int`'s sum (``l = k``, orders ``n_rep``)."""
    log_q, log_1q = math.log(q), math.log1p(-q)
    # the bound minus 1, as a sum of non-negative terms (the binomial weights sum to 1):
    #   C(n,2) q^2 (1-q)^(n-2) (e^{eps(2)} - 1) + sum_{l>=3} C(n,l) q^l (1-q)^(n-l)
    #   (c e^{(l-1) eps(l)} - 1), so a small bound keeps its relative accuracy
    with np.errstate(invalid="ignore"):
        cgf = (k - 1) * eps_int[(k - 2).astype(np.int64)]
        if not tight:
            cgf = cgf + np.where(k >= 3, math.log(3.0), 0.0)
        log_c = _log_binom(n_rep, k)
        t_q = k * log_q
        t_1q = np.where(n_rep == k, 0.0, (n_rep - k) * log_1q)
        t_e = _log_expm1(cgf)
        terms = log_c + t_q + t_1q + t_e
        return terms + _term_margin(log_c, np.log1p(n_rep), t_q, t_1q, cgf, t_e)


def _fixed_generic_int(base: Mechanism, q: float, ns: np.ndarray,
                       log_pv: tuple[float, ...] | None = None) -> np.ndarray:
    """Wang, Balle & Kasiviswanathan (2019), Theorem 9, sampling a fixed-size subset
    without replacement (ratio q = m/n), replace-one neighbouring, integer orders n >= 2::

        (n-1) eps'(n) <= log( 1 + q^2 C(n,2) min{ 4 (e^{eps(2)} - 1),
                                                  e^{eps(2)} min{2, (e^{eps(inf)} - 1)^2} }
                              + sum_{j=3}^{n} q^j C(n,j) e^{(j-1) eps(j)}
                                              min{2, (e^{eps(inf)} - 1)^j} )

    With ``log_pv`` (log upper bounds on the forward differences ``D_k`` of the base's
    moments, :mod:`._rdp_wor_gaussian`; a Gaussian base) the ``j``-th term is also
    bounded by ``q^j C(n,j) 4 sqrt(D_{2 floor(j/2)} D_{2 ceil(j/2)})`` (their Theorem 27,
    as autodp's ``improved_bound_flag`` and dp_accounting).
    """
    return _sum_over_integer_orders(
        base, ns, functools.partial(_fixed_log_terms, base, q, log_pv))


def _fixed_log_terms(base: Mechanism, q: float, log_pv: tuple[float, ...] | None,
                     eps_int: np.ndarray, n_rep: np.ndarray, k: np.ndarray) -> np.ndarray:
    """The log terms of :func:`_fixed_generic_int`'s sum (``j = k``, orders ``n_rep``)."""
    eps_inf = pure_epsilon(base)
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
    log_q = math.log(q)
    with np.errstate(invalid="ignore"):
        cgf = (k - 1) * eps_int[(k - 2).astype(np.int64)]
        higher = cgf + np.minimum(math.log(2.0), k * log_em1)
        if log_pv is not None:
            lp = np.asarray(log_pv, dtype=float)
            kk = k.astype(np.int64)
            lo_i, hi_i = 2 * (kk // 2), 2 * ((kk + 1) // 2)
            inside = hi_i < lp.size
            a = np.where(inside, lp[np.minimum(lo_i, lp.size - 1)], np.inf)
            b = np.where(inside, lp[np.minimum(hi_i, lp.size - 1)], np.inf)
            unknown = (a == np.inf) | (b == np.inf)
            pv = np.where(unknown, np.inf, math.log(4.0) + 0.5 * (a + b))
            higher = np.minimum(higher, pv)
        log_c = _log_binom(n_rep, k)
        t_q = k * log_q
        t_m = np.where(k == 2, log_two, higher)
        return log_c + t_q + t_m + _term_margin(log_c, np.log1p(n_rep), t_q, t_m, cgf)


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

    def rdp(self, mechanism: Mechanism, orders: float | Sequence[float]) -> float | np.ndarray:
        """The RDP curve of ``mechanism`` at ``orders`` (:func:`rdp_epsilon`)."""
        return rdp_epsilon(mechanism, orders)

    def _curve(self, mechanism: Mechanism):
        # fail early (and with the accountant's message) on unsupported mechanisms
        _rdp(mechanism, np.array([2.0]))
        return lambda a: _rdp(mechanism, np.asarray(a, dtype=float))

    def epsilon(self, mechanism: Mechanism, delta: float) -> PrivacyBound:
        delta = query_delta(delta)
        pure = pure_epsilon(mechanism)
        if delta == 0.0:
            if not isinstance(mechanism, Mechanism):
                raise ParameterTypeError(f"mechanism must be a Mechanism, got {mechanism!r}")
            self._curve(mechanism)
            return PrivacyBound(upper=pure, lower=None, accountant=self.name)
        eps = rdp_to_epsilon(self._curve(mechanism), delta, pure_epsilon=pure)
        if math.isnan(eps):  # pragma: no cover - defensive
            raise AccountingError("rdp: epsilon evaluated to NaN")
        return PrivacyBound(upper=eps, lower=None, accountant=self.name)

    def epsilon_and_order(self, mechanism: Mechanism, delta: float) -> tuple[float, float]:
        """``(epsilon, alpha)``: :meth:`epsilon`'s certified value (the same number) and
        the Renyi order whose conversion gives it
        (:func:`privlearn.accounting.conversion.rdp_to_epsilon_and_order`; ``inf`` when
        the pure epsilon is the answer). Google dp_accounting's
        ``get_epsilon_and_optimal_order`` and Opacus's ``get_privacy_spent``; an order
        at the edge of the searched range says the curve's optimum lies beyond it.

        Examples
        --------
        >>> from privlearn.accounting import Gaussian, compose, get_accountant, subsample
        >>> m = compose(subsample(Gaussian(1.1), rate=0.01), steps=1000)
        >>> eps, alpha = get_accountant("rdp").epsilon_and_order(m, 1e-5)
        """
        delta = query_delta(delta)
        if delta == 0.0:
            return self.epsilon(mechanism, delta).upper, math.inf
        return rdp_to_epsilon_and_order(self._curve(mechanism), delta,
                                        pure_epsilon=pure_epsilon(mechanism))

    def delta(self, mechanism: Mechanism, epsilon: float) -> PrivacyBound:
        epsilon = query_epsilon(epsilon)
        pure = pure_epsilon(mechanism)
        d = rdp_to_delta(self._curve(mechanism), epsilon, pure_epsilon=pure)
        if math.isnan(d):  # pragma: no cover - defensive
            raise AccountingError("rdp: delta evaluated to NaN")
        return PrivacyBound(upper=d, lower=None, accountant=self.name)


register_accountant(RDPAccountant())
