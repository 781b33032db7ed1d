"""Exact single-step privacy-loss pairs used by the PLD accountant (private helper).

A *pair* ``(P, Q)`` is a dominating pair of distributions for one step of a mechanism
(Zhu, Dong & Wang 2022, Definition 7): the mechanism's privacy profile is bounded by the
hockey-stick divergence ``delta(eps) = sup_S P(S) - e^eps Q(S)``. All pairs here have a
scalar privacy loss ``L = log dP/dQ``, and expose its exact tail probabilities

``tails(x) -> (P(L > x), P(L <= x), Q(L > x), Q(L <= x))``

evaluated separately on both sides so that small interval masses are obtained without
cancellation. Then (e.g. Balle & Wang 2018, Lemma 1; Sommer, Meiser & Mohammadi 2019,
Lemma 5) ``delta(eps) = P(L > eps) - e^eps Q(L > eps)``.

References
----------
.. [BW18] Balle & Wang (2018), Improving the Gaussian Mechanism for Differential Privacy,
       ICML, Theorem 8 (Gaussian profile).
.. [BBG18] Balle, Barthe & Gaboardi (2018), Privacy Amplification by Subsampling: Tight
       Analyses via Couplings and Divergences, NeurIPS, Theorems 2 (advanced joint
       convexity), 8 (Poisson) and 9 (sampling without replacement).
.. [ZDW22] Zhu, Dong & Wang (2022), Optimal Accounting of Differential Privacy via
       Characteristic Function, AISTATS, Section 3 and Theorem 9 (Poisson subsampling:
       the pairs ((1-q)Q+qP, Q) and (Q, (1-q)Q+qP) for remove and add).
.. [DRS22] Dong, Roth & Su (2022), Gaussian Differential Privacy, JRSS-B, Theorem 9
       (sampling without replacement: the symmetrised trade-off C_q(f)).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

from privlearn._renamed import renamed_keywords
from privlearn.errors import ParameterValueError

Tails = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _sf(z: np.ndarray) -> np.ndarray:
    """Standard normal survival function, accurate in both tails."""
    return special.ndtr(-z)


def _outside_support(below: np.ndarray, above: np.ndarray, *tails: np.ndarray) -> Tails:
    """Tails ``(P(L > x), P(L <= x), Q(L > x), Q(L <= x))`` set to their exact values
    outside the loss support: (1, 0, 1, 0) where ``below``, (0, 1, 0, 1) where ``above``."""
    p_gt, p_le, q_gt, q_le = tails
    one, zero = np.ones_like(p_gt), np.zeros_like(p_gt)
    return (np.where(below, one, np.where(above, zero, p_gt)),
            np.where(below, zero, np.where(above, one, p_le)),
            np.where(below, one, np.where(above, zero, q_gt)),
            np.where(below, zero, np.where(above, one, q_le)))


class Pair:
    """Base class: a dominating pair with scalar privacy loss."""

    #: smallest / largest privacy loss in the support (may be -inf / +inf)
    loss_min: float = -math.inf
    loss_max: float = math.inf
    #: pure-DP epsilon of the pair (sup of the loss), inf when unbounded
    pure_epsilon: float = math.inf

    @property
    def mass_at_infinity(self) -> float:
        """A lower bound on ``P(L = +inf)`` (P-mass where Q is 0): 0 unless known."""
        return 0.0

    def tails(self, x: np.ndarray) -> Tails:  # pragma: no cover - abstract
        raise NotImplementedError

    @renamed_keywords("Pair.delta", eps="epsilon")
    def delta(self, epsilon: np.ndarray) -> np.ndarray:
        """Exact hockey-stick divergence ``P(L > eps) - e^eps Q(L > eps)`` at
        ``eps = epsilon`` (``eps=``, the former keyword, is deprecated)."""
        eps = np.asarray(epsilon, dtype=float)
        pg, _, qg, _ = self.tails(eps)
        with np.errstate(over="ignore", invalid="ignore"):
            d = pg - np.exp(eps) * qg
        return np.clip(np.where(np.isfinite(d), d, 0.0), 0.0, 1.0)


class GaussianPair(Pair):
    """``P = N(mu, 1)``, ``Q = N(0, 1)``: loss ``mu*y - mu^2/2`` is increasing in y
    ([BW18], Theorem 8). ``mu = sensitivity / sigma``."""

    def __init__(self, mu: float) -> None:
        self.mu = float(mu)

    def tails(self, x: np.ndarray) -> Tails:
        mu = self.mu
        with np.errstate(over="ignore"):  # a tiny mu (huge noise): y = +-inf, exact tails
            y = (np.asarray(x, dtype=float) + 0.5 * mu * mu) / mu  # L > x  <=>  Y > y
        return _sf(y - mu), special.ndtr(y - mu), _sf(y), special.ndtr(y)


class LaplacePair(Pair):
    """``P = Lap(mu, 1)``, ``Q = Lap(0, 1)`` with ``mu = sensitivity / scale``.

    The loss ``|y| - |y - mu|`` is non-decreasing in y, equals ``2y - mu`` on ``[0, mu]``
    and has atoms at ``-mu`` (y <= 0) and ``+mu`` (y >= mu) (Koskela et al. 2021,
    Section 5; dp_accounting ``LaplacePrivacyLoss``).
    """

    def __init__(self, mu: float) -> None:
        self.mu = float(mu)
        self.loss_min, self.loss_max, self.pure_epsilon = -self.mu, self.mu, self.mu

    def tails(self, x: np.ndarray) -> Tails:
        mu = self.mu
        x = np.asarray(x, dtype=float)
        y = np.clip((x + mu) / 2.0, 0.0, mu)  # threshold in [0, mu]
        below = x < -mu
        above = x >= mu
        # P = Lap(mu): P(Y > y) = 1 - e^{(y-mu)}/2 for y <= mu;  P(Y <= y) = e^{(y-mu)}/2
        p_le = 0.5 * np.exp(y - mu)
        p_gt = 1.0 - p_le
        # Q = Lap(0): Q(Y > y) = e^{-y}/2 for y >= 0
        q_gt = 0.5 * np.exp(-y)
        q_le = 1.0 - q_gt
        return _outside_support(below, above, p_gt, p_le, q_gt, q_le)


class DiscretePair(Pair):
    """A pair on finitely many outcomes, given by atoms ``(loss_j, p_j, q_j)``.

    ``loss`` (optional) gives the atoms' privacy losses ``log(p_j / q_j)`` when a mass
    underflows to 0 (binary randomized response at ``epsilon`` above about 745: ``q``
    of the ``+epsilon`` atom is ``e^-epsilon / (1 + e^-epsilon)``); such a mass counts
    as 0 in the tails, which overstates ``P(L > x) - e^x Q(L > x)``: delta is never
    understated."""

    def __init__(self, p: np.ndarray, q: np.ndarray, loss: np.ndarray | None = None) -> None:
        p = np.asarray(p, dtype=float)
        q = np.asarray(q, dtype=float)
        if loss is not None:
            loss = np.asarray(loss, dtype=float)
            if loss.shape != p.shape or not np.all(np.isfinite(loss)):
                raise ParameterValueError("DiscretePair needs one finite loss per atom")
        keep = (p > 0) | (q > 0)
        p, q = p[keep], q[keep]
        if loss is None:
            if np.any(q <= 0) or np.any(p <= 0):
                raise ParameterValueError("DiscretePair needs atoms with p > 0 and q > 0")
            loss = np.log(p) - np.log(q)
        else:
            loss = loss[keep]
        order = np.argsort(loss)
        self.loss, self.p, self.q = loss[order], p[order], q[order]
        self.loss_min, self.loss_max = float(self.loss[0]), float(self.loss[-1])
        self.pure_epsilon = max(self.loss_max, 0.0)

    def tails(self, x: np.ndarray) -> Tails:
        x = np.asarray(x, dtype=float)
        gt = self.loss[None, :] > x[..., None]
        p_gt = (gt * self.p).sum(-1)
        q_gt = (gt * self.q).sum(-1)
        p_le = ((~gt) * self.p).sum(-1)
        q_le = ((~gt) * self.q).sum(-1)
        return p_gt, p_le, q_gt, q_le


def randomized_response_pair(p: float, k: int) -> DiscretePair:
    """Dominating pair of k-ary randomized response: the outputs 'true value x',
    'true value x'' and 'another category' (Kairouz, Oh & Viswanath 2016, Section 2)."""
    r = (1.0 - p) / (k - 1)
    other = (k - 2) * r
    ps = [p, r] + ([other] if k > 2 else [])
    qs = [r, p] + ([other] if k > 2 else [])
    return DiscretePair(np.array(ps), np.array(qs))


