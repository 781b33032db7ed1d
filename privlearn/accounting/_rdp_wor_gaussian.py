"""Pearson-Vajda terms of the Gaussian mechanism for the improved bound on sampling
without replacement (private helper of :mod:`privlearn.accounting.rdp`).

Wang, Balle & Kasiviswanathan (2019), Theorem 27: for a mechanism whose RDP is attained
by one pair of neighbouring inputs at every order (the Gaussian mechanism), the ``j``-th
term (``j >= 3``) of their Theorem 9 may be replaced by ``4 sqrt(D_{2 floor(j/2)}
D_{2 ceil(j/2)})`` whenever smaller, where ``D_k`` is the ``k``-th forward difference at
0 of the moment sequence ``A_i = exp((i - 1) eps(i))`` (``A_0 = A_1 = 1``), i.e. the
Pearson-Vajda ``chi^k`` divergence ``E_Q[(P/Q - 1)^k]`` of the pair (autodp's
``improved_bound_flag`` and Google dp_accounting's sampling-without-replacement RDP use
it).

``D_k = sum_i (-1)^(k-i) C(k, i) A_i`` can cancel heavily (a large noise multiplier). Each
``D_k`` is first evaluated in floating point, its positive and negative terms summed
apart in log space with a bound on every rounding (:func:`_float_differences`); it is
kept where that bracket on ``log D_k`` is narrower than half the ``1e-12`` relative
margin the decimal evaluation adds, so it is never above the decimal value (at a small
noise multiplier the moments grow so fast that nothing cancels: every ``D_k``, in a
fraction of the time). The others are evaluated in decimal arithmetic at a precision
raised until a rigorous bound on the rounding error is below 1e-9 of the value; the
float returned is the logarithm of an upper bound. Orders whose difference cannot be
certified get ``inf`` (the caller keeps Theorem 9's term there).
"""

from __future__ import annotations

import decimal
import functools
import math

import numpy as np

from privlearn.accounting._rdp_math import _ULP, _term_margin

__all__ = ["gaussian_log_forward_differences", "MAX_IMPROVED_ORDER"]

#: Largest difference order evaluated (as autodp and dp_accounting: Theorem 27 up to 256).
MAX_IMPROVED_ORDER = 258
_MAX_DIGITS = 6000


@functools.lru_cache(maxsize=64)
def gaussian_log_forward_differences(sigma: float) -> tuple[float, ...]:
    """``log`` of certified upper bounds on ``D_k``, k = 0..MAX_IMPROVED_ORDER, for the
    Gaussian mechanism with noise multiplier ``sigma`` (``eps(i) = i / (2 sigma^2)``);
    ``-inf`` where ``D_k <= 0`` is certified, ``inf`` where no bound was certified."""
    n = MAX_IMPROVED_ORDER
    out = [math.inf] * (n + 1)
    two_s2 = decimal.Decimal(2.0 * sigma * sigma)  # exact: a float times 2 is exact
    if not (two_s2.is_finite() and two_s2 > 0):
        return tuple(out)
    # the largest exponent n (n - 1) / (2 sigma^2) sets the error of the moments A_i
    max_arg = n * (n - 1) / (2.0 * sigma * sigma)
    if not math.isfinite(max_arg):
        return tuple(out)
    out[0], out[1] = 0.0, -math.inf  # D_0 = A_0 = 1, D_1 = A_1 - A_0 = 0
    _decimal_differences(two_s2, max_arg, _float_differences(2.0 * sigma * sigma, n, out),
                         out)
    return tuple(out)


def _decimal_differences(two_s2: decimal.Decimal, max_arg: float, pending: list[int],
                         out: list[float]) -> None:
    """Fill ``out[k]`` for ``k`` in ``pending`` in decimal arithmetic (module docstring);
    ``max_arg`` bounds every exponent ``i (i - 1) / two_s2``."""
    n = MAX_IMPROVED_ORDER
    digits = 60 + n // 2 + int(math.log10(max_arg + 1.0))
    while pending and digits <= _MAX_DIGITS:
        ctx = decimal.Context(prec=digits, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN,
                              rounding=decimal.ROUND_HALF_EVEN)
        moments = [ctx.exp(ctx.divide(decimal.Decimal(i * (i - 1)), two_s2))
                   for i in range(max(pending) + 1)]
        # each term: the exponent's rounding (relative 10^(1-p), times the exponent
        # <= max_arg inside the exponential), the exponential's and the product's
        # (10^(1-p) each); the running sums add at most k + 1 roundings of magnitude at
        # most the sum of |terms|. Everything doubled for safety. Every operation on the
        # moments goes through ``ctx``: its exponent range holds e^(n^2 / (2 sigma^2))
        # for a small sigma, which the default context's overflows.
        unit = decimal.Decimal(10) ** (1 - digits)
        still = []
        for k in pending:
            total = decimal.Decimal(0)
            magnitude = decimal.Decimal(0)
            for i in range(k + 1):
                term = ctx.multiply(decimal.Decimal(math.comb(k, i)), moments[i])
                magnitude = ctx.add(magnitude, term)
                total = (ctx.add if (k - i) % 2 == 0 else ctx.subtract)(total, term)
            rel = 2 * unit * (decimal.Decimal(max_arg) + 4 + (k + 2))
            err = ctx.multiply(magnitude, rel)
            upper = ctx.add(total, err)
            if upper <= 0:
                out[k] = -math.inf
            elif err <= ctx.multiply(upper, decimal.Decimal("1e-9")):
                value = float(upper.ln(ctx))  # float rounding << the 1e-12 added
                out[k] = value + _DECIMAL_MARGIN * max(1.0, abs(value))
            else:
                still.append(k)
        pending = still
        digits *= 2


