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


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
def test_a_new_ledger_and_its_lock_file_are_readable_by_their_owner_only(tmp_path, umask_022):
    # under a umask of 022 a plain create would leave the ledger readable by every user
    path = str(tmp_path / "l.db")
    with Ledger(path, create=True) as led:
        led.create_budget("adult", epsilon=1.0, delta=1e-6)
    for p in (path, path + "-writelock"):
        assert os.stat(p).st_mode & 0o777 == 0o600, p


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
def test_opening_an_existing_ledger_keeps_its_mode(tmp_path, umask_022):
    path = str(tmp_path / "l.db")
    with Ledger(path, create=True) as led:
        led.create_budget("adult", epsilon=1.0, delta=1e-6)
    os.chmod(path, 0o640)  # a ledger its owner shares with a group
    os.remove(path + "-writelock")
    with Ledger(path, create=True) as led:
        led.create_budget("census", epsilon=1.0, delta=1e-6)
    assert os.stat(path).st_mode & 0o777 == 0o640
    assert os.stat(path + "-writelock").st_mode & 0o777 == 0o640


def test_a_ledger_opened_by_a_relative_path_survives_a_change_of_directory(
        tmp_path, monkeypatch):
    # the lock file was opened by the relative path at every write: after os.chdir (a
    # job runner moving to its output directory, say) every spend of that Ledger failed
    # with "cannot open the privacy ledger ... lock file", and a pickled Ledger reopened
    # the path relative to the new directory
    import pickle

    from privlearn.accounting import Gaussian

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    led = Ledger("l.db", create=True)
    led.create_budget("adult", epsilon=1.0, delta=1e-6)
    pickled = pickle.dumps(led)
    monkeypatch.chdir(tmp_path / "b")
    led.spend("adult", Gaussian(20.0))
    assert led.spent("adult").entries == 1
    assert pickle.loads(pickled).spent("adult").entries == 1
    assert list((tmp_path / "b").iterdir()) == []  # no stray lock file (or ledger) here


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes and symbolic links")
def test_a_ledger_created_through_a_symbolic_link_is_its_owners_only(tmp_path, umask_022):
    # a link to where the ledger will be (e.g. "current.db" -> "ledgers/2026.db"): the
    # exclusive create hit the link (EEXIST, taken for "exists") and SQLite created the
    # file under the umask, readable by every user
    (tmp_path / "ledgers").mkdir()
    target = tmp_path / "ledgers" / "2026.db"
    link = tmp_path / "current.db"
    link.symlink_to(target)
    with Ledger(link, create=True) as led:
        led.create_budget("adult", epsilon=1.0, delta=1e-6)
    assert target.is_file() and link.is_symlink()
    assert os.stat(target).st_mode & 0o777 == 0o600


@pytest.mark.skipif(os.name != "posix", reason="symbolic links")
def test_every_path_of_one_ledger_queues_on_one_lock_file(tmp_path):
    # writers through a link and through the file's own path wait on the same OS lock
    from privlearn.accounting import Gaussian

    target = tmp_path / "l.db"
    (tmp_path / "links").mkdir()
    link = tmp_path / "links" / "l.db"
    link.symlink_to(target)
    with Ledger(target, create=True) as led:
        led.create_budget("adult", epsilon=1.0, delta=1e-6)
    with Ledger(link) as led:
        led.spend("adult", Gaussian(20.0))
    assert not (tmp_path / "links" / "l.db-writelock").exists()
    assert (tmp_path / "l.db-writelock").exists()
    with Ledger(target) as led:
        assert led.spent("adult").entries == 1
