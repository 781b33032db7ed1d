"""Single-step PMFs of the PLD accountant's steps and the RDP guesses of its tilt
and when its tilted grid is worth refining (private helpers of
:mod:`privlearn.accounting.pld`, moved out to keep it under the module size limit)."""

from __future__ import annotations

import math

import numpy as np

from privlearn.accounting import _pld_discrete as dsc
from privlearn.accounting._pld_surrogates import _as_fixed_size, _via_add_remove
from privlearn.accounting.accountants import get_accountant
from privlearn.accounting.mechanisms import Composed, Mechanism
from privlearn.errors import AccountingError, UnsupportedMechanismError

__all__ = ["discretize_all", "grid_gain_small", "pmfs_stub", "rdp_guess"]


def discretize_all(steps, h: float, tol: float, directional: bool) -> list:
    """Each direction's (upper, lower) single-step PMF lists at spacing ``h`` (one
    discretisation per distinct pair): ``[(rem_up, rem_low)]``, plus ``(add_up, add_low)``
    when ``directional``."""
    cache: dict[int, tuple] = {}

    def disc(key, fn):
        if key not in cache:
            cache[key] = fn()
        return cache[key]

    rem_up, rem_low, add_up, add_low = [], [], [], []
    for s, k in steps:
        if s.kind == "sym":
            u, lw = disc(id(s.a), lambda s=s: dsc.discretize(s.a, h, tol))
            rem_up.append((u, k))
            rem_low.append((lw, k))
            add_up.append((u, k))
            add_low.append((lw, k))
        elif s.kind == "max":
            # upper: the symmetrised pair; lower: each direction's own dominated pair,
            # one per composition (each is attained at every step; the maximum is not)
            u, _ = disc(id(s), lambda s=s: dsc.discretize_symmetrised(s.a, s.b, h, tol))
            _, lw = disc(id(s.a), lambda s=s: dsc.discretize(s.a, h, tol))
            _, lw_b = disc(id(s.b), lambda s=s: dsc.discretize(s.b, h, tol))
            rem_up.append((u, k))
            rem_low.append((lw, k))
            add_up.append((u, k))
            add_low.append((lw_b, k))
        else:
            u, lw = disc(id(s.a), lambda s=s: dsc.discretize(s.a, h, tol))
            rem_up.append((u, k))
            rem_low.append((lw, k))
            u, lw = disc(id(s.b), lambda s=s: dsc.discretize(s.b, h, tol))
            add_up.append((u, k))
            add_low.append((lw, k))
    out = [(rem_up, rem_low)]
    if directional:
        out.append((add_up, add_low))
    return out


def rdp_guess(mechanism: Mechanism, parts, delta: float) -> list[float]:
    """RDP epsilons near the answer, used to place the tilt and, certified as they are,
    by :meth:`PLDAccountant._fallback_epsilon`: the RDP accountant's, or -- for Poisson
    sampling under replace-one, which it does not account -- those of two surrogates:

    * the same steps with fixed-size sampling, whose mechanism attains the Poisson
      replace-one pair (the record ``+c`` or ``-c``, the one it replaces 0) and which
      Wang, Balle & Kasiviswanathan (2019) bound (so the bound holds for the pair);
    * the add/remove curve through the weak triangle inequality (:func:`_via_add_remove`),
      far tighter at small noise multipliers, where the first is loose by orders of
      magnitude."""
    rdp = get_accountant("rdp")
    try:
        return [rdp.epsilon(mechanism, delta).upper]
    except (UnsupportedMechanismError, AccountingError):
        pass
    out = []
    for surrogate_of in (_as_fixed_size, _via_add_remove):
        surrogate = [(surrogate_of(m) or m, k) for m, k in parts]
        try:
            out.append(rdp.epsilon(Composed(tuple(surrogate)), delta).upper)
        except (UnsupportedMechanismError, AccountingError):
            pass
    return out


def grid_gain_small(
    coarse_at, best: float, up: float, lo: float, coarse: float, rel_gap: float
) -> bool:
    """Whether refining the tilted grid cannot pay, judged from the bracket of the coarse
    aim ``coarse_at = (aim, up_c, lo_c)`` (``coarse`` = 4 times the spacing, tilted
    within 5% of ``best``): even an error first order in the spacing leaves at most a
    third of the coarse-to-full change to gain. With a lower end (``lo > 0``): that
    third is under the 20% of the bracket ``[lo, up]`` that
    :meth:`PLDAccountant._refine` asks of a halving (e.g. fixed-size sampling, whose gap
    is the symmetrised upper pair against the directions' lower pairs, not the grid).
    Without one (the tilted window starts above the lower pairs' crossing, and a finer
    grid keeps it so): the third of the upper end's drop is under ``rel_gap * up``.
    Without a comparable coarse aim nothing is known of the grid error and the
    refinement runs (randomized response, Poisson at q=2.85e-6: 7% looser without it).
    Decides only whether to refine; every bracket is certified."""
    if coarse_at is None or coarse != 4.0 or not up > 0.0:
        return False
    aim, up_c, lo_c = coarse_at
    if abs(aim - best) > 0.05 * best:
        return False
    if lo <= 0.0:
        return max(0.0, up_c - up) / 3.0 <= rel_gap * up
    change = max(0.0, up_c - up) + max(0.0, lo - lo_c)
    return change / 3.0 < 0.2 * (up - lo)


def pmfs_stub(pmfs: list, h: float) -> dsc.ComposedPLD:
    """An upper composition of ``pmfs`` without its FFT: only the single-step PMFs and
    the composed mass at infinity (as :func:`._pld_fft.compose_fft` rounds it up), all
    that :meth:`ComposedPLD.chernoff_epsilon` reads; it holds no distribution."""
    total = sum(c for _, c in pmfs)
    log_fin = sum(c * math.log1p(-min(p.inf, 1.0 - dsc.U)) for p, c in pmfs)
    inf_mass = min(1.0, -math.expm1(log_fin) * (1 + 8 * dsc.U * total))
    return dsc.ComposedPLD(h, 0, np.zeros(0), inf_mass, 0.0, 0.0, 0.0, pmfs=list(pmfs))
