"""The strategy-optimisation objective and its gradient, in ``O(n b)`` / ``O(n m)``
(private helper of :mod:`privlearn.correlated.optimize`).

``f(c, r) = log(sum_t w_t b_t^2) + log ||v||^2`` with ``b = a * r`` (the first column of
``B = A C^{-1}``, ``r`` that of ``C^{-1}``) and ``v`` the image of the worst participation
pattern (``k`` participations ``sep`` apart from step 0) under ``C``: the log of the loss
of :func:`privlearn.correlated.error.loss`. Working in logs makes the objective invariant
to the scale of ``C`` and keeps its gradient well scaled over many orders of magnitude.
"""

from __future__ import annotations

import numpy as np

from privlearn.correlated import _toeplitz

__all__ = ["spaced", "spaced_adjoint", "weights", "workload_filter", "Objective"]


def spaced(c: np.ndarray, sep: int, k: int) -> np.ndarray:
    """``v = sum_{m < k} shift(c, m * sep)`` truncated to ``len(c)``, in ``O(n)``: ``C u``
    for the pattern ``0, sep, ..., (k-1) sep`` (block cumulative sums)."""
    n = c.size
    if k <= 1:
        return c.copy()
    blocks = -(-n // sep)
    x = np.zeros(blocks * sep)
    x[:n] = c
    x = x.reshape(blocks, sep)
    s = np.cumsum(x, axis=0)
    if k < blocks:
        s[k:] -= s[:-k].copy()
    return s.reshape(-1)[:n]


def spaced_adjoint(g: np.ndarray, sep: int, k: int) -> np.ndarray:
    """The adjoint of :func:`spaced`: ``out[s] = sum_{m < k, s + m sep < n} g[s + m sep]``.

    Shifting down is adjoint to shifting up, so this is :func:`spaced` of the reversed
    ``g``, reversed (the same block sums, added in the same order)."""
    return spaced(g[::-1], sep, k)[::-1].copy()


def weights(n: int, reduction: str) -> np.ndarray:
    """``E = sum_t w_t b_t^2``: the mean error weights ``b_t^2`` by the ``n - t`` queries
    it enters, divided by ``n``; the max error is that of the last query (Toeplitz)."""
    if reduction == "mean":
        return (n - np.arange(n)) / n
    return np.ones(n)


def workload_filter(a: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``(num, den)`` with ``a = num / den`` as power series when the workload is the
    prefix sum (``1 / (1 - x)``), so ``b = a * r`` is a cumulative sum; None otherwise."""
    if np.all(a == 1.0):
        return np.array([1.0]), np.array([1.0, -1.0])
    return None


class Objective:
    """``f`` and its gradients ``df/dc`` and ``df/dr`` (full length ``n``).

    Parameters
    ----------
    a : workload's first column; w : the reduction's weights; sep, k : the pattern.
    """

    def __init__(self, a: np.ndarray, w: np.ndarray, sep: int, k: int) -> None:
        self.a, self.w, self.sep, self.k = a, w, sep, k
        self.n = a.size
        self.prefix = workload_filter(a) is not None

    def apply_workload(self, r: np.ndarray) -> np.ndarray:
        """``b = a * r`` (first ``n`` terms)."""
        if self.prefix:
            return np.cumsum(r)
        return _toeplitz.convolve(self.a, r, self.n)

    def workload_adjoint(self, g: np.ndarray) -> np.ndarray:
        if self.prefix:
            return np.cumsum(g[::-1])[::-1]
        return _toeplitz.correlate(g, self.a, self.n)

    def error_part(self, b: np.ndarray) -> tuple[float, np.ndarray]:
        """``log E`` and ``d log E / d b``."""
        wb = self.w * b
        err = float(wb @ b)
        return err, 2.0 * wb / err

    def sens_part(self, c: np.ndarray) -> tuple[float, np.ndarray]:
        """``||v||^2`` and ``d log ||v||^2 / d c`` (``c`` of length ``n``)."""
        v = spaced(c, self.sep, self.k)
        s2 = float(v @ v)
        return s2, spaced_adjoint(2.0 * v / s2, self.sep, self.k)


def banded_error(obj: Objective, c: np.ndarray) -> tuple[float, np.ndarray]:
    """``log E`` of the banded ``C`` with coefficients ``c`` (``c[0] != 0``) and its
    gradient in ``c``, by two recursive filters (``O(n b)``).

    ``b = C^{-1} a`` and ``d b / d c_j = -S_j C^{-1} b`` (Toeplitz matrices commute), so
    ``d E / d c_j = -sum_t g_t (C^{-1} b)_{t-j}`` with ``g = dE/db``: a correlation at
    ``len(c)`` lags."""
    bands = c.size
    n = obj.n
    b = _toeplitz.banded_solve(c, obj.a)
    err, g_b = obj.error_part(b)
    y = _toeplitz.banded_solve(c, b)
    if bands <= 16:
        g_c = np.array([-(g_b[j:] @ y[: n - j]) for j in range(bands)])
    else:
        g_c = -_toeplitz.correlate(g_b, y, n)[:bands]
    return err, g_c


# -- banded Toeplitz: reflection coefficients ------------------------------------------------
def step_up(kk: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """The monic polynomial ``a`` (``a[0] = 1``, length ``len(kk) + 1``) with reflection
    coefficients ``kk`` (Levinson's step-up recursion), and the intermediate polynomials
    for :func:`step_up_adjoint`. ``|kk| < 1`` puts every root of ``a`` outside the unit
    disk (Schur-Cohn), so ``1 / a(x)`` has bounded, decaying power-series coefficients."""
    b = kk.size + 1
    a = np.zeros(b)
    a[0] = 1.0
    hist = []
    for i in range(1, b):
        hist.append(a[: i + 1].copy())
        a[: i + 1] = hist[-1] + kk[i - 1] * hist[-1][::-1]
    return a, hist


def step_up_adjoint(kk: np.ndarray, hist: list[np.ndarray], g: np.ndarray) -> np.ndarray:
    """``d f / d kk`` from ``g = d f / d a`` (reverse mode through :func:`step_up`)."""
    b = kk.size + 1
    g = g.copy()
    out = np.zeros(b - 1)
    for i in range(b - 1, 0, -1):
        prev = hist[i - 1]
        gi = g[: i + 1]
        out[i - 1] = gi @ prev[::-1]
        g[: i + 1] = gi + kk[i - 1] * gi[::-1]
    return out


def step_down(c: np.ndarray) -> np.ndarray | None:
    """Reflection coefficients of ``c / c[0]`` (inverse of :func:`step_up`); None when a
    root of ``c`` lies on or inside the unit circle (some ``|k| >= 1``)."""
    a = np.asarray(c, dtype=float) / c[0]
    b = a.size
    kk = np.zeros(b - 1)
    for i in range(b - 1, 0, -1):
        k = a[i]
        if not abs(k) < 1.0:
            return None
        kk[i - 1] = k
        a = (a[:i] - k * a[i:0:-1]) / (1.0 - k * k)
    return kk


# -- BLT: interlaced decays ------------------------------------------------------------------
class InterlacedBLT:
    """A BLT strategy ``C`` and its inverse from ``2m + 1`` positive gaps ``g`` summing to 1:
    the points ``1 > theta_1 > hat_1 > theta_2 > ... > theta_m > hat_m > 0`` with
    ``1 - x_p = g_0 + ... + g_{p-1}``.

    ``C(x) = prod(1 - hat_j x) / prod(1 - theta_j x) = 1 + sum_j omega_j x / (1 - theta_j x)``
    and ``C^{-1}`` is the BLT with decays ``hat`` and weights ``hat_omega`` ([DMPST24],
    Lemma 5.2; McMahan & Pillutla (2025), An Inversion Theorem for Buffered Linear Toeplitz
    (BLT) Matrices, Theorem 2):
    ``omega_i = prod_j (theta_i - hat_j) / prod_{j != i} (theta_i - theta_j)``. Interlacing
    makes every ``omega_i > 0`` and ``hat_omega_i < 0`` and ``sum(omega) < 1``, so the
    Toeplitz coefficients of ``C`` are positive and decreasing (the closed-form sensitivity
    is exact) and those of ``C^{-1}`` are negative after the first. Every difference of
    points is a sum of gaps, computed without cancellation.
    """

    def __init__(self, g: np.ndarray) -> None:
        m = (g.size - 1) // 2
        self.g, self.m = g, m
        p = g.size - 1  # points x_1 .. x_p
        self.one_minus = np.cumsum(g)[:p]  # 1 - x_q for q = 1..p
        self.tail = np.cumsum(g[::-1])[::-1][1:]  # x_q = g_q + ... + g_{2m}
        idx = np.arange(1, p + 1)
        self.i_theta, self.i_hat = idx[0::2], idx[1::2]
        # D[q, q'] = |x_q - x_q'| = sum of the gaps between them (q, q' in 1..p)
        csum = np.concatenate([[0.0], np.cumsum(g)])
        lo = np.minimum.outer(idx, idx)
        hi = np.maximum.outer(idx, idx)
        self.lo, self.hi = lo, hi
        self.dist = csum[hi] - csum[lo]
        self.theta, self.hat = self.point(self.i_theta), self.point(self.i_hat)
        self.omega = self._weights(self.i_theta, self.i_hat, 1.0)
        self.hat_omega = self._weights(self.i_hat, self.i_theta, -1.0)

    def point(self, q: np.ndarray) -> np.ndarray:
        om = self.one_minus[q - 1]
        return np.where(om < 0.5, 1.0 - om, self.tail[q - 1])

    def log_point(self, q: np.ndarray) -> np.ndarray:
        om = self.one_minus[q - 1]
        return np.where(om < 0.5, np.log1p(-np.minimum(om, 0.5)), np.log(self.tail[q - 1]))

    def _weights(self, own: np.ndarray, other: np.ndarray, sign: float) -> np.ndarray:
        d_other = self.dist[np.ix_(own - 1, other - 1)]
        d_own = self.dist[np.ix_(own - 1, own - 1)] + np.eye(own.size)
        return sign * np.exp(np.log(d_other).sum(axis=1) - np.log(d_own).sum(axis=1))

    def _weights_grad(
        self, own: np.ndarray, other: np.ndarray, w: np.ndarray, gw: np.ndarray
    ) -> np.ndarray:
        """``d f / d g`` through ``log |w_i|`` (sums of +-log distances) from ``gw = df/dw``:
        each distance is the sum of the gaps between its two points (difference array)."""
        coef = (gw * w)[:, None]  # d f / d log|w_i|
        eye = np.eye(own.size, dtype=bool)
        terms = [(other[None, :] + 0 * own[:, None], coef * np.ones((1, other.size)), None),
                 (own[None, :] + 0 * own[:, None], -coef * np.ones((1, own.size)), eye)]
        diff = np.zeros(self.g.size + 1)
        for q, val, skip in terms:
            p = np.broadcast_to(own[:, None], q.shape)
            val = val / self.dist[p - 1, q - 1] if skip is None else np.where(
                skip, 0.0, val / np.where(skip, 1.0, self.dist[p - 1, q - 1]))
            np.add.at(diff, np.minimum(p, q).ravel(), val.ravel())
            np.add.at(diff, np.maximum(p, q).ravel(), -val.ravel())
        return np.cumsum(diff)[:-1]

    def gaps_grad(
        self, g_omega: np.ndarray, g_theta: np.ndarray, g_hom: np.ndarray, g_hat: np.ndarray
    ) -> np.ndarray:
        """``d f / d g`` from the gradients in (omega, theta, hat_omega, hat)."""
        out = self._weights_grad(self.i_theta, self.i_hat, self.omega, g_omega)
        out += self._weights_grad(self.i_hat, self.i_theta, self.hat_omega, g_hom)
        # x_q = 1 - (g_0 + ... + g_{q-1}): d x_q / d g_l = -1 for l < q
        gx = np.zeros(self.g.size)
        gx[self.i_theta] += g_theta
        gx[self.i_hat] += g_hat
        out -= np.cumsum(gx[::-1])[::-1] - gx  # sum over q > l
        return out


def _powers(log_decay: np.ndarray, count: int) -> np.ndarray:
    """``decay_j^t`` for ``t < count``, shape ``(m, count)``: ``decay^(jL) * decay^s`` for
    ``t = jL + s`` (two small tables of exponentials and one product)."""
    m = log_decay.size
    if count <= 0:
        return np.zeros((m, 0))
    width = max(1, int(np.sqrt(count)))
    blocks = -(-count // width)
    with np.errstate(under="ignore"):
        inner = np.exp(np.arange(width, dtype=float)[None, :] * log_decay[:, None])
        outer = np.exp((width * np.arange(blocks, dtype=float))[None, :] * log_decay[:, None])
        out = outer[:, :, None] * inner[:, None, :]
    return out.reshape(m, blocks * width)[:, :count]


def blt_coefs(weight: np.ndarray, log_decay: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``x_0 = 1``, ``x_t = sum_j weight_j decay_j^(t-1)`` (length ``n``) and the table of
    powers ``decay_j^t`` (``m x (n - 1)``), vectorised."""
    powers = _powers(log_decay, n - 1)
    x = np.empty(n)
    x[0] = 1.0
    x[1:] = weight @ powers
    return x, powers


def blt_coefs_adjoint(
    g: np.ndarray, weight: np.ndarray, decay: np.ndarray, powers: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``(d f / d weight, d f / d decay)`` from ``g = d f / d x`` (see :func:`blt_coefs`)."""
    g1 = g[1:]
    g_weight = powers @ g1
    n1 = g1.size
    if n1 < 2:
        return g_weight, np.zeros_like(decay)
    # d x_t / d decay_j = weight_j (t - 1) decay_j^(t-2), t >= 2
    g_decay = weight * (powers[:, :-1] @ (g1[1:] * np.arange(1, n1, dtype=float)))
    return g_weight, g_decay
