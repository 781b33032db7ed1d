"""Exact privacy profiles where a closed form exists.

* **Compositions of pure-DP mechanisms and randomized responses** (homogeneous or
  heterogeneous, optionally Poisson-subsampled under add/remove): each step's dominating
  pair has finitely many outcomes, so the composed privacy loss distribution (PLD) is a
  finite discrete distribution. It is enumerated *exactly* -- multinomial counts per
  part, log-masses from ``lgamma``, losses as integer combinations of the per-step
  losses -- and ``delta(eps) = sum_{l > eps} P(l) (1 - e^{eps - l})`` is evaluated and
  inverted in closed form between consecutive atoms. For ``k`` copies of an
  ``eps0``-DP mechanism this is the optimal composition theorem of Kairouz, Oh &
  Viswanath (2015), Theorem 3.3; for heterogeneous pure-DP parts it is the exact
  computation of Murtagh & Vadhan (2016) (done through the PLD rather than their
  dynamic programme).
* **Compositions that include (eps, delta)-DP steps** (:class:`ApproxDP`, not
  subsampled): each is dominated by randomized response with mass ``delta`` moved to loss
  ``+inf`` (Kairouz, Oh & Viswanath 2015, Theorem 2.1), so the composition is the pure-DP
  composition of the finite parts, scaled by ``prod (1 - delta_i)^{k_i}``, plus the P-mass
  ``1 - prod (1 - delta_i)^{k_i}`` at ``+inf``, which ``delta(eps)`` carries in full
  (the optimal composition theorem, Kairouz, Oh & Viswanath 2015, Theorem 3.3, with its
  ``1 - (1 - delta)^k`` term).
* **A single Laplace mechanism** with scale ``b`` (``eps0 = 1/b``):
  ``delta(eps) = 1 - exp((eps - eps0) / 2)`` for ``0 <= eps < eps0``, hence
  ``eps(delta) = max(0, eps0 + 2 log(1 - delta))`` (integrate the Laplace PLD; e.g.
  Balle & Wang 2018, Section 2; Koskela et al. 2020, Section 6).
* **Randomized response** (binary or k-ary) with ``eps0 = log(p (k-1) / (1-p))``: a
  special case of the first item, ``eps(delta) = eps0 + log(1 - delta / p)``.

Which kinds have which closed form is registered in the mechanism registry
(:mod:`privlearn.accounting.registry`): ``pld_atoms`` (PureDP, RandomizedResponse: the
finite dominating pair, built here by :func:`pure_dp_atoms` / :func:`randomized_response_atoms`)
and ``exact_epsilon`` / ``exact_delta`` (Laplace: :func:`laplace_epsilon` /
:func:`laplace_delta`), so a new kind with a finite pair or a closed-form profile gets
exact accounting by registering it, with no change here.

The entry points return ``None`` when no closed form applies (the caller then uses a
numerical accountant), or ``(lower, upper)`` brackets of the exact value: the only error
is floating-point rounding (``lgamma``, ``logaddexp``, sums of losses), for which an
explicit allowance is added, so ``lower <= exact <= upper`` with a relative gap of about
``1e-12`` (``1e-9`` at 10^6 steps).

References
----------
.. [1] Kairouz, Oh & Viswanath (2015), The Composition Theorem for Differential Privacy,
       ICML, Theorem 3.3 (optimal homogeneous composition).
.. [2] Murtagh & Vadhan (2016), The Complexity of Computing the Optimal Composition of
       Differential Privacy, TCC (heterogeneous composition is exactly computable).
.. [3] Kairouz, Oh & Viswanath (2015), Theorem 2.1: randomized response dominates every
       (eps, 0)-DP mechanism.
.. [4] Balle, Barthe & Gaboardi (2018), Privacy Amplification by Subsampling, NeurIPS,
       Theorem 8 (Poisson subsampling of pure DP); Zhu, Dong & Wang (2022), AISTATS,
       Theorem 9 (the remove/add dominating pairs composed separately).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from privlearn._renamed import renamed_keywords
from privlearn._validation import (
    check_count,
    check_delta,
    check_nonnegative,
    check_positive,
    check_real,
)
from privlearn.accounting._queries import query_delta, query_epsilon
from privlearn.accounting.mechanisms import (
    Composed,
    Mechanism,
    Neighbouring,
    PureDP,
    Sampling,
    Subsampled,
)
from privlearn.accounting.registry import pure_epsilon as _pure_epsilon
from privlearn.accounting.registry import read_relation, relation_base, representation_of
from privlearn.errors import ParameterValueError, UnsupportedMechanismError

__all__ = [
    "Atoms",
    "DiscretePLD",
    "MAX_ATOMS",
    "discrete_pld",
    "epsilon_bounds",
    "delta_bounds",
    "pure_dp_composition_epsilon",
    "laplace_epsilon",
    "laplace_delta",
    "approx_dp_atoms",
    "pure_dp_atoms",
    "randomized_response_atoms",
]

U = 2.0**-53
MAX_ATOMS = 2_000_000
"""Largest number of atoms of a composed PLD enumerated exactly (else ``None``)."""
#: Largest step count composed exactly: beyond it the rounding allowance of the log-masses
#: (8 u of 3 lgamma(k + 1)) exceeds 100% (a lower bound of 0) and soon overflows, and
#: beyond 2^53 the counts are not even floats.
MAX_EXACT_COUNT = 10**13


# ----------------------------------------------------------------------------------
# single-step atoms (log domain, so that any epsilon works)
# ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Atoms:
    """Outcomes of one step's dominating pair: loss ``log(P/Q)``, ``log P``, ``log Q``
    (the ``pld_atoms`` representation of a mechanism kind)."""

    loss: tuple[float, ...]
    log_p: tuple[float, ...]
    log_q: tuple[float, ...]
    #: P-mass at loss ``+inf`` (outcomes Q never produces, e.g. the delta of an
    #: (eps, delta)-DP pair; the pair is then symmetric, with as much Q-mass at ``-inf``)
    inf_mass: float = 0.0


def _softplus(x: float) -> float:
    """``log(1 + e^x)`` without overflow."""
    return x + math.log1p(math.exp(-x)) if x > 0 else math.log1p(math.exp(x))


@renamed_keywords("pure_dp_atoms", eps="epsilon")
def pure_dp_atoms(epsilon: float) -> Atoms:
    """The dominating pair of every ``epsilon``-DP mechanism: binary randomized response
    with parameter ``epsilon`` (Kairouz, Oh & Viswanath 2015, Theorem 2.1),
    ``P = (p, 1-p)``, ``Q = (1-p, p)``, ``p = e^epsilon / (1 + e^epsilon)``, in the log
    domain (any ``epsilon``). ``eps=``, the former keyword, is deprecated."""
    epsilon = check_nonnegative("epsilon", epsilon, allow_inf=True,
                                hint="pass the mechanism's pure-DP epsilon, e.g. 1.0")
    # log p = -softplus(-epsilon), log(1-p) = -softplus(epsilon)
    lp, lq = -_softplus(-epsilon), -_softplus(epsilon)
    return Atoms((epsilon, -epsilon), (lp, lq), (lq, lp))


@renamed_keywords("approx_dp_atoms", eps="epsilon")
def approx_dp_atoms(epsilon: float, delta: float) -> Atoms:
    """The dominating pair of every ``(epsilon, delta)``-DP mechanism (Kairouz, Oh &
    Viswanath 2015, Theorem 2.1): P-mass ``delta`` at loss ``+inf``, the binary randomized
    response of :func:`pure_dp_atoms` with the remaining ``1 - delta``, and the mirror
    image under Q (mass ``delta`` at ``-inf``). ``eps=``, the former keyword, is
    deprecated."""
    base = pure_dp_atoms(epsilon)
    delta = check_delta("delta", delta, hint="pass the mechanism's delta, e.g. 1e-6")
    lf = math.log1p(-delta)
    return Atoms(base.loss, tuple(x + lf for x in base.log_p),
                 tuple(x + lf for x in base.log_q), inf_mass=float(delta))


def randomized_response_atoms(p: float, k: int) -> Atoms:
    """The pair of ``k``-ary randomized response with truth probability ``p``: the true
    category, one other category, and (``k > 2``) any third one, equally likely under
    both. ``k >= 2`` and ``1/k <= p < 1`` (as :class:`RandomizedResponse` requires)."""
    k = check_count("k", k, minimum=2, hint="pass the number of categories, e.g. 2")
    p = check_real("p", p, hint="pass the truth probability, e.g. 0.75")
    if not 1.0 / k <= p < 1.0:
        raise ParameterValueError(
            f"p must be in [1/k, 1) = [{1.0 / k:.6g}, 1) for k={k} categories, got "
            f"{p!r}; pass the probability of reporting the true category, e.g. 0.75")
    lp = math.log(p)
    lr = math.log1p(-p) - math.log(k - 1)
    loss = [lp - lr, lr - lp]
    log_p, log_q = [lp, lr], [lr, lp]
    if k > 2:  # 'another category': same probability under both
        lo = lr + math.log(k - 2)
        loss.append(0.0)
        log_p.append(lo)
        log_q.append(lo)
    return Atoms(tuple(loss), tuple(log_p), tuple(log_q))


def _remove_atoms(base: Atoms, q: float) -> Atoms:
    """``((1-q) Q + q P, Q)`` (Poisson subsampling, remove direction)."""
    l1q = math.log1p(-q)
    lq = math.log(q)
    log_p = tuple(
        float(np.logaddexp(l1q + b, lq + a))
        for a, b in zip(base.log_p, base.log_q, strict=True)
    )
    loss = tuple(a - b for a, b in zip(log_p, base.log_q, strict=True))
    return Atoms(loss, log_p, base.log_q)


def _add_atoms(base: Atoms, q: float) -> Atoms:
    """``(Q, (1-q) Q + q P)`` (Poisson subsampling, add direction)."""
    rem = _remove_atoms(base, q)
    return Atoms(tuple(-x for x in rem.loss), rem.log_q, rem.log_p)


def _one_run(m: Mechanism) -> Mechanism:
    """A subsampled step at rate 1 as the one run of its base it is, at the sensitivity
    its relation implies (:func:`~privlearn.accounting.registry.relation_base`, as the
    PLD accountant models it); any other step unchanged."""
    if isinstance(m, Subsampled) and m.rate >= 1.0:
        try:
            return relation_base(m)
        except UnsupportedMechanismError:  # no scaled base: no closed form here
            return m
    return m


def _step_directions(m: Mechanism) -> list[Atoms] | None:
    """Atoms of one step per direction (one entry: symmetric; two: remove, add), or None
    if this step has no finite closed form here (same modelling as the PLD accountant)."""
    m = _one_run(m)
    if isinstance(m, Subsampled):
        atoms = representation_of(m.base, "pld_atoms")
        nb = m.neighbouring
        if atoms is None or m.scheme is not Sampling.POISSON or nb is Neighbouring.REPLACE_ONE:
            return None
        base = atoms(m.base)
        if m.rate >= 1.0 or len(base.loss) > 3:
            return None if _unrepresentable(base) else [base]
        if base.inf_mass > 0.0:  # the subsampled pair of an (eps, delta) step: the grid
            return None
        rem, add = _remove_atoms(base, m.rate), _add_atoms(base, m.rate)
        if nb is Neighbouring.REMOVE_ONLY:
            return [rem]
        if nb is Neighbouring.ADD_ONLY:
            return [add]
        return [rem, add]
    atoms = representation_of(m, "pld_atoms")
    if atoms is None:
        return None
    a = atoms(m)
    return None if _unrepresentable(a) else [a]


def _unrepresentable(atoms: Atoms) -> bool:
    """Atoms with mass at infinity whose finite losses exceed :data:`HUGE_PURE_EPSILON`
    (their smallest masses underflow), or more than three atoms (the multinomial
    enumeration's limit, e.g. a discrete Laplace of sensitivity 3 or more): left to the
    numerical accountant."""
    return len(atoms.loss) > 3 or (
        atoms.inf_mass > 0.0 and max(abs(x) for x in atoms.loss) > HUGE_PURE_EPSILON)


# ----------------------------------------------------------------------------------
# exact composition
# ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class DiscretePLD:
    """A finite privacy loss distribution with rounding allowances.

    Attributes
    ----------
    loss : ndarray, ascending
        Privacy losses ``log(P/Q)`` of the atoms (as computed).
    log_p : ndarray
        ``log P`` of each atom (as computed).
    loss_err : float
        Bound on ``|computed loss - exact loss|`` of every atom.
    rel_err : float
        Bound on ``|computed P / exact P - 1|`` of every atom (after exponentiation and
        summation).
    """

    loss: np.ndarray
    log_p: np.ndarray
    loss_err: float
    rel_err: float
    inf_mass: float = 0.0
    inf_rel_err: float = 0.0

    def infinite_mass(self, upper: bool = True) -> float:
        """The P-mass at loss ``+inf`` (``1 - prod_i (1 - delta_i)^{k_i}``), rounded up
        (``upper``) or down: delta at every epsilon is at least this."""
        s = 1.0 if upper else -1.0
        return min(1.0, max(0.0, self.inf_mass * (1.0 + s * self.inf_rel_err)))

    def _shifted(self, upper: bool) -> tuple[np.ndarray, np.ndarray]:
        s = 1.0 if upper else -1.0
        loss = self.loss + s * self.loss_err
        # (an allowance of 100% or more leaves no lower bound on a mass but 0: after
        # ~1e12 compositions; the upper side is unaffected)
        shift = math.log1p(s * self.rel_err) if s * self.rel_err > -1.0 else -math.inf
        return loss, self.log_p + shift

    @renamed_keywords("DiscretePLD.delta", eps="epsilon")
    def delta(self, epsilon: float, upper: bool = True) -> float:
        """``P(+inf) + sum_{l > epsilon} P(l) (1 - e^{epsilon - l})`` with the allowances
        on the safe side. ``eps=``, the former keyword, is deprecated."""
        loss, log_p = self._shifted(upper)
        sel = loss > epsilon
        inf = self.infinite_mass(upper)
        if not np.any(sel):
            return inf
        terms = np.exp(log_p[sel]) * -np.expm1(epsilon - loss[sel])
        val = math.fsum(terms.tolist())
        if inf > 0.0:
            val = (val + inf) * (1.0 + (2.0 * U if upper else -2.0 * U))
        return min(1.0, val) if upper else max(0.0, val)

    def epsilon(self, delta: float, upper: bool = True) -> float:
        """Smallest ``eps >= 0`` with ``delta(eps) <= delta`` (closed form between atoms:
        on ``(l_{j-1}, l_j]`` the profile is ``A_j - e^eps B_j``); the P-mass at ``+inf``
        is taken off ``delta`` first (``inf`` when it is not below ``delta``)."""
        inf = self.infinite_mass(upper)
        if inf > 0.0:
            # the finite atoms must bring delta(eps) down to delta - P(+inf)
            delta = (delta - inf) * (1.0 - 2.0 * U if upper else 1.0 + 2.0 * U)
            if delta <= 0.0:
                return math.inf
        loss, log_p = self._shifted(upper)
        n = loss.size
        # suffix sums A_j = sum_{i >= j} P_i and B_j = sum_{i >= j} P_i e^{-l_i}, in logs
        log_a = np.logaddexp.accumulate(log_p[::-1])[::-1]
        log_b = np.logaddexp.accumulate((log_p - loss)[::-1])[::-1]
        # delta at each atom: D_j = A_{j+1} - e^{l_j} B_{j+1} (locates the segment only)
        d_at = np.zeros(n)
        d_at[:-1] = np.exp(log_a[1:]) - np.exp(loss[:-1] + log_b[1:])
        # first atom j with D_j <= delta (D is non-increasing in eps); eps in (l_{j-1}, l_j]
        j = int(np.nonzero(d_at <= delta)[0][0])
        if loss[j] <= 0.0:
            return 0.0
        la, lb = float(log_a[j]), float(log_b[j])
        # eps = log((A_j - delta) / B_j); A_j - delta > 0 since delta < D_{j-1} <= A_j
        a = math.exp(la)
        if a <= delta:
            return max(0.0, float(loss[j - 1])) if j > 0 else 0.0
        eps = math.log(a - delta) - lb
        lo_edge = float(loss[j - 1]) if j > 0 else -math.inf
        eps = min(max(eps, lo_edge), float(loss[j]))
        # rounding of the final log/subtraction: relative few u of A/(A - delta)
        cond = a / (a - delta)
        slack = 8.0 * U * (cond + abs(eps) + abs(lb) + 1.0)
        eps = eps + slack if upper else eps - slack
        return max(0.0, eps)


def _log_multinomial_part(atoms: Atoms, k: int, window: tuple[int, int] | None = None
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All count vectors of ``k`` draws over the atoms of one step: (counts, log P, loss);
    for two atoms, ``window = (lo, hi)`` keeps the second atom's counts ``lo..hi`` only."""
    r = len(atoms.loss)
    lg = math.lgamma(k + 1)
    if r == 1:
        counts = np.array([[k]])
    elif r == 2:
        i = np.arange(k + 1) if window is None else np.arange(window[0], window[1] + 1)
        counts = np.stack([k - i, i], axis=1)
    else:
        i, j = np.meshgrid(np.arange(k + 1), np.arange(k + 1), indexing="ij")
        keep = i + j <= k
        i, j = i[keep], j[keep]
        counts = np.stack([k - i - j, i, j], axis=1)
        if r > 3:  # pragma: no cover - steps have at most 3 atoms
            raise ParameterValueError("at most 3 atoms per step")
    from scipy.special import gammaln

    log_coef = lg - gammaln(counts + 1.0).sum(axis=1)
    log_p = log_coef + counts @ np.array(atoms.log_p)
    loss = counts @ np.array(atoms.loss)
    return counts, log_p, loss


def _part_size(atoms: Atoms, k: int) -> int:
    r = len(atoms.loss)
    return 1 if r == 1 else (k + 1 if r == 2 else (k + 1) * (k + 2) // 2)


def _compose(parts: Sequence[tuple[Atoms, int]],
             windows: Sequence[tuple[int, int] | None] | None = None) -> DiscretePLD | None:
    """The exact composition of ``parts`` (None beyond :data:`MAX_ATOMS` atoms). With
    ``windows`` (one per part, for two-atom parts), only the count vectors inside them are
    kept: a sub-probability whose profile is below the composition's, for lower bounds
    only."""
    if windows is None:
        windows = [None] * len(parts)
    if any(k > MAX_EXACT_COUNT for _, k in parts):
        return None  # no lower bound left to read (:data:`MAX_EXACT_COUNT`)
    sizes = [_part_size(a, k) if w is None else w[1] - w[0] + 1
             for (a, k), w in zip(parts, windows, strict=True)]
    if math.prod(sizes) > MAX_ATOMS:
        return None
    loss = np.zeros(1)
    log_p = np.zeros(1)
    loss_err = 0.0
    log_err = 0.0
    for (atoms, k), window in zip(parts, windows, strict=True):
        _, lp, ls = _log_multinomial_part(atoms, k, window)
        loss = (loss[:, None] + ls[None, :]).ravel()
        log_p = (log_p[:, None] + lp[None, :]).ravel()
        mag_l = k * max(abs(x) for x in atoms.loss)
        mag_p = 3.0 * math.lgamma(k + 1) + k * max(abs(x) for x in atoms.log_p)
        # per-step loss/log-mass: a few u each (softplus, log1p, logaddexp); the count
        # combination adds at most (r + 2) u of the magnitudes; gammaln is accurate to a
        # few u of its value
        loss_err += 8.0 * U * (mag_l + 1.0) + 4.0 * U * k * max(abs(x) for x in atoms.loss)
        log_err += 8.0 * U * (mag_p + 1.0) + 4.0 * U * k * max(abs(x) for x in atoms.log_p)
    order = np.argsort(loss, kind="stable")
    loss, log_p = loss[order], log_p[order]
    n = loss.size
    # exp of a log with absolute error e: relative error <= e^{e} - 1; plus summation
    rel_err = math.expm1(log_err + 4.0 * U) + 4.0 * (n + 8) * U
    loss_err += 4.0 * U * float(np.max(np.abs(loss)))
    # P-mass at +inf: 1 - prod (1 - m_i)^{k_i}; the log-sum of same-signed terms is
    # relatively accurate to (parts + 2) u, which expm1 turns into (1 + |x|) times that
    log_fin = math.fsum(k * math.log1p(-a.inf_mass) for a, k in parts)
    inf_mass = -math.expm1(log_fin)
    inf_rel = 2.0 * (len(parts) + 6) * U * (1.0 + abs(log_fin)) + 4.0 * U
    return DiscretePLD(loss, log_p, loss_err, rel_err, inf_mass, inf_rel)


def _parts(mechanism: Mechanism) -> list[tuple[Mechanism, int]]:
    """The parts of ``mechanism`` read under one neighbouring relation
    (:func:`~privlearn.accounting.registry.read_relation`)."""
    if isinstance(mechanism, Composed):
        return list(read_relation(mechanism).parts)
    return [(mechanism, 1)]


def discrete_pld(mechanism: Mechanism) -> list[DiscretePLD] | None:
    """The exact composed PLD of ``mechanism`` per direction (remove, add), or ``None``
    when some part is not a pure-DP / randomized-response step (bare or Poisson
    subsampled under add/remove) or the PLD would have more than :data:`MAX_ATOMS`
    atoms."""
    dirs: list[list[tuple[Atoms, int]]] = [[], []]
    for m, k in _parts(mechanism):
        d = _step_directions(m)
        if d is None:
            return None
        dirs[0].append((d[0], k))
        dirs[1].append((d[-1], k))
    directional = any(a is not b for (a, _), (b, _) in zip(dirs[0], dirs[1], strict=True))
    out = []
    for parts in dirs[: 2 if directional else 1]:
        pld = _compose(parts)
        if pld is None:
            return None
        out.append(pld)
    return out


# ----------------------------------------------------------------------------------
# Laplace
# ----------------------------------------------------------------------------------
def _check_scale(noise_multiplier: object) -> float:
    """The Laplace scale ``b``, as :class:`Laplace` requires it: finite and > 0."""
    return check_positive("noise_multiplier", noise_multiplier,
                          hint="pass the Laplace scale divided by the sensitivity, e.g. 1.0")


def laplace_epsilon(noise_multiplier: float, delta: float) -> tuple[float, float]:
    """``(lower, upper)`` on the exact ``eps(delta) = max(0, 1/b + 2 log(1 - delta))`` of
    one Laplace mechanism with scale ``b = noise_multiplier`` (sensitivity 1)."""
    noise_multiplier = _check_scale(noise_multiplier)
    delta = query_delta(delta)
    if delta == 1.0:  # every mechanism is (0, 1)-DP
        return 0.0, 0.0
    eps0 = 1.0 / noise_multiplier
    val = eps0 + 2.0 * math.log1p(-delta)
    slack = 4.0 * U * (abs(eps0) + abs(val) + 1.0)
    return max(0.0, val - slack), min(eps0 * (1 + 2 * U), max(0.0, val + slack))


@renamed_keywords("laplace_delta", eps="epsilon")
def laplace_delta(noise_multiplier: float, epsilon: float) -> tuple[float, float]:
    """``(lower, upper)`` on the exact ``delta(epsilon) = 1 - exp((epsilon - 1/b) / 2)``
    (0 for ``epsilon >= 1/b``) of one Laplace mechanism. ``eps=``, the former keyword, is
    deprecated."""
    noise_multiplier = _check_scale(noise_multiplier)
    epsilon = query_epsilon(epsilon)
    eps0 = 1.0 / noise_multiplier
    if epsilon >= eps0:
        return 0.0, 0.0
    val = -math.expm1((epsilon - eps0) / 2.0)
    slack = 4.0 * U * (val + abs(epsilon - eps0) + U)
    return max(0.0, val - slack), min(1.0, val + slack)


def _single_run(mechanism: Mechanism, representation: str):
    """``fn(x)`` of the kind's ``representation`` (``exact_epsilon``/``exact_delta``) when
    ``mechanism`` is one run of a kind that registers it, else None."""
    parts = _parts(mechanism)
    if len(parts) == 1 and parts[0][1] == 1:
        m = _one_run(parts[0][0])
        fn = representation_of(m, representation)
        if fn is not None:
            return lambda x: fn(m, x)
    return None


# ----------------------------------------------------------------------------------
# entry points
# ----------------------------------------------------------------------------------
HUGE_PURE_EPSILON = 700.0
"""Above this the worst-case pair of a pure-DP step (a kind with ``pld_atoms``) has an
atom of probability ``e^-eps`` that underflows; mixed with parts that have no closed form
it is accounted by basic composition (see :func:`epsilon_bounds`)."""


def _split_huge(mechanism: Mechanism) -> tuple[float, Mechanism | None] | None:
    """``(sum of k * eps over huge pure-DP parts, the other parts)`` when some part with
    ``pld_atoms`` has a pure epsilon above ``HUGE_PURE_EPSILON`` and some other part has
    no closed form; else None."""
    parts = _parts(mechanism)
    eps = {m: _pure_epsilon(m) for m, _ in parts
           if representation_of(_one_run(m), "pld_atoms") is not None}
    eps = {m: e for m, e in eps.items() if math.isfinite(e)}  # (eps, delta) steps: no pure eps
    huge = [(m, k) for m, k in parts if eps.get(m, 0.0) > HUGE_PURE_EPSILON]
    if not huge:
        return None
    rest = [(m, k) for m, k in parts if (m, k) not in huge]
    if all(_step_directions(m) is not None for m, _ in rest):
        return None  # everything has a finite closed form: exact
    from privlearn.accounting.mechanisms import compose

    e = math.fsum(k * eps[m] for m, k in huge)
    return e, compose([m for m, _ in rest], steps=[k for _, k in rest])


def _pld_bounds(mechanism: Mechanism, what: str, at: float) -> tuple[float, float] | None:
    """``(lower, upper)`` on ``what`` ("epsilon" or "delta") at ``at`` from the exact
    discrete PLDs of :func:`discrete_pld` (the worst of its directions), or ``None``."""
    plds = discrete_pld(mechanism)
    if plds is None:
        return None
    if what == "epsilon" and max(p.infinite_mass(True) for p in plds) >= at * (1 - 1e-9):
        # delta at (or within rounding of) the mass at infinity: the numerical
        # accountant says why it cannot certify (or that epsilon is infinite)
        return None
    up = max(getattr(p, what)(at, upper=True) for p in plds)
    lo = max(getattr(p, what)(at, upper=False) for p in plds)
    return min(lo, up), up


def epsilon_bounds(mechanism: Mechanism, delta: float) -> tuple[float, float] | None:
    """``(lower, upper)`` on the exact epsilon(delta) of ``mechanism``, or ``None`` when
    no closed form applies (see module docstring). ``delta`` in ``(0, 1)``.

    Compositions that mix a :class:`PureDP` part with ``eps > 700`` (whose pair cannot be
    represented in floating point) with parts that have no closed form are bounded by
    basic composition (Dwork & Roth 2014, Theorem 3.16): ``upper = E + eps_rest(delta)``
    with ``E`` the huge parts' total epsilon; ``lower`` is the larger of the exact
    epsilon of the huge parts alone and the rest's lower bound (adding mechanisms never
    lowers epsilon). The relative gap is below ``eps_rest / E``.
    """
    delta = query_delta(delta)
    exact = _single_run(mechanism, "exact_epsilon")
    if exact is not None:
        return exact(delta)
    split = _split_huge(mechanism)
    if split is not None:
        e_huge, rest = split
        from privlearn.accounting.mechanisms import compose

        b = rest.epsilon_bounds(delta)
        huge_only = [(m, k) for m, k in _parts(mechanism) if m not in dict(_parts(rest))]
        hb = epsilon_bounds(compose([m for m, _ in huge_only], steps=[k for _, k in huge_only]),
                            delta)
        up = e_huge * (1 + 4 * U) + b.upper
        lo = max(hb[0] if hb else 0.0, b.lower if b.lower is not None else 0.0)
        return min(lo, up), up
    return _pld_bounds(mechanism, "epsilon", delta)


def delta_bounds(mechanism: Mechanism, epsilon: float) -> tuple[float, float] | None:
    """``(lower, upper)`` on the exact delta(epsilon), or ``None`` (see
    :func:`epsilon_bounds`)."""
    epsilon = query_epsilon(epsilon)
    exact = _single_run(mechanism, "exact_delta")
    if exact is not None:
        return exact(epsilon)
    split = _split_huge(mechanism)
    if split is not None:  # basic composition: delta(eps) <= delta_rest(eps - E)
        e_huge, rest = split
        if epsilon < e_huge * (1 + 4 * U):
            return 0.0, 1.0
        return 0.0, float(rest.delta(epsilon - e_huge * (1 + 4 * U)))
    return _pld_bounds(mechanism, "delta", epsilon)


def pure_dp_composition_epsilon(epsilons: Sequence[float], delta: float) -> float:
    """Certified (upper) optimal epsilon of the adaptive composition of ``eps_i``-DP
    mechanisms at ``delta`` (Kairouz, Oh & Viswanath 2015, Theorem 3.3 for equal
    epsilons; Murtagh & Vadhan 2016 for unequal ones)."""
    from privlearn.accounting.mechanisms import compose

    delta = query_delta(delta)
    if not epsilons:
        return 0.0
    if delta == 0.0:  # the largest privacy loss: the sum (KOV Theorem 3.3 with i = 0)
        return math.fsum(float(PureDP(float(e)).pure_epsilon) for e in epsilons) * (1 + 2 * U)
    bounds = epsilon_bounds(compose([PureDP(float(e)) for e in epsilons]), delta)
    if bounds is None:
        raise ParameterValueError(
            f"epsilons: the exact composition of {len(epsilons)} distinct pure-DP mechanisms "
            f"exceeds {MAX_ATOMS} atoms; use Mechanism.epsilon (numerical PLD) instead"
        )
    return bounds[1]


def _kov_homogeneous(eps0: float, k: int, delta: float) -> float:  # pragma: no cover
    """Kairouz-Oh-Viswanath Theorem 3.3 as stated (for cross-checks in the tests):
    the smallest ``eps_i = (k - 2i) eps0`` whose delta_i <= delta, where
    ``delta_i = sum_{l=0}^{i-1} C(k,l) (e^{(k-l) eps0} - e^{(k-2i+l) eps0}) / (1+e^eps0)^k``.
    Not certified (plain floating point); the exact value usually lies strictly between
    two of these grid values."""
    for i in range(k // 2 + 1):
        d = sum(
            math.comb(k, ell)
            * (math.exp((k - ell) * eps0) - math.exp((k - 2 * i + ell) * eps0))
            for ell in range(i)
        ) / (1 + math.exp(eps0)) ** k
        if d <= delta:
            return (k - 2 * i) * eps0
    return 0.0

