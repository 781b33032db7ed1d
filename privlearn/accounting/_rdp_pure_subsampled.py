"""Exact Renyi-DP of subsampled pure-DP mechanisms (private; NumPy only).

Every ``eps``-DP mechanism is a post-processing of binary randomized response with the
same ``eps`` (Kairouz, Oh & Viswanath 2015, Theorem 2.1), and subsampling commutes with
post-processing, so the Renyi divergences of a subsampled ``eps``-DP mechanism are at
most those of subsampled randomized response (data-processing inequality, van Erven &
Harremoes 2014, Theorem 9), after the usual reduction of the subsampled mechanism to a
mixture over coupled subsets (joint quasi-convexity, their Theorem 13; Balle, Barthe &
Gaboardi 2018, Section 5). The divergences of the resulting finite pairs are computed
exactly, at every real order, in both directions:

* :func:`poisson_randomized_response_rdp` -- Poisson sampling, add/remove: the pairs
  ``((1-q) P + q Q, P)`` and ``(P, (1-q) P + q Q)`` of the randomized-response pair
  ``(P, Q)``. At integer orders the first is the binomial expansion of Zhu & Wang (2019),
  Section 3 (their lower bound, here attained); the second needs no factor 3 (their
  Theorem 6) because the pair is known.
* :func:`fixed_pure_dp_rdp` -- a fixed-size batch drawn without replacement,
  replace-one: the pair ``((1-q) A + q B, (1-q) A + q B')`` of three pairwise
  ``eps``-close distributions (the coupling of Wang, Balle & Kasiviswanathan 2019,
  proof of Theorem 9). The likelihood vectors ``(A, B, B')(z)`` lie in a cone with six
  extreme rays; ``x -> x0^a x1^(1-a)`` is convex and positively homogeneous, so the
  Renyi moment is at most a linear function of the rays' weights, maximised at a vertex
  of a three-constraint polytope, which is enumerated (at most 20 vertices). The
  vertex is itself such a triple, so the bound is attained by some mechanism.

Each divergence ``log(sum_i m_i (1 + y_i)^a) / (a - 1)`` is summed as its excess
``sum_i m_i psi(y_i, a)``, ``psi(y, a) = (1 + y)^a - 1 - a y >= 0`` (the first-order
terms cancel exactly because ``sum_i m_i y_i = 0``), so a divergence near 0 (small rate
or small ``eps``) keeps its relative precision; large orders use log-sum-exp. Results are
rounded up by a bound on their floating-point error; where a value would underflow or
is not finite, ``inf`` is returned (the caller's other bounds then apply).

References
----------
.. [1] Kairouz, Oh & Viswanath (2015), The Composition Theorem for Differential Privacy,
       ICML, Theorem 2.1.
.. [2] van Erven & Harremoes (2014), Renyi Divergence and Kullback-Leibler Divergence,
       IEEE Trans. Inf. Theory, Theorems 9 (data processing) and 13 (quasi-convexity).
.. [3] Zhu & Wang (2019), Poisson Subsampled Renyi Differential Privacy, ICML.
.. [4] Wang, Balle & Kasiviswanathan (2019), Subsampled Renyi Differential Privacy and
       Analytical Moments Accountant, AISTATS, Theorem 9.
.. [5] Balle, Barthe & Gaboardi (2018), Privacy Amplification by Subsampling: Tight
       Analyses via Couplings and Divergences, NeurIPS.
"""

from __future__ import annotations

import functools
import itertools
import math
from fractions import Fraction

import numpy as np

from privlearn.accounting._rdp_math import _expm1_minus_x, _logsumexp

_ULP = float(np.finfo(float).eps)
#: Excesses below this are not trusted (subnormal range): the bound returns ``inf``.
_TINY = 1e-280


def _log1p_minus_x(x: np.ndarray) -> np.ndarray:
    """``log(1 + x) - x`` (<= 0) to a few ulps of its value for ``x > -1``: the series
    ``sum_{k>=2} (-1)^(k+1) x^k / k`` in Horner form for ``|x| < 1/4`` (the omitted terms
    are below 1e-18 of the value), ``log1p(x) - x`` above (at most 3 bits cancel)."""
    x = np.asarray(x, dtype=float)
    small = np.abs(x) < 0.25
    xs = np.where(small, x, 0.0)
    acc = np.zeros_like(xs)
    for k in range(32, 1, -1):
        acc = (1.0 / k) - xs * acc
    with np.errstate(divide="ignore", invalid="ignore"):
        big = np.log1p(np.where(small, 0.0, x)) - np.where(small, 0.0, x)
    return np.where(small, -xs * xs * acc, big)


