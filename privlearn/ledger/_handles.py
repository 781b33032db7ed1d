"""Handles on a ledger: a reservation (a planned release until settled) and one budget
(what estimators take as ``ledger=``)."""

from __future__ import annotations

import contextlib
import sqlite3
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from privlearn.accounting import Mechanism
from privlearn.errors import LedgerNotFoundError, ParameterValueError
from privlearn.ledger._records import Entry, Spent, _check_name

if TYPE_CHECKING:
    from privlearn.ledger._ledger import Ledger

__all__ = ["Reservation", "BudgetHandle", "ClosedConnection", "KeylessConnection",
           "MissingLedgerConnection", "OtherLedgerConnection", "pickled_head", "holds_head"]

DEFAULT_UNIT = "record"


def _check_unit(privacy_unit: object) -> str:
    """A budget's privacy unit: None is the default unit; an empty or non-string one is
    refused (never read as the default: that would spend on another budget)."""
    return DEFAULT_UNIT if privacy_unit is None else _check_name("privacy_unit", privacy_unit)


@dataclass(frozen=True)
class Reservation:
    """A planned release recorded by :meth:`Ledger.reserve`, counted in full until settled.

    Use as a context manager to settle automatically: on normal exit with the plan,
    unless the block settled it already (``r.settle(actual)`` inside the block stands);
    on an exception the plan is kept in full (pending).
    """

    ledger: Ledger = field(repr=False)
    entry: Entry

    @property
    def seq(self) -> int:
        return self.entry.seq

    @property
    def mechanism(self) -> Mechanism:
        return self.entry.mechanism

    def settle(self, actual: Mechanism | None = None) -> Entry:
        """Record what actually ran: ``None`` = the plan ran in full; a mechanism covered
        by the plan (a sub-composition, e.g. ``compose(step, steps=k)`` for ``k`` of a
        planned ``T`` steps); ``compose([])`` = nothing ran (only if the data was never
        touched)."""
        return self.ledger.settle(self, self.mechanism if actual is None else actual)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and any(
                r.seq == self.seq for r in self.ledger.pending(
                    self.entry.dataset, privacy_unit=self.entry.privacy_unit)):
            self.settle()


@dataclass(frozen=True)
class BudgetHandle:
    """One budget of a :class:`Ledger` (``ledger.budget("adult")``): what estimators take
    as ``ledger=``. Methods forward to the ledger with the dataset filled in."""

    ledger: Ledger
    dataset: str
    privacy_unit: str = DEFAULT_UNIT

    def spend(self, mechanism: Mechanism, *, label: str | None = None,
              who: str | None = None, metadata: dict[str, str] | None = None) -> Entry:
        return self.ledger.spend(self.dataset, mechanism, label=label, who=who,
                                 privacy_unit=self.privacy_unit, metadata=metadata)

    def reserve(self, mechanism: Mechanism, *, label: str | None = None,
                who: str | None = None, extends: int | Reservation | None = None,
                metadata: dict[str, str] | None = None) -> Reservation:
        return self.ledger.reserve(self.dataset, mechanism, label=label, who=who,
                                   privacy_unit=self.privacy_unit, extends=extends,
                                   metadata=metadata)

    def check(self, mechanism: Mechanism) -> Spent:
        return self.ledger.check(self.dataset, mechanism, privacy_unit=self.privacy_unit)

    def spent(self) -> Spent:
        return self.ledger.spent(self.dataset, privacy_unit=self.privacy_unit)

    def history(self) -> list[Entry]:
        return self.ledger.history(self.dataset, privacy_unit=self.privacy_unit)

    def __deepcopy__(self, memo) -> BudgetHandle:
        return self



class KeylessConnection:
    """The connection of a keyed :class:`Ledger` unpickled: pickles never carry the HMAC
    key (a secret; a fitted estimator holding a budget handle is a release), so such a
    handle refuses every read and write until reopened with the key."""

    def __init__(self, path: str):
        self.path = path

    def cursor(self):
        raise ParameterValueError(
            f"key: this handle on the ledger {self.path} was unpickled, and pickles never "
            "carry its HMAC key: reopen it with Ledger(path, key=...) (and its budget with "
            ".budget(dataset))")

    def close(self) -> None:
        pass


