"""Ledger reservations charged in full once made (private helper of
:mod:`privlearn.models.base` and :mod:`privlearn.models.preprocessing`).

A ledger is read by everyone who spends from its budgets, so what it records about a fit
must not depend on the values of the private data. Once a fit has reserved its plan, the
plan is charged in full whatever happens next: a refusal after the reservation (a NaN, a
label outside ``classes``, an unknown category) may depend on one record, and a
reservation settled as "nothing ran" would tell the ledger's readers so.

:class:`~privlearn.models.PrivatePipeline` reserves every private step's planned
mechanism before it reads any value, and holds the reservations (:func:`holding`) while
its steps are fitted: a step whose reservation is held does not reserve again
(:meth:`PrivateEstimator._reserve <privlearn.models.base.PrivateEstimator._reserve>`),
and the pipeline settles them all, in full, by :func:`settle_in_full` -- the code path
that settles an estimator's own reservation.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator
from typing import Any

from privlearn.accounting import Mechanism, compose
from privlearn.errors import ConfigurationError

__all__ = ["charged_note", "holding", "is_held", "reserved_in_full", "settle_in_full"]

_HELD: contextvars.ContextVar[tuple[tuple[Any, Mechanism], ...]] = contextvars.ContextVar(
    "privlearn_held_reservations", default=()
)


def is_held(estimator: Any, mechanism: Mechanism) -> bool:
    """Whether a pipeline fitting ``estimator`` holds a reservation of exactly
    ``mechanism`` for it (a step that would run another mechanism reserves its own as
    well: charging more than what ran is safe, less is not)."""
    return any(e is estimator and m == mechanism for e, m in _HELD.get())


@contextlib.contextmanager
def holding(entries: Iterable[tuple[Any, Mechanism]]) -> Iterator[None]:
    """Within the block, the ``(estimator, mechanism)`` pairs are reserved by the caller,
    who settles them: :func:`is_held` is true for them."""
    token = _HELD.set(_HELD.get() + tuple(entries))
    try:
        yield
    finally:
        _HELD.reset(token)


def settle_in_full(reservations: Iterable[Any]) -> None:
    """Settle every reservation (None skipped) as its plan run in full, whether or not
    the fit succeeded; each is settled even if another's settlement fails (the first
    such failure is raised)."""
    failure: BaseException | None = None
    for reservation in reservations:
        if reservation is None:
            continue
        try:
            reservation.settle()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the others
            failure = failure or e
    if failure is not None:
        raise failure


def charged_note(owner: str) -> str:
    """The note added to an error raised after ``owner``'s reservation was made."""
    return (
        f"The ledger reservation of this {owner} was charged in full: the data was "
        "refused after the reservation, and whether it is refused may depend on its "
        "values, which the ledger's readers must not learn from a cancelled entry. "
        "Check the data before fitting with a ledger."
    )


@contextlib.contextmanager
def reserved_in_full(
    owner: str, planned: Iterable[tuple[Any, Mechanism]], every: Iterable[Any]
) -> Iterator[None]:
    """Reserve, each on its own ledger, the planned mechanism of every estimator in
    ``planned`` (``(estimator, mechanism)`` in the order they will be fitted; those
    without a ledger, or held by an enclosing fit, are skipped), hold the reservations
    while the block runs, and settle them all in full however it ends.

    Call it once the checks that public information alone decides (parameters, shapes,
    the budgets' room) have passed, and check the data's values inside the block: from
    the first reservation on, whether the fit is refused may depend on one record, so
    every reservation is charged in full (an error gets :func:`charged_note`). A refusal
    while reserving (a budget that cannot hold a step's plan) cancels the reservations
    made so far as "nothing ran": no value has been read. An estimator of ``every``
    with a ledger that ``planned`` does not reach (its plan could not be made before
    the fit) is refused with :class:`~privlearn.errors.ConfigurationError` before
    anything is reserved: it would reserve only once the steps before it had read the
    data, so whether it records anything could depend on the values."""
    planned = list(planned)
    held = [e for e, _ in _HELD.get()]
    for est in every:
        if getattr(est, "ledger", None) is not None and not any(
            est is e for e in [*held, *(e for e, _ in planned)]
        ):
            raise ConfigurationError(
                f"{owner}: its step {type(est).__name__} has a ledger, but its mechanism "
                "cannot be planned before the fit (a step before it has an output width "
                "that its parameters do not give: planned_mechanism(X) says which), so it "
                "could not be reserved before any value is read. Make the widths public "
                "(e.g. OneHotEncoder(categories=[...])), or fit without a ledger and "
                "spend planned_mechanism on the budget yourself"
            )
    todo = [
        (e, m) for e, m in planned if getattr(e, "ledger", None) is not None and not is_held(e, m)
    ]
    reservations: list[Any] = []
    try:
        for est, mech in todo:
            reservations.append(est._reserve(mech, type(est).__name__))
    except BaseException:
        for reservation in reservations:  # refused by the budgets: nothing was read
            if reservation is not None:
                reservation.settle(compose([]))
        raise
    try:
        with holding(todo):
            yield
    except Exception as e:
        if any(r is not None for r in reservations):
            e.add_note(charged_note(owner))
        raise
    finally:
        settle_in_full(reservations)
