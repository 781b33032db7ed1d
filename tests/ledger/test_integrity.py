"""A tampered ledger refuses to report or record anything until it verifies again.

The attack: someone with write access to the file drops the append-only triggers and
deletes (or edits) entries, so that the ledger's total looks smaller. ``verify`` reports
it; every other public path must refuse rather than answer from the tampered file.
"""

from __future__ import annotations

import sqlite3

import pytest
from _tampering import non_ledger_files, tamper

from privlearn.accounting import Gaussian, compose
from privlearn.errors import LedgerIntegrityError, LedgerNotFoundError, NotALedgerError
from privlearn.ledger import Ledger


def _backup(src, dst) -> None:
    a, b = sqlite3.connect(src), sqlite3.connect(dst)
    a.backup(b)
    a.close()
    b.close()


#: Every public way to read or extend a ledger, as (name, call).
PATHS = [
    ("spent", lambda led: led.spent("a")),
    ("spent.epsilon_remaining", lambda led: led.spent("a").epsilon_remaining),
    ("spend", lambda led: led.spend("a", Gaussian(50.0))),
    ("reserve", lambda led: led.reserve("a", Gaussian(50.0))),
    ("settle", lambda led: led.settle(4, None)),
    ("check", lambda led: led.check("a", Gaussian(50.0))),
    ("mechanism", lambda led: led.mechanism("a")),
    ("history", lambda led: led.history()),
    ("history(dataset)", lambda led: led.history("a")),
    ("pending", lambda led: led.pending("a")),
    ("budget_info", lambda led: led.budget_info("a")),
    ("budgets", lambda led: led.budgets()),
    ("budget", lambda led: led.budget("a")),
    ("create_budget", lambda led: led.create_budget("b", 1.0, 1e-6)),
    ("head", lambda led: led.head()),
]
ATTACKS = {
    "delete a spend": ["DELETE FROM entries WHERE seq = 2"],
    "delete the last spend": ["DELETE FROM entries WHERE seq = 5"],
    "edit a spend": ["UPDATE entries SET mechanism = replace(mechanism, '3.0', '300.0') "
                     "WHERE seq = 3"],
    "delete and renumber": ["DELETE FROM entries WHERE seq = 2",
                            "UPDATE entries SET seq = seq - 1 WHERE seq > 2"],
    "raise the cap": ["UPDATE entries SET payload = replace(payload, '\"epsilon\": 5.0', "
                      "'\"epsilon\": 50.0') WHERE seq = 1"],
    "drop the head": ["DELETE FROM head"],
}


@pytest.fixture
def ledger_path(tmp_path):
    p = tmp_path / "l.db"
    with Ledger(p, create=True) as led:
        led.create_budget("a", 5.0, 1e-6)
        for sigma in (2.0, 3.0, 4.0):
            led.spend("a", Gaussian(sigma))
        led.reserve("a", compose(Gaussian(20.0), steps=3))  # entry 5, open
    return p


def _assert_refused(led: Ledger, call) -> None:
    with pytest.raises(LedgerIntegrityError, match="failed its integrity check") as info:
        call(led)
    assert info.value.problems  # what was found
    assert "restore the file from a backup" in str(info.value)
    with pytest.raises(LedgerIntegrityError):  # refused again, not only once
        call(led)


def _entries(path) -> int:
    con = sqlite3.connect(path)
    n = con.execute("SELECT count(*) FROM entries").fetchone()[0]
    con.close()
    return n


@pytest.mark.parametrize("opened", ["before", "after"])
def test_every_public_path_refuses_a_ledger_with_a_deleted_spend(ledger_path, opened):
    """Whether the Ledger object was opened (and had verified the file) before the
    tampering or is opened after it, every read and write refuses; nothing is appended."""
    early = Ledger(ledger_path)
    handle = early.budget("a")  # what estimators hold
    tamper(ledger_path, *ATTACKS["delete a spend"])
    led = early if opened == "before" else Ledger(ledger_path)
    for _name, call in PATHS:
        _assert_refused(led, call)
    for call in (lambda h: h.spent(), lambda h: h.spend(Gaussian(50.0)),
                 lambda h: h.reserve(Gaussian(50.0)), lambda h: h.check(Gaussian(50.0)),
                 lambda h: h.history()):
        _assert_refused(handle, call)
    report = led.verify()
    assert not report and "entry 2 is missing (found seq 3 in its place)" in report.problems
    assert _entries(ledger_path) == 4  # nothing appended


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_every_attack_is_refused(ledger_path, attack):
    early = Ledger(ledger_path)
    early.spent("a")
    tamper(ledger_path, *ATTACKS[attack])
    for led in (early, Ledger(ledger_path)):
        for call in (lambda led: led.spent("a"), lambda led: led.spend("a", Gaussian(50.0))):
            _assert_refused(led, call)
        assert not led.verify()


