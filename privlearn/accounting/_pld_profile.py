"""Reading a composed privacy loss distribution (private helper of
:mod:`privlearn.accounting.pld`): certified ``delta(eps)`` and ``epsilon(delta)`` of the
composed grid pairs, with every error term added (upper) or subtracted (lower).

Between grid points the composed profile is ``A_j - e^eps C_j`` (``A`` the tail masses,
``C`` the discounted tail sums), so ``epsilon(delta)`` is solved exactly inside the grid
cell where the profile crosses the target, rounding the upper bound up and the lower bound
down; far in the tail, where the FFT error allowance would dominate, the upper delta uses
the Chernoff bound of the composed grid pair instead (see :mod:`privlearn.accounting.pld`,
Method, points 3 and 4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from privlearn.accounting import _pld_discrete as dsc
from privlearn.errors import CertificationError

__all__ = ["PLDResult", "delta_upper", "delta_at", "grid_gap", "eps_for_delta"]


@dataclass
class PLDResult:
    directions: list[tuple[dsc.ComposedPLD, dsc.ComposedPLD]]  # (upper, lower) per direction
    h: float
    window_points: int = 0  # grid points of the widest window (set where the FFT is skipped)

    def slack(self) -> float:
        return max(max(u.slack_up, lw.slack_low) for u, lw in self.directions)


def delta_upper(res: PLDResult, eps: float) -> float:
    """Certified upper delta: the worst direction. Where that direction's value is
    dominated by the FFT error allowance (far in the tail), its Chernoff bound is used
    instead, and the next direction considered."""
    ups = sorted(((delta_at(u, eps, True), i) for i, (u, _) in enumerate(res.directions)),
                 reverse=True)
    best = 0.0
    for up, i in ups:
        if up <= best:
            break
        c = res.directions[i][0]
        if c.slack_up > 0.01 * up:
            up = min(up, c.chernoff_delta(eps))
        best = max(best, up)
    return best


def delta_at(c: dsc.ComposedPLD, eps: float, upper: bool) -> float:
    h, j0, pi = c.h, c.j0, c.pi
    N = pi.size
    l0 = j0 * h
    if eps <= l0:
        if c.tilt:  # a tilted grid does not cover the losses below its window
            return 1.0 if upper else 0.0
        lk = (j0 + np.arange(N)) * h
        tail = float(np.sum(np.abs(pi)))
        val = float(np.sum(pi) - np.sum(pi * np.exp(eps - lk)))
    else:
        x = eps / h - j0  # inf for an epsilon near the float maximum: above the grid
        j = math.ceil(x) - 1 if x < N else N  # l_j < eps <= l_{j+1}
        if j >= N - 1:
            val, tail = 0.0, 0.0
        else:
            tail = float(c.A[j])
            val = float(c.A[j] - math.exp(eps - (j0 + j) * h) * c.C[j])
    rnd = 4.0 * N * dsc.U * abs(tail)  # summation roundoff of the cumulative sums
    ts = c.tilt_slack(eps)  # 0 unless the composition was tilted
    if upper:
        return min(1.0, max(val, 0.0) + rnd + c.inf + c.slack_up + ts)
    return max(0.0, val - rnd - c.slack_low - ts)


def grid_gap(res: PLDResult, eps: float) -> float:
    """Part of the gap between upper and lower delta that a finer grid can reduce (the
    difference of the composed grid profiles; error allowances excluded)."""
    gap = 0.0
    for u, low in res.directions:
        gap = max(gap, _delta_at_raw(u, eps) - _delta_at_raw(low, eps))
    return gap


def _delta_at_raw(c: dsc.ComposedPLD, eps: float) -> float:
    N = c.pi.size
    if eps <= c.j0 * c.h:
        lk = (c.j0 + np.arange(N)) * c.h
        return float(np.sum(c.pi) - np.sum(c.pi * np.exp(eps - lk)))
    x = eps / c.h - c.j0  # inf for an epsilon near the float maximum: above the grid
    if x >= N:
        return 0.0
    j = math.ceil(x) - 1
    if j >= N - 1:
        return 0.0
    return float(c.A[j] - math.exp(eps - (c.j0 + j) * c.h) * c.C[j])


def eps_for_delta(c: dsc.ComposedPLD, delta: float, upper: bool) -> float:
    h, j0 = c.h, c.j0
    A, C = c.A, c.C
    N = A.size
    if upper:
        extra = c.inf + c.slack_up
        if extra >= delta:
            raise CertificationError(
                f"pld: cannot certify delta={delta:g}: the certified error terms already sum "
                f"to {extra:.3g} (mass at infinity + window tails + roundoff); pass a delta "
                f"above {extra:.3g} (an (epsilon, delta)-DP part is certified only above "
                "its own delta, e.g. ApproxDP(1.0, 1e-6) at delta 2e-6), or use "
                "accountant='rdp' where the mechanism has an RDP curve"
            )
    else:
        extra = -c.slack_low
    # summation roundoff of the cumulative sums: relative <= N u (terms summed from the top)
    rnd = (4.0 * N * dsc.U) * A * (1.0 if upper else -1.0)  # absolute, per grid point
    if c.tilt:
        # the tilted allowance decreases in eps: its value at the cell's left end l_k
        # bounds it on the whole cell (added to upper, subtracted from lower deltas)
        ts = c.tilt_slack((j0 + np.arange(N)) * h)
        extra = extra + (ts if upper else -ts)
    vals = A - C + rnd + extra
    above = np.nonzero(vals > delta)[0]
    if above.size == 0 and c.tilt:
        # the certified delta is already below the target at the window's first loss
        # l0 (every loss below l0 adds nothing to delta(l0)): epsilon <= l0, certified;
        # a lower bound is not available below the window
        return max(j0 * h, 0.0) if upper else 0.0
    if above.size == 0:
        # the crossing is at or below the first grid loss l0
        l0 = j0 * h
        if l0 <= 0.0:
            return 0.0
        lk = (j0 + np.arange(N)) * h
        tot = float(np.sum(c.pi)) + extra - delta
        B = float(np.sum(c.pi * np.exp(-(lk - l0))))
        if tot <= 0 or B <= 0:
            return 0.0
        eps = l0 + math.log(tot / B)
        eps += (1.0 if upper else -1.0) * 4e-15 * max(1.0, abs(eps))
        return max(0.0, min(eps, l0))
    k = int(above[-1])
    if k >= N - 1:
        if upper:
            raise CertificationError("pld: epsilon lies beyond the composition window")
        return (j0 + N - 1) * h
    lk = (j0 + k) * h
    num = A[k] + rnd[k] + (extra[k] if np.ndim(extra) else extra) - delta
    if C[k] > 0 and num > 0:
        t = math.log(num / C[k])
        t = min(max(t, 0.0), h)
    else:
        t = h if upper else 0.0
    eps = lk + t
    if upper:
        eps = eps + 4e-15 * max(1.0, abs(eps)) + 1e-14 * h
        eps = min(eps, lk + h)
    else:
        eps = eps - 4e-15 * max(1.0, abs(eps)) - 1e-14 * h
    return max(eps, 0.0)
