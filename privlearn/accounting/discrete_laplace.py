"""The discrete Laplace (two-sided geometric) mechanism as a mechanism kind.

:class:`DiscreteLaplace` adds integer noise ``Z`` with ``P(Z = k) = c e^{-a |k|}``,
``c = (1 - e^-a) / (1 + e^-a) = tanh(a / 2)``, to an integer-valued query whose value one
record changes by at most ``sensitivity`` (Ghosh, Roughgarden & Sundararajan 2012; Google
dp_accounting's ``DiscreteLaplaceDpEvent(noise_parameter, sensitivity)``).

Dominating pair
---------------
With ``D = sensitivity``, ``P = D + Z`` and ``Q = Z`` have the privacy loss
``L(k) = a (|k| - |k - D|)``: ``-a D`` for ``k <= 0``, ``a (2k - D)`` for ``0 < k < D``
and ``a D`` for ``k >= D``, so the pair has ``D + 1`` atoms (loss ``a (2j - D)`` for
``j = 0, ..., D``) with masses

* ``Q``: ``1 / (1 + e^-a)`` at ``j = 0``, ``c e^{-a j}`` for ``0 < j < D``, ``e^{-a D} /
  (1 + e^-a)`` at ``j = D``;
* ``P``: the mirror image (``P_j = Q_{D - j}``).

It is symmetric (``(Q, P)`` has the same loss distribution), and it dominates the pair
``(d + Z, Z)`` of every query difference ``0 < d <= D``: that pair's loss is
non-decreasing in ``k`` (``Z`` is log-concave), so its hockey-stick divergence at
``gamma`` is ``sup_t P(Z >= t - d) - gamma P(Z >= t)`` over thresholds ``t``, and
``P(Z >= t - d) <= P(Z >= t - D)`` term by term (a negative difference is the mirror
image). The kind registers it
as its ``pld_pair`` and its ``pld_atoms`` (exact closed-form composition), its exact
Renyi divergence as ``rdp``, and ``a D`` as its pure epsilon (attained at ``k <= 0``).

Conventions (as :class:`~privlearn.accounting.Laplace`): ``sensitivity`` is the add/remove
bound on one record's contribution under every relation, so under replace-one the
accountants use ``2 D`` (``replace_one_doubles_sensitivity``); for inputs ``f`` records
apart the sensitivity is ``ceil(f D)``.

References
----------
.. [GRS12] Ghosh, Roughgarden & Sundararajan (2012), Universally Utility-Maximizing
       Privacy Mechanisms, SIAM J. Comput. (the geometric mechanism).
.. [ZDW22] Zhu, Dong & Wang (2022), Optimal Accounting of Differential Privacy via
       Characteristic Function, AISTATS, Definition 7 (dominating pairs).
.. [M17] Mironov (2017), Renyi Differential Privacy, CSF, Proposition 3 (RDP is at most
       the pure epsilon).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from privlearn._validation import check_count, check_positive
from privlearn.accounting import (
    _builtin_kinds,  # noqa: F401  (built-in kinds first)
    closed_form,
)
from privlearn.accounting.mechanisms import Mechanism
from privlearn.accounting.registry import register_mechanism
from privlearn.errors import ParameterValueError

__all__ = ["DiscreteLaplace"]

_ULP = sys.float_info.epsilon

#: Largest sensitivity accepted (the pair has ``sensitivity + 1`` atoms).
MAX_SENSITIVITY = 1_000_000


@dataclass(frozen=True, slots=True)
class DiscreteLaplace(Mechanism):
    """Discrete Laplace noise ``P(Z = k) ~ exp(-noise_parameter |k|)`` on an integer query.

    Parameters
    ----------
    noise_parameter : float > 0
        ``a`` of the distribution (dp_accounting's ``noise_parameter``); the mechanism is
        ``(a * sensitivity, 0)``-DP.
    sensitivity : int >= 1
        How far one record can move the integer query (add/remove; doubled under
        replace-one, as for :class:`~privlearn.accounting.Laplace`).

    Examples
    --------
    >>> from privlearn.accounting import DiscreteLaplace, compose
    >>> eps = compose(DiscreteLaplace(0.1, sensitivity=2), steps=100).epsilon(1e-6)

    References
    ----------
    Ghosh, Roughgarden & Sundararajan (2012), Universally Utility-Maximizing Privacy
    Mechanisms, SIAM J. Comput.
    """

    noise_parameter: float
    sensitivity: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "noise_parameter",
            check_positive(
                "noise_parameter",
                self.noise_parameter,
                hint="pass a in P(Z = k) ~ exp(-a |k|), e.g. 0.5",
            ),
        )
        d = check_count(
            "sensitivity",
            self.sensitivity,
            minimum=1,
            hint="pass the integer query's sensitivity, e.g. 1",
        )
        if d > MAX_SENSITIVITY:
            raise ParameterValueError(
                f"sensitivity must be at most {MAX_SENSITIVITY}, got {d}; rescale the query "
                "(noise_parameter / g for a query divided by g)"
            )
        object.__setattr__(self, "sensitivity", d)


def _log_masses(m: DiscreteLaplace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(loss, log P, log Q)`` of the ``D + 1`` atoms (module docstring), log domain."""
    a, d = m.noise_parameter, m.sensitivity
    j = np.arange(d + 1, dtype=float)
    log_norm = -math.log1p(math.exp(-a))  # log(1 / (1 + e^-a))
    log_c = math.log(-math.expm1(-a)) + log_norm  # log tanh(a / 2)
    log_q = log_c - a * j
    log_q[0] = log_norm
    log_q[-1] = log_norm - a * d
    log_p = log_q[::-1].copy()
    loss = a * (2.0 * j - d)
    return loss, log_p, log_q


def _pair(m: DiscreteLaplace):
    """The ``D + 1``-atom pair as a :class:`~privlearn.accounting._pld_pairs.DiscretePair`
    whose tails are cumulative sums over its sorted atoms (``O(log n)`` per point, so a
    pair of a large sensitivity stays cheap). Imported here: ``import
    privlearn.accounting`` stays light."""
    from privlearn.accounting._pld_pairs import DiscretePair

    class _SortedDiscretePair(DiscretePair):
        def __init__(self, p: np.ndarray, q: np.ndarray, loss: np.ndarray) -> None:
            super().__init__(p, q, loss)
            # P(L > loss_i) and P(L <= loss_i) summed separately (no cancellation)
            self._p_le = np.concatenate([[0.0], np.cumsum(self.p)])
            self._q_le = np.concatenate([[0.0], np.cumsum(self.q)])
            self._p_gt = np.concatenate([np.cumsum(self.p[::-1])[::-1], [0.0]])
            self._q_gt = np.concatenate([np.cumsum(self.q[::-1])[::-1], [0.0]])

        def tails(self, x: np.ndarray):
            i = np.searchsorted(self.loss, np.asarray(x, dtype=float), side="right")
            return self._p_gt[i], self._p_le[i], self._q_gt[i], self._q_le[i]

    loss, log_p, log_q = _log_masses(m)
    return _SortedDiscretePair(np.exp(log_p), np.exp(log_q), loss)


def _atoms(m: DiscreteLaplace) -> closed_form.Atoms:
    loss, log_p, log_q = _log_masses(m)
    return closed_form.Atoms(tuple(loss.tolist()), tuple(log_p.tolist()), tuple(log_q.tolist()))


def _pure_epsilon(m: DiscreteLaplace) -> float:
    """``a D`` (the loss at ``k <= 0``), rounded up (one product)."""
    return math.nextafter(m.noise_parameter * m.sensitivity, math.inf)


def _rdp(m: DiscreteLaplace, alphas: np.ndarray) -> np.ndarray:
    """Exact Renyi divergence ``log(sum_j P_j^alpha Q_j^(1-alpha)) / (alpha - 1)`` of the
    pair (symmetric: the same for ``(Q, P)``), plus a bound on its rounding error (each
    exponent's error is a few ulps of its magnitude, log-sum-exp adds a few ulps of the
    number of atoms), capped by the pure epsilon (Mironov 2017, Proposition 3)."""
    from scipy import special

    _, log_p, log_q = _log_masses(m)
    a = np.asarray(alphas, dtype=float)[:, None]
    with np.errstate(over="ignore", invalid="ignore"):
        terms = a * log_p[None, :] + (1.0 - a) * log_q[None, :]
        val = special.logsumexp(terms, axis=1)
        err = (
            4.0
            * _ULP
            * (
                np.max(np.abs(a * log_p[None, :]) + np.abs((1.0 - a) * log_q[None, :]), axis=1)
                + len(log_p)
                + np.abs(val)
            )
        )
        out = (np.maximum(val, 0.0) + err) / (a[:, 0] - 1.0)
    out = np.where(np.isnan(out), np.inf, out)
    return np.minimum(out, _pure_epsilon(m))


def _scaled(m: DiscreteLaplace, factor: float) -> DiscreteLaplace:
    """Inputs ``factor`` records apart move the integer query by ``ceil(factor D)``."""
    if factor <= 1.0:
        return m
    return DiscreteLaplace(m.noise_parameter, math.ceil(factor * m.sensitivity))


def _to_dict(m: DiscreteLaplace) -> dict[str, Any]:
    return {"noise_parameter": float(m.noise_parameter), "sensitivity": int(m.sensitivity)}


def _from_dict(d: dict[str, Any]) -> DiscreteLaplace:
    if not isinstance(d, dict) or set(d) != {"noise_parameter", "sensitivity"}:
        raise ParameterValueError(
            f"a DiscreteLaplace is stored as {{'noise_parameter', 'sensitivity'}}, got {d!r}"
        )
    return DiscreteLaplace(d["noise_parameter"], d["sensitivity"])


register_mechanism(
    DiscreteLaplace,
    pure_epsilon=_pure_epsilon,
    pld_pair=_pair,
    rdp=_rdp,
    scale_sensitivity=_scaled,
    replace_one_doubles_sensitivity=True,
    pld_atoms=_atoms,
    to_dict=_to_dict,
    from_dict=_from_dict,
)