@renamed_keywords("pure_dp_pair", eps="epsilon")
def pure_dp_pair(epsilon: float) -> DiscretePair:
    """Binary randomized response with parameter eps = ``epsilon``, which dominates every
    (eps, 0)-DP mechanism (Kairouz, Oh & Viswanath 2015, Theorem 2.1). ``eps=``, the
    former keyword, is deprecated."""
    eps = epsilon
    p = 1.0 / (1.0 + math.exp(-eps))  # e^eps / (1 + e^eps)
    r = math.exp(-eps) / (1.0 + math.exp(-eps))  # 1 - p without cancellation (eps > 37)
    # above about 745 r underflows to 0: the losses +-eps are then given, not log(p / r)
    loss = None if r > 0.0 else np.array([eps, -eps])
    return DiscretePair(np.array([p, r]), np.array([r, p]), loss=loss)


class ApproxDPPair(Pair):
    """The pair of a generic ``(eps, delta)``-DP mechanism (Kairouz, Oh & Viswanath 2015,
    Theorem 2.1): outcomes with losses ``+inf, eps, -eps, -inf`` and P-masses ``delta,
    (1 - delta) e^eps / (1 + e^eps), (1 - delta) / (1 + e^eps), 0`` (Q: the same in
    reverse). It is its own swap, so it dominates both directions. The atom at ``+inf``
    stays outside the finite support ``[-eps, eps]``; the grid sends its P-mass to
    ``+inf`` (it always counts in delta)."""

    @property
    def mass_at_infinity(self) -> float:
        return self.mass_inf

    def __init__(self, eps: float, delta: float) -> None:
        self.eps, self.mass_inf = float(eps), float(delta)
        w = 1.0 - self.mass_inf
        self.hi = w / (1.0 + math.exp(-self.eps))  # P-mass at loss eps
        self.lo = w * math.exp(-self.eps) / (1.0 + math.exp(-self.eps))  # at loss -eps
        self.loss_min, self.loss_max = -self.eps, self.eps
        self.pure_epsilon = math.inf

    def tails(self, x: np.ndarray) -> Tails:
        x = np.asarray(x, dtype=float)
        e, hi, lo, d = self.eps, self.hi, self.lo, self.mass_inf
        up, down = (x < e).astype(float), (x < -e).astype(float)
        p_gt = d + up * hi + down * lo
        p_le = (1.0 - up) * hi + (1.0 - down) * lo
        q_gt = up * lo + down * hi
        q_le = d + (1.0 - up) * lo + (1.0 - down) * hi
        return p_gt, p_le, q_gt, q_le


