"""Numerical helpers of the Renyi-DP accountant (private; NumPy/SciPy only).

Log-space sums with certified rounding margins, the extension of integer-order bounds to
real orders, and the closed-form RDP curves of binary randomized response and the Laplace
mechanism that several kinds and the subsampling bounds share. See
:mod:`privlearn.accounting.rdp` for the references.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

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



def _clean_nan(x: np.ndarray) -> np.ndarray:
    return np.where(np.isnan(x), np.inf, x)
