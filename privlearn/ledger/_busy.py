"""Waiting for another writer of a ledger file, within the ledger's ``timeout``: the OS
write lock every writer queues on, and SQLite's lock; past the timeout both are a
:class:`~privlearn.errors.LedgerBusyError` naming the file, the timeout and what to do,
with the transaction rolled back (nothing recorded). A file that cannot be written or
read (disk full, I/O error, read-only) is a :class:`~privlearn.errors.LedgerStorageError`,
rolled back the same way, and a damaged file (SQLite's "database disk image is
malformed") a :class:`~privlearn.errors.LedgerIntegrityError`."""

from __future__ import annotations

import contextlib
import sqlite3
import sys
import time
from collections.abc import Iterator

if sys.platform != "win32":
    import fcntl
else:  # pragma: no cover - Windows: SQLite's own locking only
    fcntl = None

from privlearn.errors import LedgerBusyError, LedgerIntegrityError, LedgerStorageError

#: the seconds a Ledger (and a ``privlearn budget`` command) waits for another writer
#: by default
DEFAULT_TIMEOUT = 60.0
#: the longest sleep between two tries of a held OS write lock (seconds)
_MAX_POLL = 0.002


def busy_error(path: str, timeout: float) -> LedgerBusyError:
    """The refusal of a request that waited ``timeout`` seconds for ``path``'s lock."""
    return LedgerBusyError(
        f"the privacy ledger {path} stayed locked by another writer for the whole "
        f"timeout={timeout:g} s this Ledger waits; nothing was recorded. Try again, pass "
        "a larger timeout= to Ledger(...), or find the process that holds a write "
        "transaction open on the file (another Ledger, or an SQLite client such as "
        "sqlite3 or DB Browser, in a transaction)", path=path, timeout=timeout)


def is_lock_timeout(exc: BaseException) -> bool:
    """Whether SQLite gave up waiting for a lock (``SQLITE_BUSY`` / ``SQLITE_LOCKED``)."""
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    return "locked" in str(exc) or "busy" in str(exc)


#: SQLite's primary result codes of a file that cannot be written or read, and the
#: ``reason`` of the :class:`LedgerStorageError` each one is
_STORAGE_CODES = {
    sqlite3.SQLITE_FULL: "full",
    sqlite3.SQLITE_IOERR: "io",
    sqlite3.SQLITE_READONLY: "readonly",
    sqlite3.SQLITE_CANTOPEN: "unopenable",
}
_STORAGE_SAY = {
    "full": "the disk, quota or file size limit is full",
    "io": "an I/O error (often a full disk, or a file size limit)",
    "readonly": "the file or its file system is read-only",
    "unopenable": "a file of the ledger cannot be opened",
}


def storage_error(exc: BaseException, path: str) -> LedgerStorageError | None:
    """:class:`LedgerStorageError` when SQLite's ``exc`` says the file could not be
    written or read (disk full, I/O error, read-only), else None."""
    if not isinstance(exc, sqlite3.OperationalError):
        return None
    code = getattr(exc, "sqlite_errorcode", None)
    reason = None if code is None else _STORAGE_CODES.get(code & 0xFF)
    if reason is None:
        return None
    return LedgerStorageError(
        f"the privacy ledger {path} could not be written or read: {_STORAGE_SAY[reason]} "
        f"({exc}); nothing was recorded. Free space (or raise the limit) where the ledger "
        "and its -wal and -shm files live, check that they and their directory are "
        "writable, and try again", path=path, reason=reason)


def as_busy_error(exc: sqlite3.OperationalError, path: str,
                  timeout: float) -> BaseException:
    """SQLite's error ``exc``, or :class:`LedgerBusyError` if it is a lock timeout, or
    :class:`LedgerStorageError` if the file could not be written or read."""
    if is_lock_timeout(exc):
        return busy_error(path, timeout)
    return storage_error(exc, path) or exc


@contextlib.contextmanager
def lock_timeout_refused(conn: sqlite3.Connection, path: str,
                         timeout: float) -> Iterator[None]:
    """Turn SQLite's lock timeout inside the block into :class:`LedgerBusyError`, a
    file that could not be written or read into :class:`LedgerStorageError`, and a
    damaged file into :class:`LedgerIntegrityError`, after
    rolling back what the block's transaction had written (a failed ``COMMIT`` leaves
    the transaction open)."""
    try:
        yield
    except sqlite3.DatabaseError as exc:  # OperationalError is one too
        typed = (as_busy_error(exc, path, timeout) if isinstance(exc, sqlite3.OperationalError)
                 else corrupt_error(exc, path) or exc)
        if typed is exc:
            raise
        if getattr(conn, "in_transaction", False):
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        raise typed from None


def is_corrupt(exc: BaseException) -> bool:
    """Whether SQLite found the file damaged (``SQLITE_CORRUPT`` / ``SQLITE_NOTADB``:
    "database disk image is malformed"), e.g. bytes overwritten in the middle."""
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(exc, sqlite3.DatabaseError) and code is not None and (
        code & 0xFF in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB))


def corrupt_error(exc: BaseException, path: str) -> LedgerIntegrityError | None:
    """:class:`LedgerIntegrityError` when SQLite's ``exc`` says the ledger file is
    damaged, else None: its entries cannot all be read, so no total is reported from it
    and nothing is appended to it."""
    if not is_corrupt(exc):
        return None
    problem = f"unreadable ledger: {exc}"
    return LedgerIntegrityError(
        f"ledger {path} is damaged ({exc}); nothing is reported or recorded until it "
        "verifies again: restore the file from a backup (`privlearn budget verify PATH` "
        "checks it)", (problem,))


def lock_file(fd: int, path: str, timeout: float) -> None:
    """Take the exclusive OS lock on ``fd`` (``flock``), waiting at most ``timeout``
    seconds for the writer that holds it (tries every 2 ms at most once it is held)."""
    deadline = time.monotonic() + timeout
    pause = 0.0001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise busy_error(path, timeout) from None
            time.sleep(min(pause, left))
            pause = min(2 * pause, _MAX_POLL)


def end_transaction(conn: sqlite3.Connection, how: str) -> None:
    """End ``conn``'s transaction with ``how`` when one is still open: after some errors
    (an I/O error, a full disk) SQLite has already rolled it back, and a second error
    (``cannot rollback - no transaction is active``) would hide the first."""
    if getattr(conn, "in_transaction", True):
        cur = conn.cursor()  # an unpickled handle's connection answers with its own error
        cur.execute(how)
