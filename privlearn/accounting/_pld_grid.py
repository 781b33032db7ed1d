"""Certified discretisation of one step's privacy loss pair on a uniform loss grid
(private helper of :mod:`privlearn.accounting.pld`).

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from scipy.optimize import isotonic_regression

from privlearn.accounting._pld_grid_tail import rounded_down, rounded_up_tail
from privlearn.accounting._pld_pairs import Pair
from privlearn.errors import AccountingError, PrivacyLossOverflowError

U = float(np.finfo(float).eps)  # unit roundoff (x2, conservative)
MAX_STEP_POINTS = 4_000_000
#: single-step losses beyond +-X_LIMIT are not given likelihood ratios ``e^loss`` (which
#: overflow near 709): see :func:`discretize`
X_LIMIT = 690.0
#: losses scanned for the tails: 160 a side up to 1e4, then 24 more up to 1e6 (noise
#: multipliers down to ~7e-4; the grid beyond +-X_LIMIT is cut, see :func:`discretize`)
_CAND_SIDE = np.concatenate([np.geomspace(1e-9, 1e4, 160), np.geomspace(1e4, 1e6, 25)[1:]])
_CAND = np.concatenate([-_CAND_SIDE[::-1], [0.0], _CAND_SIDE])


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
        raise PrivacyLossOverflowError(
            "pld: the privacy loss tail does not vanish below loss 1e6 (the mechanism is "
            "essentially non-private)")
    return float(_CAND[ok[0]])


def _left_point(pair: Pair, tol: float) -> float:
    """A loss x with P(L <= x) <= tol."""
    _, pl, _, _ = pair.tails(_CAND)
    ok = np.nonzero(pl <= tol)[0]
    if ok.size == 0:
        raise PrivacyLossOverflowError(
            "pld: the privacy loss lower tail does not vanish above -1e6 (the mechanism is "
            "essentially non-private)")
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


def _loss_grid(lo: float, hi: float, h: float) -> tuple[int, int, np.ndarray]:
    """The uniform loss grid ``e_i = (i0 + i) h``, ``i = 0..n``, covering ``[lo, hi]`` with
    one spare point on each side: ``(i0, n, e)``. Refuses a loss range beyond +-700
    (``e^loss`` overflows) and grids above :data:`MAX_STEP_POINTS`."""
    if lo < -700.0 or hi > 700.0:
        raise PrivacyLossOverflowError(
            f"pld: single-step privacy loss range [{lo:.4g}, {hi:.4g}] exceeds +-700 "
            "(the mechanism is essentially non-private)"
        )
    i0 = math.floor(lo / h) - 1
    n = math.ceil(hi / h) + 1 - i0
    if n > MAX_STEP_POINTS:
        raise AccountingError(f"pld: single-step grid too large ({n} points)")
    # the spare points lie up to 2 h beyond the range: a grid as coarse as the windows of
    # very long compositions (h of order 1e8 at 1e15 steps) would put them past +-700
    if (i0 * h < -700.0) or ((i0 + n) * h > 700.0):
        raise PrivacyLossOverflowError(
            f"pld: loss grid [{i0 * h:.4g}, {(i0 + n) * h:.4g}] (spacing {h:.3g}) exceeds "
            "+-700 (e^loss overflows): the composition is too long for this accountant's "
            "grid; accountant='rdp' answers it")
    return i0, n, (i0 + np.arange(n + 1)) * h


def discretize(pair: Pair, h: float, tol: float) -> tuple[StepPMF, StepPMF]:
    """Upper (dominating) and lower (dominated) grid PMFs of one step; see module doc.

    A single-step loss range beyond ``+-`` :data:`X_LIMIT` (small noise multipliers,
    e.g. sigma 0.03: losses up to ~865), where the likelihood ratios ``e^loss`` of the
    construction overflow, is cut there (:mod:`._pld_grid_tail`): the P-mass left of
    ``-X_LIMIT`` goes to the first grid point (rounding losses up; the lower pair's
    first point is lowered as for any left tail), and past ``+X_LIMIT`` the upper pair
    rounds every interval's P-mass up to its right end on an extension of the grid,
    while the lower PMF rounds the P-mass of every interval down to its left end."""
    lo, hi = loss_range(pair, tol)
    # (the grid adds up to 2 h beyond the cut, which must stay inside +-700: a coarse
    # grid, as for long compositions, is cut earlier; beyond h ~ 300 it is refused)
    limit = min(X_LIMIT, 699.0 - 2.0 * h)
    top = None
    if limit > 100.0:
        lo = max(lo, -limit)
        if hi > limit:
            top, hi = hi, limit
    i0, n, e = _loss_grid(lo, hi, h)
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
    if top is not None:
        ext, inf_up = rounded_up_tail(pair, float(e[-1]), top, h, P_R, tol)
        p_up = np.concatenate([p_up, ext])
    elif P_R > 0:
        frac = math.exp(min(0.0, math.log(Q_R) + e[-1] - math.log(P_R))) if Q_R > 0 else 0.0
        inf_up = P_R * (1.0 - frac)
        p_up[-1] += P_R * frac
    else:
        inf_up = 0.0
    up = StepPMF(i0, p_up, inf_up)
    if top is not None:
        return up, StepPMF(i0, rounded_down(g.P_I, ext), 0.0)

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

    Upper: connect-the-dots of the max profile, masses from its slope changes. Lower: a
    grid pair whose profile is below the max profile (each interval's chord is below one
    pair's profile). It bounds one step only: no mechanism attains the max profile at
    every epsilon, so its composition is no lower bound on a composed mechanism's; the
    PLD accountant composes each direction's own dominated pair (:func:`discretize`)
    instead.
    """
    lo_a, hi_a = loss_range(pa, tol)
    lo_b, hi_b = loss_range(pb, tol)
    i0, n, e = _loss_grid(min(lo_a, lo_b), max(hi_a, hi_b), h)
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
