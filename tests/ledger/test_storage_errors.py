"""A ledger whose file cannot be written (disk full, an I/O error): a typed
LedgerStorageError naming the file, status 2 and one line from the shell, nothing
recorded -- never SQLite's bare OperationalError with a traceback.

The full disk is real: the child process runs under a file size limit
(``RLIMIT_FSIZE``) above the ledger's files but below what a spend with a long label
writes to the write-ahead log, so the write fails in the kernel as on a full disk."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import privlearn
from privlearn.errors import LedgerNotFoundError, LedgerStorageError
from privlearn.ledger import Ledger

resource = pytest.importorskip("resource")
pytestmark = pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"),
                                reason="needs a POSIX file size limit")

ROOT = Path(privlearn.__file__).resolve().parents[1]
LABEL = "x" * 100_000  # a spend that writes ~100 kB to the WAL


@pytest.fixture
def ledger_path(tmp_path):
    path = str(tmp_path / "l.db")
    with Ledger(path, create=True) as led:
        led.create_budget("adult", epsilon=1.0, delta=1e-6)
    return path


def _run_limited(args: list[str], path: str) -> subprocess.CompletedProcess:
    # above the database and its 32 kB shared-memory index, below the spend's WAL frames
    limit = max(os.path.getsize(path), 32768) + 16384

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path]),
           "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PRIVLEARN_LEDGER_KEY", None)
    return subprocess.run([sys.executable, *args], preexec_fn=limit_file_size, env=env,
                          capture_output=True, text=True, timeout=120)


def _entries(path: str) -> int:
    with Ledger(path) as led:
        assert led.verify()
        return len(led.history())


def test_a_spend_the_disk_cannot_hold_is_a_ledger_storage_error(ledger_path):
    code = (
        "import sys\n"
        "from privlearn.accounting import Gaussian\n"
        "from privlearn.errors import LedgerStorageError\n"
        "from privlearn.ledger import Ledger\n"
        "led = Ledger(sys.argv[1])\n"
        "try:\n"
        f"    led.spend('adult', Gaussian(50.0), label='x' * {len(LABEL)})\n"
        "except LedgerStorageError as e:\n"
        "    assert isinstance(e, OSError) and e.path == sys.argv[1], e\n"
        "    print('typed', e.reason)\n"
        "    led.spend('adult', Gaussian(50.0), label='short')  # the ledger still works\n"
        "    print('then spent')\n"
    )
    before = _entries(ledger_path)
    r = _run_limited(["-c", code, ledger_path], ledger_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[:2] in (["typed", "io"], ["typed", "full"]), r.stdout
    assert "then spent" in r.stdout
    assert _entries(ledger_path) == before + 1  # the refused spend recorded nothing


def test_the_shell_reports_it_in_one_line_with_status_2(ledger_path):
    before = _entries(ledger_path)
    r = _run_limited(["-m", "privlearn", "budget", "spend", ledger_path, "--dataset", "adult",
                      "--noise-multiplier", "50", "--label", LABEL], ledger_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    assert ledger_path in r.stderr and "nothing was recorded" in r.stderr
    assert "Traceback" not in r.stderr
    assert _entries(ledger_path) == before


def test_the_error_is_exported_where_the_other_ledger_errors_are():
    import privlearn.ledger

    assert privlearn.ledger.LedgerStorageError is LedgerStorageError
    assert issubclass(LedgerStorageError, OSError)


def _ledger_with_a_release(path) -> None:
    from privlearn.accounting import Gaussian

    with Ledger(path, create=True) as led:
        led.create_budget("adult", 1.0, 1e-6)
        led.spend("adult", Gaussian(8.0), label="mean age")


def test_a_ledger_opened_read_only_reads_and_never_writes(tmp_path):
    from privlearn.accounting import Gaussian

    path = tmp_path / "r.db"
    _ledger_with_a_release(path)
    before = path.read_bytes()
    led = Ledger(path, read_only=True)
    assert led.read_only and Ledger(path).read_only is False
    assert led.spent("adult").entries == 1 and led.verify().ok
    assert [e.label for e in led.history("adult")] == [None, "mean age"]
    with pytest.raises(LedgerStorageError, match="read-only"):
        led.spend("adult", Gaussian(8.0))
    led.close()
    assert path.read_bytes() == before
    with pytest.raises(ValueError, match="read_only"):
        Ledger(tmp_path / "new.db", create=True, read_only=True)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root may write a file whatever its mode")
def test_show_history_verify_read_a_ledger_the_user_may_not_write(tmp_path):
    # a ledger shared read-only (e.g. an auditor's copy): the reading commands worked
    # only on a file the user may write (LedgerNotFoundError "unopenable")
    from click.testing import CliRunner

    from privlearn.cli import cli

    path = tmp_path / "r.db"
    _ledger_with_a_release(path)
    for suffix in ("", "-writelock"):
        p = Path(str(path) + suffix)
        if p.exists():
            p.chmod(0o444)
    assert Ledger(path).read_only
    for args in (["show", "--dataset", "adult"], ["history", "--dataset", "adult"],
                 ["verify"]):
        r = CliRunner().invoke(cli, ["budget", args[0], str(path), *args[1:]])
        assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["budget", "spend", str(path), "--dataset", "adult",
                                 "--noise-multiplier", "8"])
    assert r.exit_code == 2 and "read-only" in r.output, r.output


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs")
@pytest.mark.parametrize("create", [False, True])
def test_a_path_that_is_not_a_regular_file_is_refused_before_sqlite_opens_it(tmp_path,
                                                                           create):
    # a device (budget init /dev/null wrote /dev/null-journal and a lock file in /dev),
    # a pipe or a socket cannot be a ledger: refused by name, nothing created next to it
    from privlearn.cli import cli

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(LedgerNotFoundError, match="not a regular file") as info:
        Ledger(fifo, create=create)
    assert info.value.reason == "not_a_file" and info.value.path == str(fifo)
    r = CliRunner().invoke(cli, ["budget", "show", str(fifo)])
    assert r.exit_code == 2 and r.stderr.startswith("error: ") and "not a regular file" in (
        r.stderr), r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]
