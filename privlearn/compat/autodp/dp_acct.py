"""autodp-compatible ``dp_acct``: the classical (epsilon, delta) accountant.

``DP_acct`` records the ``(eps_i, delta_i)`` of every mechanism run and answers
``get_eps(delta)``. autodp bounds the composition with Kairouz, Oh & Viswanath (2015),
Theorem 3.5 (three closed-form relaxations). Here the answer is the *optimal*
composition itself: a composition of ``(eps_i, delta_i)``-DP mechanisms is
``(eps, 1 - prod_i (1 - delta_i) (1 - delta_pure(eps)))``-DP, where ``delta_pure`` is the
exact privacy profile of the composition of the ``eps_i``-DP mechanisms (Kairouz, Oh &
Viswanath 2015, Theorem 3.3 for equal epsilons; Murtagh & Vadhan 2016, "The Complexity
of Computing the Optimal Composition of Differential Privacy", TCC, for unequal ones),
computed exactly by :func:`privlearn.accounting.closed_form.pure_dp_composition_epsilon`
(certified, rounded up). It is never larger than autodp's value; where the exact
computation is too large (many distinct epsilons) privlearn's certified PLD accountant
answers.
"""

from __future__ import annotations

import math
from typing import Any

from privlearn.accounting import PureDP, compose
from privlearn.accounting.closed_form import pure_dp_composition_epsilon
from privlearn.compat.autodp._missing import missing
from privlearn.compat.autodp.autodp_core import as_float
from privlearn.errors import ParameterValueError

__all__ = ["DP_acct"]


class DP_acct:  # noqa: N801 (autodp's name)
    """Keeps the ``(eps, delta)`` of every mechanism run so far; ``get_eps(delta)``
    returns the optimal composition (see the module docstring).

    Parameters
    ----------
    disp : bool
        Kept for autodp compatibility (no effect).
    """

    def __init__(self, disp: bool = False) -> None:
        self.DPlosses: list[list[float]] = []
        self.disp = disp
        self._log_keep = 0.0  # sum log(1 - delta_i)

    def update_DPlosses(self, eps: Any, delta: Any) -> None:  # noqa: N802 (autodp's name)
        """Record one ``(eps, delta)``-DP mechanism."""
        e = as_float("eps", eps)
        d = as_float("delta", delta)
        if not (e >= 0 and 0 <= d <= 1):
            raise ParameterValueError(
                f"eps must be in [0, inf] and delta in [0, 1], got eps={eps!r}, "
                f"delta={delta!r}: pass the (eps, delta) of one mechanism"
            )
        self.DPlosses.append([e, d])
        self._log_keep += math.log1p(-d) if d < 1 else -math.inf

    def get_eps_delta_naive(self) -> tuple[float, float]:
        """Basic composition: ``(sum eps_i, sum delta_i)``."""
        return (math.fsum(e for e, _ in self.DPlosses),
                math.fsum(d for _, d in self.DPlosses))

    def get_minimum_possible_delta(self) -> float:
        """``1 - prod (1 - delta_i)``: no epsilon holds below this delta."""
        return -math.expm1(self._log_keep)

    def get_eps(self, delta: Any) -> float:
        """Optimal composition epsilon at ``delta`` (``inf`` below the minimum delta; at
        the minimum delta, 0 for pure steps, the sum of the epsilons)."""
        d = as_float("delta", delta)
        if d < 0:
            raise ParameterValueError(
                f"delta must be in [0, inf) (>= 1: no bound needed), got {delta!r}: pass "
                "a small positive delta, e.g. 1e-5"
            )
        if d >= 1:
            return 0.0
        # 1 - delta = (1 - delta~) prod (1 - delta_i)  =>  delta~ for the pure part
        log_rest = math.log1p(-d) - self._log_keep
        if log_rest > 0:  # below the minimum delta: no epsilon holds
            return math.inf
        # a (0, delta_i)-DP step adds nothing once its delta_i is taken out above
        epsilons = [e for e, _ in self.DPlosses if e > 0]
        if not epsilons:
            return 0.0
        if math.isinf(max(epsilons)):
            return math.inf
        d_pure = -math.expm1(log_rest)
        if d_pure == 0.0:  # delta is the minimum delta (0 for pure steps): basic composition
            return math.fsum(epsilons)
        try:
            return pure_dp_composition_epsilon(epsilons, d_pure)
        except ValueError:  # too many distinct epsilons for the exact computation
            return compose([PureDP(e) for e in epsilons]).epsilon(d_pure)


def __getattr__(name: str) -> Any:
    raise missing("dp_acct", name, __all__)
