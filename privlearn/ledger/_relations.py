"""Releases read under a budget's neighbouring relation, what a plan covers, and the
check of a budget's privacy unit."""

from __future__ import annotations

from collections.abc import Sequence

from privlearn._validation import check_enum
from privlearn.accounting import Composed, Mechanism, Neighbouring, as_replace_one
from privlearn.accounting.registry import stated_relations
from privlearn.errors import (
    LedgerConflictError,
    ParameterValueError,
    UnsupportedMechanismError,
)
from privlearn.ledger._records import Budget

__all__ = ["check_privacy_unit"]


def _parts(m: Mechanism) -> list[tuple[Mechanism, int]]:
    return list(m.parts) if isinstance(m, Composed) else [(m, 1)]


def _covered(actual: Mechanism, plan: Mechanism) -> bool:
    """True when ``actual`` runs a sub-multiset of ``plan``'s steps (e.g. a prefix of its
    steps). Dropping releases from a composition is post-processing of the full one
    (discard their outputs), so the plan's guarantee covers ``actual``."""
    budget = [[m, k] for m, k in _parts(plan)]
    for m, k in _parts(actual):
        need = k
        for slot in budget:
            if slot[0] == m and need > 0:
                take = min(need, slot[1])
                slot[1] -= take
                need -= take
        if need > 0:
            return False
    return True


_AR, _RO = Neighbouring.ADD_REMOVE, Neighbouring.REPLACE_ONE
_ONE_SIDED = frozenset({Neighbouring.ADD_ONLY, Neighbouring.REMOVE_ONLY})
_SAY = {_AR: "add/remove", _RO: "replace-one", Neighbouring.ADD_ONLY: "add-only",
        Neighbouring.REMOVE_ONLY: "remove-only"}


def _check_budget_relation(value: object) -> Neighbouring | None:
    if value is None:
        return None
    hint = ("pass 'add_remove' or 'replace_one', or leave it out to take the relation of "
            "the first release")
    relation = check_enum("neighbouring", value, Neighbouring, hint=hint)
    if relation in _ONE_SIDED:
        raise ParameterValueError(
            f"neighbouring must be 'add_remove' or 'replace_one' for a budget, got "
            f"{relation.value!r} (one-sided: it bounds one direction only); {hint}")
    return relation


def _common_relation(relations: frozenset[Neighbouring]) -> Neighbouring | None:
    """The one relation releases stating ``relations`` are counted under: replace-one when
    one of them is (the add/remove ones read under replace-one), else the one-sided
    relation when one is (add/remove implies both one-sided ones), else add/remove; None
    when there is no release."""
    if not relations:
        return None
    if _RO in relations:
        return _RO
    one_sided = relations & _ONE_SIDED
    if len(one_sided) > 1:
        raise LedgerConflictError(
            "releases under add-only and under remove-only neighbouring bound opposite "
            "directions and have no common guarantee to add up")
    return next(iter(one_sided), _AR)


def _relation(budget: Budget, mechs: Sequence[Mechanism]) -> Neighbouring | None:
    """The relation the budget's total holds under: the one set at creation, else the
    common relation of its releases (so a budget without one is counted under replace-one
    as soon as it holds a replace-one release)."""
    if budget.neighbouring is not None:
        return budget.neighbouring
    return _common_relation(frozenset().union(*(stated_relations(m) for m in mechs)))


def _read(mechanism: Mechanism, relation: Neighbouring | None) -> Mechanism:
    """``mechanism`` as counted under ``relation``; :class:`UnsupportedMechanismError`
    when it holds no guarantee under it."""
    stated = stated_relations(mechanism)
    if relation is None or stated <= {relation} or (
            relation in _ONE_SIDED and stated <= {relation, _AR}):
        return mechanism
    if relation is _RO:
        return as_replace_one(mechanism)
    raise UnsupportedMechanismError(
        f"a release under {' and '.join(sorted(_SAY[r] for r in stated))} neighbouring "
        f"holds no guarantee under {_SAY[relation]}")


