"""The ledger file's format: its SQLite schema, the columns and hashed content of an
entry, the genesis hash of the chain, and the check of the schema version of a file."""

from __future__ import annotations

import json
import os
import stat
import urllib.parse

from privlearn.errors import (
    LedgerConflictError,
    LedgerIntegrityError,
    LedgerNotFoundError,
    NotALedgerError,
    ParameterValueError,
)

#: The format of the ledger file this version reads and writes.
SCHEMA_VERSION = 1
#: The ``prev_hash`` of the first entry.
GENESIS = "0" * 64


_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS entries (
    seq INTEGER PRIMARY KEY,
    kind TEXT NOT NULL,
    dataset TEXT NOT NULL,
    privacy_unit TEXT NOT NULL,
    mechanism TEXT,
    payload TEXT,
    label TEXT,
    who TEXT,
    time TEXT NOT NULL,
    ref INTEGER,
    prev_hash TEXT NOT NULL,
    hash TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_by_budget ON entries (dataset, privacy_unit, seq);
CREATE TABLE IF NOT EXISTS head (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    count INTEGER NOT NULL,
    hash TEXT NOT NULL
);
CREATE TRIGGER IF NOT EXISTS entries_no_update BEFORE UPDATE ON entries
BEGIN SELECT RAISE(ABORT, 'privlearn ledger entries are append-only'); END;
CREATE TRIGGER IF NOT EXISTS entries_no_delete BEFORE DELETE ON entries
BEGIN SELECT RAISE(ABORT, 'privlearn ledger entries are append-only'); END;
"""

_COLUMNS = (
    "seq, kind, dataset, privacy_unit, mechanism, payload, label, who, time, ref, "
    "prev_hash, hash"
)
_CONTENT_KEYS = ("seq", "kind", "dataset", "privacy_unit", "mechanism", "payload", "label",
                 "who", "time", "ref")
#: The hashed text of an entry: its content as compact JSON with sorted keys.
_ENCODE = json.JSONEncoder(sort_keys=True, separators=(",", ":")).encode


def _check_schema(path: str, row) -> None:
    """Refuse a file whose format this version cannot read: one written by a newer
    privlearn (its rows may hold what this code would misread), one claiming a version
    below 1 (which no privlearn writes), or a ``meta`` table without a readable schema
    version (``row``: the ``meta`` row ``schema``)."""
    try:
        version = int(row[0])
    except (TypeError, ValueError):
        raise LedgerIntegrityError(
            f"{path} has no readable schema version ({None if row is None else row[0]!r}); "
            "it is not a privacy ledger this version can read: restore it from a backup "
            "or pass the path of a ledger", ("no readable schema version",)) from None
    if version < 1:
        raise LedgerConflictError(
            f"{path} claims schema version {version}, which no privlearn writes (versions "
            f"start at 1; this version reads schema {SCHEMA_VERSION}), so it cannot be read "
            "as a privacy ledger: restore it from a backup or pass the path of a ledger "
            "(it was not changed)")
    if version > SCHEMA_VERSION:
        raise LedgerConflictError(
            f"{path} is a privacy ledger of schema version {version}, written by a newer "
            f"privlearn; this version reads schema {SCHEMA_VERSION} and would misread it: "
            "upgrade privlearn to use this ledger (it was not changed)")



def home_hint(path: str) -> str:
    """What to add to a refusal of ``path`` when it starts with ``~``: Python does not
    expand it (the shell does), so ``~/privacy.db`` names a folder called ``~``."""
    if not str(path).startswith("~"):
        return ""
    return (f"; a leading '~' is not expanded in a path given from Python (the shell "
            f"expands it): pass os.path.expanduser({str(path)!r}), i.e. "
            f"{os.path.expanduser(path)!r}")


def check_ledger_path(path: str) -> None:
    """Refuse, before SQLite opens anything, a ledger path whose directory does not
    exist, that is a directory, or that exists but is not a regular file (a device such
    as /dev/null, a FIFO, a socket: SQLite would write its journal and the lock file
    next to it, e.g. in /dev, and fail), and SQLite's ``":memory:"``, a database that
    dies with its connection: every new ``Ledger(":memory:", create=True)`` would start
    the budget again from nothing."""
    if str(path) == ":memory:":
        raise LedgerNotFoundError(
            "path=':memory:' is SQLite's in-memory database, not a file: its budget would "
            "vanish with this Ledger, and the next Ledger(':memory:', create=True) would "
            "spend the same data's budget again from nothing. A ledger must outlive the "
            "process; for a throwaway one (a test, a notebook trial) pass a file in a "
            "temporary directory, e.g. Ledger(Path(tempfile.mkdtemp()) / 'privacy.db', "
            "create=True)",
            path=str(path), reason="in_memory")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise LedgerNotFoundError(
            f"the directory {folder} of the ledger path {path} does not exist; "
            "create the directory first (a ledger is created in an existing directory)"
            + home_hint(path), path=path, reason="no_directory")
    if os.path.isdir(path):
        raise LedgerNotFoundError(
            f"{path} is a directory, not a privacy ledger; pass the path of a file "
            f"in it (e.g. {os.path.join(path, 'ledger.db')})",
            path=path, reason="directory")
    try:
        mode = os.stat(path).st_mode
    except OSError:  # none there yet (created by create=True), or not ours to stat
        return
    if not stat.S_ISREG(mode):
        raise LedgerNotFoundError(
            f"{path} is not a regular file (a device, pipe or socket), so it cannot be a "
            "privacy ledger; pass the path of a ledger file (or of a new one to create)",
            path=path, reason="not_a_file")


def read_only_uri(path: str) -> str:
    """The SQLite URI opening ``path`` (absolute) read-only (``mode=ro``): it never
    writes the file, so a ledger this process may only read can be shown and verified."""
    return "file:" + urllib.parse.quote(path) + "?mode=ro"


#: The first 16 bytes of every SQLite 3 database file (the file format's header string).
_SQLITE_HEADER = b"SQLite format 3\x00"


def unreadable_file_error(path: str, abs_path: str, exc: BaseException) -> Exception:
    """The error for a file SQLite cannot read as a database: without SQLite's header it
    is not a ledger at all (:class:`NotALedgerError`: a text file, random bytes); with it,
    a damaged database, possibly a ledger (:class:`LedgerIntegrityError`)."""
    try:
        with open(abs_path, "rb") as fh:
            header = fh.read(len(_SQLITE_HEADER))
    except OSError:
        header = _SQLITE_HEADER  # cannot tell: the stricter answer
    if header != _SQLITE_HEADER:
        return NotALedgerError(
            f"{path} is not a privacy ledger (not an SQLite database); pass the path of a "
            "ledger, or create one at a path where no file exists", path=path)
    return LedgerIntegrityError(
        f"{path} is not a readable privacy ledger ({exc}); restore it from a backup or "
        "pass the path of a ledger", (f"unreadable ledger: {exc}",))


def refuse_foreign_database(cur, path: str) -> set[str]:
    """The names of the database's tables; :class:`NotALedgerError` if it has tables but
    not the ledger's (someone else's SQLite database: nothing of it is changed)."""
    tables = {r[0] for r in cur.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if tables and "meta" not in tables:
        raise NotALedgerError(
            f"{path} is an SQLite database but not a privacy ledger (tables "
            f"{', '.join(sorted(tables))}); pass the path of a ledger, or create one "
            "at a path where no file exists", path=path)
    return tables


def open_schema(cur, path: str, keyed: bool, create: bool) -> None:
    """Inside a transaction on a new connection: create the ledger's tables in an empty
    file (``create``), or check that the file is a ledger this version reads, created
    with an HMAC key exactly when ``keyed``."""
    tables = refuse_foreign_database(cur, path)
    if "meta" not in tables:
        if not create:
            raise LedgerNotFoundError(
                f"{path} is empty, not a privacy ledger; pass create=True to "
                "create one there", path=path, reason="empty")
        for stmt in _SCHEMA.split(";\n"):
            if stmt.strip():
                cur.execute(stmt)
        cur.execute(
            "INSERT INTO meta VALUES ('schema', ?), ('keyed', ?)",
            (str(SCHEMA_VERSION), "1" if keyed else "0"),
        )
        cur.execute("INSERT INTO head VALUES (1, 0, ?)", (GENESIS,))
        return
    _check_schema(path, cur.execute("SELECT value FROM meta WHERE key='schema'").fetchone())
    row = cur.execute("SELECT value FROM meta WHERE key='keyed'").fetchone()
    if row is not None and (row[0] == "1") != keyed:
        raise ParameterValueError(
            f"key: ledger {path} was created "
            + ("with an HMAC key: pass key= (the same secret; `privlearn budget` "
               "reads it from --key-file PATH or PRIVLEARN_LEDGER_KEY)"
               if row[0] == "1" else
               "without an HMAC key: do not pass key= (unless it was created "
               "with this key: then the file was rewritten without it, i.e. "
               "tampered with, which dropping the key would hide: restore it "
               "from a backup)")
        )