def discrete_renyi(
    masses: np.ndarray, y: np.ndarray, log1p_y: np.ndarray, alphas: np.ndarray
) -> np.ndarray:
    """``D_a(X0 || X1)`` of finite distributions, rounded up, at orders ``a > 1``.

    ``X1 = masses`` (summing to 1) and ``X0 = masses * (1 + y)`` (so ``sum m y = 0``);
    ``log1p_y`` is ``log(1 + y)`` to a few ulps (given so that a huge ``y`` keeps it).
    Outcomes are the leading axis of ``masses``, ``y`` and ``log1p_y``.
    """
    a = np.asarray(alphas, dtype=float)
    m = np.asarray(masses, dtype=float)[:, None]
    yy = np.asarray(y, dtype=float)[:, None]
    ly = np.asarray(log1p_y, dtype=float)[:, None]
    am1 = a - 1.0
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        t = a * ly  # log of (1 + y)^a, one row per outcome
        near = np.all(np.abs(t) <= 600.0, axis=0) & np.all(np.isfinite(yy))
        tn = np.where(near, t, 0.0)
        phi = _expm1_minus_x(tn)
        lin = a * _log1p_minus_x(yy)  # a (log(1+y) - y)
        lin = np.where(near, lin, 0.0)
        psi = np.maximum(phi + lin, 0.0)
        # phi and lin to a few ulps each, t to ~2 ulps (its error moves phi by
        # |expm1(t)| |dt|), y to a few ulps (moving psi by ~|t| ulps relative)
        err = (
            32.0
            * _ULP
            * ((phi + np.abs(lin)) * (1.0 + np.abs(tn)) + np.abs(np.expm1(tn)) * np.abs(tn))
        )
        z = np.sum(m * psi, axis=0)
        z_err = np.sum(m * err, axis=0) + 16.0 * _ULP * z
        v_near = np.log1p(z + z_err) / am1 * (1.0 + 8.0 * _ULP)
        moved = np.any((m > 0) & (yy != 0.0), axis=0)
        v_near = np.where(moved & (z < _TINY), np.inf, v_near)  # underflow: no claim
        lt = np.log(m) + t
        ls = _logsumexp(lt, axis=0)
        mag = np.max(np.where(np.isfinite(lt), np.abs(np.log(m)) + np.abs(t), 0.0), axis=0)
        v_far = (ls + 16.0 * _ULP * (mag + 1.0) + 2.0 * _ULP * m.shape[0]) / am1
    out = np.where(near, v_near, v_far)
    out = np.where(np.isnan(out), np.inf, out)
    return np.maximum(out, 0.0)


def poisson_randomized_response_rdp(
    p: float, r: float, p_minus_r: float, rest: float, q: float, alphas: np.ndarray
) -> np.ndarray:
    """Exact RDP of the Poisson-subsampled randomized-response pair, rounded up.

    The base pair is ``P = (p, r, rest)``, ``Q = (r, p, rest)`` (k-ary randomized
    response: ``rest`` is the mass of the outputs where they agree; binary randomized
    response, which dominates every ``log(p / r)``-DP mechanism, has ``rest = 0``). With
    ``M = (1 - q) P + q Q`` the result is ``max(D_a(M || P), D_a(P || M))`` -- the
    Renyi-DP of the Poisson-subsampled mechanism under add/remove neighbouring, at every
    real order ``a > 1`` (see the module docstring). ``p_minus_r`` must be accurate to a
    few ulps (it is the only difference taken).
    """
    a = np.asarray(alphas, dtype=float)
    if q == 0.0 or p_minus_r == 0.0:
        return np.zeros_like(a)
    if not (r > 0.0 and p > 0.0 and math.isfinite(p / r)):
        return np.full_like(a, np.inf)
    c = q * p_minus_r  # mass moved from the first outcome to the second
    # M's masses as sums of non-negative terms (p - c would cancel when r << p)
    m0, m1 = (1.0 - q) * p + q * r, (1.0 - q) * r + q * p
    masses_rem = np.array([p, r, rest])
    y_rem = np.array([-c / p, c / r, 0.0])
    masses_add = np.array([m0, m1, rest])
    y_add = np.array([c / m0, -c / m1, 0.0])
    with np.errstate(divide="ignore"):
        ly_rem = np.log1p(y_rem)
        ly_add = np.log1p(y_add)
    fwd = discrete_renyi(masses_rem, y_rem, ly_rem, a)
    bwd = discrete_renyi(masses_add, y_add, ly_add, a)
    return np.maximum(fwd, bwd)


def _binary_rr(eps: float) -> tuple[float, float, float]:
    """``(p, r, p - r)`` of binary randomized response with ``p / r = e^eps``."""
    p = 1.0 / (1.0 + math.exp(-eps))
    r = math.exp(-eps) * p
    return p, r, math.tanh(eps / 2.0)


