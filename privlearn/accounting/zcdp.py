"""A release known only through a zero-concentrated DP guarantee, as a mechanism kind.

:class:`ZCDP` describes a mechanism that is ``(xi, rho)``-zCDP: its Renyi divergence of
every order ``alpha > 1`` is at most ``xi + rho * alpha`` (Bun & Steinke 2016,
Definition 1.1; Google dp_accounting's ``ZCDpEvent(rho, xi)``). It is registered like any
other kind (:func:`privlearn.accounting.register_mechanism`), with that curve as its
``rdp`` representation, so the ``"rdp"`` accountant composes it with every other kind,
subsamples it (the general bounds of Zhu & Wang 2019, Theorem 6, and of Wang, Balle &
Kasiviswanathan 2019, Theorem 9) and converts the total to ``(epsilon, delta)``.

A zCDP guarantee is a bound on a curve, not a dominating pair: mechanisms with the same
curve have different ``(epsilon, delta)`` profiles (the Gaussian mechanism with noise
multiplier ``1 / sqrt(2 rho)`` is the least costly of them), so the ``"pld"`` and
``"analytic"`` accountants refuse it (as dp_accounting's PLD accountant refuses
``ZCDpEvent``); evaluate it with ``accountant="rdp"``.

Like :class:`~privlearn.accounting.PureDP`, the guarantee is stated for the neighbouring
relation under which the release is used (no factor is applied under replace-one). For
inputs ``k`` records apart (group privacy, used for fixed-size sampling under add/remove
and for the replace-one reading of an add/remove statement) a ``rho``-zCDP mechanism is
``k^2 rho``-zCDP (Bun & Steinke 2016, Proposition 1.9); no such statement is used for
``xi > 0``, which is refused there.

References
----------
.. [BS16] Bun & Steinke (2016), Concentrated Differential Privacy: Simplifications,
       Extensions, and Lower Bounds, TCC, Definition 1.1 and Proposition 1.9.
.. [M17] Mironov (2017), Renyi Differential Privacy, CSF, Proposition 3 (the
       ``alpha -> inf`` limit of the Renyi divergence is the pure-DP epsilon).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from privlearn._validation import check_nonnegative
from privlearn.accounting import _builtin_kinds  # noqa: F401  (built-in kinds first)
from privlearn.accounting.mechanisms import Mechanism
from privlearn.accounting.registry import register_mechanism
from privlearn.errors import ParameterValueError, UnsupportedMechanismError

__all__ = ["ZCDP"]

_ULP = sys.float_info.epsilon


@dataclass(frozen=True, slots=True)
class ZCDP(Mechanism):
    """A ``(xi, rho)``-zCDP mechanism: Renyi-DP ``xi + rho * alpha`` at every order.

    Parameters
    ----------
    rho : float >= 0
        The zCDP parameter (``rho = 1 / (2 s^2)`` for a Gaussian mechanism with noise
        multiplier ``s``).
    xi : float >= 0
        The additive term of approximate zCDP (default 0, pure zCDP).

    Only the ``"rdp"`` accountant evaluates it (the module docstring says why).

    Examples
    --------
    >>> from privlearn.accounting import ZCDP, compose
    >>> eps = compose(ZCDP(0.01), steps=50).epsilon(1e-6, accountant="rdp")

    References
    ----------
    Bun & Steinke (2016), Concentrated Differential Privacy: Simplifications, Extensions,
    and Lower Bounds, TCC, Definition 1.1.
    """

    rho: float
    xi: float = 0.0

    def __post_init__(self) -> None:
        hint = "pass e.g. rho=0.5 (a Gaussian with noise multiplier 1 is 0.5-zCDP)"
        object.__setattr__(self, "rho", check_nonnegative("rho", self.rho, hint=hint))
        object.__setattr__(
            self, "xi", check_nonnegative("xi", self.xi, hint="pass xi=0.0 for (pure) rho-zCDP")
        )


def _zcdp_rdp(m: ZCDP, alphas: np.ndarray) -> np.ndarray:
    """``xi + rho * alpha`` (Bun & Steinke 2016, Definition 1.1), rounded up by a bound
    on its two roundings (a product and a sum)."""
    with np.errstate(over="ignore"):
        return (m.xi + m.rho * alphas) * (1.0 + 4.0 * _ULP)


def _zcdp_pure_epsilon(m: ZCDP) -> float:
    """``xi`` when ``rho = 0`` (the curve is then ``xi`` at every order, and its
    ``alpha -> inf`` limit is the pure-DP epsilon: Mironov 2017, Proposition 3);
    ``inf`` otherwise."""
    return float(m.xi) if m.rho == 0.0 else math.inf


def _zcdp_group(m: ZCDP, factor: float) -> ZCDP:
    """``m`` for inputs up to ``factor`` records apart: ``k^2 rho``-zCDP with ``k =
    ceil(factor)`` (Bun & Steinke 2016, Proposition 1.9, group privacy); ``factor <= 1``
    returns ``m``.

    Raises
    ------
    UnsupportedMechanismError
        For ``xi > 0`` (no group-privacy statement of approximate zCDP is used).
    """
    if factor <= 1.0:
        return m
    if m.xi > 0.0:
        raise UnsupportedMechanismError(
            f"{m!r} read for inputs {math.ceil(factor)} records apart (group privacy, e.g. "
            "fixed-size sampling under add/remove or a replacement read as two add/remove "
            "steps) needs a group-privacy statement for approximate zCDP (xi > 0), which "
            "privlearn does not use; state the release's zCDP guarantee under the relation "
            "in use (e.g. subsample(ZCDP(rho, xi), 1.0, scheme='fixed') for replace-one)"
        )
    k = math.ceil(factor)
    return ZCDP(math.nextafter(k * k * m.rho, math.inf))


def _to_dict(m: ZCDP) -> dict[str, Any]:
    return {"rho": float(m.rho), "xi": float(m.xi)}


def _from_dict(d: dict[str, Any]) -> ZCDP:
    if not isinstance(d, dict) or set(d) != {"rho", "xi"}:
        raise ParameterValueError(f"a ZCDP is stored as {{'rho', 'xi'}}, got {d!r}")
    return ZCDP(d["rho"], d["xi"])


register_mechanism(
    ZCDP,
    pure_epsilon=_zcdp_pure_epsilon,
    rdp=_zcdp_rdp,
    scale_sensitivity=_zcdp_group,
    to_dict=_to_dict,
    from_dict=_from_dict,
)
