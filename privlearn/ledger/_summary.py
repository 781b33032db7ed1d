"""What a budget's counted releases add up to (a :class:`Spent`), kept with the releases.

The releases of a budget are held by its :class:`~privlearn.ledger._tally.Tally` as one
:class:`~privlearn.ledger._tally.Releases` object, replaced by a new one whenever an
entry of the budget is folded in or the tally is rebuilt (a new chain head with new
releases, a file changed by another process, a settle). The summary of those releases is
a deterministic function of them, the budget, the counts and the last reported total, so
it is kept on that object under exactly those inputs (and the accountant object that
composed them): a ``spent`` query, the report of a refused spend, ``budget show`` in the
same process, read it again instead of recomposing every distinct mechanism (the
accountant's own cache holds a few compositions only, and a search that checks many
candidates evicts them). Nothing computed from other releases can be read: the key is
the releases object itself.
"""

from __future__ import annotations

from privlearn.accounting import get_accountant
from privlearn.errors import ParameterTypeError, ParameterValueError
from privlearn.ledger._filter import evaluate_budget
from privlearn.ledger._records import Budget, Spent
from privlearn.ledger._relations import _relation
from privlearn.ledger._tally import Releases, read_releases

__all__ = ["summary"]


def _evaluate(budget: Budget, mechs: Releases, n: int, pending: int, floor: float | None) -> Spent:
    relation = _relation(budget, mechs.distinct)
    upper, lower, aeps = evaluate_budget(budget, read_releases(budget, mechs, relation))
    upper = upper if floor is None else max(upper, floor)  # monotone in the spends
    binding = upper if aeps is None else max(upper, aeps)  # what the cap is checked on
    return Spent(
        dataset=budget.dataset,
        privacy_unit=budget.privacy_unit,
        epsilon_spent=upper,
        epsilon_lower=lower,
        epsilon_budget=budget.epsilon,
        delta=budget.delta,
        epsilon_remaining=max(0.0, budget.epsilon - binding),
        entries=n,
        pending=pending,
        accountant=budget.accountant,
        adaptive=budget.adaptive,
        adaptive_epsilon=aeps,
        adaptive_order=budget.adaptive_order,
        neighbouring=relation,
    )


def summary(
    budget: Budget, mechs: Releases, n: int, pending: int, floor: float | None = None
) -> Spent:
    """The :class:`Spent` of the releases ``mechs`` of ``budget`` (``n`` releases,
    ``pending`` reservations, ``floor`` the last reported total), computed once per
    releases object and inputs (see the module docstring)."""
    try:
        key = (budget, n, pending, floor, get_accountant(budget.accountant))
    except (ParameterTypeError, ParameterValueError):  # unknown: the evaluation says so
        return _evaluate(budget, mechs, n, pending, floor)
    done = mechs.summaries.get(key)
    if done is None:  # (an error is raised, never kept)
        done = mechs.summaries[key] = _evaluate(budget, mechs, n, pending, floor)
    return done
