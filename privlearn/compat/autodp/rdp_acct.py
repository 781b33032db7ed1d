"""autodp-compatible ``rdp_acct.anaRDPacct``: an RDP accountant over RDP functions.

Each ``compose_*`` call records a privlearn description (an
:class:`~privlearn.accounting.RDPMechanism` wrapping the function, subsampled where
asked); ``get_eps`` / ``get_delta`` / ``get_rdp`` evaluate their composition with
privlearn's ``"rdp"`` accountant (optimal conversion over orders; subsampling bounds of
Wang, Balle & Kasiviswanathan 2019, Theorem 9, for sampling without replacement and of
Zhu & Wang 2019, Theorem 6 / Mironov, Talwar & Zhang 2019 for Poisson sampling).

autodp's numerical knobs (``m``, ``tol``, ``m_max``, ``m_lin_max``, ``approx``,
``verbose``) do not apply; set away from autodp's defaults they raise an
``AutodpArgumentWarning``. A non-integer ``coeff`` of a subsampled mechanism is rounded up
(conservative) with a ``UserWarning``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from privlearn._validation import check_delta, check_epsilon, check_nonnegative
from privlearn.accounting import Mechanism as PrivlearnMechanism
from privlearn.accounting import RDPMechanism, compose, subsample
from privlearn.compat.autodp._missing import missing
from privlearn.compat.autodp.autodp_core import as_float, non_default, warn_no_effect

__all__ = ["anaRDPacct"]

_DEFAULTS = {"m": 100, "tol": 0.1, "m_max": 500, "m_lin_max": 10000, "approx": False,
             "verbose": False}


def _pure(func: Callable[[float], float]) -> float:
    try:
        v = float(func(math.inf))
    except Exception:  # noqa: BLE001 - a user function that cannot take inf: unknown
        return math.inf
    return v if v > 0 and not math.isnan(v) else math.inf


class anaRDPacct:  # noqa: N801 (autodp's name)
    """RDP accountant (see module docstring)."""

    def __init__(
        self,
        m: int = 100,
        tol: float = 0.1,
        m_max: int = 500,
        m_lin_max: int = 10000,
        approx: bool = False,
        verbose: bool = False,
    ) -> None:
        warn_no_effect(
            "anaRDPacct",
            non_default(
                {"m": m, "tol": tol, "m_max": m_max, "m_lin_max": m_lin_max,
                 "approx": approx, "verbose": verbose},
                _DEFAULTS,
            ),
            "privlearn's RDP accountant chooses its orders and conversion itself "
            "(certified; see privlearn.accounting.rdp)",
        )
        self._parts: list[tuple[PrivlearnMechanism, int]] = []

    # -- composition -------------------------------------------------------------------
    def _add(self, mech: PrivlearnMechanism, coeff: Any, what: str) -> None:
        c = check_nonnegative("coeff", as_float("coeff", coeff))
        if c == 0:
            return
        k = math.ceil(c)
        if k != c:
            warnings.warn(
                f"anaRDPacct.{what}: coeff={c} rounded up to {k} (conservative)",
                UserWarning,
                stacklevel=3,
            )
        self._parts.append((mech, k))

    def compose_mechanism(self, func: Callable[[float], float], coeff: Any = 1.0) -> None:
        """Compose the mechanism with RDP function ``func`` ``coeff`` times (a real
        ``coeff`` scales its RDP exactly)."""
        c = check_nonnegative("coeff", as_float("coeff", coeff))
        if c == 0:
            return
        if float(c).is_integer():
            self._parts.append((RDPMechanism(func, pure_epsilon=_pure(func)), int(c)))
        else:  # RDP composes additively: c * func is the RDP of the "c-fold" mechanism
            scaled = RDPMechanism(lambda a, f=func, c=c: c * f(a), pure_epsilon=c * _pure(func))
            self._parts.append((scaled, 1))

    def compose_subsampled_mechanism(
        self,
        func: Callable[[float], float],
        prob: Any,
        coeff: Any = 1.0,
        improved_bound_flag: bool = False,
    ) -> None:
        """Compose ``coeff`` runs of ``func``'s mechanism on a subsample of rate ``prob``
        drawn without replacement (replace-one neighbouring)."""
        if improved_bound_flag:
            warn_no_effect(
                "anaRDPacct.compose_subsampled_mechanism",
                {"improved_bound_flag": improved_bound_flag},
                "privlearn always uses its tightest valid subsampling bound",
            )
        q = as_float("prob", prob)
        if q == 0:
            return
        base = RDPMechanism(_memo(func), pure_epsilon=_pure(func))
        self._add(
            subsample(base, q, scheme="fixed", neighbouring="replace_one"),
            coeff,
            "compose_subsampled_mechanism",
        )

    def compose_poisson_subsampled_mechanisms(
        self, func: Callable[[float], float], prob: Any, coeff: Any = 1.0
    ) -> None:
        """Compose ``coeff`` runs of ``func``'s mechanism on a Poisson subsample of rate
        ``prob`` (add/remove neighbouring)."""
        q = as_float("prob", prob)
        if q == 0:
            return
        base = RDPMechanism(_memo(func), pure_epsilon=_pure(func))
        self._add(subsample(base, q), coeff, "compose_poisson_subsampled_mechanisms")

    compose_poisson_subsampled_mechanisms1 = compose_poisson_subsampled_mechanisms

    # -- queries -----------------------------------------------------------------------
    def _mech(self) -> PrivlearnMechanism | None:
        if not self._parts:
            return None
        return compose([m for m, _ in self._parts], steps=[k for _, k in self._parts])

    def get_eps(self, delta: Any) -> float:
        """Certified epsilon at ``delta`` (0 before any composition or at delta 1)."""
        d = check_delta("delta", as_float("delta", delta), allow_one=True)
        m = self._mech()
        return 0.0 if m is None else float(m.epsilon(d, "rdp"))

    def get_delta(self, eps: Any) -> float:
        """Certified delta at ``eps``."""
        e = check_epsilon("eps", as_float("eps", eps))
        m = self._mech()
        return 0.0 if m is None else float(m.delta(e, "rdp"))

    def get_rdp(self, alphas: Any) -> np.ndarray:
        """The composed RDP at orders ``alphas`` (> 1)."""
        a = np.asarray(alphas, dtype=float).reshape(-1)
        m = self._mech()
        return np.zeros_like(a) if m is None else np.asarray(m.rdp(a.tolist()), dtype=float)

    def evalRDP(self, alpha: Any) -> Any:  # noqa: N802 (autodp's name)
        """The composed RDP at one order or an array of orders (autodp's
        ``evalRDP``); orders <= 1 give the value at order 1 + 1e-9 (the KL limit from
        above, an upper bound) and order 0 gives 0, as autodp's oracle does."""
        a = np.asarray(alpha, dtype=float)
        flat = a.reshape(-1)
        out = np.zeros_like(flat)
        pos = flat > 0
        if np.any(pos):
            out[pos] = self.get_rdp(np.maximum(flat[pos], 1.0 + 1e-9))
        return float(out[0]) if a.ndim == 0 else out.reshape(a.shape)

    def build_zeroth_oracle(self) -> None:
        """Kept for autodp compatibility: :meth:`evalRDP` is always available (nothing to
        build)."""


def _memo(func: Callable[[float], float]) -> Callable[[float], float]:
    """``func`` with its values cached per order: a subsampling bound evaluates the base
    curve at every integer order up to the one asked, so repeated queries (autodp's
    tutorials evaluate ``evalRDP`` at thousands of orders) would call it quadratically
    often. As autodp's accountant, the function is taken to be fixed once composed."""
    cache: dict[float, float] = {}

    def f(alpha: float) -> float:
        a = float(alpha)
        if a not in cache:
            cache[a] = func(a)
        return cache[a]

    return f


def __getattr__(name: str) -> Any:
    raise missing("rdp_acct", name, __all__)
