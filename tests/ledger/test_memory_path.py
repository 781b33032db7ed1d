"""A ledger is a file: SQLite's ``":memory:"`` is not a path for one.

``sqlite3.connect(":memory:")`` opens a database that lives only as long as its
connection, so ``Ledger(":memory:", create=True)`` used to hand out a budget that every
new ``Ledger(":memory:", create=True)`` started again from nothing (the same data, the
budget spent twice), while leaving two empty files named ``:memory:`` and
``:memory:-writelock`` in the working directory. It is refused, before anything is
created, with the way to get a throwaway ledger.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from privlearn.accounting import PureDP
from privlearn.cli import cli
from privlearn.errors import LedgerNotFoundError
from privlearn.ledger import Ledger


@pytest.mark.parametrize("path", [":memory:", Path(":memory:")])
@pytest.mark.parametrize("create", [True, False])
def test_in_memory_path_is_refused_before_any_file_is_made(
    tmp_path, monkeypatch, path, create
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LedgerNotFoundError) as err:
        Ledger(path, create=create)
    message = str(err.value)
    assert "':memory:'" in message and "tempfile.mkdtemp()" in message, message
    assert err.value.reason == "in_memory"
    assert os.listdir(tmp_path) == []  # no stray ':memory:' files


def test_the_suggested_throwaway_ledger_keeps_its_budget_across_handles(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LedgerNotFoundError) as err:
        Ledger("./:memory:", create=True)  # the same name, normalised
    assert err.value.reason == "in_memory"
    path = Path(tempfile.mkdtemp(dir=tmp_path)) / "privacy.db"  # what the message suggests
    first = Ledger(path, create=True)
    first.create_budget("d", epsilon=1.0, delta=1e-6)
    first.spend("d", PureDP(0.75), label="a count")
    assert Ledger(path).spent("d").epsilon_spent == pytest.approx(0.75, abs=1e-3)


def test_cli_budget_init_refuses_the_in_memory_path(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(
        cli, ["budget", "init", ":memory:", "--dataset", "d", "--epsilon", "1", "--delta", "1e-6"]
    )
    assert r.exit_code == 2, r.output
    assert "':memory:'" in r.output
    assert os.listdir(tmp_path) == []