class RemovePair(Pair):
    """``(P_s, Q_s) = ((1-q) Q + q P, Q)``: the 'remove' direction of Poisson subsampling
    ([ZDW22] Theorem 9; [BBG18] Theorem 8 for the resulting amplification).

    Loss ``L_s = log(1 - q + q e^L)`` is an increasing function of the base loss, so
    ``L_s > x  <=>  L > g(x)`` with ``g(x) = log((e^x - 1 + q) / q)``.
    """

    @property
    def mass_at_infinity(self) -> float:
        # P_s = (1-q) Q + q P is q P where Q is 0 (rounded down)
        return self.qr * self.base.mass_at_infinity * (1.0 - 1e-15)

    def __init__(self, base: Pair, q: float) -> None:
        self.base, self.qr = base, float(q)
        self.loss_min = math.log1p(-q) if q < 1 else base.loss_min
        if base.loss_min > -math.inf:
            self.loss_min = self._fwd(base.loss_min)
        self.loss_max = self._fwd(base.loss_max)
        self.pure_epsilon = max(self.loss_max, 0.0)

    def _fwd(self, lo: float) -> float:
        q = self.qr
        if lo == math.inf:
            return math.inf
        if lo == -math.inf:
            return math.log1p(-q) if q < 1 else -math.inf
        # log(1 - q + q e^lo), stable
        return float(np.logaddexp(math.log1p(-q) if q < 1 else -np.inf, math.log(q) + lo))

    def _inv(self, x: np.ndarray) -> np.ndarray:
        """g(x) = log((e^x - (1-q)) / q); -inf where e^x <= 1 - q."""
        q = self.qr
        x = np.asarray(x, dtype=float)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            # e^x - (1-q) = expm1(x) + q
            v = np.expm1(x) + q
            big = x > 30.0
            g = np.where(v > 0, np.log(np.where(v > 0, v, 1.0)) - math.log(q), -np.inf)
            g = np.where(
                big, x + np.log1p(-(1.0 - q) * np.exp(-np.where(big, x, 0.0))) - math.log(q), g
            )
        return g

    def tails(self, x: np.ndarray) -> Tails:
        q = self.qr
        g = self._inv(x)
        pg, pl, qg, ql = self.base.tails(g)
        return (1 - q) * qg + q * pg, (1 - q) * ql + q * pl, qg, ql


