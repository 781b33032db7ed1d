"""Numerical helpers of the Renyi-DP accountant (private; NumPy/SciPy only).

Log-space sums with certified rounding margins, the extension of integer-order bounds to
real orders, and the closed-form RDP curves of binary randomized response and the Laplace
mechanism that several kinds and the subsampling bounds share. See
:mod:`privlearn.accounting.rdp` for the references.
"""

from __future__ import annotations

import functools
import math

import numpy as np

_ULP = float(np.finfo(float).eps)
#: Largest integer order at which O(alpha) sums are evaluated; above it the subsampled
#: bound falls back to the (valid, looser) base-mechanism RDP.
MAX_SUM_ORDER = 1 << 17
#: Largest non-integer order evaluated with the fractional series of Mironov et al.;
#: above it the cumulant is interpolated between integers (valid by convexity).
MAX_FRACTIONAL_SERIES_ORDER = 256.0


def _rr_rdp(eps: float, alphas: np.ndarray) -> np.ndarray:
    """RDP of binary randomized response with ``P(truth) = e^eps / (1 + e^eps)``.

    ``D_alpha = log(p^alpha (1-p)^(1-alpha) + (1-p)^alpha p^(1-alpha)) / (alpha - 1)``,
    the exact Renyi divergence between the two output distributions
    (:func:`_randomized_response_divergence`). Every eps-DP mechanism is a
    post-processing of it (Kairouz, Oh & Viswanath 2015, Thm 2.1), so by the
    data-processing inequality this bounds the RDP of every eps-DP mechanism; it is also
    at most ``eps`` (Mironov 2017, Prop. 3).
    """
    if math.isinf(eps):
        return np.full_like(alphas, np.inf)
    if eps == 0.0:
        return np.zeros_like(alphas)
    log_p = -math.log1p(math.exp(-eps))  # log(e^eps / (1 + e^eps))
    val = _randomized_response_divergence(log_p, log_p - eps, math.tanh(eps / 2.0), eps, 0.0,
                                          alphas)
    return np.minimum(val, eps)


def _randomized_response_divergence(log_p: float, log_r: float, p_minus_r: float,
                                    log_ratio: float, rest: float,
                                    alphas: np.ndarray) -> np.ndarray:
    """Renyi divergence ``log(p^a r^(1-a) + r^a p^(1-a) + rest) / (a - 1)`` between two
    randomized-response output distributions (truth probability ``p = e^log_p``, another
    given output ``r = e^log_r``, ``rest = 1 - p - r`` on the outputs where they agree),
    rounded up.

    The argument is ``1 + z``, ``z = (p - r) u + p phi(u) + r phi(-u)``, ``u = (a - 1)
    log(p/r)``, ``phi(u) = e^u - 1 - u >= 0``: every term is non-negative, so a divergence
    near 0 (``p`` near ``r`` or ``a`` near 1) keeps its relative precision; ``u > 600``
    uses log-sum-exp. ``p_minus_r`` and ``log_ratio`` must be accurate to a few ulps.
    """
    a = np.asarray(alphas, dtype=float)
    p, r = math.exp(log_p), math.exp(log_r)  # r may underflow: its terms are then < 1e-300
    u = (a - 1.0) * log_ratio
    near = u <= 600.0
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        un = np.where(near, u, 0.0)
        z = p_minus_r * un + p * _expm1_minus_x(un) + r * _expm1_minus_x(-un)
        v_near = np.log1p(z) / (a - 1.0) * (1.0 + 64 * _ULP)
        # a log p + (1 - a) log r = log r + a log(p/r), and symmetrically: the large
        # products a log p, a log r never appear (their rounding is ~a ulps)
        lp, lr = log_p, log_r
        terms = [lr + a * log_ratio, lp - a * log_ratio]
        if rest > 0.0:
            terms.append(np.full_like(a, math.log(rest)))
        v_far = _logsumexp(np.stack(terms), axis=0) / (a - 1)
        v_far = v_far + 8 * _ULP * (np.abs(a * log_ratio) + abs(lp) + abs(lr) + 1.0) / (a - 1)
    return np.maximum(np.where(near, v_near, v_far), 0.0)


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
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        s = np.add.reduceat(np.exp(x - np.repeat(m_safe, lengths)), starts)
        out = m_safe + np.log(s)
    return np.where(np.isposinf(m), np.inf, out)


#: Below this ``min(k, n - k)``, ``log C(n, k)`` is the logarithm of the exact integer.
_EXACT_BINOM_EDGE = 32


