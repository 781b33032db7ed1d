"""RDP of the Poisson-subsampled Gaussian mechanism (private helper of
:mod:`privlearn.accounting.rdp`).

References
----------
.. [1] Mironov, Talwar & Zhang (2019), Renyi Differential Privacy of the Sampled Gaussian
       Mechanism, arXiv:1908.10530, Section 3 (integer and fractional alpha).
.. [2] van Erven & Harremoes (2014), Renyi Divergence and Kullback-Leibler Divergence,
       IEEE Trans. Inf. Theory, Theorem 11 (convexity used for interpolation).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy import special

from privlearn._renamed import renamed_keywords
from privlearn.accounting._rdp_math import (
    _ULP,
    MAX_FRACTIONAL_SERIES_ORDER,
    MAX_SUM_ORDER,
    _interpolate_integer_bound,
    _log1p_of_log,
    _log_binom,
    _log_expm1,
    _logsumexp,
    _segment_logsumexp,
    _segments,
    _sum_margin,
    _term_margin,
    gaussian_rdp_upper,
    round_up_tiny,
)

#: above this noise multiplier the series' exponents ``(k^2 - k) / (2 sigma^2)`` leave
#: the normal range (and ``sigma^2`` overflows from ``~1.3e154``): the curve is the
#: Gaussian's own, ``alpha / (2 sigma^2)``, an upper bound (subsampling never increases
#: a divergence), at most ``alpha * 5e-301``
_BASE_CURVE_SIGMA = 1e150

__all__ = ["subsampled_gaussian_rdp", "clear_cache"]


@renamed_keywords("subsampled_gaussian_rdp", q="sampling_rate", sigma="noise_multiplier",
                  alphas="orders")
def subsampled_gaussian_rdp(sampling_rate: float, noise_multiplier: float,
                            orders: np.ndarray) -> np.ndarray:
    """RDP of the Poisson-subsampled Gaussian mechanism (add/remove neighbouring).

    ``eps(alpha) = log(A_alpha) / (alpha - 1)`` with ``A_alpha`` the alpha-th moment of the
    likelihood ratio of ``(1-q) N(0, sigma^2) + q N(1, sigma^2)`` to ``N(0, sigma^2)``
    (Mironov, Talwar & Zhang 2019, Section 3):

    * integer alpha: ``A = sum_{k=0}^{alpha} C(alpha,k) (1-q)^(alpha-k) q^k
      exp((k^2 - k) / (2 sigma^2))`` (their Section 3.3), exact, summed as ``A - 1``
      (the terms k >= 2 with ``exp(.) - 1``) for relative precision at tiny rates;
    * fractional alpha <= :data:`MAX_FRACTIONAL_SERIES_ORDER`: their two-series expansion
      (Section 3.3, "fractional alpha"; as ``_compute_log_a_frac`` in TF-Privacy/Opacus),
      rearranged to sum ``A - 1`` for relative precision at tiny rates (:func:`_sg_frac`),
      until the tail, which alternates in sign with decreasing magnitude, is below 1e-11
      of ``A - 1``; the first omitted terms are added as an error bound. If the series
      cannot be summed reliably the interpolation below is used;
    * larger fractional alpha: linear interpolation of ``(alpha-1) eps(alpha)`` between
      neighbouring integers (valid by convexity, van Erven & Harremoes 2014 Thm 11).

    Results are rounded up by a bound on the floating-point error of the sums. ``q``,
    ``sigma`` and ``alphas`` (the keywords' former names, the paper's) are deprecated.
    """
    alphas = np.asarray(orders, dtype=float)
    flat = alphas.ravel()
    # memoised per (rate, sigma, orders): a composition's parts, an accountant's history
    # and the PLD accountant's order guess ask for the same curves again
    out = np.array(_subsampled_gaussian_curve(float(sampling_rate), float(noise_multiplier),
                                              tuple(flat.tolist())), dtype=float)
    return out.reshape(alphas.shape)


@functools.lru_cache(maxsize=4096)
def _subsampled_gaussian_curve(q: float, sigma: float, orders: tuple[float, ...]) -> tuple:
    """:func:`subsampled_gaussian_rdp` at the flat ``orders`` (memoised; a tuple); a value
    below the normal range is rounded up (:func:`round_up_tiny`: never 0)."""
    alphas = np.asarray(orders, dtype=float)
    if sigma >= _BASE_CURVE_SIGMA:
        return tuple(gaussian_rdp_upper(alphas, sigma).tolist())
    return tuple(round_up_tiny(np.asarray(_sg_curve(q, sigma, alphas))).tolist())


def _sg_curve(q: float, sigma: float, alphas: np.ndarray) -> tuple:
    """The curve of :func:`_subsampled_gaussian_curve` as computed, before the rounding
    of the values below the normal range."""
    out = np.empty_like(alphas)
    is_int = alphas == np.round(alphas)
    if is_int.any():
        out[is_int] = _sg_int(q, sigma, alphas[is_int])
    frac_idx = np.flatnonzero(~is_int)
    if frac_idx.size:
        series = frac_idx[alphas[frac_idx] <= MAX_FRACTIONAL_SERIES_ORDER]
        if series.size:
            out[series] = _sg_frac(q, sigma, alphas[series])
        interp_needed = []
        for i in frac_idx.tolist():
            if alphas[i] <= MAX_FRACTIONAL_SERIES_ORDER and not math.isnan(out[i]):
                continue
            v = (_sg_frac_absolute(q, sigma, float(alphas[i]))
                 if alphas[i] <= MAX_FRACTIONAL_SERIES_ORDER else None)
            if v is None:
                interp_needed.append(i)
            else:
                out[i] = v
        if interp_needed:
            idx = np.array(interp_needed)
            out[idx] = _interpolate_integer_bound(alphas[idx], lambda ns: _sg_int(q, sigma, ns))
    return tuple(out.tolist())


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
        # A - 1 = sum_{k>=2} C(n,k) (1-q)^(n-k) q^k (e^{(k^2-k)/(2 sigma^2)} - 1): the
        # binomial weights sum to 1 and the k = 0, 1 exponents are 0. Summing the excess
        # over 1 (all terms positive) keeps a small divergence's relative accuracy.
        n_rep, k, starts = _segments(n_ok, start=2)
        log_c = _log_binom(n_rep, k)
        t_q = k * math.log(q)
        t_1q = np.where(n_rep == k, 0.0, (n_rep - k) * math.log1p(-q))
        expo = (k * k - k) / (2.0 * sigma * sigma)
        t_e = _log_expm1(expo)
        terms = log_c + t_q + t_1q + t_e
        terms = terms + _term_margin(log_c, np.log1p(n_rep), t_q, t_1q, expo, t_e)
        log_am1 = _segment_logsumexp(terms, starts)
        log_a = _log1p_of_log(log_am1 + _sum_margin(log_am1, n_ok))
        out[ok] = np.minimum(log_a / (n_ok - 1), n_ok / (2 * sigma * sigma))
    return tuple(out.tolist())


def _sg_frac(q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """Fractional-alpha RDP from the series of Mironov, Talwar & Zhang (2019), Section 3.3,
    summed as the excess ``A_alpha - 1`` for relative precision at small rates; NaN where
    the series cannot be summed reliably (the caller then uses the absolute-precision form
    :func:`_sg_frac_absolute`, or else a valid interpolation bound).

    With ``L(x) = e^{(2x - 1) / (2 sigma^2)}``, ``X ~ N(0, sigma^2)``, ``z0 = sigma^2
    log(1/q - 1) + 1/2`` (where ``q L = 1 - q``) and ``w_i = binom(alpha, i) q^i
    (1-q)^(alpha-i)`` (which sum to 1 for ``q < 1/2``)::

        A - 1 = sum_{i>=1} w_i (E[L^i; X <= z0] - P(X <= z0))
                + sum_{i>=0} binom(alpha, i) s1_i - P(X > z0)

    where ``E[L^i; X <= z0] = e^{c_i} Phi((z0 - i) / sigma)``, ``c_i = (i^2 - i) / (2
    sigma^2)``, and ``s1_i`` is the second series of Mironov et al. For ``i <= z0`` the
    region-1 difference is written ``expm1(c_i) - (e^{c_i} Phi_c((z0 - i) / sigma) -
    Phi_c(z0 / sigma))`` (the bracket is ``E[L^i - 1; X > z0] >= 0``, with at most a factor
    ``(q / (1-q))^i`` cancelling), so the first-order cancellation in ``(1 + q (L - 1))^alpha
    - 1`` never reaches the floating-point sums. Each term is rounded on the safe side by a
    bound on its floating-point error; positive and negative terms are summed apart and
    their difference is rounded up by a bound that grows with their cancellation. The tail
    (two series alternating in sign with decreasing magnitudes) is bounded by the sum of
    their first omitted terms (for ``i > alpha`` both series' terms decrease: ``q L / (1-q)``
    is below 1 on ``X <= z0`` and above 1 on ``X > z0``), which is added; terms are added
    until that bound is below ``1e-11`` of ``A - 1`` (or ``2^16`` terms). All orders are
    summed at once.
    """
    alphas = np.asarray(alphas, dtype=float)
    out = np.full(alphas.shape, np.nan)
    if not q < 0.5:
        return out
    todo = np.arange(alphas.size)
    n_terms = int(math.ceil(float(alphas.max()))) + 64
    while todo.size:
        last = n_terms >= 1 << 16
        val, done = _sg_frac_pass(q, sigma, alphas[todo], n_terms, last)
        out[todo[done]] = val[done]
        todo = todo[~done]
        if last:
            break
        n_terms *= 4
    return out


def _sg_frac_pass(q: float, sigma: float, alphas: np.ndarray, n_terms: int,
                  last: bool) -> tuple[np.ndarray, np.ndarray]:
    """One pass of :func:`_sg_frac` with ``n_terms`` terms: (value or NaN, finished)."""
    s2 = sigma * sigma
    z0 = s2 * math.log(1.0 / q - 1.0) + 0.5
    b = z0 / sigma
    log_q, log_1q = math.log(q), math.log1p(-q)
    lphi_b, lphic_b = float(special.log_ndtr(b)), float(special.log_ndtr(-b))
    al = alphas[:, None]
    i = np.arange(n_terms + 1, dtype=float)[None, :]
    j = al - i
    log_c, err_c, sign = _binomial_table(alphas, n_terms)
    t_q, t_1q = i * log_q, j * log_1q
    c = (i * i - i) / (2 * s2)
    a_i = (z0 - i) / sigma
    split = (a_i >= 0.0) & (i >= 1)
    direct = ~split & (i >= 1)
    lphi_a, lphic_a = special.log_ndtr(a_i), special.log_ndtr(-a_i)
    log_w = log_c + t_q + t_1q
    # the error allowance of the weight parts, shared by the terms below (the additions of
    # _term_margin in its order: 1 + |err_c| + |t_q| + |t_1q| + ...)
    mag_w = 1.0 + _fin_abs(err_c) + _fin_abs(t_q) + _fin_abs(t_1q)
    # columns of the split (i <= z0) and direct (i > z0) terms, the tail column excluded:
    # each piece is formed on its own columns only (elsewhere it is zero)
    cols_s = np.flatnonzero(split[0, :-1])
    cols_d = np.flatnonzero(direct[0, :-1])
    cols_s2 = cols_s[cols_s >= 2]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        t_e = _log_expm1(c)
        x = c + lphic_a
        d = np.minimum(lphic_b - x, 0.0)
        rho = np.exp(d)
        bracket = x + np.log(-np.expm1(d))  # log(e^{c_i} Phi_c(a_i) - Phi_c(b))
        parts1 = (j * log_q, i * log_1q, (j * j - j) / (2 * s2),
                  special.log_ndtr((j - z0) / sigma))
        ls1 = log_c + sum(parts1)

        def margin(cols, *extra):
            mag = mag_w[:, cols]
            for p in extra:
                p = p[:, cols]
                mag = mag + np.where(np.isfinite(p), np.abs(p), 0.0)
            return 16.0 * _ULP * mag

        lw_s, lw_d = log_w[:, cols_s], log_w[:, cols_d]
        lw_s2 = log_w[:, cols_s2]
        # (log |term|, error bound, sign of the term relative to binom(alpha, i), columns)
        pieces = [
            (lw_s2 + t_e[:, cols_s2], margin(cols_s2, c, t_e), 1, cols_s2),
            (lw_s + bracket[:, cols_s], margin(cols_s, c, lphic_a, lphic_b + 0.0 * c)
             * ((1.0 + rho) / (1.0 - rho))[:, cols_s], -1, cols_s),
            (lw_d + c[:, cols_d] + lphi_a[:, cols_d], margin(cols_d, c, lphi_a), 1, cols_d),
            (lw_d + lphi_b, margin(cols_d, lphi_b + 0.0 * c), -1, cols_d),
            (ls1[:, :-1], _term_margin(err_c, *parts1)[:, :-1], 1, slice(0, -1)),
        ]
        # tail bound: the first omitted terms of the two alternating series
        ls0_end = log_w[:, -3:] + c[:, -3:] + lphi_a[:, -3:]
        tail = np.logaddexp(np.logaddexp(ls0_end[:, -1], ls1[:, -1]), log_w[:, -1] + lphi_b)
        tail = tail + _term_margin(err_c[:, -1], t_q[:, -1], t_1q[:, -1], c[:, -1],
                                   lphi_a[:, -1], *(p[:, -1] for p in parts1))
        lc_orig = np.logaddexp(ls0_end, ls1[:, -3:])  # log |term| of the plain series
        decreasing = (lc_orig[:, -1] <= lc_orig[:, -2]) & (lc_orig[:, -2] <= lc_orig[:, -3])
        pos_l, neg_l = [tail[:, None]], [np.full((alphas.size, 1), lphic_b - 16 * _ULP * (
            1.0 + abs(lphic_b)))]
        bad = np.zeros(alphas.size, dtype=bool)
        for lv, err, rel_sign, cols in pieces:
            shape = (alphas.size, sign[:, cols].shape[1])
            lv = np.broadcast_to(lv, shape)
            err = np.broadcast_to(err, shape)
            sg = rel_sign * sign[:, cols]
            bad |= np.isnan(lv).any(axis=1) | np.isposinf(lv).any(axis=1)
            live = np.isfinite(lv)
            pos_l.append(np.where(live & (sg > 0), lv + err, -np.inf))
            neg_l.append(np.where(live & (sg < 0), lv - err, -np.inf))
        pos = np.asarray(_logsumexp(np.concatenate(pos_l, axis=1), axis=1))
        neg = np.asarray(_logsumexp(np.concatenate(neg_l, axis=1), axis=1))
        bad |= ~np.isfinite(pos) | np.isnan(neg) | (neg >= pos - 1e-3)  # heavy cancellation
        r = np.exp(neg - pos)
        log_am1 = pos + np.log1p(-r)
        count = 5.0 * (n_terms + 1) + 2.0
        log_am1 = log_am1 + (_ULP * (2.0 * math.log2(count) + 8.0) * (1.0 + r) / (1.0 - r)
                             + 4 * _ULP * np.abs(log_am1))
        log_a = _log1p_of_log(log_am1)
        val = np.minimum(log_a / (alphas - 1.0), alphas / (2 * s2))
    converged = decreasing & (tail < log_am1 + math.log(1e-11))
    bad |= ~np.isfinite(val) | (last & ~decreasing)
    val = np.where(bad, np.nan, val)
    return val, bad | converged | last


def _fin_abs(p: np.ndarray) -> np.ndarray:
    """``|p|`` where finite, else 0 (a part's share of :func:`_term_margin`)."""
    return np.where(np.isfinite(p), np.abs(p), 0.0)


#: Largest table (orders x terms) of :func:`_binomial_table` kept in its memo.
_MEMO_TABLE_SIZE = 1 << 18


def _binomial_table(alphas: np.ndarray, n_terms: int) -> tuple[np.ndarray, ...]:
    """``log |binom(alpha, i)|``, its error allowance and its sign for ``i = 0..n_terms``
    (rows: ``alphas``). They depend on the orders alone, so the parts of a composition
    share them (memoised for tables up to :data:`_MEMO_TABLE_SIZE` entries)."""
    if alphas.size * (n_terms + 1) <= _MEMO_TABLE_SIZE:
        return _binomial_table_memo(tuple(alphas.tolist()), n_terms)
    return _binomial_table_compute(alphas, n_terms)


@functools.lru_cache(maxsize=8)
def _binomial_table_memo(alphas: tuple[float, ...], n_terms: int) -> tuple[np.ndarray, ...]:
    out = _binomial_table_compute(np.asarray(alphas, dtype=float), n_terms)
    for a in out:
        a.flags.writeable = False
    return out


def _binomial_table_compute(alphas: np.ndarray, n_terms: int) -> tuple[np.ndarray, ...]:
    al = alphas[:, None]
    i = np.arange(n_terms + 1, dtype=float)[None, :]
    j = al - i
    lgam_a = special.gammaln(al + 1.0)
    g_i, g_j = special.gammaln(i + 1.0), special.gammaln(j + 1.0)
    log_c = lgam_a - g_i - g_j
    # log |binom(alpha, i)| for i <= 2 without the cancellation of the gammaln difference
    log_c[:, 0] = 0.0
    log_c[:, 1] = np.log(alphas)
    log_c[:, 2] = np.log(alphas * (alphas - 1.0) / 2.0)
    err_c = np.abs(lgam_a) + np.abs(g_i) + np.abs(g_j)
    err_c[:, :3] = np.abs(log_c[:, :3])
    sign = special.gammasgn(j + 1.0)  # sign of binom(alpha, i)
    return log_c, err_c, sign


def _sg_frac_absolute(q: float, sigma: float, alpha: float) -> float | None:
    """Fractional-alpha series of Mironov, Talwar & Zhang (2019), Section 3.3,
    summed for ``A_alpha`` itself (absolute precision in ``log A``).

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
        g_i, g_j = special.gammaln(i + 1.0), special.gammaln(j + 1.0)
        log_c = lgam_a - g_i - g_j
        # log |binom(alpha, i)| for i <= 2 without the cancellation of the gammaln
        # difference (a few ulps of log Gamma(alpha + 1): 1e-12 at alpha = 256)
        log_c[0] = 0.0
        log_c[1] = math.log(alpha)
        log_c[2] = math.log(alpha * (alpha - 1.0) / 2.0)
        err_c = np.abs(lgam_a) + np.abs(g_i) + np.abs(g_j)
        err_c[:3] = np.abs(log_c[:3])
        sign = special.gammasgn(j + 1.0)  # sign of binom(alpha, i)
        parts0 = (i * log_q, j * log_1q, (i * i - i) / (2 * s2),
                  special.log_ndtr((z0 - i) / sigma))
        parts1 = (j * log_q, i * log_1q, (j * j - j) / (2 * s2),
                  special.log_ndtr((j - z0) / sigma))
        ls0 = log_c + sum(parts0)
        ls1 = log_c + sum(parts1)
        # each term rounded on the safe side (up where it adds, down where it subtracts)
        # by a bound on its floating-point error: a few ulps of each part's magnitude
        e0 = _term_margin(err_c, *parts0)
        e1 = _term_margin(err_c, *parts1)
        tail_up = float(np.logaddexp(ls0[-1] + e0[-1], ls1[-1] + e1[-1]))
        ls0 = ls0 + np.where(sign > 0, e0, -e0)
        ls1 = ls1 + np.where(sign > 0, e1, -e1)
        lc = np.logaddexp(ls0, ls1)  # log |c_i|
        if np.isnan(lc).any() or np.isposinf(lc).any():
            return None
        body, sg, tail = lc[:-1], sign[:-1], tail_up
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


def clear_cache() -> None:
    """Clear the memoised integer-order curves (for honest cold-start timings)."""
    _subsampled_gaussian_int.cache_clear()
    _subsampled_gaussian_curve.cache_clear()
    _binomial_table_memo.cache_clear()