class AddPair(Pair):
    """``(P_a, Q_a) = (Q, (1-q) Q + q P)``: the 'add' direction of Poisson subsampling
    ([ZDW22] Theorem 9). ``L_a = -log(1 - q + q e^L)``, decreasing in the base loss."""

    def __init__(self, base: Pair, q: float) -> None:
        self.rem = RemovePair(base, q)
        self.qr = float(q)
        self.loss_min = -self.rem.loss_max
        self.loss_max = -self.rem.loss_min
        self.pure_epsilon = max(self.loss_max, 0.0)

    def tails(self, x: np.ndarray) -> Tails:
        q = self.qr
        g = self.rem._inv(-np.asarray(x, dtype=float))  # L_a > x <=> L < g  (ties: <=)
        pg, pl, qg, ql = self.rem.base.tails(g)
        # P_a = Q;  Q_a = (1-q) Q + q P. 'L < g' is taken as 'L <= g' (an atom exactly on a
        # grid point then lands on the grid point itself, which changes nothing below).
        return ql, qg, (1 - q) * ql + q * pl, (1 - q) * qg + q * pg


class SwappedPair(Pair):
    """``(Q, P)``: loss negated."""

    def __init__(self, base: Pair) -> None:
        self.base = base
        self.loss_min, self.loss_max = -base.loss_max, -base.loss_min
        self.pure_epsilon = max(self.loss_max, 0.0)

    def tails(self, x: np.ndarray) -> Tails:
        pg, pl, qg, ql = self.base.tails(-np.asarray(x, dtype=float))
        return ql, qg, pl, pg


def _log_abs_expm1(x: np.ndarray) -> np.ndarray:
    """``log|e^x - 1|`` without overflow (``-inf`` at x = 0)."""
    x = np.asarray(x, dtype=float)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        pos = x + np.log1p(-np.exp(-np.abs(x)))  # x > 0
        neg = np.log(-np.expm1(np.minimum(x, 0.0)))  # x < 0
    return np.where(x > 0, pos, np.where(x < 0, neg, -np.inf))


class ReplaceGaussianPair(Pair):
    """``P = (1-q) N(0,1) + q N(mu,1)``, ``Q = (1-q) N(0,1) + q N(-mu,1)``: the tight pair of
    a (Poisson or fixed-size) subsampled Gaussian under replace-one neighbouring, where one
    record's contribution moves from ``+c`` to ``-c`` (``mu = |c| / sigma``; dp_accounting's
    ``GaussianPrivacyLoss`` with ``AdjacencyType.REPLACE``). At ``q = 1`` it is the Gaussian
    pair with ``2 mu``. Swapping P and Q gives the same loss distribution (reflect y).

    With ``t = mu y`` and ``m = mu^2 / 2`` the loss is
    ``L(t) = log(1-q + q e^{t-m}) - log(1-q + q e^{-t-m})``, increasing in t; ``L(t) = x``
    solves ``a^2 + b a - e^x = 0`` for ``a = e^t`` with ``b = -(1-q) (e^x - 1) e^{m} / q``,
    evaluated in log space.
    """

    def __init__(self, mu: float, q: float) -> None:
        self.mu, self.qr = float(mu), float(q)

    def _threshold(self, x: np.ndarray) -> np.ndarray:
        """t(x) with ``L > x <=> t > t(x)``."""
        mu, q = self.mu, self.qr
        x = np.asarray(x, dtype=float)
        m = 0.5 * mu * mu
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            log1q = math.log1p(-q) if q < 1.0 else -math.inf
            lb = log1q + _log_abs_expm1(x) + m - math.log(q)  # log|b|
            s = np.maximum(lb, 0.5 * x)
            r1 = np.exp(lb - s)
            r2 = np.exp(0.5 * x - s)
            lroot = s + np.log(r1 + np.hypot(r1, 2.0 * r2))  # log(|b| + sqrt(b^2 + 4 e^x))
            t = np.where(x >= 0, lroot - math.log(2.0), x + math.log(2.0) - lroot)
        return t

    def tails(self, x: np.ndarray) -> Tails:
        mu, q = self.mu, self.qr
        y = self._threshold(x) / mu  # L > x  <=>  Y > y
        p_gt = (1 - q) * _sf(y) + q * _sf(y - mu)
        p_le = (1 - q) * special.ndtr(y) + q * special.ndtr(y - mu)
        q_gt = (1 - q) * _sf(y) + q * _sf(y + mu)
        q_le = (1 - q) * special.ndtr(y) + q * special.ndtr(y + mu)
        return p_gt, p_le, q_gt, q_le