def _stirling_remainder(x: np.ndarray) -> np.ndarray:
    """``log Gamma(x + 1) - ((x + 1/2) log x - x + log(2 pi) / 2)`` for ``x >= 32``: the
    Stirling series to the ``x^-9`` term (alternating with decreasing terms, so the
    first omitted one, ``691 / (360360 x^11) < 2e-19``, bounds the truncation error)."""
    r = 1.0 / (x * x)
    return (1.0 / 12 - r * (1.0 / 360 - r * (1.0 / 1260 - r * (1.0 / 1680 - r / 1188)))) / x


@functools.lru_cache(maxsize=512)
def _log_binom_edge(n: int) -> np.ndarray:
    """``log C(n, j)`` for ``j < _EXACT_BINOM_EDGE`` (and ``j <= n``) from exact integers."""
    return np.array([math.log(math.comb(n, j)) for j in range(min(n, _EXACT_BINOM_EDGE - 1) + 1)])


def _log_binom(n: np.ndarray, k: np.ndarray) -> np.ndarray:
    """``log C(n, k)`` for integers ``0 <= k <= n``, to a few ulps of
    ``|log C(n, k)| + log(n + 1) + 1`` (:func:`_log_binom_margin`) at every size.

    ``min(k, n - k) < 32``: the logarithm of the exact integer. Otherwise Stirling's
    formula with its remainder series (:func:`_stirling_remainder`), written without
    cancellation between large terms, ``k log(n/k) - (n-k) log1p(-k/n) + log(n / (2 pi k
    (n-k))) / 2 + r(n) - r(k) - r(n-k)`` (differences of ``gammaln`` or ``betaln`` lose
    ``n log n`` ulps: 1e-10 at ``n = 65536``, enough to make a small Renyi divergence come
    out below its true value).
    """
    n, k = np.broadcast_arrays(np.asarray(n, dtype=float), np.asarray(k, dtype=float))
    kk = np.minimum(k, n - k)
    out = np.zeros(n.shape)
    big = kk >= _EXACT_BINOM_EDGE
    if big.any():
        nb, kb = n[big], kk[big]
        mb = nb - kb
        out[big] = (kb * np.log(nb / kb) - mb * np.log1p(-kb / nb)
                    + 0.5 * np.log(nb / (kb * mb)) - 0.5 * math.log(2.0 * math.pi)
                    + _stirling_remainder(nb) - _stirling_remainder(kb)
                    - _stirling_remainder(mb))
    small = ~big & (kk > 0)
    if small.any():
        ns, ks = n[small], kk[small].astype(np.int64)
        vals = np.empty(ns.shape)
        for u in np.unique(ns).tolist():
            sel = ns == u
            vals[sel] = _log_binom_edge(int(u))[ks[sel]]
        out[small] = vals
    return out


def _term_margin(*parts: np.ndarray) -> np.ndarray:
    """Upper bound on the floating-point error of a log-space term formed by adding
    ``parts`` (each computed to a few ulps of its magnitude; a ``log C(n, k)`` of
    :func:`_log_binom` passed with its ``log(n + 1) + 1`` allowance). Infinite parts
    contribute nothing: they make the term infinite anyway."""
    mag = 1.0
    for p in parts:
        p = np.asarray(p, dtype=float)
        mag = mag + np.where(np.isfinite(p), np.abs(p), 0.0)
    return 16.0 * _ULP * mag


