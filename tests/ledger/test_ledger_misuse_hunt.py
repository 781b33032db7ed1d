"""The privacy ledger as users misuse it: files restored under a live ledger, many
processes charging one file, processes killed between reserve and settle. Every check
is against a naive ground truth (the brute-force composition of the charged
mechanisms, or the file's own entries), never against a number the ledger printed."""

from __future__ import annotations

import os
import random
import shutil

import pytest

from privlearn.accounting import Gaussian, compose
from privlearn.errors import LedgerIntegrityError, LedgerNotFoundError, LedgerStorageError
from privlearn.ledger import Ledger


def test_a_backup_copied_over_a_live_ledger_is_a_typed_error_not_sqlite_s(tmp_path):
    # a user restores a backup over the ledger (and deletes its -wal/-shm files) while
    # a Ledger of this process still has it open: SQLite's read fails with an I/O
    # error and rolls the read transaction back itself; that must surface as a typed
    # error naming the file, not as "cannot commit - no transaction is active"
    path = str(tmp_path / "privacy.db")
    with Ledger(path, create=True) as led:
        led.create_budget("adult", 50.0, 1e-5)
        led.spend("adult", Gaussian(3.0))
    shutil.copy(path, tmp_path / "backup.db")
    live = Ledger(path)
    live.spend("adult", Gaussian(3.0))
    shutil.copyfile(tmp_path / "backup.db", path)
    for suffix in ("-wal", "-shm"):
        os.remove(path + suffix)
    try:
        with pytest.raises((LedgerStorageError, LedgerIntegrityError)) as info:
            Ledger(path).spent("adult")
        assert path in str(info.value)
    finally:
        live.close()


@pytest.fixture
def damaged(tmp_path):
    """A ledger with 30 releases whose middle page was overwritten with other bytes (a
    bad disk block, a botched copy): SQLite still opens it but reports "database disk
    image is malformed" when it reads the entries."""
    path = str(tmp_path / "privacy.db")
    with Ledger(path, create=True) as led:
        led.create_budget("adult", 50.0, 1e-5)
        for _ in range(30):
            led.spend("adult", Gaussian(30.0), label="y" * 200)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(random.Random(0).randbytes(3000))
    return path


def test_a_damaged_ledger_is_refused_with_an_integrity_error_naming_it(damaged):
    led = Ledger(damaged)
    with pytest.raises(LedgerIntegrityError, match="malformed") as info:
        led.spent("adult")
    assert damaged in str(info.value) and info.value.problems
    with pytest.raises(LedgerIntegrityError):
        led.spend("adult", Gaussian(30.0))
    report = led.verify()  # never raises for a damaged file: it reports it
    assert not report.ok and "malformed" in " ".join(report.problems)


@pytest.mark.parametrize(
    "command",
    [
        ["show", "--dataset", "adult"],
        ["verify"],
        ["spend", "--dataset", "adult", "--noise-multiplier", "50"],
        ["history"],
    ],
)
def test_the_shell_reports_a_damaged_ledger_in_one_line_with_status_4(damaged, command):
    from click.testing import CliRunner

    from privlearn.cli import cli

    args = ["budget", command[0], damaged, *command[1:]]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 4, result.output
    assert "Traceback" not in result.output and "malformed" in result.output
    assert len(result.output.strip().splitlines()) == 1


def _ledger_with_spends(path: str, n: int) -> Ledger:
    led = Ledger(path, create=True)
    led.create_budget("adult", 50.0, 1e-5)
    for _ in range(n):
        led.spend("adult", Gaussian(3.0))
    return led


def test_a_ledger_deleted_while_open_neither_answers_nor_records(tmp_path):
    # SQLite keeps the deleted file open: before, the object went on reporting the
    # deleted file's total, and refused spends blaming its lock file
    path = str(tmp_path / "privacy.db")
    led = _ledger_with_spends(path, 2)
    for suffix in ("", "-wal", "-shm"):
        os.remove(path + suffix)
    try:
        with pytest.raises(LedgerNotFoundError, match="deleted or moved") as info:
            led.spent("adult")
        assert info.value.path == path
        with pytest.raises(LedgerNotFoundError, match="deleted or moved"):
            led.spend("adult", Gaussian(3.0))
    finally:
        led.close()


def test_a_fresh_ledger_put_in_place_of_an_open_one_is_refused_not_read_as_empty(tmp_path):
    # the file is deleted and a new ledger with the same budget created at the path
    # (e.g. a script's `Ledger(path, create=True)` after a cleanup): the object that
    # recorded three releases must not go on reading the deleted file; before, it did,
    # and its next spend "succeeded" into the deleted file: a charge nobody could see
    path = str(tmp_path / "privacy.db")
    led = _ledger_with_spends(path, 3)
    truth = compose([Gaussian(3.0)] * 3).epsilon(1e-5, "pld")  # brute force
    assert led.spent("adult").epsilon_spent >= truth - 1e-9
    for suffix in ("", "-wal", "-shm"):
        os.remove(path + suffix)
    _ledger_with_spends(path, 0).close()
    try:
        with pytest.raises(LedgerIntegrityError, match="does not extend the head"):
            led.spent("adult")
        with pytest.raises(LedgerIntegrityError):
            led.spend("adult", Gaussian(3.0))
    finally:
        led.close()
    with Ledger(path) as fresh:  # the new file itself is untouched: its budget, no spend
        assert fresh.spent("adult").entries == 0
