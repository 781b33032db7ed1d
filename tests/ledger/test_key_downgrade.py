"""A keyed ledger rewritten without the key (a spend removed, the chain recomputed with
plain SHA-256, the file's key marker set to "unkeyed"): the owner, who opens it with the
key, must be told that this is what tampering looks like, not only to drop the key (which
would make the forged file verify)."""

from __future__ import annotations

import hashlib
import json
import sqlite3

import pytest
from _tampering import tamper
from click.testing import CliRunner

from privlearn.accounting import Gaussian
from privlearn.cli import cli
from privlearn.ledger import Ledger

KEY = b"owner-secret"
_CONTENT = ("seq", "kind", "dataset", "privacy_unit", "mechanism", "payload", "label", "who",
            "time", "ref")


def _downgraded(tmp_path) -> str:
    path = str(tmp_path / "keyed.db")
    led = Ledger(path, create=True, key=KEY)
    led.create_budget("adult", epsilon=5.0, delta=1e-6)
    led.spend("adult", Gaussian(4.0))
    led.spend("adult", Gaussian(4.0))
    led.close()
    # the attacker (no key): delete the last spend and recompute an unkeyed chain, the
    # documented format (prev + newline + compact sorted-key JSON of the content)
    tamper(path, "DELETE FROM entries WHERE seq = 3")
    con = sqlite3.connect(path)
    prev = "0" * 64
    rows = con.execute(f"SELECT {', '.join(_CONTENT)} FROM entries ORDER BY seq").fetchall()
    con.execute("DELETE FROM entries")
    for r in rows:
        text = json.dumps(dict(zip(_CONTENT, r, strict=True)), sort_keys=True,
                          separators=(",", ":"))
        h = hashlib.sha256((prev + "\n" + text).encode()).hexdigest()
        con.execute("INSERT INTO entries VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", (*r, prev, h))
        prev = h
    con.execute("UPDATE head SET count = ?, hash = ?", (len(rows), prev))
    con.execute("UPDATE meta SET value = '0' WHERE key = 'keyed'")
    con.commit()
    con.close()
    return path


def test_the_owner_opening_a_downgraded_ledger_with_its_key_is_told_of_tampering(tmp_path):
    path = _downgraded(tmp_path)
    with pytest.raises(ValueError) as info:
        Ledger(path, key=KEY)
    msg = str(info.value)
    assert "tampered" in msg and "backup" in msg, msg
    # the premise: without the key the forged file verifies (no check can tell it from a
    # ledger that never had a key; only the owner's knowledge of the key can)
    assert Ledger(path).verify().ok


def test_the_cli_names_tampering_when_a_key_meets_an_unkeyed_ledger(tmp_path):
    path = _downgraded(tmp_path)
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    r = CliRunner().invoke(cli, ["budget", "show", path, "--key-file", str(key_file),
                                 "--dataset", "adult"], env={"PRIVLEARN_LEDGER_KEY": None})
    assert r.exit_code == 2, r.output
    assert "tampered" in r.stderr and "backup" in r.stderr and "--key-file" in r.stderr