def _lap_sf(y: np.ndarray, c: float) -> np.ndarray:
    """P(Y > y) for Y ~ Lap(c, 1)."""
    with np.errstate(over="ignore"):
        return np.where(y >= c, 0.5 * np.exp(-(y - c)), 1.0 - 0.5 * np.exp(np.minimum(y - c, 0.0)))


def _lap_cdf(y: np.ndarray, c: float) -> np.ndarray:
    """P(Y <= y) for Y ~ Lap(c, 1)."""
    with np.errstate(over="ignore"):
        return np.where(y < c, 0.5 * np.exp(y - c), 1.0 - 0.5 * np.exp(-np.maximum(y - c, 0.0)))


class ReplaceLaplacePair(Pair):
    """``P = (1-q) Lap(0,1) + q Lap(mu,1)``, ``Q = (1-q) Lap(0,1) + q Lap(-mu,1)``: the
    replace-one pair of a subsampled Laplace mechanism (a record's contribution moves from
    ``+c`` to ``-c``, ``mu = |c| / b``). At ``q = 1`` it is the Laplace pair with ``2 mu``.

    The loss is non-decreasing in y, constant (atoms) for ``y <= -mu`` and ``y >= mu``,
    ``L(0) = 0``; on ``(0, mu)`` it is ``log(1-q + q e^{2y-mu}) - log D`` with
    ``D = 1-q + q e^{-mu}``, and ``L(-y) = -L(y)``.
    """

    def __init__(self, mu: float, q: float) -> None:
        self.mu, self.qr = float(mu), float(q)
        # L_max = log(1-q + q e^mu) - log(1-q + q e^-mu)
        log1q = math.log1p(-q) if q < 1.0 else -math.inf
        self._logD = float(np.logaddexp(log1q, math.log(q) - self.mu))
        lmax = float(np.logaddexp(log1q, math.log(q) + self.mu)) - self._logD
        self.loss_min, self.loss_max, self.pure_epsilon = -lmax, lmax, lmax

    def _threshold(self, x: np.ndarray) -> np.ndarray:
        """y(x) in [-mu, mu] with ``L > x <=> Y > y(x)`` for x in [L_min, L_max)."""
        mu, q = self.mu, self.qr
        ax = np.abs(np.asarray(x, dtype=float))
        log1q = math.log1p(-q) if q < 1.0 else -math.inf
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            # e^{2y - mu} = (e^{|x|} D - (1-q)) / q, in log space
            v = np.where(
                np.isfinite(log1q),
                self._logD + ax + np.log1p(-np.exp(log1q - self._logD - ax)),
                self._logD + ax,
            )
            y = 0.5 * (mu + v - math.log(q))
        y = np.clip(np.nan_to_num(y, nan=0.0), 0.0, mu)
        return np.where(np.asarray(x) >= 0, y, -y)

    def tails(self, x: np.ndarray) -> Tails:
        mu, q = self.mu, self.qr
        x = np.asarray(x, dtype=float)
        y = self._threshold(x)
        below = x < self.loss_min
        above = x >= self.loss_max
        p_gt = (1 - q) * _lap_sf(y, 0.0) + q * _lap_sf(y, mu)
        p_le = (1 - q) * _lap_cdf(y, 0.0) + q * _lap_cdf(y, mu)
        q_gt = (1 - q) * _lap_sf(y, 0.0) + q * _lap_sf(y, -mu)
        q_le = (1 - q) * _lap_cdf(y, 0.0) + q * _lap_cdf(y, -mu)
        return _outside_support(below, above, p_gt, p_le, q_gt, q_le)
