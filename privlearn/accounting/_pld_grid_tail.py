"""The far upper tail of one step's dominating grid pair, beyond the losses whose
likelihood ratios ``e^loss`` floating point holds (private helper of
:mod:`privlearn.accounting._pld_grid`).

At small noise multipliers (a Gaussian with sigma 0.03 has single-step losses up to
about 865 at a tail mass of 1e-20) the connect-the-dots construction of
:func:`privlearn.accounting._pld_grid.discretize` would need ``e^loss`` beyond the
largest float. Its grid stops at :data:`~privlearn.accounting._pld_grid.X_LIMIT`; past
it the P-mass of every grid interval ``(e_j, e_{j+1}]`` is put on its right end
``e_{j+1}`` (the pessimistic rounding of Meiser & Mohammadi 2018, Section 4, and of
Google dp_accounting's ``pessimistic_estimate`` without connect-the-dots).

Why this dominates: the privacy profile is a sum over outcomes,
``delta(x) = E_P[(1 - x e^{-L})_+]``, and ``(1 - x e^{-L})_+`` is non-decreasing in the
loss ``L``, so moving each interval's P-mass to its right end raises every term; the
atom at ``e_{j+1}`` carries Q-mass ``P(I) e^{-e_{j+1}} <= Q(I)`` (the rest goes to loss
``-inf``, where it never counts), so the result is a pair of (sub-)probability measures
whose profile is above the exact one at every ``x``. Connect-the-dots on the intervals
below the cut bounds each interval's term in the same way (Doroshenko et al. 2022,
Theorem 4.1 applied interval by interval), so the two constructions can be mixed.
Mass beyond the last point goes to loss ``+inf``.

The lower PMF of a cut step (:func:`rounded_down`) puts the P-mass of every interval on
its left end ``e_j`` and drops the mass outside the grid. It bounds the composed profile
from below path by path, with no pair behind it: the composed profile is
``E_{P^T}[(1 - x e^{-S})_+]`` with ``S`` the sum of the single-step losses (the loss of a
product pair is the sum), the rounded sum ``S'`` is at most ``S`` on every path, the
integrand is non-decreasing in ``S``, and dropping P-mass removes non-negative terms
(Meiser & Mohammadi 2018, Section 4: the optimistic bucketing; Google dp_accounting's
``pessimistic_estimate=False``). Connect-the-dots' lower pair cannot be extended past
the cut the same way: its values at the grid points already count the tail.
"""

from __future__ import annotations

import math

import numpy as np

from privlearn.accounting._pld_pairs import Pair
from privlearn.errors import AccountingError

__all__ = ["rounded_down", "rounded_up_tail"]

#: the most grid points the extension may add
MAX_TAIL_POINTS = 4_000_000


def rounded_up_tail(
    pair: Pair, e_last: float, top: float, h: float, p_beyond: float, tol: float
) -> tuple[np.ndarray, float]:
    """``(masses, mass_at_infinity)``: P-masses at the losses ``e_last + k h``,
    ``k = 1..m``, and the P-mass left beyond them, for the P-mass ``p_beyond`` right of
    ``e_last``. ``top`` is a loss with ``P(L > top) <= tol`` (the grid reaches it, so the
    mass at infinity is at most about ``tol``)."""
    if p_beyond <= 0.0:
        return np.zeros(0), 0.0
    m = math.ceil((top - e_last) / h) + 1
    if m > MAX_TAIL_POINTS:
        raise AccountingError(
            f"pld: single-step grid too large ({m} points beyond loss {e_last:.4g})"
        )
    ext = e_last + h * np.arange(1, m + 1)
    pg = np.asarray(pair.tails(ext)[0], dtype=float)
    # monotone P-tails (a rounding wobble must not make a mass negative); the first
    # interval starts from the mass beyond e_last itself
    pg = np.minimum.accumulate(np.minimum(pg, p_beyond))
    masses = -np.diff(np.concatenate([[p_beyond], pg]))
    # each mass is a difference of two tails: round it up by its own rounding error
    masses = np.maximum(masses, 0.0) * (1.0 + 4.0 * np.finfo(float).eps)
    return masses, float(pg[-1])


def rounded_down(interval_masses: np.ndarray, tail_masses: np.ndarray) -> np.ndarray:
    """The P-masses of the lower :class:`~privlearn.accounting._pld_grid.StepPMF` of a
    cut step (nothing at infinity): the P-mass of the grid interval ``(e_j, e_{j+1}]`` at
    ``e_j`` for the intervals below the cut (``interval_masses``) and past it
    (``tail_masses``, as :func:`rounded_up_tail` returns them), each rounded down by its
    rounding error."""
    p = np.concatenate([np.asarray(interval_masses, dtype=float), tail_masses])
    return np.maximum(p, 0.0) * (1.0 - 8.0 * np.finfo(float).eps)
