"""A ledger whose lock file cannot be opened (a ledger another user owns, a read-only
directory): a clear LedgerNotFoundError naming the file, status 2 from the shell, never a
bare OSError from the lock."""

from __future__ import annotations

import errno
import os

import pytest
from click.testing import CliRunner

from privlearn.cli import cli
from privlearn.errors import LedgerNotFoundError
from privlearn.ledger import Ledger


@pytest.fixture
def locked_out(tmp_path, monkeypatch):
    path = str(tmp_path / "l.db")
    with Ledger(path, create=True) as led:
        led.create_budget("adult", epsilon=1.0, delta=1e-6)
    real_open = os.open

    def refuse_lock(p, *args, **kwargs):  # what EACCES on the lock file looks like
        if str(p).endswith("-writelock"):
            raise PermissionError(errno.EACCES, "Permission denied", str(p))
        return real_open(p, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse_lock)
    return path


def test_a_lock_file_that_cannot_be_opened_is_a_clear_ledger_error(locked_out):
    with pytest.raises(LedgerNotFoundError, match="writelock") as info:
        Ledger(locked_out)
    assert info.value.reason == "unopenable" and info.value.path == locked_out


def test_the_cli_reports_it_in_one_line_with_status_2(locked_out):
    r = CliRunner().invoke(cli, ["budget", "show", locked_out, "--dataset", "adult"],
                           env={"PRIVLEARN_LEDGER_KEY": None})
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("error: ") and "writelock" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