def poisson_pure_dp_rdp(eps: float, q: float, alphas: np.ndarray) -> np.ndarray:
    """RDP of any Poisson-subsampled ``eps``-DP mechanism (add/remove), rounded up: the
    exact divergences of subsampled binary randomized response
    (:func:`poisson_randomized_response_rdp`; Kairouz, Oh & Viswanath 2015, Theorem 2.1).
    ``eps`` is rounded up first (the divergences increase with it)."""
    a = np.asarray(alphas, dtype=float)
    if not math.isfinite(eps) or eps > 700.0:
        return np.full_like(a, np.inf)
    if eps == 0.0:
        return np.zeros_like(a)
    p, r, d = _binary_rr(math.nextafter(eps, math.inf))
    return poisson_randomized_response_rdp(p, r, d, 0.0, q, a)


#: The extreme rays of ``{v in R^3_+: v_i <= e^eps v_j}`` (coordinates ``A, B, B'``),
#: written with entries 1 (``e^eps`` after scaling) and ``e^-eps`` (``0`` below).
_RAYS = ((1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 0), (1, 0, 1), (0, 1, 1))


@functools.lru_cache(maxsize=256)
def _fixed_vertices(eps: float) -> tuple[tuple[tuple[int, ...], tuple[float, ...]], ...]:
    """Vertices of ``{W >= 0: sum_r W_r ray_r = (1, 1, 1)}`` for the rays of
    :data:`_RAYS` at ``e^-eps`` (exact rational arithmetic on the float ``e^-eps``):
    ``(ray indices, weights)`` for each basic feasible solution."""
    lo = Fraction(math.exp(-eps))
    rays = [[Fraction(1) if e else lo for e in ray] for ray in _RAYS]
    out = []
    for idx in itertools.combinations(range(len(rays)), 3):
        cols = [rays[i] for i in idx]
        w = _solve3(cols)
        if w is None or any(x < 0 for x in w):
            continue
        out.append((idx, tuple(float(x) for x in w)))
    return tuple(out)


def _solve3(cols: list[list[Fraction]]) -> list[Fraction] | None:
    """Solve ``sum_j w_j cols[j] = (1, 1, 1)`` exactly (Cramer's rule); ``None`` if
    singular."""

    def det(m):
        return (
            m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0])
        )

    mat = [[cols[j][i] for j in range(3)] for i in range(3)]  # rows: coordinates
    d = det(mat)
    if d == 0:
        return None
    out = []
    for j in range(3):
        mj = [[Fraction(1) if k == j else mat[i][k] for k in range(3)] for i in range(3)]
        out.append(det(mj) / d)
    return out


def fixed_pure_dp_rdp(eps: float, q: float, alphas: np.ndarray) -> np.ndarray:
    """RDP of any ``eps``-DP mechanism (replace-one) run on a fixed-size batch drawn
    without replacement with ratio ``q = batch / n``, replace-one neighbouring, rounded
    up.

    By the coupling in the proof of Wang, Balle & Kasiviswanathan (2019), Theorem 9,
    and joint quasi-convexity, the subsampled pair is a mixture of pairs
    ``((1-q) A + q B, (1-q) A + q B')`` with ``A, B, B'`` pairwise ``eps``-close; the
    largest Renyi divergence of such a pair is attained on one of the finitely many
    vertex triples enumerated by :func:`_fixed_vertices` (module docstring), which are
    evaluated exactly. The set of triples is symmetric in ``B, B'``, so one direction
    covers both. ``eps`` is rounded up first.
    """
    a = np.asarray(alphas, dtype=float)
    if not math.isfinite(eps) or eps > 700.0:
        return np.full_like(a, np.inf)
    if eps == 0.0 or q == 0.0:
        return np.zeros_like(a)
    eps = math.nextafter(eps, math.inf)
    lo = math.exp(-eps)
    gap = -math.expm1(-eps)  # 1 - e^-eps: the difference of two ray coordinates
    best = np.zeros_like(a)
    for idx, weights in _fixed_vertices(eps):
        masses, ys = [], []
        for i, w in zip(idx, weights, strict=True):
            if w == 0.0:
                continue
            ra, rb, rb2 = (1.0 if e else lo for e in _RAYS[i])
            x1 = (1.0 - q) * ra + q * rb2  # the ray's X1 = (1-q) A + q B'
            db = (_RAYS[i][1] - _RAYS[i][2]) * gap  # B - B' on the ray
            masses.append(w * x1)
            ys.append(q * db / x1)
        y = np.array(ys)
        with np.errstate(divide="ignore"):
            v = discrete_renyi(np.array(masses), y, np.log1p(y), a)
        best = np.maximum(best, v)
    return best