@functools.lru_cache(maxsize=1)
def _log_binomials(n: int) -> np.ndarray:
    """``log C(k, i)`` for ``0 <= i <= k <= n`` (0 elsewhere), ``(n + 1, n + 1)``: the
    logarithms of the exact integers (Pascal's triangle; each converted to the nearest
    float, below 2^1024 for ``n <= 1000``), to a few ulps of ``1 + |log C(k, i)|``."""
    out = np.zeros((n + 1, n + 1))
    row = [1]
    for k in range(n + 1):
        if k:
            row = [a + b for a, b in zip([0, *row], [*row, 0], strict=True)]
        out[k, : k + 1] = np.log(np.array(row, dtype=float))
    return out


#: The decimal evaluation's margin on ``log D_k`` (relative, at least absolute).
_DECIMAL_MARGIN = 1e-12


def _float_differences(two_s2: float, n: int, out: list[float]) -> list[int]:
    """Fill ``out[k]`` (k = 2..n) with ``log`` of a certified upper bound on ``D_k`` where
    floating point certifies it tightly; return the ``k`` left to the decimal evaluation.

    The terms ``C(k, i) A_i`` are formed in log space, ``t_i = log C(k, i) + i (i - 1) /
    two_s2``, each to within ``m_i`` (:func:`._rdp_math._term_margin`, which also covers
    the rounding of ``two_s2 = 2 sigma^2`` itself, ``|t_i|`` ulps at most); the positive
    (``k - i`` even) and negative ones are summed apart, scaled by the largest, with a
    relative error at most ``eta = 2 (max_i m_i + (k + 8) u)`` (``m_i`` with the
    rounding of ``t_i - M``, ``M = max_i t_i``; used only where ``eta < 1e-6``). So
    ``D_k e^-M`` lies in ``S+ - S- +- (eta + 4 u)(S+ + S-)``. ``D_k <= 0`` is certified
    (``-inf``) where the upper end is not positive; otherwise the value is kept where the
    logarithms of both ends, rounded outwards, are within half the decimal margin: it is
    then below the decimal evaluation's ``log D_k + 1e-12 max(1, |log D_k|)``."""
    ks = np.arange(2, n + 1, dtype=float)
    i = np.arange(n + 1, dtype=float)
    K, Ii = np.meshgrid(ks, i, indexing="ij")
    valid = Ii <= K
    Ic = np.where(valid, Ii, 0.0)
    log_c = _log_binomials(n)[2:]
    with np.errstate(invalid="ignore", over="ignore"):
        expo = (Ic * (Ic - 1.0)) / two_s2
        t = np.where(valid, log_c + expo, -np.inf)
        marg = np.where(valid, _term_margin(log_c, np.log1p(K) + 1.0, expo, expo), 0.0)
        top = np.max(t, axis=1, keepdims=True)
        # (the subtraction's rounding, u |t_i - M| at most, where the term is not 0)
        marg = marg + np.where(valid & np.isfinite(t - top), 2.0 * _ULP * np.abs(t - top), 0.0)
        scaled = np.where(valid, np.exp(t - top), 0.0)
        even = ((K - Ii) % 2 == 0) & valid
        pos = np.sum(np.where(even, scaled, 0.0), axis=1)
        neg = np.sum(np.where(even | ~valid, 0.0, scaled), axis=1)
        eta = 2.0 * (np.max(marg, axis=1) + (ks + 8.0) * _ULP) + 4.0 * _ULP
        diff = pos - neg
        # (terms below the normal range, 2^-1074 absolute each at most: 1e-300 in all)
        err = eta * (pos + neg) + 1e-300
        hi, lo = diff + err, diff - err
        m = top[:, 0]
        ok_hi = hi > 0
        log_hi = np.log(np.where(ok_hi, hi, 1.0))
        log_lo = np.log(np.where(lo > 0, lo, 1.0))
        slack = 8.0 * _ULP * (np.abs(m) + np.abs(log_hi) + np.abs(log_lo) + 1.0)
        up = m + log_hi + slack
        down = m + log_lo - slack
    tight = (lo > 0) & (eta < 1e-6) & np.isfinite(up) & np.isfinite(down) & (
        up - down <= 0.5 * _DECIMAL_MARGIN * np.maximum(1.0, np.minimum(np.abs(up),
                                                                        np.abs(down))))
    pending = []
    for j, k in enumerate(range(2, n + 1)):
        if not math.isfinite(float(m[j])):
            pending.append(k)
        elif not ok_hi[j] and math.isfinite(float(hi[j])) and eta[j] < 1e-6:
            out[k] = -math.inf
        elif tight[j]:
            out[k] = float(up[j])
        else:
            pending.append(k)
    return pending
