"""Privacy loss distribution (PLD) accountant with certified upper *and* lower bounds.

Registered as ``"pld"`` (the default accountant). Supported mechanisms: every kind with a
``pld_pair`` in the mechanism registry (:mod:`privlearn.accounting.registry`; built in:
:class:`Gaussian`, :class:`Laplace`, :class:`RandomizedResponse`, :class:`PureDP`),
:class:`Subsampled` of these (Poisson or fixed-size sampling, add/remove or replace-one
neighbouring) and :class:`Composed` lists of all of them (any counts). Everything
kind-specific below (pairs, pure epsilons, the replace-one pairs, scaling to twice the
sensitivity) is the kind's registered function.

Length: the accountant's query logic -- the plain grid, its refinement, the tilted grid
for tiny delta and the certified fallbacks -- is one decision procedure over one cache of
composed grids; the grid, tail, FFT and profile mechanics are already in ``_pld_*``.

Method
------
1. Compositions of kinds with an equivalent Gaussian are evaluated exactly in constant time by
   the analytic curve (:mod:`privlearn.accounting.analytic`; Dong, Roth & Su 2022,
   Corollary 3.3 and Balle & Wang 2018, Theorem 8); upper and lower bounds bracket the
   exact value by the certified floating-point error of its evaluation. One subsampled
   Gaussian step is evaluated from its pair's exact profile (:mod:`._pld_single`).
2. ``delta = 0`` is answered exactly (rounded up) from the description
   (:func:`privlearn.accounting.registry.pure_epsilon`): the pure epsilon of each step
   (Laplace ``1/b``, randomized response ``log(p (k-1) / (1-p))``, PureDP ``eps``,
   subsampled ``log(1 + q (e^eps - 1))`` -- Balle, Barthe & Gaboardi 2018, Theorems 8
   and 9 -- replace-one subsampled Laplace ``log((1-q+q e^{1/b}) / (1-q+q e^{-1/b}))``,
   and ``inf`` for any Gaussian), summed over the composition. These values are
   attained by the dominating pairs used below, so upper and lower bound coincide.
3. Otherwise each step's exact dominating pair (see :mod:`._pld_pairs`) is discretised on
   a uniform loss grid twice -- a *dominating* grid pair by "connect the dots"
   (Doroshenko et al. 2022, PETS) and a *dominated* grid pair (see
   :mod:`._pld_discrete`) -- and both are composed by FFT on a window certified by
   Chernoff bounds. The upper bound is the composed dominating PLD plus every error term
   (window tails, mass at infinity, floating-point allowance); the lower bound is the
   composed dominated PLD minus every error term. Hence ``lower <= true <= upper``.
   Far in the tail, where the FFT error allowance would dominate ``delta(eps)``, the
   upper bound also uses a Chernoff bound on the composed grid pair computed from the
   single-step PMFs, ``P(S > eps) <= min_lam E[e^{lam S}] e^{-lam eps}`` (plus the mass
   at infinity), which does not involve the FFT.
4. ``epsilon(delta)`` is solved exactly inside the grid cell where ``delta(eps)`` crosses
   the target (between grid points the composed profile is ``A - e^eps B``), rounding
   the upper bound up and the lower bound down.

Neighbouring relations and subsampling
--------------------------------------
Gaussian and Laplace noise multipliers are relative to the bound ``C`` on one record's
contribution (the add/remove sensitivity) under every relation (the convention of
Google's dp_accounting; see :mod:`privlearn.accounting.mechanisms`). PureDP and randomized
response state their epsilon for the relation of the :class:`Subsampled` object.

* Poisson, add/remove: the remove pair ``((1-q) Q + q P, Q)`` and the add pair
  ``(Q, (1-q) Q + q P)`` are composed separately and the worse one is reported (a fixed
  pair of neighbouring datasets has the same direction at every step; Zhu, Dong & Wang
  2022, Theorem 9 and Section 5; as in Google's dp_accounting).
* replace-one, Poisson sampling, Gaussian or Laplace base: replacing a record moves its
  contribution from ``+c`` to ``-c`` at worst, so one step is dominated by the tight pair
  ``((1-q) N(0,s^2) + q N(1,s^2), (1-q) N(0,s^2) + q N(-1,s^2))`` (Laplace:
  ``Lap(+-1, b)``; with probability ``1 - q`` the record is not in the batch and the
  outputs coincide; joint convexity, Balle, Barthe & Gaboardi 2018, Theorem 2). Its loss
  distribution is the same in both directions (reflection), so one composition
  suffices. This is dp_accounting's ``AdjacencyType.REPLACE`` for Poisson sampling; at
  ``q = 1`` it is the base at sensitivity ``2 C``.
* replace-one, fixed-size sampling (any base), and replace-one Poisson sampling of a
  PureDP / randomized response base: the symmetrised profile ``max(delta_remove,
  delta_add)`` of the base at the relation's sensitivity (Gaussian, Laplace: ``2 C``),
  i.e. the trade-off function ``C_q(f)`` of Dong, Roth & Su 2022, Theorem 9 (sampling
  without replacement; Balle, Barthe & Gaboardi 2018, Theorem 9 for its pure-DP case).
  Without replacement the pair above does not dominate: a batch that misses the record
  holds another one in its place, so the record ``+c`` against the replacement ``-c``
  (every other record ``-c``) gives ``((1-q) N(0,s^2) + q N(2,s^2), N(0,s^2))``, which
  ``C_q`` attains (Lebeda, Regehr, Kamath & Steinke 2024, Avoiding Pitfalls for Privacy
  Accounting of Subsampled Mechanisms under Composition, Section 5).
* fixed size, add/remove: the batch with and without the extra record differ by a
  replacement, whose sensitivity is at most twice the add/remove sensitivity (triangle
  inequality); the base pair is taken at twice the sensitivity (group privacy ``2 eps``
  for :class:`PureDP`) and both directions are composed separately.

Limitations
-----------
The floating-point allowance of the FFT composition is a worst-case bound that grows
with the number of steps (about ``1e-9`` for 1e4 DP-SGD steps). When it exceeds
``1e-3 delta`` the low-frequency Fourier coefficients are recomputed directly (see
:func:`._pld_fft.compose_fft`; each step's bulk term by term, its light tail -- at most
1e-3 of the mass, e.g. the sampled part at q=1e-5 -- through one FFT), which brings it
down to about ``2e-11`` per 1e4 steps (the rounding of the single-step masses, ``8 u``
per step, is then most of it). For smaller targets (tiny delta, 10^5-10^6 steps)
``epsilon(delta)`` composes the exponentially tilted PMFs instead
(:func:`._pld_fft.compose_fft_tilted`, tilt at the Chernoff optimum for the target): the
allowance becomes ``M e^{-theta eps}`` times the tilted one, i.e. relative to delta
rather than absolute, and delta down to 1e-14 and below is certified with the usual gap.
A tilt is composed only when that Chernoff factor at the target is below 0.1: a heavy
single-step tail (q=1e-5, sigma <= 0.8) keeps it near 1, and the tilted grid would cost
millions of points for no smaller allowance. The tilted answer is also combined (tighter
ends of both certified brackets) whenever the plain grid's gap stays above ``max_gap``
(refinement stops short of ``rel_gap`` when the error allowances keep it out of reach;
see :class:`PLDAccountant`). The tilt is first aimed between the plain grid's certified
lower bound and the smallest certified upper guess (the pure epsilon, the plain grid's
Chernoff bound -- the Renyi conversion of its own pair -- and the RDP accountant's).
Where the per-step rounding allowance (8 u a step) alone reaches delta and the plain grid
is large, that grid is not composed (its PMFs' Chernoff bound is still read), and without
its floor the tilt is aimed on a grid 4 times coarser before the full one.
Only when the tilted grid cannot answer either does ``epsilon(delta)`` return the
smallest of those certified upper guesses, with ``PrivacyBound.accountant``
naming the one that answered and the plain grid's lower bound; only when none exists is
:class:`AccountingError` raised rather than returning an uncertified value.

References
----------
.. [1] Koskela, Jalko & Honkela (2020), Computing Tight Differential Privacy Guarantees
       Using FFT, AISTATS.
.. [2] Doroshenko, Ghazi, Kamath, Kumar & Manurangsi (2022), Connect the Dots: Tighter
       Discrete Approximations of Privacy Loss Distributions, PETS.
.. [3] Zhu, Dong & Wang (2022), Optimal Accounting of Differential Privacy via
       Characteristic Function, AISTATS.
.. [4] Dong, Roth & Su (2022), Gaussian Differential Privacy, JRSS-B.
.. [5] Balle, Barthe & Gaboardi (2018), Privacy Amplification by Subsampling, NeurIPS.
.. [6] Esscher (1932), On the probability function in the collective theory of risk,
       Skandinavisk Aktuarietidskrift (the exponential tilt); Alghamdi, Gomez, Asoodeh,
       Calmon, Kosut & Sankar (2023), The Saddle-Point Method in Differential Privacy,
       ICML (its use for privacy loss distributions).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from privlearn.accounting import _pld_discrete as dsc
from privlearn.accounting import closed_form
from privlearn.accounting._pld_fallback import fallback_delta
from privlearn.accounting._pld_lower import binary_lower
from privlearn.accounting._pld_mass import mass_at_infinity, refuse_below_mass_at_infinity
from privlearn.accounting._pld_pairs import AddPair, Pair, RemovePair
from privlearn.accounting._pld_profile import PLDResult as _Result
from privlearn.accounting._pld_profile import delta_at as _delta_at
from privlearn.accounting._pld_profile import delta_upper as _delta_upper
from privlearn.accounting._pld_profile import eps_for_delta as _eps_for_delta
from privlearn.accounting._pld_profile import grid_gap as _grid_gap
from privlearn.accounting._pld_rdp_cap import rdp_capped
from privlearn.accounting._pld_single import single_step_gaussian
from privlearn.accounting._pld_steps import discretize_all, grid_gain_small, pmfs_stub, rdp_guess
from privlearn.accounting._pld_tails import chernoff_theta
from privlearn.accounting._queries import query_delta, query_epsilon
from privlearn.accounting._types import PrivacyBound
from privlearn.accounting.accountants import get_accountant, register_accountant
from privlearn.accounting.analytic import gaussian_delta_bounds, gaussian_epsilon_bounds
from privlearn.accounting.mechanisms import Composed, Mechanism, Neighbouring, Sampling, Subsampled
from privlearn.accounting.registry import (
    equivalent_gaussian,
    lookup,
    read_relation,
    relation_base,
    representation_of,
)
from privlearn.accounting.registry import pure_epsilon as _registry_pure_epsilon
from privlearn.errors import (
    AccountingError,
    CertificationError,
    UnsupportedMechanismError,
)

__all__ = ["PLDAccountant", "pure_epsilon"]


# ----------------------------------------------------------------------------------
# description -> steps (every kind-specific piece comes from the mechanism registry)
# ----------------------------------------------------------------------------------


def _parts(mechanism: Mechanism) -> list[tuple[Mechanism, int]]:
    if isinstance(mechanism, Composed):
        parts = list(mechanism.parts)
    else:
        parts = [(mechanism, 1)]
    for m, _ in parts:
        _check_supported(m)
    return parts


def _check_supported(m: Mechanism) -> None:
    """Every kind needs a registered ``pld_pair`` (raises UnsupportedMechanismError)."""
    lookup("pld_pair", m.base if isinstance(m, Subsampled) else m, accountant="pld")


def _base_pair(m: Mechanism) -> Pair:
    """Dominating pair of one run of a (non-structural) mechanism."""
    return lookup("pld_pair", m, accountant="pld")(m)


def _replace_pair(m: Subsampled) -> Pair | None:
    """The tight replace-one pair of a Poisson-subsampled mechanism whose kind registers
    one (a record's contribution moves from ``+c`` to ``-c``), or None.

    Poisson sampling only: without replacement, the batch that misses the record holds
    another record in its place, so the outputs with and without it differ by up to
    ``2 c`` (e.g. the record ``+c``, every other ``-c``, the replacement ``-c``) and one
    step is ``((1-q) N(0, s^2) + q N(2, s^2), N(0, s^2))``, far beyond the pair above
    (Lebeda, Regehr, Kamath & Steinke 2024, Avoiding Pitfalls for Privacy Accounting of
    Subsampled Mechanisms under Composition, Section 5)."""
    if (m.neighbouring is not Neighbouring.REPLACE_ONE or m.rate >= 1.0
            or m.scheme is not Sampling.POISSON):
        return None
    fn = representation_of(m.base, "pld_replace_one_pair")
    return None if fn is None else fn(m.base, m.rate)


def pure_epsilon(mechanism: Mechanism) -> float:
    """Epsilon at ``delta = 0`` of the modelled pairs, summed over the composition
    (:func:`privlearn.accounting.registry.pure_epsilon`, rounded up); raises
    :class:`UnsupportedMechanismError` for mechanisms this accountant cannot evaluate."""
    _parts(mechanism)
    return _registry_pure_epsilon(mechanism)


@dataclass(frozen=True)
class _Step:
    kind: str  # "sym" (same pair both directions), "dir" (remove/add), "max" (symmetrised)
    a: Pair
    b: Pair | None = None


def _step(m: Mechanism) -> _Step:
    if isinstance(m, Subsampled):
        rep = _replace_pair(m)
        if rep is not None:  # symmetric: (Q, P) has the same loss distribution
            return _Step("sym", rep)
        base = _base_pair(relation_base(m, accountant="pld"))
        q = m.rate
        if q >= 1.0:
            return _Step("sym", base)
        rem, add = RemovePair(base, q), AddPair(base, q)
        if m.neighbouring is Neighbouring.REMOVE_ONLY:  # one-sided relations (autodp's)
            return _Step("sym", rem)
        if m.neighbouring is Neighbouring.ADD_ONLY:
            return _Step("sym", add)
        if m.neighbouring is Neighbouring.REPLACE_ONE:
            return _Step("max", rem, add)
        return _Step("dir", rem, add)
    return _Step("sym", _base_pair(m))


# ----------------------------------------------------------------------------------
# the accountant
# ----------------------------------------------------------------------------------


class PLDAccountant:
    """Privacy-loss-distribution accountant (see module docstring).

    Parameters
    ----------
    n_target : int
        Target FFT length: the grid spacing is chosen so that the composition window has
        about this many points (finer grids are tighter and slower).
    max_points : int
        Largest FFT length allowed; coarser grids keep the upper bound certified and only
        loosen the lower bound. A refinement of the tilted grid (tiny delta) stops before
        a grid above twice this.
    tail_tol : float
        Certified bound on the probability mass outside the FFT window on each side.
    rel_gap : float
        Target relative gap between upper and lower epsilon; the grid is refined (up to
        ``max_points``) while the gap is larger.
    max_gap : float
        Relative gap accepted when ``rel_gap`` is out of reach: once the part of the gap
        held open by the certified error allowances (which a finer grid does not
        reduce) would keep it above ``rel_gap`` for two more halvings of the grid,
        refinement stops as soon as the gap is below ``max_gap``; the certified upper
        end is returned. Refining would cost 2-8 times the time for an upper bound
        tighter by a fraction of the gap. Refinement also stops when the allowance part
        alone exceeds ``max_gap``. ``delta()`` refines through the same loop with ten
        times these targets (delta is far more sensitive to the grid than epsilon) and
        at most two halvings.
    cache_size : int
        Number of composed mechanisms kept (epsilon and delta queries reuse them). The
        cache is shared by every thread that uses the accountant (the registered ``"pld"``
        accountant is one object): a lock guards it, and compositions are computed outside
        the lock, so threads compute in parallel and never see a partial entry.
    fallback : bool
        When the grid cannot certify ``delta`` (tiny delta, long compositions), answer
        with the smaller of the pure epsilon and the RDP accountant's epsilon, named in
        ``PrivacyBound.accountant`` (default; ``delta`` likewise answers with the RDP
        accountant's delta where no loss grid holds a step); ``False`` raises
        :class:`AccountingError`.
    """

    name = "pld"

    def __init__(
        self,
        *,
        n_target: int = 1 << 16,
        max_points: int = 1 << 21,
        tail_tol: float = 1e-18,
        rel_gap: float = 0.003,
        max_gap: float = 0.01,
        cache_size: int = 16,
        fallback: bool = True,
    ) -> None:
        self.n_target = int(n_target)
        self.max_points = int(max_points)
        self.tail_tol = float(tail_tol)
        self.rel_gap = float(rel_gap)
        self.max_gap = max(float(max_gap), self.rel_gap)
        self.cache_size = int(cache_size)
        self.fallback = bool(fallback)
        self._cache: OrderedDict[tuple, _Result] = OrderedDict()
        self._lock = threading.Lock()

    # -- public API --------------------------------------------------------------------
    def epsilon(self, mechanism: Mechanism, delta: float) -> PrivacyBound:
        """Certified ``PrivacyBound(upper, lower)`` on epsilon at the given delta (of
        ``mechanism`` read under one neighbouring relation:
        :func:`privlearn.accounting.registry.read_relation`)."""
        mechanism, delta = read_relation(mechanism), query_delta(delta)
        refuse_below_mass_at_infinity(_parts(mechanism), _step, delta)
        with np.errstate(all="ignore"):  # noise 1e-300, eps 1e308: inf, NaN (checked)
            return rdp_capped(binary_lower(self._epsilon(mechanism, delta), _parts(mechanism),
                                           _step, "epsilon", delta), mechanism, "epsilon", delta)

    def _epsilon(self, mechanism: Mechanism, delta: float) -> PrivacyBound:
        parts = _parts(mechanism)
        sigma = equivalent_gaussian(mechanism)
        if sigma is not None:  # exact curve, bracketed by its floating-point error
            lo, up = gaussian_epsilon_bounds(sigma, delta)
            return PrivacyBound(up, lo, self.name)
        exact = closed_form.epsilon_bounds(mechanism, delta) if delta > 0.0 else None
        if exact is not None:  # exact finite PLD / Laplace closed form
            return PrivacyBound(exact[1], exact[0], self.name)
        one = self._single(parts, "epsilon", delta)
        if one is not None:  # one subsampled Gaussian step: its pair, no grid
            return PrivacyBound(min(one[1], pure_epsilon(mechanism)), one[0], self.name)
        if delta <= 0.0:
            e = pure_epsilon(mechanism)
            if math.isinf(e):
                return PrivacyBound(math.inf, math.inf, self.name)
            # the exact value, rounded up (upper) and down by as much again (lower): the
            # dominating pairs attain it
            return PrivacyBound(e, e * (1.0 - 16.0 * dsc.U), self.name)
        pe = pure_epsilon(mechanism)  # epsilon(delta) <= epsilon(0) for every delta
        res = None
        steps = sum(k for _, k in parts)
        # every grid that is not tilted carries the per-step rounding allowance (8 u a
        # step, :func:`._pld_fft.compose_fft`): where that alone reaches delta, neither
        # the plain nor the accurate grid can certify an upper bound
        hopeless = 8.0 * dsc.U * steps >= delta
        cher0 = math.inf  # (the plain grid's Chernoff bound, when only its PMFs are made)
        try:
            stub = self._compute(parts, 1.0, pmfs_only=True) if hopeless else None
            if stub is not None and _SKIP_HOPELESS and stub.window_points > 2 * self.n_target:
                # (a cheap grid is still composed: its lower end places the tilt)
                cher0 = max(u.chernoff_epsilon(delta) for u, _ in stub.directions)
                raise CertificationError(
                    f"pld: cannot certify delta={delta:g}: the rounding allowance of "
                    f"{steps} steps alone is {8.0 * dsc.U * steps:.3g}")
            res = self._composed(mechanism, parts, h_scale=1.0)
            accurate = res.slack() > 1e-3 * delta
            if accurate and hopeless:
                # the accurate grid keeps the per-step rounding allowance (8 u a step,
                # :func:`._pld_fft.compose_fft`), which alone reaches delta: it cannot
                # certify either (composing it cost seconds at 1e3-1e5 steps)
                raise CertificationError(
                    f"pld: cannot certify delta={delta:g}: the rounding allowance of "
                    f"{steps} steps alone is {8.0 * dsc.U * steps:.3g}")
            if accurate:  # small delta: recompute the low frequencies without FFT error
                res = self._composed(mechanism, parts, h_scale=1.0, accurate=True)
            up, lo = self._eps_bounds(res, delta)
        except (AccountingError, OverflowError) as err:
            # e.g. delta below the certified FFT error terms, or a loss grid beyond floats.
            # The plain grid's lower bound stays valid (its allowance is subtracted): it
            # is also the floor of the tilt's search (:meth:`_tilted_epsilon`)
            # Its Chernoff bound (:meth:`ComposedPLD.chernoff_epsilon`) is a certified
            # upper bound, the first guess of the tilt and a fallback
            floor, cher = None, cher0
            if res is not None:
                try:
                    floor = max(_eps_for_delta(low, delta, False) for _, low in res.directions)
                except (AccountingError, OverflowError):
                    floor = None
                cher = max(u.chernoff_epsilon(delta) for u, _ in res.directions)
            tilted = self._tilted_epsilon(mechanism, parts, delta, min(pe, cher), floor=floor)
            if tilted is not None:
                if floor is not None and tilted.lower is not None:
                    return PrivacyBound(tilted.upper, min(max(tilted.lower, floor),
                                                          tilted.upper), tilted.accountant)
                return tilted
            if not self.fallback:
                raise
            fb = self._fallback_epsilon(mechanism, delta, min(pe, cher), err)
            if 8.0 * dsc.U * steps > _LOWER_ALLOWANCE_CAP:
                # the grid's lower end could only be read where delta(eps) exceeds its
                # rounding allowance (above 1e-6): not worth a grid of millions of
                # points (2e14 steps: 10 s); 0 is the certified lower end it would give
                return PrivacyBound(fb.upper, 0.0, fb.accountant)
            try:
                res = self._composed(mechanism, parts, h_scale=1.0, accurate=True)
                lo = max(_eps_for_delta(low, delta, False) for _, low in res.directions)
            except (_TooLarge, AccountingError, OverflowError):
                return fb
            return PrivacyBound(fb.upper, min(lo, fb.upper), fb.accountant)
        allow = self._allowance_gap(res, delta, up, lo)
        up, lo = min(up, pe), min(lo, pe)
        # (when the allowance part alone exceeds max_gap, no finer plain grid can bring
        # the gap under it: the tilted composition below, whose allowance is relative,
        # is what can)
        up, lo = self._refine(mechanism, parts, self._eps_bracket(delta), up, lo, allow,
                              accurate=accurate)
        if up > 0 and (up - lo) > self.max_gap * up and accurate:
            # the gap is held open by the FFT error allowance (small delta): the tilted
            # composition's allowance is relative; both brackets are certified, so take
            # the tighter ends
            tilted = self._tilted_epsilon(mechanism, parts, delta, pe, first_guess=up,
                                          floor=lo)
            if tilted is not None:
                up = min(up, tilted.upper)
                lo = max(lo, tilted.lower if tilted.lower is not None else lo)
        return PrivacyBound(min(up, pe), min(lo, up, pe), self.name)

    def delta(self, mechanism: Mechanism, epsilon: float) -> PrivacyBound:
        """Certified ``PrivacyBound(upper, lower)`` on delta at the given epsilon (of
        ``mechanism`` read under one neighbouring relation, as :meth:`epsilon`)."""
        mechanism, epsilon = read_relation(mechanism), query_epsilon(epsilon)
        with np.errstate(all="ignore"):  # as in epsilon
            return rdp_capped(binary_lower(self._delta(mechanism, epsilon), _parts(mechanism),
                                           _step, "delta", epsilon), mechanism, "delta", epsilon)

    def _delta(self, mechanism: Mechanism, epsilon: float) -> PrivacyBound:
        parts = _parts(mechanism)
        sigma = equivalent_gaussian(mechanism)
        if sigma is not None:
            lo, up = gaussian_delta_bounds(sigma, epsilon)
            return PrivacyBound(up, lo, self.name)
        exact = closed_form.delta_bounds(mechanism, epsilon)
        if exact is not None:  # exact finite PLD / Laplace closed form
            return PrivacyBound(exact[1], exact[0], self.name)
        one = self._single(parts, "delta", epsilon)
        if one is not None:  # one subsampled Gaussian step: its pair, no grid
            return PrivacyBound(one[1], one[0], self.name)
        pe = pure_epsilon(mechanism)
        if epsilon >= pe * (1.0 + 4.0 * dsc.U):  # beyond the largest privacy loss
            return PrivacyBound(0.0, 0.0, self.name)
        try:
            res = self._composed(mechanism, parts, h_scale=1.0)
            up = _delta_upper(res, epsilon)
            # (also when a Chernoff bound already took delta below the FFT allowance: the
            # accurate allowance can be far smaller -- q=1e-5: 2e-10 instead of 1.7e-6)
            accurate = res.slack() > 1e-3 * up
            if accurate:  # small delta: recompute the low frequencies without FFT error
                res = self._composed(mechanism, parts, h_scale=1.0, accurate=True)
                up = min(up, _delta_upper(res, epsilon))  # both certified
        except (AccountingError, OverflowError) as err:
            # no grid holds a step (an overflow), or the low frequencies of ~1e16 or more
            # steps cannot be recomputed (their allowance overflows): RDP, as epsilon does
            if not self.fallback:
                raise
            return fallback_delta(mechanism, epsilon, pe, mass_at_infinity(parts, _step), err)
        lo = max(mass_at_infinity(parts, _step), *(_delta_at(low, epsilon, False)
                                                     for _, low in res.directions))
        allow = max(0.0, (up - lo) - _grid_gap(res, epsilon))
        # delta is far more sensitive than epsilon to the grid: the targets are 10 x
        # rel_gap and 10 x max_gap, and at most two halvings
        up, lo = self._refine(mechanism, parts, self._delta_bracket(epsilon), up, lo, allow,
                              accurate=accurate, scale=10.0, min_h_scale=1 / 4)
        if up > 0 and (up - lo) > 10 * self.max_gap * up and epsilon > 0:
            # the gap is held open by the plain grid's absolute FFT allowance (delta far
            # below it, e.g. 1e-12 after 100 steps): the composition tilted at epsilon
            # has a relative allowance (module docstring, Limitations); both brackets are
            # certified, so take the tighter ends
            try:
                res_t = self._composed(mechanism, parts, 1.0, True, tilt_at=epsilon)
                up = min(up, _delta_upper(res_t, epsilon))
                lo = max(lo, max(_delta_at(low, epsilon, False) for _, low in res_t.directions))
            except (_TooLarge, AccountingError, OverflowError):
                pass
        who = self.name
        if up > 0 and (up - lo) > 10 * self.max_gap * up and epsilon > 0:
            # still open: at a large epsilon the grid's absolute floor (its FFT and
            # truncation allowances, ~1e-20) exceeds delta itself, which the RDP
            # accountant's certified delta then beats by orders of magnitude
            try:
                rdp_up = get_accountant("rdp").delta(mechanism, epsilon).upper
            except (UnsupportedMechanismError, AccountingError):
                rdp_up = math.inf
            if rdp_up < up:
                up, who = rdp_up, "rdp"
        if math.isfinite(pe):
            # every composed loss is <= pe (to a few ulps), so delta(eps) =
            # E_P[(1 - e^{eps - L})_+] <= 1 - e^{eps - pe} <= pe - eps: near the pure
            # epsilon this beats the grid, whose atoms sit up to h above the true loss
            up = min(up, max(0.0, pe * (1.0 + 16.0 * dsc.U) - epsilon))
        # the grid's lower pairs drop the mass at infinity, which delta never falls below
        lo = max(lo, mass_at_infinity(parts, _step))
        return PrivacyBound(up, min(lo, up), who)

    # -- internals ---------------------------------------------------------------------
    def _single(self, parts, what: str, at: float) -> tuple[float, float] | None:
        """One step of subsampled Gaussian pairs (:mod:`._pld_single`), else None."""
        if len(parts) != 1 or parts[0][1] != 1:
            return None
        return single_step_gaussian(_step(parts[0][0]), what, at, self.rel_gap)

    def _fallback_epsilon(
        self, mechanism: Mechanism, delta: float, pe: float, err: AccountingError
    ) -> PrivacyBound:
        """When the grid cannot certify ``delta`` (tiny delta, long compositions), the
        smallest certified answer of the other methods: ``pe`` (the pure epsilon, a valid
        epsilon for every delta, or the plain grid's Chernoff bound where smaller) and
        the RDP accountant (for Poisson sampling under
        replace-one, its bound for fixed-size sampling; see :func:`._pld_steps.rdp_guess`).
        ``PrivacyBound.accountant`` says
        which one answered (``"pld"`` for ``pe``, ``"rdp"``); no lower bound.
        Raises the grid's error when neither can answer."""
        candidates: list[tuple[float, str]] = []
        if math.isfinite(pe):
            candidates.append((pe, self.name))
        # the RDP accountant's epsilon; for Poisson sampling under replace-one, which it
        # does not account, that of fixed-size sampling, whose mechanism attains the
        # Poisson pair (a record +c or -c, the one it replaces 0), so its RDP bound holds
        # for that pair (:func:`._pld_steps.rdp_guess`); none when RDP cannot answer either
        candidates.extend((e, "rdp") for e in rdp_guess(mechanism, _parts(mechanism), delta))
        if not candidates or not math.isfinite(min(candidates)[0]):
            raise err
        up, who = min(candidates)
        return PrivacyBound(up, None, who)

    def _tilted_epsilon(
        self, mechanism: Mechanism, parts, delta: float, pe: float,
        first_guess: float | None = None, floor: float | None = None,
    ) -> PrivacyBound | None:
        """Epsilon from the exponentially tilted composition (tiny delta, very long
        runs; :func:`privlearn.accounting._pld_fft.compose_fft_tilted`), or None when it
        cannot certify either. The tilt is the Chernoff-optimal one for a guess of
        epsilon (the pure or RDP epsilon first, then the tilted answer itself, until it
        moves by less than 2%); the grid is then refined while the certified gap exceeds
        ``rel_gap``, as on the plain path.

        ``floor``: a certified lower bound on epsilon (the plain grid's), or None. A
        guess far above epsilon puts the tilted window above it (or makes it too wide
        for the grid); the next guess is then the geometric mean of the guess and the
        floor, or 0.7 times the guess without one. Only the tilt's placement depends
        on the guesses, never the certification: an RDP guess loose by orders of
        magnitude (fixed-size sampling under replace-one at small noise multipliers:
        21500 for a true ~163) costs a few refused windows, not the answer."""
        guesses = [pe] if math.isfinite(pe) else []
        if first_guess is not None:
            guesses.append(first_guess)
        else:
            guesses.extend(rdp_guess(mechanism, parts, delta))
        guesses = [g for g in guesses if math.isfinite(g) and g > 0]
        if floor is not None and not (math.isfinite(floor) and floor > 0):
            floor = None
        if not guesses:
            if floor is None:
                return None
            guesses = [2.0 * floor]
        guess = min(guesses)
        retry_at = None
        if floor is not None and guess > 1.1 * floor:
            # epsilon lies between the certified floor and the upper guesses, usually far
            # nearer the floor (an RDP or Chernoff guess is loose, the plain grid's lower
            # bound only by its allowance): aim between them, and at the upper guess
            # itself if that window is refused
            retry_at, guess = guess, math.sqrt(guess * floor)
        up = lo = None
        lowered = False
        try:
            # the tilt is aimed on a grid _COARSE times coarser (a quarter of the cost;
            # only where the tilt sits depends on it), then composed at full resolution
            # at the aim it converged to (only that answer is used); any refusal of the
            # coarse grid falls back to aiming at full resolution
            # (with a floor the first aim, between it and the upper guess, is close)
            coarse, aimed, coarse_at = _COARSE > 1.0 and floor is None, False, None
            for _ in range(16):
                try:
                    res = self._composed(mechanism, parts, _COARSE if coarse else 1.0, True,
                                         tilt_at=guess, tilt_delta=delta,
                                         check_gain=not lowered)
                    up2, lo2 = self._eps_bounds(res, delta)
                except _NoTiltGain:
                    if retry_at is not None:  # (a Chernoff factor at the lower aim)
                        guess, retry_at = retry_at, None
                        continue
                    if coarse:  # (the coarse PMFs' Chernoff factor is the larger one)
                        coarse = False
                        continue
                    break  # at the target itself: the tilt cannot help
                except (AccountingError, OverflowError) as exc:
                    if coarse:  # aim at full resolution, as without the coarse grid
                        coarse = False
                        continue
                    if not isinstance(exc, AccountingError):
                        raise
                    # e.g. the guess was far above epsilon, so the tilted window starts
                    # above it: aim lower (a tilt for a loss below the target; its
                    # Chernoff factor at the guess says nothing of the allowance at it)
                    if retry_at is not None:
                        guess, retry_at = retry_at, None
                        continue
                    if floor is not None and guess > 1.1 * floor:
                        guess = math.sqrt(guess * floor)
                    else:
                        guess *= 0.7
                    lowered = True
                    continue
                retry_at = None
                if coarse:
                    coarse_at = (up2, up2, lo2)  # (the next aim, its bracket)
                    if abs(up2 - guess) <= 0.02 * up2 or up2 - lo2 <= self.rel_gap * up2:
                        coarse, aimed = False, True  # compose at full resolution there
                    guess = up2
                    continue
                if up is None or up2 < up:
                    up, lo, best, best_res = up2, lo2, guess, res
                # (the tilt need not be optimal: one aimed on the coarse grid, whose
                # allowance differs, can be 2-4% off, which moves the answer by 1e-4)
                if abs(up2 - guess) <= (0.05 if aimed else 0.02) * up2:
                    break
                aimed = False
                if up2 - lo2 <= self.rel_gap * up2:
                    # already as tight as a refinement would make it: a tilt placed at
                    # the answer would only shrink an allowance that does not matter
                    break
                guess = up2
            if up is None:
                return None
            if _SKIP_BLIND_REFINE and (
                    grid_gain_small(coarse_at, best, up, lo, _COARSE, self.rel_gap)
                    or (lo <= 0.0 and first_guess is not None and up >= first_guess)):
                # no lower end (a finer grid keeps it 0) and the coarse aim shows the upper
                # end's grid error below rel_gap (fixed-size sampling at q=1e-6: 3 s for an
                # upper end larger) or the caller's refined plain grid already has the
                # lower upper end (``first_guess``), or the coarse aim shows the grid holds
                # too little of the gap for a halving to pay; the caller's lower ends apply
                return PrivacyBound(min(up, pe), min(lo, up, pe), self.name)
            allow = self._allowance_gap(best_res, delta, up, lo)
            up, lo = self._refine(mechanism, parts, self._eps_bracket(delta), up, lo,
                                  allow, accurate=True, tilt_at=best, tilt_delta=delta,
                                  check_gain=False)
        except (_TooLarge, AccountingError):
            if up is None:
                return None
        return PrivacyBound(min(up, pe), min(lo, up, pe), self.name)

    def _refine(
        self, mechanism: Mechanism, parts, bracket, up: float, lo: float, allow: float,
        *, accurate: bool, tilt_at: float | None = None, scale: float = 1.0,
        min_h_scale: float = 1 / 64, tilt_delta: float | None = None,
        check_gain: bool = True,
    ) -> tuple[float, float]:
        """The grid refinement shared by every query: halve the grid spacing while the
        certified bracket ``[lo, up]`` is wider than ``scale * rel_gap`` (relative) and
        refining can still pay (:meth:`_out_of_reach`); keep the tighter end of each
        bracket (each is certified). ``bracket(res) -> (up, lo, allow)`` reads one
        composition; ``allow`` is the part of its gap held open by the error allowances.
        Stops when a halving no longer shrinks the gap by 20% (the grid is no longer
        what limits it) or the grid would exceed ``max_points``."""
        h_scale = 1.0
        while (up > 0 and (up - lo) > scale * self.rel_gap * up and h_scale > min_h_scale
               and not self._out_of_reach(up, lo, allow, scale)):
            # a halving leaves about allow + grid gap / 4 (second order in h): while that
            # is still above max_gap, skip the level (its grid is a third of the next
            # one's cost, and the next one's bracket is the tighter); a finer grid that is
            # too large falls back to the halving
            step = 4.0 if (h_scale / 4.0 >= min_h_scale and allow + (up - lo - allow) / 4.0
                           > 2.0 * scale * self.max_gap * up) else 2.0
            try:
                res2 = self._composed(mechanism, parts, h_scale / step, accurate,
                                      tilt_at=tilt_at, tilt_delta=tilt_delta,
                                      check_gain=check_gain)
            except _TooLarge:
                if step == 2.0:
                    break
                step, res2 = 2.0, None
            except (AccountingError, OverflowError):
                break
            try:
                if res2 is None:
                    res2 = self._composed(mechanism, parts, h_scale / 2.0, accurate,
                                          tilt_at=tilt_at, tilt_delta=tilt_delta,
                                          check_gain=check_gain)
                up2, lo2, allow = bracket(res2)
            except (_TooLarge, AccountingError, OverflowError):
                break
            h_scale /= step
            gap_before = up - lo
            up, lo = min(up, up2), max(lo, lo2)
            if up - lo > 0.8 * gap_before:
                break
        return up, lo

    def _eps_bracket(self, delta: float):
        def bracket(res: _Result) -> tuple[float, float, float]:
            up, lo = self._eps_bounds(res, delta)
            return up, lo, self._allowance_gap(res, delta, up, lo)
        return bracket

    @staticmethod
    def _delta_bracket(epsilon: float):
        def bracket(res: _Result) -> tuple[float, float, float]:
            up = _delta_upper(res, epsilon)
            lo = max(_delta_at(low, epsilon, False) for _, low in res.directions)
            # the allowance part: what the composed grid profiles' difference leaves
            return up, lo, max(0.0, (up - lo) - _grid_gap(res, epsilon))
        return bracket

    def _out_of_reach(self, up: float, lo: float, allow: float, scale: float = 1.0) -> bool:
        """Whether refinement should stop short of ``scale * rel_gap``: the allowance
        part of the gap alone exceeds ``scale * max_gap`` (no finer grid brings the gap
        under it), or the gap is below ``scale * max_gap`` and, with its grid part
        shrinking fourfold per halving (second order in ``h``), two more halvings would
        leave it above ``scale * rel_gap``. Only decides how long to refine; every
        bracket returned is certified."""
        gap = up - lo
        if allow > scale * self.max_gap * up:
            return True
        return (gap <= scale * self.max_gap * up
                and allow + (gap - allow) / 16.0 > scale * self.rel_gap * up)

    @staticmethod
    def _allowance_gap(res: _Result, delta: float, up: float, lo: float) -> float:
        """The part of the epsilon gap ``up - lo`` of ``res`` due to its error allowances
        (FFT round-off, window tails, the tilted allowance), which a finer grid does not
        reduce: the distance of each end from the epsilon of the same grid profile
        without its allowance (a heuristic for when to stop refining; never a bound)."""
        try:
            up_raw = max(
                _eps_for_delta(u, delta + u.slack_up + u.tilt_slack(up), True)
                for u, _ in res.directions)
            lo_raw = max(
                _eps_for_delta(low, delta - min(low.slack_low + low.tilt_slack(lo),
                                                0.5 * delta), False)
                for _, low in res.directions)
        except (AccountingError, OverflowError):
            return 0.0
        return max(0.0, up - up_raw) + max(0.0, lo_raw - lo)

    def _eps_bounds(self, res: _Result, delta: float) -> tuple[float, float]:
        up = max(_eps_for_delta(u, delta, True) for u, _ in res.directions)
        lo = max(_eps_for_delta(low, delta, False) for _, low in res.directions)
        return up, lo

    def _composed(
        self, mechanism: Mechanism, parts, h_scale: float, accurate: bool = False,
        tilt_at: float | None = None, tilt_delta: float | None = None,
        check_gain: bool = True,
    ) -> _Result:
        """The composition at grid scale ``h_scale`` (cached). With ``tilt_at``, tilted
        for that loss; ``tilt_delta`` (the target delta, when known) loosens the tilted
        window's tails to what that target needs; ``check_gain`` refuses
        (:class:`_NoTiltGain`) a tilt whose Chernoff factor at ``tilt_at`` is not small."""
        key = (mechanism, h_scale, accurate, tilt_at, tilt_delta)
        with self._lock:
            res = self._cache.get(key)
            if res is not None:
                self._cache.move_to_end(key)
                return res
        # computed outside the lock (threads compose in parallel; a composition is
        # deterministic, so two threads computing the same key store equal results)
        res = self._compute(parts, h_scale, accurate, tilt_at, tilt_delta, check_gain)
        with self._lock:
            self._cache[key] = res
            self._cache.move_to_end(key)
            # bound the memory held: at most cache_size entries and ~2e7 grid points
            held = sum(_points(r) for r in self._cache.values())
            while len(self._cache) > self.cache_size or (
                    len(self._cache) > 1 and held > 2e7):
                _, old = self._cache.popitem(last=False)
                held -= _points(old)
        return res

    def _compute(self, parts, h_scale: float, accurate: bool = False,
                 tilt_at: float | None = None, tilt_delta: float | None = None,
                 check_gain: bool = True, pmfs_only: bool = False) -> _Result:
        steps = [(_step(m), k) for m, k in parts]
        T = sum(k for _, k in parts)
        step_tol = self.tail_tol / max(T, 1)
        directional = any(s.kind in ("dir", "max") for s, _ in steps)
        # 1. a coarse pass sizes the window (Chernoff bounds of the coarse PMFs)
        lo_sum = hi_sum = 0.0
        for s, _ in steps:
            for pr in (s.a,) if s.b is None else (s.a, s.b):
                lo, hi = dsc.loss_range(pr, step_tol)
                lo_sum, hi_sum = min(lo_sum, lo), max(hi_sum, hi)
        width0 = max(hi_sum - lo_sum, 1e-6)
        h0 = width0 / 2000.0
        windows = []
        for pm_up, _ in self._discretize_all(steps, h0, step_tol, directional):
            a, b, la, lb = dsc.chernoff_window(pm_up, h0, self.tail_tol)
            pad = 0.05 * (b - a) + 4 * h0
            windows.append([a - pad, b + pad, la, lb])
        width = max(w[1] - w[0] for w in windows)
        scale = min(
            dsc.loss_scale(pr) for s, _ in steps for pr in ((s.a,) if s.b is None else (s.a, s.b))
        )
        # resolve the bulk of every single-step loss (scale / 8), but with at most
        # 8 n_target points: the relative-gap refinement refines further where needed
        h = max(min(width / self.n_target, scale / 8.0), width / (8 * self.n_target), 1e-7)
        h *= h_scale
        if width / h > self.max_points:
            if h_scale < 1.0:
                raise _TooLarge
            h = width / self.max_points
        # 2. fine pass; the window tails are re-certified from the fine PMFs
        out, shared = [], dsc.shared_uppers()  # (fixed size: one upper, two directions)
        fine = self._discretize_all(steps, h, step_tol, directional)
        if pmfs_only:  # no FFT: what chernoff_epsilon reads (upper PMFs, mass at inf)
            return _Result([(pmfs_stub(pm_up, h), None) for pm_up, _ in fine], h,
                           math.ceil(width / h))
        for (pm_up, pm_low), win in zip(fine, windows, strict=True):
            if tilt_at is not None:  # tiny delta: the tilted composition (Esscher)
                theta = chernoff_theta(pm_up, h, tilt_at)
                # its allowance is the plain one times the Chernoff bound
                # M e^{-theta eps} at the target: useless unless that is small (a heavy
                # single-step tail -- q=1e-5, sigma <= 0.8 -- can keep it near 1)
                log_chernoff = float(dsc.log_mgf(pm_up, h, np.array([theta]), True)[0]
                                     - theta * tilt_at)
                if check_gain and log_chernoff > _LOG_TILT_GAIN:
                    raise _NoTiltGain(
                        f"pld: the tilted composition would not reduce the error allowance "
                        f"(Chernoff bound {math.exp(min(log_chernoff, 0.0)):.3g} at the target)")
                # the tilted window's tails enter the allowance times that factor: for
                # a target delta, 1e-6 delta / factor (at most 1e-9) of the tilted mass
                # suffices, and a heavy tilted tail makes a 1e-18 window twice as wide
                ttol = self.tail_tol
                if tilt_delta is not None and tilt_delta > 0:
                    ttol = max(ttol, math.exp(min(
                        math.log(_TILTED_TAIL_TOL),
                        math.log(1e-6) + math.log(tilt_delta)  # no underflow to 0
                        - min(log_chernoff, 0.0))))
                # a refinement never composes a tilted grid above 2 max_points (the
                # plain grid's bound is max_points), as _TooLarge
                cap = 2 * self.max_points if h_scale < 1.0 else None
                try:
                    cu = dsc.compose_fft_tilted(pm_up, h, theta, ttol, upper=True,
                                                accurate=accurate,
                                                max_points=2 * self.max_points,
                                                refuse_above=cap)
                except AccountingError:
                    if cap is None:
                        raise
                    raise _TooLarge from None
                cl = dsc.compose_fft_tilted(pm_low, h, theta, ttol, upper=False,
                                            accurate=accurate, max_points=2 * self.max_points)
                cu.prepare()
                cl.prepare()
                out.append((cu, cl))
                continue
            a, b, la, lb = win
            for _ in range(6):
                cu = shared(pm_up, h, a, b, la, lb, accurate)
                cl = dsc.compose_fft(pm_low, h, a, b, la, lb, upper=False, accurate=accurate)
                if max(cu.tails, cl.tails) <= 1e3 * self.tail_tol:
                    break
                wdt = b - a
                a, b = a - 0.25 * wdt, b + 0.25 * wdt
                if (b - a) / h > 2 * self.max_points:
                    break
            cu.prepare()
            cl.prepare()
            out.append((cu, cl))
        return _Result(out, h)

    _discretize_all = staticmethod(discretize_all)


def _points(res: _Result) -> int:
    """Grid points held by a cached composition."""
    return sum(c.pi.size + low.pi.size for c, low in res.directions)


class _TooLarge(Exception):
    pass


class _NoTiltGain(AccountingError):
    """The tilted composition's allowance would not be much below the plain one."""


#: the tilted composition is computed only when its Chernoff factor ``M e^{-theta eps}``
#: divides the error allowance by at least 10
_LOG_TILT_GAIN = math.log(0.1)
#: shortcuts of :meth:`PLDAccountant.epsilon` (the tests compare them with the exhaustive
#: path: False, False, 1.0): skip the untilted grids where the per-step rounding
#: allowance alone reaches delta; skip a tilted refinement that cannot pay; the grid scale
#: (relative spacing) on which the tilt is aimed before the full grid
_SKIP_HOPELESS, _SKIP_BLIND_REFINE, _COARSE = True, True, 4.0
#: largest per-step rounding allowance for which the fallback still composes the accurate
#: grid for its lower end
_LOWER_ALLOWANCE_CAP = 1e-6
#: certified mass of the tilted distribution outside the tilted window (each side)
_TILTED_TAIL_TOL = 1e-9


register_accountant(PLDAccountant())