def _read_all(budget: Budget, mechs: Sequence[Mechanism], relation: Neighbouring | None
              ) -> list[Mechanism]:
    out = []
    for i, m in enumerate(mechs, start=1):
        try:
            out.append(_read(m, relation))
        except UnsupportedMechanismError as exc:
            raise LedgerConflictError(
                f"budget {budget.dataset!r} (privacy unit {budget.privacy_unit!r}) counts "
                f"its releases under {_SAY[relation]} neighbours, and its counted release "
                f"{i} cannot be read under that relation ({exc}); its total has no "
                "guarantee: start a new budget for further releases") from exc
    return out


def _check_relation(budget: Budget, mechs: Sequence[Mechanism], mechanism: Mechanism,
                    what: str) -> None:
    """Refuse (:class:`LedgerConflictError`) a release that holds no guarantee under the
    budget's relation: the one set at creation, else the one its releases so far fix."""
    new = stated_relations(mechanism)
    if budget.neighbouring is not None:
        relation, why = budget.neighbouring, "set when it was created"
    else:
        relation = _relation(budget, mechs)
        why = "fixed by the releases it holds"
        if relation is None:  # the first release fixes it
            relation = _common_relation(new)
    if relation is None:
        return
    if relation is not _RO and _RO in new:
        raise LedgerConflictError(
            f"{what} refused: budget {budget.dataset!r} counts its releases under "
            f"{_SAY[relation]} neighbours ({why}), and this release holds a replace-one "
            "guarantee (e.g. fixed-size sampling), which implies none under "
            f"{_SAY[relation]}: one total of both would hold under neither relation. "
            "Describe the release under add/remove (Poisson sampling: "
            "make_private(sampling='poisson'), `privlearn budget spend --sampling "
            "poisson`), or spend it on a budget created with neighbouring='replace_one' "
            "(`privlearn budget init --neighbouring replace_one`), which counts add/remove "
            "releases at their replace-one cost (twice the sensitivity, group privacy); "
            "nothing was recorded")
    try:
        _read(mechanism, relation)
    except UnsupportedMechanismError as exc:
        raise LedgerConflictError(
            f"{what} refused: budget {budget.dataset!r} counts its releases under "
            f"{_SAY[relation]} neighbours ({why}), and this release has no guarantee "
            f"under that relation: {exc}; nothing was recorded") from exc


def check_privacy_unit(handle: object, unit: str, *, spender: str, remedy: str) -> None:
    """Refuse to spend a guarantee per ``unit`` from a budget per another privacy unit.

    A guarantee covers one privacy unit: a release that is ``epsilon``-DP per record is
    only ``k epsilon``-DP (group privacy; Dwork & Roth 2014, Section 2.3) for a user with
    ``k`` records, and a per-user guarantee caps what a budget per record does not count.
    So a budget only takes releases accounted per its own unit. Every spender checks here
    (the estimators' ``ledger=``, :func:`privlearn.torch.make_private`), before it plans
    or reads anything.

    Parameters
    ----------
    handle
        The budget handle (``Ledger(path).budget(dataset, privacy_unit=...)``); a handle
        without a ``privacy_unit`` attribute (a custom integration) is not checked.
    unit : str
        The privacy unit the release is accounted per (``"record"`` or ``"user"``).
    spender : str
        Who spends, for the message (e.g. ``"SSPRegressor"``).
    remedy : str
        What the spender can do instead, for the message.

    Raises
    ------
    LedgerConflictError
        The budget's unit is not ``unit``.
    """
    budget_unit = getattr(handle, "privacy_unit", None)
    if budget_unit is None or budget_unit == unit:
        return
    raise LedgerConflictError(
        f"ledger={handle!r}: this budget is per {budget_unit!r} but "
        f"{spender} gives a guarantee per {unit!r}: a guarantee per {unit} cannot be spent "
        f"from a budget per {budget_unit}. {remedy}")