def _log_expm1(x: np.ndarray) -> np.ndarray:
    """``log(e^x - 1)`` for ``x >= 0`` without overflow (``-inf`` at 0, ``inf`` at inf)."""
    x = np.asarray(x, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(np.isposinf(x), np.inf, x + np.log(-np.expm1(-x)))


def _sum_margin(logsum: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Upper bound on the floating-point error of a log-sum-exp of ``count`` terms
    (0 where the sum is infinite or empty)."""
    logsum = np.asarray(logsum, dtype=float)
    margin = _ULP * (2.0 * np.log2(count + 1.0) + 8.0) + 4.0 * _ULP * np.abs(logsum)
    return np.where(np.isfinite(logsum), margin, 0.0)


def _log1p_of_log(log_x: np.ndarray) -> np.ndarray:
    """``log(1 + x)`` from ``log x`` (``x >= 0``), rounded up by a relative margin: a
    Renyi moment ``A = 1 + x`` summed as its excess ``x`` over 1, so a tiny divergence
    keeps its relative accuracy."""
    return np.logaddexp(0.0, log_x) * (1.0 + 8.0 * _ULP)


# ----------------------------------------------------------------------------------------

def _expm1_minus_x(u: np.ndarray) -> np.ndarray:
    """``e^u - 1 - u`` (>= 0) to a few ulps of its value: Taylor series ``sum_{k>=2}
    u^k / k!`` in Horner form for ``|u| < 1/2`` (the omitted terms are below 1e-22 of
    the value), ``expm1(u) - u`` above, where at most two bits cancel."""
    u = np.asarray(u, dtype=float)
    small = np.abs(u) < 0.5
    us = np.where(small, u, 0.0)
    acc = np.ones_like(us)
    for k in range(22, 2, -1):
        acc = 1.0 + us * acc / k
    with np.errstate(over="ignore"):
        big = np.expm1(np.where(small, 0.0, u)) - u
    return np.where(small, 0.5 * us * us * acc, big)


def _laplace_rdp(b: float, alphas: np.ndarray) -> np.ndarray:
    """Mironov (2017), Proposition 6 (Table II), for scale b and sensitivity 1
    (``eps = 1/b``)::

        eps(alpha) = log( alpha/(2 alpha - 1) exp((alpha-1) eps)
                          + (alpha-1)/(2 alpha - 1) exp(-alpha eps) ) / (alpha - 1)

    The argument of the logarithm is ``1 + z`` with ``z = (alpha phi((alpha-1) eps) +
    (alpha-1) phi(-alpha eps)) / (2 alpha - 1)``, ``phi(u) = e^u - 1 - u >= 0`` (the
    first-order terms cancel exactly), so ``log1p(z) / (alpha - 1)`` keeps full relative
    precision for a small ``eps`` or an order near 1 (where the divergence is about
    ``alpha eps^2 / 2``); for ``(alpha - 1) eps > 600`` the form above is evaluated with
    ``logaddexp``. Rounded up (``eps`` rounded up first: the divergence increases with
    it) and capped at its ``alpha -> inf`` limit ``eps``.
    """
    eps = float(np.nextafter(1.0 / b, np.inf))
    a = np.asarray(alphas, dtype=float)
    am1 = a - 1.0
    near = am1 * eps <= 600.0
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        an = np.where(near, a, 2.0)
        z = (an * _expm1_minus_x((an - 1.0) * eps) + (an - 1.0) * _expm1_minus_x(-an * eps)) / (
            2.0 * an - 1.0)
        v_near = np.log1p(z) / (an - 1.0) * (1.0 + 32 * _ULP)
        af = np.where(near, 1e3, a)
        t1 = np.log(af / (2 * af - 1)) + (af - 1) * eps
        t2 = np.log((af - 1) / (2 * af - 1)) - af * eps
        v_far = np.logaddexp(t1, t2) / (af - 1)
        v_far = v_far + 8 * _ULP * (np.abs(t1) + np.abs(t2) + 1.0) / (af - 1)
    return np.minimum(np.where(near, v_near, v_far), eps)


def _clean_nan(x: np.ndarray) -> np.ndarray:
    return np.where(np.isnan(x), np.inf, x)


#: the smallest positive normal float64; below it a result has an absolute error of up
#: to half of the smallest subnormal instead of a relative one
_FLOAT_MIN = float(np.finfo(float).tiny)


def round_up_tiny(values: np.ndarray) -> np.ndarray:
    """``values`` (non-negative upper bounds whose computation rounded each operation
    to nearest, relative margins included) with every entry below the normal range
    raised by two subnormal ulps: there a rounding is absolute (up to half the smallest
    subnormal, ``2**-1075``) and not covered by a relative margin, and a positive
    divergence that underflowed to 0 would claim no privacy loss at all. The smallest
    result is ``2 * 2**-1074``, never 0."""
    v = np.array(values, dtype=float)
    small = ~(v >= _FLOAT_MIN)  # 0, subnormal (and NaN, left as it is below)
    small &= ~np.isnan(v)
    if small.any():
        v[small] = np.nextafter(np.nextafter(np.maximum(v[small], 0.0), np.inf), np.inf)
    return v


def gaussian_rdp_upper(alphas: np.ndarray, sigma: float) -> np.ndarray:
    """``alpha / (2 sigma^2)``, the Gaussian mechanism's Renyi divergence of order
    ``alpha`` (Mironov 2017, Proposition 7), rounded up, for every ``sigma``: above
    ``~1.3e154`` the square overflows to inf and the quotient would be 0 (no privacy
    loss), so it is computed as ``(alpha / sigma) / sigma / 2`` there, and a value below
    the normal range is rounded up by :func:`round_up_tiny` (never 0 for ``alpha > 0``:
    the true divergence is positive)."""
    a = np.asarray(alphas, dtype=float)
    with np.errstate(over="ignore", under="ignore", divide="ignore"):
        v = a / (2.0 * sigma * sigma) * (1 + 2 * _ULP)
        redo = ~(v >= _FLOAT_MIN)
        if np.any(redo):
            v = np.array(v, dtype=float)
            v[redo] = (a[redo] / sigma) / sigma * 0.5 * (1 + 4 * _ULP)
    return round_up_tiny(v)
