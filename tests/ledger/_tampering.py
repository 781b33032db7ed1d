"""Helpers shared by the ledger tests: tamper with a ledger file as an attacker with
write access would, and make files that are not ledgers."""

from __future__ import annotations

import sqlite3
from pathlib import Path


def tamper(path, *sql: str) -> None:
    """Drop the append-only triggers, then run ``sql`` on the file (another connection)."""
    con = sqlite3.connect(path)
    con.execute("DROP TRIGGER IF EXISTS entries_no_update")
    con.execute("DROP TRIGGER IF EXISTS entries_no_delete")
    for s in sql:
        con.execute(s)
    con.commit()
    con.close()


def non_ledger_files(directory: Path) -> tuple[Path, Path]:
    """A file that is not a database, and an SQLite database that is not a ledger."""
    junk = directory / "junk.db"
    junk.write_bytes(b"this is not a database" * 100)
    other = directory / "other.db"
    con = sqlite3.connect(other)
    con.execute("CREATE TABLE t (x)")
    con.commit()
    con.close()
    return junk, other