def test_the_deleted_spend_would_have_given_a_too_low_total(ledger_path):
    """What the refusal prevents: the file without entry 2 composes to less."""
    honest = Ledger(ledger_path).spent("a").epsilon_spent
    tamper(ledger_path, "DELETE FROM entries WHERE seq = 2")
    con = sqlite3.connect(ledger_path)
    rows = con.execute("SELECT count(*) FROM entries WHERE kind = 'spend'").fetchone()[0]
    con.close()
    assert rows == 2
    assert compose([Gaussian(3.0), Gaussian(4.0), compose(Gaussian(20.0), steps=3)]
                   ).epsilon(1e-6) < honest
    with pytest.raises(LedgerIntegrityError, match="entry 2 is missing"):
        Ledger(ledger_path).spent("a")


def test_restoring_the_file_lifts_the_refusal(ledger_path, tmp_path):
    backup = tmp_path / "backup.db"
    _backup(ledger_path, backup)
    led = Ledger(ledger_path)
    honest = led.spent("a")
    tamper(ledger_path, "DELETE FROM entries WHERE seq = 3")
    with pytest.raises(LedgerIntegrityError):
        led.spent("a")
    _backup(backup, ledger_path)  # restore through SQLite (the connection stays valid)
    assert led.spent("a") == honest  # the file verifies again: reports resume
    led.spend("a", Gaussian(50.0))
    assert led.verify()


def test_truncation_with_a_rewritten_head_is_refused_by_an_object_that_saw_more(
        ledger_path):
    """Without a key a consistent shorter chain passes verify() in a fresh process; a
    Ledger object that had verified the longer chain refuses the rollback."""
    led = Ledger(ledger_path)
    led.spent("a")
    con = sqlite3.connect(ledger_path)
    prev = con.execute("SELECT hash FROM entries WHERE seq = 4").fetchone()[0]
    con.close()
    tamper(ledger_path, "DELETE FROM entries WHERE seq = 5",
            f"UPDATE head SET count = 4, hash = '{prev}'")
    with pytest.raises(LedgerIntegrityError, match="does not extend the head"):
        led.spent("a")
    assert not led.verify()
    assert Ledger(ledger_path).verify()  # the documented limit: keep head() elsewhere
    assert not Ledger(ledger_path).verify(expected_head=(5, "0" * 64))


def test_own_appends_are_not_re_verified_but_other_writers_are(ledger_path, monkeypatch):
    """The full check (re-hashing every entry) runs on first use and after another
    connection commits, never between an object's own appends."""
    led, other = Ledger(ledger_path), Ledger(ledger_path)
    calls = []
    real = Ledger._chain_problems

    def counting(self, *args, **kwargs):
        calls.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Ledger, "_chain_problems", counting)
    led.spent("a")
    assert calls == [led]
    for _ in range(3):
        led.spend("a", Gaussian(60.0))
        led.spent("a")
    assert calls == [led]
    other.spend("a", Gaussian(60.0))  # other's first check, then its append
    led.spent("a")  # another connection committed: checked again
    assert calls == [led, other, led]
    led.spent("a")
    assert calls == [led, other, led]


def test_a_rolled_back_append_is_not_taken_for_tampering(ledger_path, monkeypatch):
    """An append inside a transaction that then fails leaves the verified head as it was
    (the refusal is for files changed by others, not for this object's rollbacks)."""
    led = Ledger(ledger_path)
    real_append = Ledger._append

    def append_then_fail(self, *args, **kwargs):
        real_append(self, *args, **kwargs)
        raise RuntimeError("crash inside the transaction")

    monkeypatch.setattr(Ledger, "_append", append_then_fail)
    with pytest.raises(RuntimeError, match="inside the transaction"):
        led.spend("a", Gaussian(50.0))
    monkeypatch.undo()
    assert led.spent("a").entries == 4  # rolled back; no false alarm
    led.spend("a", Gaussian(50.0))
    assert led.verify() and led.head()[0] == 6


def test_missing_ledger_is_an_error_not_a_new_file(tmp_path):
    p = tmp_path / "typo.db"
    with pytest.raises(LedgerNotFoundError, match=f"no privacy ledger at {p}.*create=True"):
        Ledger(p)
    assert not p.exists()
    with pytest.raises(FileNotFoundError):  # LedgerNotFoundError is one
        Ledger(p)
    p.touch()  # an empty file is not a ledger either
    with pytest.raises(LedgerNotFoundError, match="is empty"):
        Ledger(p)
    with Ledger(p, create=True) as led:
        assert led.budgets() == [] and led.verify()
    with Ledger(p) as led:  # exists now
        assert led.verify()
    with pytest.raises(TypeError, match="create must be a bool"):
        Ledger(p, create="yes")


def test_a_file_that_is_not_a_ledger_is_refused(tmp_path):
    junk, other = non_ledger_files(tmp_path)
    before = other.read_bytes()
    for p in (junk, other):
        for create in (False, True):
            # a NotALedgerError: a LedgerNotFoundError (no ledger there) that is still
            # a LedgerIntegrityError, the type it had before
            with pytest.raises(NotALedgerError, match="not a privacy ledger") as info:
                Ledger(p, create=create)
            assert isinstance(info.value, LedgerNotFoundError)
            assert isinstance(info.value, LedgerIntegrityError)
            assert info.value.reason == "not_a_ledger" and info.value.path == str(p)
    assert other.read_bytes() == before  # someone's database: not even set to WAL
