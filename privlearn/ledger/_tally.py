"""The counted releases of one budget, folded entry by entry (see :class:`Tally`).

A spend checks the cap on the composition of every release counted so far. Reading and
parsing the whole history, merging it into one composition and re-reading it under the
budget's neighbouring relation on every spend made a spend's cost grow with the history.
A :class:`Tally` keeps that state -- the releases merged into ``(mechanism, count)`` parts
(composition of ``k`` runs of one mechanism is one self-composition), the number of
releases and pending reservations, the last reported total -- together with the chain
head ``(count, hash)`` of the last entry it folded. It is used only when the (verified)
chain still holds that hash at that position, which fixes every entry it covers (each
entry's hash covers its content and the previous hash); then only the later entries are
read. Anything else (no tally, a head that does not match, a settle, which rewrites an
earlier release) rebuilds it from every row, so the result is always the one of the full
recomposition.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from privlearn.accounting import Composed, Mechanism, Neighbouring, compose
from privlearn.errors import LedgerConflictError, UnsupportedMechanismError
from privlearn.ledger._filter import reported_floor
from privlearn.ledger._relations import _read_all
from privlearn.ledger._schema import GENESIS

_ROWS = ("SELECT seq, kind, mechanism, ref, payload FROM entries WHERE dataset=? AND "
         "privacy_unit=? AND seq>? AND kind IN ('spend', 'reserve', 'settle') ORDER BY seq")


class Releases(Sequence):
    """The counted releases in entry order (a read-only sequence), with their merged
    composition and, per Renyi order and relation, the running sum of their RDP at that
    order in entry order (what :func:`~privlearn.ledger._filter.rdp_at_order` adds up),
    so that evaluating them costs what the distinct mechanisms cost."""

    __slots__ = ("_slots", "composed", "rdp_sums", "summaries")

    def __init__(self, slots: list[Mechanism], composed: Composed,
                 rdp_sums: dict | None = None):
        self._slots = slots
        self.composed = composed
        self.rdp_sums = {} if rdp_sums is None else rdp_sums
        self.summaries: dict = {}  # what these releases add up to (see _summary)

    def __len__(self) -> int:
        return len(self._slots)

    def __getitem__(self, i):
        return self._slots[i]

    def __iter__(self) -> Iterator[Mechanism]:
        return iter(self._slots)

    @property
    def distinct(self) -> list[Mechanism]:
        """The distinct mechanisms, in order of first release."""
        return [m for m, _ in self.composed.parts]

    def plus(self, mechanism: Mechanism) -> Releases:
        """These releases and one more (a new object; this one is unchanged)."""
        return Releases([*self._slots, mechanism], compose([self.composed, mechanism]), {
            key: _add_rdp(total, mechanism, key) for key, total in self.rdp_sums.items()})


def _add_rdp(total: float, mechanism: Mechanism, key: tuple) -> float:
    """``total`` plus ``mechanism``'s RDP at the key's order, read under its relation,
    as :func:`~privlearn.ledger._filter.rdp_at_order` adds it (inf when it has none: the
    filter's own evaluation then raises its error)."""
    from privlearn.ledger._filter import rdp_at_order
    from privlearn.ledger._relations import _read

    order, relation = key
    try:
        v = rdp_at_order([_read(mechanism, relation)], order)
    except (UnsupportedMechanismError, NotImplementedError):  # the full evaluation says why
        return math.nan
    return total + v


class Tally:
    """The counted state of one budget up to the chain head ``head``."""

    __slots__ = ("floor", "head", "n", "pending", "releases", "runs", "run_of", "slots")

    def __init__(self) -> None:
        self.head: tuple[int, str] = (0, GENESIS)
        self.slots: dict[int, Mechanism] = {}  # counted entry (seq) -> its mechanism
        self.n = 0  # spends
        self.pending: set[int] = set()  # reservations not settled
        self.runs: dict[int, int] = {}  # run -> its reservations that count
        self.run_of: dict[int, int] = {}  # reservation -> its run
        self.floor: float | None = None
        self.releases: Releases | None = None

    def fold(self, rows: Sequence[tuple], parse) -> bool:
        """Fold spend and reserve rows in; False (nothing folded) at a settle."""
        if any(r[1] == "settle" for r in rows):
            return False
        new: list[Mechanism] = []
        for seq, kind, text, ref, payload in rows:
            m = parse(text)
            self.slots[seq] = m
            new.append(m)
            if kind == "spend":
                self.n += 1
            else:
                run = self.run_of[seq] = seq if ref is None else self.run_of.get(ref, ref)
                self.runs[run] = self.runs.get(run, 0) + 1
                self.pending.add(seq)
            if payload is not None:
                self.floor = reported_floor([payload])
        if self.releases is not None:
            for m in new:
                self.releases = self.releases.plus(m)
        return True

    def rebuild(self, rows: Sequence[tuple], parse) -> None:
        """Every row of the budget, as the full recomposition reads them."""
        self.__init__()
        settled = {ref: text for _, kind, text, ref, _ in rows if kind == "settle"}
        for seq, kind, text, ref, payload in rows:
            if payload is not None:
                self.floor = reported_floor([payload])
            if kind == "spend":
                self.slots[seq] = parse(text)
                self.n += 1
            elif kind == "reserve":
                run = self.run_of[seq] = seq if ref is None else self.run_of.get(ref, ref)
                if seq in settled:
                    if settled[seq] is None:  # nothing ran (e.g. a fit that failed)
                        continue
                    self.slots[seq] = parse(settled[seq])
                else:
                    self.pending.add(seq)
                    self.slots[seq] = parse(text)
                self.runs[run] = self.runs.get(run, 0) + 1

    def counted(self) -> tuple[Releases, int, int, float | None]:
        """``(releases, releases counted, pending reservations, last reported total)``."""
        if self.releases is None:
            slots = list(self.slots.values())
            self.releases = Releases(slots, compose(slots))
        return self.releases, self.n + len(self.runs), len(self.pending), self.floor


def read_tally(tallies: dict, cur, dataset: str, unit: str, parse) -> Tally:
    """The tally of ``(dataset, unit)`` at the snapshot read by ``cur`` (whose chain was
    verified in this transaction): the cached one extended by the later entries when the
    chain still holds its head, else rebuilt from every row."""
    count, h = cur.execute("SELECT count, hash FROM head WHERE id=1").fetchone()
    t = tallies.pop((dataset, unit), None)  # put back once consistent (a parse may raise)
    if t is not None and t.head != (count, h):
        at = t.head[0]
        row = (cur.execute("SELECT hash FROM entries WHERE seq=?", (at,)).fetchone()
               if at else (GENESIS,))
        if row is None or row[0] != t.head[1] or at > count or not t.fold(
                cur.execute(_ROWS, (dataset, unit, at)).fetchall(), parse):
            t = None
    if t is None:
        t = Tally()
        t.rebuild(cur.execute(_ROWS, (dataset, unit, 0)).fetchall(), parse)
    t.head = (int(count), str(h))
    tallies[(dataset, unit)] = t
    return t


def read_releases(budget, releases: Releases, relation: Neighbouring | None) -> Releases:
    """``releases`` read under ``relation`` (as :func:`_read_all`), merged; the RDP sum at
    an adaptive budget's order carried along."""
    parts = releases.composed.parts
    try:
        read = _read_all(budget, [m for m, _ in parts], relation)
    except LedgerConflictError:  # the message names the release in entry order
        _read_all(budget, list(releases), relation)
        raise
    composed = compose(read, steps=[k for _, k in parts]) if parts else compose([])
    out = Releases(releases, composed)  # entries in their own reading: only len() is used
    if budget.adaptive:
        key = (budget.adaptive_order, relation)
        if key not in releases.rdp_sums:
            total = 0.0
            for m in releases:
                total = _add_rdp(total, m, key)
            releases.rdp_sums[key] = total
        out.rdp_sums = {budget.adaptive_order: releases.rdp_sums[key]}
    return out