class MissingLedgerConnection:
    """The connection of a :class:`Ledger` unpickled where its file cannot be opened (a
    fitted estimator's ``ledger=`` handle, loaded by whoever received the model, or in
    another working directory): the model loads and predicts; a read or spend raises
    :class:`~privlearn.errors.LedgerNotFoundError` saying what to do, and no empty ledger
    is created in its place."""

    def __init__(self, path: str, reason: str | None):
        self.path, self.reason = path, reason

    def cursor(self):
        raise LedgerNotFoundError(
            f"no privacy ledger can be opened at {self.path}: this handle on it was "
            "unpickled, e.g. with a fitted model, and nothing can be "
            "spent from it here. To fit the model again, give it a budget of a ledger that "
            "exists: est.set_params(ledger=Ledger(path).budget(dataset)) (a pipeline's step: "
            "step__ledger=...), or ledger=None",
            path=self.path, reason=self.reason)

    def close(self) -> None:
        pass


class ClosedConnection:
    """The connection of a :class:`Ledger` after :meth:`Ledger.close`: every read and write
    (through the ledger or a budget handle or reservation of it) is refused with a typed
    error naming the file, instead of SQLite's "Cannot operate on a closed database"."""

    def __init__(self, path: str):
        self.path = path

    def cursor(self):
        raise ParameterValueError(
            f"ledger: the Ledger on {self.path} was closed (e.g. a budget handle used after "
            "its `with Ledger(...)` block): open it again with Ledger(path) and take its "
            "budget with .budget(dataset)")

    def close(self) -> None:
        pass


class OtherLedgerConnection:
    """The connection of a :class:`Ledger` unpickled where the file at its path is not
    the ledger it was pickled from (it holds no entry ``count`` with the hash the pickle
    recorded: another ledger at the same path, e.g. on another machine, or the file
    rolled back behind what the pickled handle had seen). Every read and spend raises
    :class:`~privlearn.errors.LedgerNotFoundError` (reason ``"other_ledger"``): spending
    there would charge a budget that never counted what the handle spent before."""

    def __init__(self, path: str, head: tuple[int, str]):
        self.path, self.head = path, head

    def cursor(self):
        count, h = self.head
        raise LedgerNotFoundError(
            f"the privacy ledger at {self.path} is not the one this handle was pickled from "
            f"(that one had entry {count} with hash {h[:12]}..., this file has not: another "
            "ledger at the same path, e.g. on another machine, or the file restored from an "
            "older backup), so nothing is read or spent from it. To fit the model again, "
            "give it a budget explicitly: est.set_params(ledger=Ledger(path).budget(dataset)) "
            "(a pipeline's step: step__ledger=...), or ledger=None",
            path=self.path, reason="other_ledger")

    def close(self) -> None:
        pass


def pickled_head(ledger: Ledger) -> tuple[int, str] | None:
    """The head ``(count, hash)`` a pickle of ``ledger`` records, so that the copy it
    unpickles into recognises the file (:func:`holds_head`): the head last verified, else
    read now; None for a ledger that cannot be read (closed, tampered, keyed and
    unpickled) or has no entry (nothing of it to recognise)."""
    if ledger._seen is None:
        with contextlib.suppress(Exception):  # noqa: BLE001 - the pickle is made regardless
            ledger.head()
    seen = ledger._seen
    return None if seen is None or seen[0] == 0 else (int(seen[0]), str(seen[1]))


def holds_head(conn: sqlite3.Connection, head: tuple[int, str]) -> bool:
    """Whether the ledger file of ``conn`` holds entry ``head[0]`` with hash ``head[1]``
    (it is the ledger a pickle recorded, possibly grown since). A file that cannot be
    read here is not judged: its first use reports what is wrong with it."""
    try:
        row = conn.execute("SELECT hash FROM entries WHERE seq=?", (head[0],)).fetchone()
    except sqlite3.Error:
        return True
    return row is not None and row[0] == head[1]
