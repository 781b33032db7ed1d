"""A ledger file deleted, moved or replaced while a :class:`~privlearn.ledger.Ledger`
has it open. SQLite keeps reading and writing the file it opened, whatever now lies at
the path: a deleted or moved ledger would go on answering (and recording releases
nobody finds at the path), and a backup copied over it would be read by other processes
while this one writes elsewhere. So every request first compares the file at the path
with the one opened: a missing file is a
:class:`~privlearn.errors.LedgerNotFoundError`, another file is opened in its place and
checked, as any file is, against the head this object verified (a backup that lacks
releases recorded here is a :class:`~privlearn.errors.LedgerIntegrityError`)."""

from __future__ import annotations

import os
import sqlite3
from typing import TYPE_CHECKING

from privlearn.errors import LedgerNotFoundError

if TYPE_CHECKING:
    from privlearn.ledger._ledger import Ledger


def file_identity(path: str) -> tuple[int, int] | None:
    """``(device, inode)`` of the file at ``path``, None when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def follow_file(ledger: Ledger) -> sqlite3.Connection:
    """The connection of ``ledger`` to the file now at its path: the one it has while
    that is the file it opened, else a new one to the file there (the old one closed).

    Raises
    ------
    LedgerNotFoundError
        No file at the path any more (deleted or moved away since it was opened).
    """
    conn = ledger._conn
    if ledger._ident is None or not isinstance(conn, sqlite3.Connection):
        return conn  # a closed or unpickled handle: its connection says why it refuses
    try:
        st = os.stat(ledger._abs)
    except FileNotFoundError:
        raise LedgerNotFoundError(
            f"the privacy ledger {ledger.path} was deleted or moved away while this Ledger "
            "had it open; nothing was read or recorded: put the ledger back at that path "
            "(restore it from a backup), or open it where it now is",
            path=ledger.path,
            reason="missing",
        ) from None
    except OSError:
        return conn  # e.g. a directory we may no longer search: SQLite reports it
    ident = (st.st_dev, st.st_ino)
    if ident == ledger._ident:
        return conn
    new = ledger._connect(False)  # typed errors: not a ledger, unreadable, ...
    conn.close()
    ledger._conn, ledger._ident = new, ident
    ledger._tallies.clear()  # a cache of the other file's entries
    ledger._verified_version = ledger._failure = None  # check it against the head seen
    return new
