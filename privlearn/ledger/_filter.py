"""The Renyi privacy filter: a budget rule valid under fully adaptive composition.

When each release's *parameters* (its mechanism) may depend on the outputs of earlier
releases -- "look at the result, then decide what to run next, with what noise" -- the
standard composition theorems, which take the sequence of mechanisms as fixed in advance,
do not apply as stated. A *privacy filter* is a stopping rule that keeps a stated
guarantee anyway.

Renyi filter (Feldman & Zrnic 2021, Section 3): fix an order ``alpha > 1`` and an RDP
budget ``B``. Admit the next release ``M_t`` (its RDP curve ``rho_t`` may be chosen
adaptively) only while ``sum_{s <= t} rho_s(alpha) <= B``. The whole interaction is then
``(alpha, B)``-RDP, hence ``(epsilon, delta)``-DP with
``epsilon = B + log((alpha - 1) / alpha) - (log(delta) + log(alpha)) / (alpha - 1)``
(Canonne, Kamath & Steinke 2020, Proposition 12; Balle et al. 2020, Theorem 21; computed
by :func:`privlearn.accounting.conversion.epsilon_from_rdp`). A single order is fixed in
advance because the filter's guarantee holds order by order.

The price of adaptivity is that one order must serve every release, so the filter admits
less than the tight (PLD) composition of the same releases taken as a fixed sequence;
the ledger reports both.

References
----------
.. [1] V. Feldman, T. Zrnic (2021), Individual Privacy Accounting via a Renyi Filter,
       NeurIPS.
.. [2] J. Whitehouse, A. Ramdas, R. Rogers, Z. S. Wu (2023), Fully-Adaptive Composition
       in Differential Privacy, ICML.
.. [3] C. Canonne, G. Kamath, T. Steinke (2020), The Discrete Gaussian for Differential
       Privacy, NeurIPS, Proposition 12.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from privlearn._validation import check_delta, check_nonnegative, check_positive
from privlearn.accounting import (
    AccountingError,
    Composed,
    Mechanism,
    UnsupportedMechanismError,
    compose,
)
from privlearn.accounting.registry import representation_of
from privlearn.errors import ParameterTypeError, ParameterValueError

__all__ = ["default_filter_order", "evaluate_budget", "filter_epsilon", "rdp_at_order",
           "payload_metadata", "reported_floor", "reported_payload"]


def default_filter_order(epsilon: float, delta: float) -> float:
    """``alpha = 1 + 2 log(1/delta) / epsilon``: the order at which the conversion term
    ``log(1/delta) / (alpha - 1)`` takes half of the budget (a standard choice; pass
    ``adaptive_order`` to :meth:`Ledger.create_budget` to pick another)."""
    epsilon = check_positive("epsilon", epsilon)
    delta = _check_filter_delta(delta)
    return 1.0 + 2.0 * math.log(1.0 / delta) / epsilon


def filter_order(epsilon: float, delta: float, adaptive: object,
                 adaptive_order: object) -> float | None:
    """The Renyi order of a budget's filter (None when not ``adaptive``), its settings
    checked as :meth:`Ledger.create_budget` takes them."""
    if not isinstance(adaptive, bool):
        raise ParameterTypeError(f"adaptive must be a bool, got {adaptive!r}")
    order = None
    if adaptive:
        order = (
            default_filter_order(epsilon, delta)
            if adaptive_order is None
            else check_positive("adaptive_order", adaptive_order)
        )
        if order <= 1.0 or not math.isfinite(order):
            raise ParameterValueError(
                f"adaptive_order must be in (1, inf), got {adaptive_order!r}; leave it "
                "out for the default 1 + 2 log(1/delta) / epsilon")
        if delta == 0.0:
            raise ParameterValueError(
                "delta must be in (0, 1) with adaptive=True (the Renyi filter gives no "
                "delta=0 guarantee), got 0; pass a small delta such as 1e-6")
    elif adaptive_order is not None:
        raise ParameterValueError(
            f"adaptive_order is only used with adaptive=True, got {adaptive_order!r} "
            "with adaptive=False; pass adaptive=True or drop adaptive_order")
    return order


def _check_filter_delta(delta: object) -> float:
    d = check_delta("delta", delta)
    if d == 0.0:
        raise ParameterValueError(
            f"delta must be in (0, 1) for the adaptive (Renyi filter) rule, got {delta!r}: "
            "an RDP guarantee gives no delta = 0 one; pass a small delta such as 1e-6")
    return d


def rdp_at_order(mechanisms: Sequence[Mechanism], order: float) -> float:
    """``sum_t rho_t(order)`` over the releases (RDP adds; Mironov 2017, Proposition 1)."""
    total = 0.0
    for m in mechanisms:
        try:
            v = float(m.rdp(order))
        except (UnsupportedMechanismError, NotImplementedError) as exc:
            raise UnsupportedMechanismError(
                f"the adaptive (Renyi filter) rule needs an RDP curve for every release, "
                f"and {m!r} has none: {exc}"
            ) from exc
        if math.isnan(v):
            v = math.inf
        total += max(v, 0.0)  # a Renyi divergence is >= 0: a negative value is round-off
    return total


def filter_epsilon(rdp_total: float, order: float, delta: float) -> float:
    """Epsilon certified at ``delta`` by an ``(order, rdp_total)``-RDP guarantee.

    ``rdp_total`` in [0, inf] (inf gives inf), ``order`` in (1, inf), ``delta`` in (0, 1);
    anything else is refused (:class:`~privlearn.errors.ParameterValueError`), never
    answered with an epsilon of 0."""
    rdp_total = check_nonnegative("rdp_total", rdp_total, allow_inf=True)
    order = check_positive("order", order)
    if order <= 1.0:
        raise ParameterValueError(
            f"order must be in (1, inf), got {order!r}: Renyi divergences of order <= 1 "
            "give no (epsilon, delta) guarantee; the default is 1 + 2 log(1/delta) / epsilon")
    delta = _check_filter_delta(delta)
    if rdp_total == 0.0:
        return 0.0
    if not math.isfinite(rdp_total):
        return math.inf
    from privlearn.accounting.conversion import epsilon_from_rdp  # lazily: imports SciPy

    eps = float(epsilon_from_rdp(np.array([order]), np.array([rdp_total]), delta)[0])
    if math.isnan(eps):
        raise ArithmeticError(f"the RDP-to-DP conversion at order {order} returned nan for "
                              f"rdp_total={rdp_total}, delta={delta}")
    return max(0.0, eps)


def _float_up(x: Fraction) -> float:
    """The smallest float >= ``x``."""
    f = float(x)
    return math.nextafter(f, math.inf) if Fraction(f) < x else f


def _float_down(x: Fraction) -> float:
    """The largest float <= ``x``."""
    f = float(x)
    return math.nextafter(f, -math.inf) if Fraction(f) > x else f


def _merged(mechs: Sequence[Mechanism]) -> Composed:
    """The releases merged into ``(mechanism, count)`` parts (the ledger's releases carry
    theirs, kept up to date entry by entry)."""
    composed = getattr(mechs, "composed", None)
    return composed if composed is not None else compose(list(mechs))


def _stated_delta(mechs: Sequence[Mechanism]) -> Fraction:
    """The sum of the deltas of the releases known through an ``(epsilon, delta)``
    statement (exactly)."""
    total = Fraction(0)
    for m, k in _merged(mechs).parts:
        fn = representation_of(m, "stated_dp")
        if fn is not None:
            total += Fraction(fn(m)[1]) * k
    return total


def basic_composition_epsilon(mechs: Sequence[Mechanism], delta: float,
                              accountant: str) -> float | None:
    """Epsilon at ``delta`` by basic composition of the releases known only through an
    ``(epsilon, delta)`` guarantee (the kinds with a ``stated_dp`` representation:
    :class:`~privlearn.accounting.PureDP`, :class:`~privlearn.accounting.ApproxDP`) with the tight
    composition of the others, or None when it does not apply.

    Basic composition (Dwork, Roth 2014, Theorem 3.16; it holds under adaptive choice,
    Theorem 3.20's setting) adds the epsilons and the deltas of ``(epsilon_i, delta_i)``
    guarantees; composed with a mechanism that is ``(epsilon', delta')``-DP it gives
    ``(sum epsilon_i + epsilon', sum delta_i + delta')``. The PLD accountant's certified
    epsilon of the same releases is tighter in general but carries discretisation
    error, which refuses ``ApproxDP(1, 1e-5)`` read at ``delta = 1e-5`` and inflates
    ``ApproxDP(0.5, 4e-6)`` twice to just above 1; this bound, computed in exact
    rational arithmetic and rounded up, is exact there. The rest is read at
    ``delta - sum delta_i`` (rounded down).
    """
    stated, rest, rest_steps = [], [], []
    for m, k in _merged(mechs).parts:  # exact sums: the same over parts as over releases
        fn = representation_of(m, "stated_dp")
        if fn is None:
            rest.append(m)
            rest_steps.append(k)
        else:
            stated.append((fn(m), k))
    if not stated:
        return None
    eps = sum((Fraction(e) * k for (e, _), k in stated), Fraction(0))
    spent_delta = sum((Fraction(d) * k for (_, d), k in stated), Fraction(0))
    left = Fraction(delta) - spent_delta
    if left < 0:
        return None
    if rest:
        left_f = _float_down(left)
        if left_f <= 0.0:
            return None
        try:
            eps_rest = compose(rest, steps=rest_steps).epsilon_bounds(left_f,
                                                                      accountant).upper
        except (AccountingError, UnsupportedMechanismError):
            return None
        if not math.isfinite(eps_rest):
            return None
        eps += Fraction(eps_rest)
    return _float_up(eps)


#: The accountants of the budgets on which a release the accountant cannot evaluate is
#: composed under Renyi DP instead of refused: the general-purpose default. A budget
#: created with a specialised accountant (e.g. ``"analytic"``, the exact Gaussian) keeps
#: refusing what that accountant does not cover, as its creator chose.
RDP_FALLBACK_ACCOUNTANTS = ("pld",)


def _rdp_fallback(mechs: Sequence[Mechanism], delta: float, basic: float | None,
                  refusal: Exception) -> float:
    """The certified epsilon at ``delta`` of the releases composed by the RDP accountant
    (with basic composition of the ``(epsilon, delta)`` statements, where smaller), for a
    budget whose accountant cannot evaluate one of them; ``refusal`` (that accountant's
    error) is raised, with what to choose instead, when RDP cannot bound them either."""
    bounds = [] if basic is None else [basic]
    for fn in (lambda: _merged(mechs).epsilon_bounds(delta, "rdp").upper,
               lambda: basic_composition_epsilon(mechs, delta, "rdp")):
        try:
            eps = fn()
        except (AccountingError, UnsupportedMechanismError):
            continue
        if eps is not None and math.isfinite(eps):
            bounds.append(eps)
    if not bounds:
        if _stated_delta(mechs) > delta:  # no accountant admits these
            raise AccountingError(
                f"the releases' stated deltas add up to {float(_stated_delta(mechs)):g}, "
                f"past the budget's delta {delta:g}") from refusal
        raise UnsupportedMechanismError(
            f"{refusal}; neither that accountant nor Renyi DP can bound every release of "
            "this budget: record such releases on a budget created with another "
            "accountant (create_budget(..., accountant='rdp') for a mechanism known by "
            "its RDP curve, e.g. an RDPMechanism)") from refusal
    return min(bounds)


def _basic_or_refuse(mechs: Sequence[Mechanism], delta: float, basic: float | None,
                     refusal: Exception) -> float:
    """``basic`` (the releases' basic composition) when it applies; otherwise an
    :class:`AccountingError` when their stated deltas alone exceed ``delta`` (no
    accountant admits them), else ``refusal`` (the accountant's own error) again."""
    if basic is not None:
        return basic
    if _stated_delta(mechs) > delta:
        raise AccountingError(
            f"the releases' stated deltas add up to {float(_stated_delta(mechs)):g}, "
            f"past the budget's delta {delta:g}") from refusal
    raise refusal


def evaluate_budget(budget, mechs: Sequence[Mechanism]
                    ) -> tuple[float, float | None, float | None]:
    """``(upper, lower, adaptive_epsilon)`` of the releases ``mechs`` (already read under
    the budget's neighbouring relation) at the budget's delta: the certified bounds of
    their tight composition with the budget's accountant (the upper one no larger than
    their :func:`basic_composition_epsilon`, where that applies; that one alone when the
    accountant cannot evaluate them, e.g. RDP and an ``ApproxDP``; with a release the
    accountant has no representation for, e.g. an ``RDPMechanism`` on a PLD budget, their
    composition under Renyi DP), and for an adaptive
    budget the epsilon its Renyi filter certifies (None otherwise)."""
    if not mechs:
        return 0.0, 0.0, (0.0 if budget.adaptive else None)
    basic = basic_composition_epsilon(mechs, budget.delta, budget.accountant)
    try:
        b = _merged(mechs).epsilon_bounds(budget.delta, budget.accountant)
    except UnsupportedMechanismError as exc:
        # a release the accountant has no representation for (e.g. an RDPMechanism,
        # known only by its RDP curve, on a PLD budget): every release composed under
        # Renyi DP, a valid and looser upper bound (Mironov 2017, Proposition 1 and 3)
        if budget.accountant in RDP_FALLBACK_ACCOUNTANTS:
            upper = _rdp_fallback(mechs, budget.delta, basic, exc)
        else:  # e.g. RDP and an ApproxDP: basic composition, where it applies
            upper = _basic_or_refuse(mechs, budget.delta, basic, exc)
        lower = None
    except AccountingError as exc:
        # e.g. a PLD that cannot certify the releases: basic composition, where it applies
        upper, lower = _basic_or_refuse(mechs, budget.delta, basic, exc), None
    else:
        upper, lower = b.upper, b.lower
        if basic is not None and basic < upper:
            upper = basic
            lower = None if lower is None else min(lower, upper)
    adaptive_eps = None
    if budget.adaptive:
        total = getattr(mechs, "rdp_sums", {}).get(budget.adaptive_order)
        if total is None or math.isnan(total):  # not kept (or a release without RDP)
            total = rdp_at_order([m for m, k in _merged(mechs).parts for _ in range(k)]
                                 if hasattr(mechs, "composed") else mechs,
                                 budget.adaptive_order)
        adaptive_eps = filter_epsilon(total, budget.adaptive_order, budget.delta)
    return upper, lower, adaptive_eps


def reported_payload(epsilon_spent: float | None, metadata: dict | None = None) -> str:
    """The payload of a spend or reservation entry: the epsilon spent reported once it was
    admitted (``None`` for a settle entry: what a settle leaves is not bounded below by
    what was reported while the plan counted in full), and the entry's ``metadata`` when
    it has some (a key that readers of the epsilon alone pass over, so older versions
    read these payloads as before)."""
    payload: dict = {"epsilon_spent": epsilon_spent}
    if metadata:
        payload["metadata"] = metadata
    return json.dumps(payload)


def payload_metadata(payload: str | None) -> dict[str, str] | None:
    """The ``metadata`` of an entry's payload; None for a payload without it (written
    before entries had metadata, or with none) and for a ledger written before entries
    had payloads."""
    if payload is None:
        return None
    value = json.loads(payload)
    meta = value.get("metadata") if isinstance(value, dict) else None
    return {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else None


def reported_floor(payloads) -> float | None:
    """The epsilon spent last reported, from the payloads of a budget's entries in order
    (None when none was recorded since the last settle, or in ledgers written before).

    The PLD accountant's certified upper bound is not monotone in the releases: its
    discretisation adapts to the composition, so one more release can certify a total a
    few 1e-8 below the previous one. Each total is an upper bound, and so is their running
    maximum (the true epsilon only grows with releases), so the ledger reports (and caps)
    ``max(certified bound, last reported)``: the spent epsilon never decreases with a new
    release and is never below a certified bound."""
    floor = None
    for p in payloads:
        if p is not None:
            value = json.loads(p).get("epsilon_spent")
            floor = None if value is None else float(value)
    return floor
