"""FFT composition of discretised privacy loss distributions with certified error
terms (private helper of :mod:`privlearn.accounting.pld`).

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
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import fft as sfft

from privlearn.accounting._pld_grid import StepPMF, U
from privlearn.accounting._pld_tails import (
    _LAMBDAS_TAIL,
    chernoff_window,
    log_mgf,
    tail_bounds,
)
from privlearn.errors import AccountingError, ParameterValueError

__all__ = ["ComposedPLD", "compose_fft", "compose_fft_tilted", "discounted_tail_sums",
           "tilt_pmfs"]


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
        raise ParameterValueError(f"h must be a positive finite grid spacing, got {h!r}")
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
    #: exponential tilt of the composition (0: plain); with a tilt the grid covers only
    #: losses above ``j0 h`` and the error allowance depends on epsilon, see
    #: :func:`compose_fft_tilted` and :meth:`tilt_slack`
    tilt: float = 0.0
    log_tilt_slack: float = -math.inf

    def tilt_slack(self, eps):
        """Error allowance of a tilted composition at loss(es) ``eps`` (added to upper,
        subtracted from lower deltas): ``exp(log_tilt_slack - tilt eps)``, decreasing in
        ``eps``; 0 without a tilt. Scalars and arrays."""
        if self.tilt == 0.0:
            return 0.0 if np.ndim(eps) == 0 else np.zeros(np.shape(eps))
        x = np.minimum(self.log_tilt_slack - self.tilt * np.asarray(eps, dtype=float), 700.0)
        out = np.exp(x)
        return float(out) if np.ndim(eps) == 0 else out

    def chernoff_delta(self, eps: float) -> float:
        """Certified upper bound on ``delta(eps)`` of the composed (upper) grid pair:
        ``delta(eps) <= P(S > eps) + P(S = inf) <= min_lam E[e^{lam S}] e^{-lam eps} +
        inf`` (Chernoff), with the finite part's moment generating function from the
        single-step PMFs (rounded up). Independent of the FFT, hence of its error
        allowance; useful far in the tail, where that allowance dominates."""
        if self.pmfs is None:
            return 1.0
        tot = self._chernoff_log_mgf()
        with np.errstate(over="ignore", invalid="ignore"):  # a huge eps: k = -inf, bound 0
            k = tot - _LAMBDAS_TAIL * eps
        return min(1.0, math.exp(min(0.0, float(np.min(k)))) * (1 + 1e-12) + self.inf)

    def chernoff_epsilon(self, delta: float) -> float:
        """Certified upper bound on ``epsilon(delta)`` of the composed (upper) grid pair
        from the same Chernoff bound as :meth:`chernoff_delta`: the smallest ``eps`` with
        ``min_lam E[e^{lam S}] e^{-lam eps} + inf <= delta`` (the Renyi-divergence
        conversion of the pair itself, independent of the FFT and its allowance; ``inf``
        when the mass at infinity alone reaches delta or the PMFs are not kept)."""
        if self.pmfs is None:
            return math.inf
        room = delta - self.inf * (1 + 1e-12)
        if not room > 0.0:
            return math.inf
        tot = self._chernoff_log_mgf()
        # exp(K - lam eps) (1 + 1e-12) <= room  <=>  eps >= (K + log((1 + 1e-12)/room))/lam
        with np.errstate(over="ignore", invalid="ignore"):
            e = (tot + math.log1p(1e-12) - math.log(room)) / _LAMBDAS_TAIL
        e = e[np.isfinite(e)]
        if e.size == 0:
            return math.inf
        eps = float(np.min(e))
        return max(0.0, eps + 4.0 * U * abs(eps))

    def _chernoff_log_mgf(self) -> np.ndarray:
        """Upper bound on ``log E[e^{lam S}]`` at ``_LAMBDAS_TAIL`` from the single-step
        PMFs (block-aggregated, rounded up)."""
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
        return tot

    def prepare(self) -> None:
        if self.A is not None:  # prepared already (one composition shared, pi unchanged)
            return
        pi = self.pi
        rev = pi[::-1]
        A = np.concatenate([np.cumsum(rev)[::-1][1:], [0.0]])
        self.A, self.C = A, discounted_tail_sums(pi, self.h)

    def losses(self) -> np.ndarray:
        return (self.j0 + np.arange(self.pi.size)) * self.h


#: grid points of upper compositions kept for the other direction (32 MB)
_SHARED_POINTS = 1 << 22


def shared_uppers() -> Callable[..., ComposedPLD]:
    """:func:`compose_fft` of upper PMFs, memoised on the PMFs' identities and the window
    for one reuse: the two directions of fixed-size sampling compose the same
    symmetrised pair on the same windows (widened alike unless the lower pairs' tails
    differ), so within one composition (one grid) the second reads the first's results,
    the same objects. An entry is dropped once read; entries beyond
    :data:`_SHARED_POINTS` grid points are not kept (recomputed). The PMFs are held with
    their result, so their identities stay theirs."""
    memo: dict[tuple, tuple[list, ComposedPLD]] = {}

    def compose(pmfs: list[tuple[StepPMF, int]], h: float, a: float, b: float,
                lam_a: float, lam_b: float, accurate: bool) -> ComposedPLD:
        key = (tuple((id(p), c) for p, c in pmfs), h, a, b, lam_a, lam_b, accurate)
        hit = memo.pop(key, None)
        if hit is not None:
            return hit[1]
        cu = compose_fft(pmfs, h, a, b, lam_a, lam_b, upper=True, accurate=accurate)
        if sum(v.pi.size for _, v in memo.values()) + cu.pi.size <= _SHARED_POINTS:
            memo[key] = (list(pmfs), cu)
        return cu

    return compose


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
        n_low = int(big[-1]) + 1 if big.size else 0
        if any(math.fsum(pt[4]) <= 0 for pt in parts):
            n_low = 0

        # the direct formula works with |S + psi|^2 - 1 and loses its accuracy (and
        # underflows to log 0) where |phi_j| is small; such coefficients are not amplified
        # by a power either, so recompute only the prefix where every |phi_j| > 1/2
        for r, _lr, _count, _l1, _p in parts:
            small = np.nonzero(r[:n_low] <= 0.5)[0]
            if small.size:
                n_low = int(small[0])
        # its cost is n_low x (bulk size) sines per part (the tail of each PMF goes
        # through one more FFT, see below): bounded (the plain FFT error bound, larger
        # but certified, is kept beyond that)
        bulks = [_bulk_range(pt[4]) for pt in parts]
        nnz = sum(int(np.count_nonzero(pt[4][lo:hi])) for pt, (lo, hi) in
                  zip(parts, bulks, strict=True))
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
        for (r, lr, count, _l1, p), (b_lo, b_hi) in zip(parts, bulks, strict=True):
            # the bulk [b_lo, b_hi) directly; the tail (relative mass <= _TAIL_FRAC) by
            # one FFT, whose error (<= (5 log2 N + 16) u ||tail||_1 per coefficient,
            # phase factor and subtraction included) is absolute but on a small mass
            k = b_lo + np.nonzero(p[b_lo:b_hi])[0]
            pk = p[k]
            S_b = math.fsum(pk)
            c = int(round(float(np.sum(pk * k)) / S_b)) if S_b > 0 else (b_lo + b_hi) // 2
            kk = (k - c).astype(np.int64)
            tail = p.copy()
            tail[b_lo:b_hi] = 0.0
            S_t = math.fsum(tail)
            t1 = math.fsum(np.abs(tail))
            # S - 1, correctly rounded (S itself would carry an absolute error of u,
            # which the power turns into a relative error T u of every coefficient)
            sm1 = math.fsum(np.concatenate([p, [-1.0]]))
            re = np.empty(n_low)
            im = np.empty(n_low)
            B = np.empty(n_low)
            rows = max(16, int(2e6 // max(k.size, 1)))  # frequencies per block
            for j_start in range(0, n_low, rows):
                jb = jj[j_start : j_start + rows]
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
            tail_err = 0.0
            if t1 > 0.0:
                xt = np.zeros(N)
                xt[: tail.size] = tail
                ft = sfft.rfft(xt)[:n_low]
                # sum_tail p_k e^{-i w_j (k - c)}: the phase w_j c reduced exactly
                ph = (2.0 * math.pi / N) * np.mod(jj * (c % N), N)
                sh = ft * np.exp(1j * ph)
                re += sh.real - S_t
                im += sh.imag
                tail_err = (5.0 * log2n + 16.0) * t1
            a_ = sm1 + re  # S - 1 + Re psi
            ab = a_ * (a_ + 2.0)
            z = ab + im * im  # |S + psi|^2 - 1
            lphi = 0.5 * np.log1p(z)
            ang = np.arctan2(im, 1.0 + a_)
            absphi = np.exp(lphi)
            logr_low += count * lphi
            ang_low += count * ang
            phase_int = np.mod(phase_int + np.mod(jj * ((count * c) % N), N), N)
            nlog = math.log2(max(k.size, 2)) + 8.0
            # errors of Re psi and Im psi (|d re| + |d im| <= u (B nlog + 2 tail_err)) and
            # of S - 1 move log|phi| and arg phi by at most their sum over |phi| each;
            # forming z rounds by u (3 |a (a + 2)| + im^2 + |z|), i.e. log|phi| by that
            # over 2 |phi|^2; forming 1 + a rounds by u (1 + |a|), i.e. arg phi by that
            # times |im| / |phi|^2; log1p, arctan2 and the sums: the 4 (|lphi| + |ang|) term
            err_rel += count * U * (
                2.0 * (B * nlog + 2.0 * tail_err + abs(sm1)) / absphi
                + (3.0 * np.abs(ab) + im * im + np.abs(z)) / (2.0 * absphi * absphi)
                + np.abs(im) * (1.0 + np.abs(a_)) / (absphi * absphi)
                + 4.0 * (np.abs(lphi) + np.abs(ang)))
            # replace the FFT values of this part (used by the bounds below)
            r[:n_low] = absphi
            lr[:n_low] = lphi
        logr_tot[:n_low] = logr_low
        ang_tot[:n_low] = ang_low - (2.0 * math.pi / N) * phase_int
        # (+ 16 u: exp, cos, sin and the phase 2 pi m / N of the polar form)
        low_err = np.exp(logr_low) * (err_rel + 16.0 * U)
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


#: relative mass of a single-step PMF left out of the bulk of the direct low-frequency
#: recomputation (its FFT error, amplified like the bulk's, stays below the per-step
#: rounding allowance of the power: (5 log2 N + 16) x 1e-3 < 1 for N < 2^150)
_TAIL_FRAC = 1e-3


def _bulk_range(p: np.ndarray) -> tuple[int, int]:
    """Index range ``[lo, hi)`` of a PMF holding all but about ``_TAIL_FRAC`` of its
    absolute mass (half of it on each side): the part of
    :func:`compose_fft`'s direct low-frequency recomputation done term by term. Which
    range is chosen affects cost and tightness only; the error bound holds for any."""
    a = np.abs(p)
    cs = np.cumsum(a)
    tot = float(cs[-1]) if cs.size else 0.0
    if tot <= 0.0:
        return 0, p.size
    lo = int(np.searchsorted(cs, 0.5 * _TAIL_FRAC * tot, side="right"))
    hi = int(np.searchsorted(cs, (1.0 - 0.5 * _TAIL_FRAC) * tot, side="left")) + 1
    return min(lo, p.size - 1), max(min(hi, p.size), lo + 1)


def tilt_pmfs(pmfs: list[tuple[StepPMF, int]], h: float, theta: float
              ) -> tuple[list[tuple[StepPMF, int]], float]:
    """Exponentially tilted single-step PMFs ``p_k e^{theta l_k} / Z`` (finite part
    normalised to 1; the mass at infinity is kept as it is) and ``log M = sum count log Z``,
    the log moment generating function of the composed finite loss at ``theta``.

    Convolution commutes with the tilt: the composition of the tilted PMFs is the
    composed PMF times ``e^{theta l} / M``, so the composed masses are recovered as
    ``pi_l = pi~_l exp(log M - theta l)`` (Esscher transform; see
    :func:`compose_fft_tilted`)."""
    out = []
    log_m = 0.0
    for pmf, count in pmfs:
        p = pmf.p
        e = theta * (pmf.k0 + np.arange(p.size)) * h
        nz = p != 0
        if not np.any(p > 0):
            raise AccountingError("pld: a step has no finite privacy loss mass to tilt")
        m = float(e[nz].max())
        pt = p * np.exp(np.minimum(e - m, 0.0))
        z = math.fsum(pt)
        out.append((StepPMF(pmf.k0, pt / z, pmf.inf), count))
        log_m += count * (m + math.log(z))
    return out, log_m


def compose_fft_tilted(
    pmfs: list[tuple[StepPMF, int]],
    h: float,
    theta: float,
    tail_tol: float,
    upper: bool,
    accurate: bool = False,
    max_points: int = 1 << 22,
    refuse_above: int | None = None,
) -> ComposedPLD:
    """Composition of ``pmfs`` through the exponential tilt ``theta > 0`` (for tiny delta).

    ``refuse_above``: raise :class:`AccountingError` before composing when the tilted
    window needs more grid points than that (a refinement's cost bound). ``max_points``
    bounds the memory: a window above it is refused the same way, and the widening for
    the tails stops once it passes it.

    The plain FFT's round-off allowance is absolute (about ``u sqrt(N)`` times the total
    mass), which stops certification near delta ~ 1e-10 for long compositions. Here the
    PMFs are tilted by ``e^{theta l}`` (:func:`tilt_pmfs`), composed by :func:`compose_fft`
    on a window chosen for the *tilted* distribution (Chernoff bounds of the tilted PMFs),
    and untilted. Every error term of the tilted composition -- FFT round-off, the
    per-step rounding allowance, the tilted mass wrapped around the circle from either
    side -- is a tilted mass ``e_l`` at some loss ``l``; it moves the untilted profile
    ``delta(eps) = sum_{l > eps} pi_l (1 - e^{eps - l})`` by at most
    ``sum_{l > eps} e_l M e^{-theta l} <= M e^{-theta eps} sum_l e_l``. The untilted mass
    above the window is at most ``M e^{-theta top} P~(S > top) <= M e^{-theta eps}
    P~(S > top)``. Hence the certified allowance at ``eps`` is
    ``exp(log_tilt_slack - theta eps)`` (:meth:`ComposedPLD.tilt_slack`), with
    ``log_tilt_slack = log M + log(tilted allowances + 2 tilted tails + 8 u T)``: relative
    rather than absolute accuracy where delta is tiny. With ``theta`` at the Chernoff
    optimum for the target epsilon, ``M e^{-theta eps}`` is the Chernoff bound on
    ``P(S > eps)``, only a modest factor above delta, so the allowance stays about
    ``1e-13`` relative (Esscher 1932; the same device as saddle-point methods for
    privacy loss distributions, e.g. Alghamdi et al. 2023, "The Saddle-Point Method in
    Differential Privacy", ICML).

    The grid covers only the tilted window ``[j0 h, top]``: profiles at ``eps <= j0 h``
    are not available (:func:`~privlearn.accounting._pld_profile.delta_at` returns the
    trivial bounds there and ``eps_for_delta`` refuses).
    """
    if not (theta > 0.0 and math.isfinite(theta)):
        raise ParameterValueError(f"theta must be a positive finite tilt, got {theta!r}")
    tp, log_m = tilt_pmfs(pmfs, h, theta)
    a, b, la, lb = chernoff_window(tp, h, tail_tol)
    pad = 0.05 * (b - a) + 4 * h
    a, b = a - pad, b + pad
    if refuse_above is not None and (b - a) / h > refuse_above:
        raise AccountingError(f"pld: the tilted window needs {(b - a) / h:.3g} grid points, "
                              f"more than {refuse_above}")
    if (b - a) / h > max_points:
        # refused before any array is allocated: a heavy tilted tail (q=1e-6, sigma=0.3
        # under replace-one, 1e5 steps) asked for 3e8 points, some 20 GB
        raise AccountingError(f"pld: the tilted window needs {(b - a) / h:.3g} grid points, "
                              f"more than max_points={max_points}")
    for _ in range(6):
        c = compose_fft(tp, h, a, b, la, lb, upper=upper, accurate=accurate)
        if c.tails <= 1e3 * tail_tol or (b - a) / h > max_points:
            break
        w = b - a
        a, b = a - 0.25 * w, b + 0.25 * w
    T = sum(k for _, k in pmfs)
    expo = log_m - theta * c.losses()
    if float(np.max(expo)) > 700.0:
        raise AccountingError("pld: the tilted window reaches losses whose masses overflow "
                              "when untilted; the tilt is too large for this composition")
    pi = c.pi * np.exp(expo)
    if upper:
        coef = c.slack_up + c.tails + 8.0 * U * T  # t_hi + fft + single, + t_lo + t_hi
        return ComposedPLD(h, c.j0, pi, c.inf, c.tails, 0.0, 0.0, pmfs=list(pmfs),
                           tilt=theta, log_tilt_slack=log_m + math.log(coef))
    coef = c.slack_low + 8.0 * U * T
    return ComposedPLD(h, c.j0, pi, 0.0, c.tails, 0.0, 0.0, tilt=theta,
                       log_tilt_slack=log_m + math.log(coef))
