"""Certified discretisation and FFT composition of privacy loss distributions (private).

Discretisation (one step)
-------------------------
On the uniform loss grid ``e_i = (i0 + i) h`` (``X_i = exp(e_i)``) the exact single-step
profile ``delta(x) = P(L > log x) - x Q(L > log x)`` is convex in ``x = e^eps``.

* **Upper (dominating) pair** -- "connect the dots" (Doroshenko, Ghazi, Kamath, Kumar &
  Manurangsi 2022, PETS, Theorem 4.1 / Algorithm 1): the piecewise-linear interpolation
  of the exact profile at the ``X_i`` lies above the profile, and is the profile of the
  discrete pair obtained by splitting the mass of every loss interval ``(e_i, e_{i+1}]``
  between its two end points so that the mean likelihood ratio is preserved. The P-mass
  sent to ``X_{i+1}`` is ``e^h theta / rho`` of the interval's P-mass, where
  ``rho = P(I) / (Q(I) X_i)`` and ``theta = (rho - 1) / (e^h - 1)``. Mass beyond the last
  grid point is split between ``X_n`` and ``+inf`` the same way; mass left of the first
  point goes to ``X_0`` (its Q-remainder to loss ``-inf``, which never counts).

* **Lower (dominated) pair**. Coarsening the output to "which loss interval" is a
  post-processing, so its pair C is dominated by the true one (data processing). The
  profile of C agrees with the exact profile at every ``X_i`` and on each interval lies
  below the chord by a tent of height ``dX Q(I) theta (1 - theta)``. Lowering the left
  end point of the interval by ``L = P(I) - X_i Q(I)`` or its right end point by
  ``R = X_{i+1} Q(I) - P(I)`` puts the chord below that tent; we lower right end points
  left of ``eps = 0`` (values stay above ``1 - x``) and left end points right of it
  (values stay above 0). The greatest convex minorant of the lowered interpolant
  (pool-adjacent-violators on the slopes) is then a valid privacy profile below C's,
  i.e. the profile of a grid-supported pair dominated by C (Blackwell; Dong, Roth & Su
  2022, Proposition 2.12 and Theorem 2.10). Mass above the last grid point is dropped;
  removing outcomes, or lowering an outcome's P-mass at fixed Q-mass, can only decrease
  ``sum (p - e^eps q)_+`` of every product outcome, so such sub-probability PMFs still
  give lower bounds after composition. Composition preserves both orders (Dong, Roth &
  Su 2022, Theorem 3.2), so the composed upper and lower bounds are certified. The
  bias of both constructions is second order in ``h`` per step.

Composition
-----------
Distributions of the total loss are composed by one real FFT per part, a power per part
and one inverse FFT on a window ``[a, a + N h)``. The window is chosen from Chernoff
bounds computed from the discrete PMFs themselves (block-aggregated, which only
increases the moment generating function), so the mass wrapped around the circle is
certified to be below ``tail_tol`` on each side. Floating-point error of the FFT and of
the power is bounded per Fourier coefficient and converted to the time domain with
Parseval's identity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from scipy import fft as sfft
from scipy.optimize import isotonic_regression

from privlearn.accounting._pld_pairs import Pair
from privlearn.accounting._types import AccountingError

U = float(np.finfo(float).eps)  # unit roundoff (x2, conservative)
MAX_STEP_POINTS = 4_000_000
_CAND = np.concatenate([-np.geomspace(1e4, 1e-9, 160), [0.0], np.geomspace(1e-9, 1e4, 160)])


@dataclass
class StepPMF:
    """P-masses of a discrete single-step pair at losses ``(k0 + i) * h``."""

    k0: int
    p: np.ndarray
    inf: float  # P-mass at +inf loss


def _right_point(pair: Pair, tol: float) -> float:
    """A loss x with P(L > x) <= tol (scanned on a geometric grid)."""
    pg, _, _, _ = pair.tails(_CAND)
    ok = np.nonzero(pg <= tol)[0]
    if ok.size == 0:
        raise AccountingError("pld: privacy loss tail does not vanish below loss 1e4")
    return float(_CAND[ok[0]])


def _left_point(pair: Pair, tol: float) -> float:
    """A loss x with P(L <= x) <= tol."""
    _, pl, _, _ = pair.tails(_CAND)
    ok = np.nonzero(pl <= tol)[0]
    if ok.size == 0:
        raise AccountingError("pld: privacy loss lower tail does not vanish above -1e4")
    return float(_CAND[ok[-1]])


def loss_scale(pair: Pair) -> float:
    """Distance between the 10% and 90% quantiles of the loss under P (a grid-scale
    heuristic only; it affects speed and tightness, never certification)."""
    _, pl, _, _ = pair.tails(_CAND)
    i1 = int(np.searchsorted(pl, 0.1))
    i9 = int(np.searchsorted(pl, 0.9))
    i1 = min(max(i1, 0), _CAND.size - 1)
    i9 = min(max(i9, i1 + 1), _CAND.size - 1)
    return float(_CAND[i9] - _CAND[max(i1 - 1, 0)])


def loss_range(pair: Pair, tol: float) -> tuple[float, float]:
    lo = pair.loss_min if math.isfinite(pair.loss_min) else _left_point(pair, tol)
    hi = pair.loss_max if math.isfinite(pair.loss_max) else _right_point(pair, tol)
    return min(lo, 0.0), max(hi, 0.0)  # the grid always contains the loss 0


def _safe_ratio_log(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(num) - np.log(den)


def discretize(pair: Pair, h: float, tol: float) -> tuple[StepPMF, StepPMF]:
    """Upper (dominating) and lower (dominated) grid PMFs of one step; see module doc."""
    lo, hi = loss_range(pair, tol)
    if lo < -700.0 or hi > 700.0:
        raise AccountingError(
            f"pld: single-step privacy loss range [{lo:.4g}, {hi:.4g}] exceeds +-700 "
            "(the mechanism is essentially non-private); use a smaller epsilon target"
        )
    i0 = math.floor(lo / h) - 1
    i1 = math.ceil(hi / h) + 1
    n = i1 - i0
    if n > MAX_STEP_POINTS:
        raise AccountingError(f"pld: single-step grid too large ({n} points)")
    e = (i0 + np.arange(n + 1)) * h
    g = _grid_quantities(pair, e, h)
    pg, pl, qg, P_I, Q_I = g.pg, g.pl, g.qg, g.P_I, g.Q_I
    rho, theta = g.rho, g.theta
    w_right = np.clip(math.exp(h) * theta / rho, 0.0, 1.0)

    # ---------------- upper: connect the dots ----------------
    p_up = np.zeros(n + 1)
    p_up[:-1] += (1.0 - w_right) * P_I
    p_up[1:] += w_right * P_I
    P_L, P_R, Q_R = float(pl[0]), float(pg[-1]), float(qg[-1])
    p_up[0] += P_L
    if P_R > 0:
        frac = math.exp(min(0.0, math.log(Q_R) + e[-1] - math.log(P_R))) if Q_R > 0 else 0.0
        inf_up = P_R * (1.0 - frac)
        p_up[-1] += P_R * frac
    else:
        inf_up = 0.0
    up = StepPMF(i0, p_up, inf_up)

    # ---------------- lower: dominated grid pair ----------------
    # (the tent corrections ``d`` of the profile: see :func:`_grid_quantities`)
    eh, delta, d = g.eh, g.delta, g.d
    m = n
    X = np.exp(e[: m + 1])
    dX = X[:-1] * eh
    # slopes of g(x) - (1 - x) on segments [0, X_0], [X_0, X_1], ..., [X_{m-1}, X_m]
    # slopes of g on segments [0, X_0], [X_0, X_1], ..., [X_{m-1}, X_m]; computed from
    # small quantities so that the tiny Q-masses at large losses keep full precision
    sl = np.empty(m + 1)
    sl[0] = -qg[0] - (pl[0] + d[0]) / X[0]
    if m >= 2:
        s_delta = -qg[1:m] - theta[: m - 1] * Q_I[: m - 1]
        sl[1:m] = s_delta - (d[1:m] - d[: m - 1]) / dX[: m - 1]
    w_last = max(delta[m - 1] - d[m - 1], 0.0)
    sl[m] = -w_last / dX[m - 1]
    return up, _lower_pmf(sl, X, dX, i0)


def _lower_pmf(sl: np.ndarray, X: np.ndarray, dX: np.ndarray, i0: int) -> StepPMF:
    """Grid P-masses of ``max(gcm(g), 1 - x)`` from the slopes ``sl`` of ``g`` on the
    segments ``[0, X_0], [X_0, X_1], ..., [X_{m-1}, X_m]`` (g = 0 right of X_m).
    ``gcm`` is the greatest convex minorant (pool-adjacent-violators on the slopes)."""
    m = X.size - 1
    widths = np.concatenate([[X[0]], dX])
    sl = isotonic_regression(sl, weights=widths).x
    jumps = np.maximum(np.diff(np.concatenate([sl, [0.0]])), 0.0)  # Q-mass at X_0..X_m
    t = sl + 1.0  # slopes of F = g - (1 - x) (only used left of the crossing)
    F = np.cumsum(t * widths)  # F(X_k), k = 0..m
    tt = np.concatenate([t, [1.0]])
    p_low = np.zeros(m + 1)
    if t[0] < 0:
        # max(g, 1 - x) has one off-grid kink c where F returns to 0, carrying Q-mass
        # t[k]; it is moved down to the grid point X_{k-1} keeping its Q-mass and
        # lowering its P-mass (this can only decrease sum (p - e^eps q)_+), or dropped.
        pos = np.nonzero(F >= 0)[0]
        if pos.size == 0:
            return StepPMF(i0, np.zeros(1), 0.0)
        k = int(pos[0])
        x_prev = 0.0 if k == 0 else X[k - 1]
        F_prev = 0.0 if k == 0 else F[k - 1]
        c = x_prev - F_prev / t[k] if t[k] > 0 else X[k]
        if c >= X[k]:
            p_low[k] = X[k] * max(tt[k + 1], 0.0)
            first_kept = k + 1
        else:
            if k >= 1:
                p_low[k - 1] = X[k - 1] * t[k]
            first_kept = k
    else:
        first_kept = 0
    p_low[first_kept:] += X[first_kept:] * jumps[first_kept:]
    return StepPMF(i0, p_low, 0.0)


# ----------------------------------------------------------------------------------
# composition
# ----------------------------------------------------------------------------------

_LAMBDAS = np.geomspace(1e-3, 3e3, 48)
_LAMBDAS_TAIL = np.geomspace(1e-2, 1e9, 89)


def log_mgf(
    pmfs: list[tuple[StepPMF, int]], h: float, lam: np.ndarray, upper_tail: bool
) -> np.ndarray:
    """Upper bound on ``log E[exp(lam S)]`` (``upper_tail``) or ``log E[exp(-lam S)]`` of
    the finite part of ``S = sum of independent losses`` (rounded up)."""
    tot = np.zeros_like(lam)
    for pmf, count in pmfs:
        keep = pmf.p > 0
        if not np.any(keep):
            return np.full_like(lam, -np.inf)
        ls = np.log(pmf.p[keep])
        loss = (pmf.k0 + np.nonzero(keep)[0]) * h
        if not upper_tail:
            loss = -loss
        a = ls[None, :] + lam[:, None] * loss[None, :]
        mx = a.max(1)
        k = mx + np.log(np.exp(a - mx[:, None]).sum(1))
        tot += count * (k + 8 * U * (np.abs(k) + np.abs(mx) + 1.0))
    return tot


def chernoff_window(pmfs, h: float, tol: float) -> tuple[float, float, float, float]:
    """(a, b, lam_a, lam_b) with P(S < a) <= tol and P(S > b) <= tol (Chernoff bound
    ``P(S > b) <= exp(K(lam) - lam b)``, finite parts only)."""
    lt = math.log(tol)
    K_up = log_mgf(pmfs, h, _LAMBDAS, True)
    vb = (K_up - lt) / _LAMBDAS
    ib = int(np.argmin(vb))
    K_lo = log_mgf(pmfs, h, _LAMBDAS, False)
    va = (K_lo - lt) / _LAMBDAS
    ia = int(np.argmin(va))
    lo_sup = sum(c * pmf.k0 for pmf, c in pmfs) * h
    hi_sup = sum(c * (pmf.k0 + pmf.p.size - 1) for pmf, c in pmfs) * h
    return max(-float(va[ia]), lo_sup), min(float(vb[ib]), hi_sup), _LAMBDAS[ia], _LAMBDAS[ib]


def tail_bounds(pmfs, h: float, lo: float, hi: float, lam_a: float, lam_b: float):
    """Certified ``P(S < lo)`` and ``P(S > hi)`` from a few Chernoff exponents."""
    lo_sup = sum(c * pmf.k0 for pmf, c in pmfs) * h
    hi_sup = sum(c * (pmf.k0 + pmf.p.size - 1) for pmf, c in pmfs) * h
    mult = np.array([0.6, 1.0, 1.6])
    if hi >= hi_sup:
        t_hi = 0.0
    else:
        lam = lam_b * mult
        t_hi = float(np.exp(min(0.0, float(np.min(log_mgf(pmfs, h, lam, True) - lam * hi)))))
    if lo <= lo_sup:
        t_lo = 0.0
    else:
        lam = lam_a * mult
        t_lo = float(np.exp(min(0.0, float(np.min(log_mgf(pmfs, h, lam, False) + lam * lo)))))
    return t_lo * (1 + 1e-12), t_hi * (1 + 1e-12)


def discounted_tail_sums(pi: np.ndarray, h: float) -> np.ndarray:
    """``C_j = sum_{k > j} pi_k exp(-(k - j) h)`` for every j (``C_{N-1} = 0``).

    Equivalent to the recursion ``C_j = e^{-h} (C_{j+1} + pi_{j+1})`` but vectorised in
    blocks of ``B`` points with ``B h <= 50``: inside a block starting at ``s`` the sum
    over the block is ``e^{(j-s) h} sum_{j < k < s+B} pi_k e^{-(k-s) h}`` (one reverse
    cumulative sum; every scale factor lies in ``[e^-50, e^50]``, so nothing under- or
    overflows), and the contribution of later blocks is carried block by block as
    ``e^{-(s+B-1-j) h} C_{s+B-1}``. Each value is exact up to a relative rounding error of
    ``O(B u)`` of ``sum_{k > j} |pi_k| e^{-(k-j) h}``, like the recursion itself.
    """
    pi = np.asarray(pi, dtype=float)
    n = pi.size
    if n == 0:
        return np.zeros(0)
    if not (h > 0.0 and math.isfinite(h)):
        raise ValueError(f"h must be a positive finite grid spacing, got {h!r}")
    B = max(1, min(n, int(50.0 / h)))
    nb = -(-n // B)
    x = np.zeros(nb * B)
    x[:n] = pi
    x = x.reshape(nb, B)
    i = np.arange(B, dtype=float)
    down = np.exp(-i * h)  # e^{-(k-s) h}, k - s = 0..B-1
    up = np.exp(i * h)  # e^{(j-s) h}
    y = x * down[None, :]
    # within-block sums over k > j: reverse cumulative sum, shifted by one
    rc = np.cumsum(y[:, ::-1], axis=1)[:, ::-1]
    within = np.zeros_like(rc)
    within[:, :-1] = rc[:, 1:]
    within *= up[None, :]
    # carry: C at the last index of block b is e^{-h} (C_s' + pi_s') with s' the first
    # index of block b + 1; C in block b is within + e^{-(B-1-(j-s)) h} C_last(b)
    last_fac = down[::-1]  # e^{-(B-1-(j-s)) h}
    eh = math.exp(-h)
    carry = np.zeros(nb)  # C at the last index of each block
    for b in range(nb - 2, -1, -1):
        c_first_next = within[b + 1, 0] + last_fac[0] * carry[b + 1]
        carry[b] = eh * (c_first_next + x[b + 1, 0])
    C = within + carry[:, None] * last_fac[None, :]
    return C.reshape(-1)[:n]


@dataclass
class ComposedPLD:
    """Distribution of the composed loss on the window ``(j0 + j) h``, j = 0..N-1."""

    h: float
    j0: int
    pi: np.ndarray
    inf: float  # composed mass at +inf (upper only)
    tails: float  # certified P(S < window) + P(S > window)
    slack_up: float  # added to every upper delta
    slack_low: float  # subtracted from every lower delta
    A: np.ndarray | None = None  # A_j = sum_{k > j} pi_k
    C: np.ndarray | None = None  # C_j = sum_{k > j} pi_k exp(-(l_k - l_j))
    pmfs: list | None = None  # the composed single-step PMFs (upper only)

    def chernoff_delta(self, eps: float) -> float:
        """Certified upper bound on ``delta(eps)`` of the composed (upper) grid pair:
        ``delta(eps) <= P(S > eps) + P(S = inf) <= min_lam E[e^{lam S}] e^{-lam eps} +
        inf`` (Chernoff), with the finite part's moment generating function from the
        single-step PMFs (rounded up). Independent of the FFT, hence of its error
        allowance; useful far in the tail, where that allowance dominates."""
        if self.pmfs is None:
            return 1.0
        # block-aggregate each PMF to at most 4096 points, every block's mass moved to
        # the block's largest loss (this only increases E[e^{lam S}] for lam > 0)
        agg = []
        for pmf, count in self.pmfs:
            n = pmf.p.size
            w = max(1, -(-n // 4096))
            nb = -(-n // w)
            x = np.zeros(nb * w)
            x[:n] = np.maximum(pmf.p, 0.0)
            agg.append((StepPMF(0, x.reshape(nb, w).sum(1), 0.0), count, pmf.k0 + w - 1, w))
        # losses of block b: (k0 + w - 1 + b w) h; log_mgf needs a single h per PMF, so
        # evaluate each part separately with its own block spacing
        tot = np.zeros_like(_LAMBDAS_TAIL)
        for a_pmf, count, k_top, w in agg:
            part = StepPMF(0, a_pmf.p, 0.0)
            kk = log_mgf([(part, count)], w * self.h, _LAMBDAS_TAIL, True)
            shift = count * _LAMBDAS_TAIL * (k_top * self.h)
            tot += kk + shift + 4 * U * np.abs(shift)
        k = tot - _LAMBDAS_TAIL * eps
        return min(1.0, math.exp(min(0.0, float(np.min(k)))) * (1 + 1e-12) + self.inf)

    def prepare(self) -> None:
        pi = self.pi
        rev = pi[::-1]
        A = np.concatenate([np.cumsum(rev)[::-1][1:], [0.0]])
        self.A, self.C = A, discounted_tail_sums(pi, self.h)

    def losses(self) -> np.ndarray:
        return (self.j0 + np.arange(self.pi.size)) * self.h


def compose_fft(
    pmfs: list[tuple[StepPMF, int]],
    h: float,
    a: float,
    b: float,
    lam_a: float,
    lam_b: float,
    upper: bool,
    accurate: bool = False,
) -> ComposedPLD:
    """Compose the parts on the circular window of losses ``(j0 + j) h``, j < N, with
    ``j0 = floor(a / h)``; error terms are certified (see module docstring).

    With ``accurate``, the low-frequency coefficients, whose forward-FFT error would be
    amplified about ``T``-fold by the power, are recomputed directly as
    ``phi_j = e^{-i w_j c} (S + psi_j)`` with ``psi_j = sum_k p_k (e^{-i w_j (k-c)} - 1)``
    (c the rounded mean index), which has error relative to ``|psi_j|`` rather than to
    ``||p||_1``; the phase ``w_j T c`` is reduced exactly in integer arithmetic."""
    j0 = math.floor(a / h)
    N = sfft.next_fast_len(max(math.ceil(b / h) - j0 + 1, 16), real=True)
    top = (j0 + N - 1) * h
    t_lo, t_hi = tail_bounds(pmfs, h, j0 * h, top, lam_a, lam_b)
    T_tot = sum(c for _, c in pmfs)
    if T_tot == 1:  # a single step needs no FFT: its PMF, wrapped onto the same circle
        (pmf, _), = [(pm, c) for pm, c in pmfs if c > 0]
        pi = np.zeros(N)
        np.add.at(pi, (pmf.k0 - j0 + np.arange(pmf.p.size)) % N, pmf.p)
        single_allow = 8.0 * U
        if upper:
            return ComposedPLD(
                h, j0, pi, min(1.0, pmf.inf), t_lo + t_hi, t_hi + single_allow, 0.0,
                pmfs=list(pmfs),
            )
        return ComposedPLD(h, j0, pi, 0.0, t_lo + t_hi, 0.0, t_lo + t_hi + single_allow)
    total_offset = 0
    log_fin = 0.0  # log P(every step's loss is finite)
    log2n = math.log2(N)
    logr_tot = np.zeros(N // 2 + 1)
    ang_tot = np.zeros(N // 2 + 1)
    parts = []
    for pmf, count in pmfs:
        p = pmf.p
        x = np.zeros(N)
        if p.size <= N:
            x[: p.size] = p
        else:
            np.add.at(x, np.arange(p.size) % N, p)
        total_offset += count * pmf.k0
        phi = sfft.rfft(x)
        r = np.abs(phi)
        with np.errstate(divide="ignore"):
            lr = np.log(r)
        logr_tot += count * lr
        ang_tot += count * np.angle(phi)
        parts.append((r, lr, count, float(np.abs(p).sum()), p))
        log_fin += count * math.log1p(-min(pmf.inf, 1.0 - U))
    n_low = 0
    if accurate and all(pt[4].size <= N for pt in parts):
        # number of low frequencies whose amplified FFT error is not negligible
        amp = np.zeros(N // 2 + 1)
        for r, _lr, count, l1, _p in parts:
            amp += count * l1 * np.divide(np.exp(logr_tot), r, out=np.zeros_like(r), where=r > 0)
        # (only coefficients whose error the power amplifies: never for a single step)
        l1_tot = sum(pt[2] * pt[3] for pt in parts)
        big = np.nonzero((amp * 5.0 * U * log2n > 1e-19) & (amp > 2.0 * l1_tot / T_tot))[0]
        n_low = min(int(big[-1]) + 1, 256) if big.size else 0
        if any(math.fsum(pt[4]) <= 0 for pt in parts):
            n_low = 0
        # the direct formula works with |S + psi|^2 - 1 and loses its accuracy (and
        # underflows to log 0) where |phi_j| is small; such coefficients are not amplified
        # by a power either, so recompute only the prefix where every |phi_j| > 1/2
        for r, _lr, _count, _l1, _p in parts:
            small = np.nonzero(r[:n_low] <= 0.5)[0]
            if small.size:
                n_low = int(small[0])
        # its cost is n_low x (support size) sines per part: bounded (the plain FFT error
        # bound, larger but certified, is kept beyond that)
        nnz = sum(int(np.count_nonzero(pt[4])) for pt in parts)
        n_low = min(n_low, int(3e7 // max(nnz, 1)))
        if n_low:
            # worth it only if those coefficients carry most of the FFT error allowance
            absP0 = np.exp(logr_tot)
            err0 = np.zeros_like(absP0)
            for r, _lr, count, l1, _p in parts:
                mrel = np.divide(absP0, r, out=np.zeros_like(absP0), where=r > 0)
                err0 += count * l1 * mrel
            e2 = err0 * err0
            if float(np.sum(e2[:n_low])) < 0.75 * float(np.sum(e2)):
                n_low = 0
    low_err = np.zeros(n_low)
    if n_low:
        jj = np.arange(n_low)
        phase_int = np.zeros(n_low, dtype=np.int64)
        logr_low = np.zeros(n_low)
        ang_low = np.zeros(n_low)
        err_rel = np.zeros(n_low)
        for r, lr, count, _l1, p in parts:
            k = np.nonzero(p)[0]
            pk = p[k]
            S = math.fsum(pk)
            c = int(round(float(np.sum(pk * k)) / S))
            kk = (k - c).astype(np.int64)
            re = np.empty(n_low)
            im = np.empty(n_low)
            B = np.empty(n_low)
            for j_start in range(0, n_low, 16):
                jb = jj[j_start : j_start + 16]
                # theta_jk = 2 pi ((j (k - c)) mod N) / N in (-pi, pi]
                m = np.mod(jb[:, None] * kk[None, :], N)
                m = np.where(m > N // 2, m - N, m)
                th = (2.0 * math.pi / N) * m
                s1 = np.sin(th)
                s2 = np.sin(0.5 * th)
                s2 = 2.0 * s2 * s2
                sl_ = slice(j_start, j_start + jb.size)
                re[sl_] = -np.sum(s2 * pk[None, :], axis=1)
                im[sl_] = -np.sum(s1 * pk[None, :], axis=1)
                B[sl_] = np.sum((s2 + np.abs(s1)) * pk[None, :], axis=1)
            z = (S - 1.0 + re) * (S + 1.0 + re) + im * im  # |S + psi|^2 - 1
            lphi = 0.5 * np.log1p(z)
            ang = np.arctan2(im, S + re)
            absphi = np.exp(lphi)
            logr_low += count * lphi
            ang_low += count * ang
            phase_int = np.mod(phase_int + np.mod(jj * ((count * c) % N), N), N)
            nlog = math.log2(max(k.size, 2)) + 8.0
            err_rel += count * U * ((B * nlog + 1.0) / absphi + 4.0 * (np.abs(lphi) + np.abs(ang)))
            # replace the FFT values of this part (used by the bounds below)
            r[:n_low] = absphi
            lr[:n_low] = lphi
        logr_tot[:n_low] = logr_low
        ang_tot[:n_low] = ang_low - (2.0 * math.pi / N) * phase_int
        low_err = np.exp(logr_low) * (err_rel + 8.0 * U)
        if not (np.all(np.isfinite(low_err)) and np.all(np.isfinite(logr_low))):
            raise AccountingError("pld: direct low-frequency recomputation failed")
    # Phi = prod phi_p^count in polar form (cheaper and no less accurate than exp(log))
    absP = np.exp(logr_tot)
    spec = np.empty(N // 2 + 1, dtype=complex)
    spec.real = absP * np.cos(ang_tot)
    spec.imag = absP * np.sin(ang_tot)
    # per-coefficient error bound: forward-FFT error (<= 5 u log2 N ||p||_1 per
    # coefficient) amplified by the power (|d phi^T| <= T |Phi| / |phi| |d phi|), plus the
    # error of the polar power (<= |Phi| T u (|log|phi|| + 8)); Parseval converts the
    # spectrum error to an l2 bound in time, and sum_{k in S} |e_k| <= sqrt(N) ||e||_2.
    err = 8 * U * absP
    for r, lr, count, l1, _ in parts:
        mrel = np.divide(absP, r, out=np.zeros_like(absP), where=r > 0)
        err += count * (5.0 * U * log2n * l1) * mrel
        lra = np.where(np.isfinite(lr), -lr, 0.0)
        err += (count * U) * absP * (np.abs(lra) + 8.0)
    if n_low:
        err[:n_low] = low_err  # directly computed coefficients: their own bound
    l2_err = math.sqrt(2.0 * float(np.sum(err * err)))
    l2_spec = math.sqrt(2.0 * float(np.sum(absP * absP)))
    fft_allow = l2_err + 5.0 * U * log2n * l2_spec  # = sqrt(N) * ||e||_2
    pi = sfft.irfft(spec, n=N)
    pi = np.roll(pi, -((j0 - total_offset) % N))
    # single-step masses carry rounding errors of a few ulps of the cumulative tails they
    # are differences of; by summation by parts each step's profile moves by at most a
    # few ulps, and composition adds these (first order): 8 U per step.
    single_allow = 8.0 * U * T_tot
    if upper:
        inf_mass = min(1.0, -math.expm1(log_fin) * (1 + 8 * U * T_tot))
        return ComposedPLD(
            h, j0, pi, inf_mass, t_lo + t_hi, t_hi + fft_allow + single_allow, 0.0,
            pmfs=list(pmfs),
        )
    return ComposedPLD(h, j0, pi, 0.0, t_lo + t_hi, 0.0, t_lo + t_hi + fft_allow + single_allow)


class _GridQuantities(NamedTuple):
    pg: np.ndarray  # P(L > e_i), P(L <= e_i), Q(L > e_i), Q(L <= e_i) at the grid points
    pl: np.ndarray
    qg: np.ndarray
    ql: np.ndarray
    P_I: np.ndarray  # P and Q masses of the intervals (e_i, e_{i+1}]
    Q_I: np.ndarray
    eh: float  # e^h - 1
    rho: np.ndarray  # e^{-e_i} P(I) / Q(I), clipped to [1, e^h]
    theta: np.ndarray  # (rho - 1) / (e^h - 1)
    delta: np.ndarray  # the profile delta(e_i)
    d: np.ndarray  # lowering of the grid points that keeps the lower pair dominated


def _grid_quantities(pair: Pair, e: np.ndarray, h: float) -> _GridQuantities:
    """Interval masses, in-interval ratios and the profile on the grid ``e``, and the
    tent corrections ``d`` of the dominated (lower) pair.

    On interval i the profile is the chord minus a tent of height base_i theta_i
    (1 - theta_i) peaking at X_i + theta_i dX_i. The chord falls below the tent if the
    left end point is lowered by L_i = base_i theta_i = P(I) - X_i Q(I) or the right one
    by R_i = base_i (1 - theta_i) = X_{i+1} Q(I) - P(I). Intervals left of eps = 0 lower
    their right end (then every value stays >= 1 - x, because delta(X) - (1 - X) =
    E_Q[(X - e^L)_+] >= R), intervals right of it lower their left end (then every value
    stays >= 0, because delta(X_i) >= L_i). Left of X_0 (segment from (0, 1)) the left
    tail needs X_0 lowered by Q_L X_0 - P_L; right of X_n, g = 0 <= profile of C.
    """
    pg, pl, qg, ql = (np.asarray(a, dtype=float) for a in pair.tails(e))
    # interval masses of (e_i, e_{i+1}], each from the side with less cancellation
    P_I = np.maximum(np.where(pl[1:] < 0.5, pl[1:] - pl[:-1], pg[:-1] - pg[1:]), 0.0)
    Q_I = np.maximum(np.where(ql[1:] < 0.5, ql[1:] - ql[:-1], qg[:-1] - qg[1:]), 0.0)
    eh = math.expm1(h)
    with np.errstate(over="ignore", invalid="ignore"):
        rho = np.exp(_safe_ratio_log(P_I, Q_I) - e[:-1])
    rho = np.where(P_I > 0, np.where(Q_I > 0, rho, math.inf), 1.0)
    rho = np.clip(np.nan_to_num(rho, nan=1.0, posinf=math.exp(h)), 1.0, math.exp(h))
    theta = np.clip((rho - 1.0) / eh, 0.0, 1.0)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        frac_d = np.exp(np.minimum(0.0, np.log(qg) + e - np.log(pg)))
    delta = np.maximum(np.where(pg > 0, pg * (1.0 - np.nan_to_num(frac_d, nan=0.0)), 0.0), 0.0)
    base = P_I * eh / rho  # = Q(I) * dX_i
    i0 = int(round(e[0] / h))
    n = e.size - 1
    s0 = -i0  # grid index of eps = 0 (1 <= s0 <= n - 1)
    X0 = math.exp(e[0])
    d = np.zeros(n + 1)
    d[0] = max(float(ql[0]) * X0 - float(pl[0]), 0.0)
    R_low = base * (1.0 - theta)
    L_low = base * theta
    d[1 : s0 + 1] = R_low[:s0]
    d[s0] = max(d[s0], L_low[s0])
    d[s0 + 1 : n] = L_low[s0 + 1 : n]
    d[n] = delta[n]  # g(X_n) = 0
    return _GridQuantities(pg, pl, qg, ql, P_I, Q_I, eh, rho, theta, delta, d)


def _interval_quantities(pair: Pair, e: np.ndarray, h: float):
    g = _grid_quantities(pair, e, h)
    w = np.maximum(g.delta - g.d, 0.0)
    om = g.pl + np.exp(e) * g.qg + g.d  # 1 - w without cancellation
    return w, om


def discretize_symmetrised(pa: Pair, pb: Pair, h: float, tol: float) -> tuple[StepPMF, StepPMF]:
    """Pair whose profile is ``max(delta_a, delta_b)`` (a valid, convex profile: the
    profile of the trade-off function ``min{f_a, f_b}**``; Dong, Roth & Su 2022,
    Theorem 9 for sampling without replacement).

    Upper: connect-the-dots of the max profile, masses from its slope changes. Lower: the
    dominated grid pair of ``pa`` alone (``delta_a <= max(delta_a, delta_b)``).
    """
    lo_a, hi_a = loss_range(pa, tol)
    lo_b, hi_b = loss_range(pb, tol)
    lo, hi = min(lo_a, lo_b), max(hi_a, hi_b)
    if lo < -700.0 or hi > 700.0:
        raise AccountingError("pld: single-step privacy loss range exceeds +-700")
    i0 = math.floor(lo / h) - 1
    i1 = math.ceil(hi / h) + 1
    n = i1 - i0
    if n > MAX_STEP_POINTS:
        raise AccountingError(f"pld: single-step grid too large ({n} points)")
    e = (i0 + np.arange(n + 1)) * h
    X = np.exp(e)
    vals = []
    for pr in (pa, pb):
        pg, pl, qg, ql = pr.tails(e)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            fr = np.exp(np.minimum(0.0, np.log(qg) + e - np.log(pg)))
        dl = np.where(pg > 0, pg * (1.0 - np.nan_to_num(fr, nan=0.0)), 0.0)
        one_minus = pl + X * qg  # 1 - delta, without cancellation
        vals.append((np.maximum(dl, 0.0), one_minus))
    delta = np.maximum(vals[0][0], vals[1][0])
    om = np.minimum(vals[0][1], vals[1][1])
    dX = X[:-1] * math.expm1(h)
    # slope on each segment, from the representation with less cancellation
    s = np.where(delta[:-1] < 0.5, (delta[1:] - delta[:-1]) / dX, -(om[1:] - om[:-1]) / dX)
    s0 = -om[0] / X[0]
    s_all = np.concatenate([[s0], s, [0.0]])
    q_mass = np.maximum(np.diff(s_all), 0.0)
    p_up = X * q_mass
    up = StepPMF(i0, p_up, float(delta[-1]))
    # lower: on each interval take the lowered interpolant of one pair (the one larger at
    # both ends, or pair a where they cross); at a grid point shared by intervals with
    # different choices take the smaller value. Each chord then lies below the profile
    # of one coarsened pair, hence below max(delta_a, delta_b).
    wa, oma = _interval_quantities(pa, e, h)
    wb, omb = _interval_quantities(pb, e, h)
    use_b = (wb[:-1] > wa[:-1]) & (wb[1:] > wa[1:])  # choice per interval
    ch_left = np.concatenate([[use_b[0]], use_b])  # choice of the interval left of point
    ch_right = np.concatenate([use_b, [use_b[-1]]])
    w = np.minimum(np.where(ch_left, wb, wa), np.where(ch_right, wb, wa))
    om = np.maximum(np.where(ch_left, omb, oma), np.where(ch_right, omb, oma))
    sl = np.empty(n + 1)
    sl[0] = -om[0] / X[0]
    dw = np.where(w[:-1] < 0.5, w[1:] - w[:-1], om[:-1] - om[1:])
    sl[1:] = dw / dX
    return up, _lower_pmf(sl, X, dX, i0)
