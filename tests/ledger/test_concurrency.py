"""Many processes spending at once: the cap holds, no spend is lost or duplicated."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _ledger_workers import create_and_reserve, spend_many

import privlearn
from privlearn.accounting import Gaussian, compose
from privlearn.ledger import Ledger, LedgerBusyError

SIGMA = 70.0
CAP = 1.0
DELTA = 1e-6


def test_eight_processes_fifty_spends_each(tmp_path):
    path = str(tmp_path / "c.db")
    Ledger(path, create=True).create_budget("data", CAP, DELTA)
    # how many Gaussian(SIGMA) releases fit under the cap (exact analytic composition)
    fit = max(k for k in range(1, 400) if compose(Gaussian(SIGMA), steps=k).epsilon(DELTA) <= CAP)
    assert 50 < fit < 400  # the cap binds part-way through the 400 attempts

    ctx = mp.get_context("spawn")
    with ctx.Pool(8) as pool:
        results = pool.starmap(spend_many, [(path, w, 50, SIGMA) for w in range(8)])
    acked = [lab for ok, _ in results for lab in ok]
    refused = [lab for _, bad in results for lab in bad]
    assert len(acked) + len(refused) == 400

    led = Ledger(path)
    assert led.verify()
    stored = [e.label for e in led.history("data") if e.kind == "spend"]
    assert len(stored) == len(set(stored))  # nothing duplicated
    assert sorted(stored) == sorted(acked)  # nothing lost, nothing refused stored
    assert len(stored) == fit  # the cap was filled exactly, never exceeded
    s = led.spent("data")
    assert s.epsilon_spent <= CAP
    assert s.entries == fit


@pytest.mark.slow  # (two spawned interpreters; the eight-process test is the default check)
def test_two_processes_creating_and_reserving_at_once_keep_the_cap(tmp_path):
    """Two processes start at the same instant on a path where no ledger is yet: each
    creates it and the budget (exist_ok) and reserves until refused. One budget entry,
    an intact chain, every acknowledged reservation stored once (settled), none refused
    stored, and the cap filled exactly (the closed-form count of releases under it)."""
    path = str(tmp_path / "race.db")
    fit = max(k for k in range(1, 100) if compose(Gaussian(25.0), steps=k).epsilon(DELTA)
              <= CAP)
    assert 20 < fit < 60  # binds part-way through the 60 attempts
    start = time.time() + 1.5  # after both children imported privlearn
    with mp.get_context("spawn").Pool(2) as pool:
        results = pool.starmap(create_and_reserve,
                               [(path, w, 30, 25.0, start) for w in range(2)])
    acked = [lab for ok, _ in results for lab in ok]
    led = Ledger(path)
    assert led.verify().ok
    kinds = [e.kind for e in led.history("data")]
    assert kinds.count("budget") == 1 and led.pending("data") == []
    stored = [e.label for e in led.history("data") if e.kind == "reserve"]
    assert sorted(stored) == sorted(acked) and len(set(stored)) == len(stored)
    assert len(stored) == fit and led.spent("data").epsilon_spent <= CAP
    led.close()


def test_sigkill_mid_spends_keeps_every_acknowledged_spend(tmp_path):
    path = str(tmp_path / "k.db")
    Ledger(path, create=True).create_budget("data", 1e6, 1e-6)
    worker = Path(__file__).with_name("_ledger_workers.py")
    # the child imports the privlearn under test (the one this process imported), whatever
    # the working directory and whether or not it is installed
    root = Path(privlearn.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *sys.path])}
    proc = subprocess.Popen([sys.executable, str(worker), path], stdout=subprocess.PIPE,
                            text=True, env=env)
    acked, reserved = [], None
    deadline = time.monotonic() + 60
    while len(acked) < 30 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("RESERVED"):
            reserved = int(line.split()[1])
        elif line.startswith("ACK"):
            acked.append(line.split()[1])
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert len(acked) == 30 and reserved is not None

    led = Ledger(path)
    report = led.verify()
    assert report, report.problems
    stored = [e.label for e in led.history("data") if e.kind == "spend"]
    assert set(acked) <= set(stored)
    assert len(stored) - len(acked) <= 1  # at most the one in flight, committed unacked
    pend = led.pending("data")
    assert [r.seq for r in pend] == [reserved]  # the planned run still counts in full
    s = led.spent("data")
    assert s.entries == len(stored) + 1
    assert s.epsilon_spent == compose(
        [Gaussian(50.0)] + [Gaussian(1000.0)] * len(stored)
    ).epsilon(1e-6)
    led.spend("data", Gaussian(1000.0), label="after the crash")  # still writable
    assert led.verify()


def test_threads_sharing_a_ledger_or_each_with_its_own_keep_the_cap(tmp_path):
    import threading

    from privlearn.errors import BudgetExceededError

    sigma = 12.0
    fit = max(k for k in range(1, 60) if compose(Gaussian(sigma), steps=k).epsilon(DELTA) <= CAP)
    for shared in (True, False):
        path = str(tmp_path / f"t{shared}.db")
        main = Ledger(path, create=True)
        main.create_budget("data", CAP, DELTA)
        acked, errors = [], []

        def worker(w, shared=shared, path=path, main=main, acked=acked, errors=errors):
            led = main if shared else Ledger(path)
            for i in range(8):
                try:
                    led.spend("data", Gaussian(sigma), label=f"{w}-{i}")
                    acked.append(f"{w}-{i}")
                except BudgetExceededError:
                    pass
                except Exception as exc:  # noqa: BLE001 - reported below
                    errors.append(repr(exc))

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        labels = [e.label for e in main.history("data") if e.kind == "spend"]
        assert sorted(labels) == sorted(acked) and len(acked) == fit  # none lost or extra
        assert main.spent("data").epsilon_spent <= CAP and main.verify()
        main.close()


def test_a_long_timeout_still_waits_for_another_writer(tmp_path):
    # SQLite's busy timeout is milliseconds in a C int: timeout=1e7 seconds wrapped to 0
    # (no wait at all), so a spend meeting another connection's write lock failed at once
    # with sqlite3.OperationalError "database is locked"
    path = str(tmp_path / "t.db")
    Ledger(path, create=True).create_budget("data", 1e6, 1e-6)
    led = Ledger(path, timeout=1e7)
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    release = threading.Timer(0.3, lambda: other.execute("COMMIT"))
    release.start()
    try:
        led.spend("data", Gaussian(100.0), label="after the other writer")
    finally:
        release.join()
        other.close()
    assert [e.label for e in led.history("data") if e.kind == "spend"] == [
        "after the other writer"]


def _hold_the_write_lock(path: str, holder: str):
    """Another writer in the middle of a write on ``path``: a plain SQLite connection in a
    write transaction, or another Ledger inside its own write (which holds the OS write
    lock too). Returns the function that releases it."""
    if holder == "sqlite":
        other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        other.execute("BEGIN IMMEDIATE")
        return other.close
    held = Ledger(path)._write()
    held.__enter__()
    return lambda: held.__exit__(None, None, None)


@pytest.mark.parametrize("holder", ["sqlite", "ledger"])
def test_a_lock_timeout_is_a_ledger_busy_error_and_records_nothing(tmp_path, holder):
    """Another writer holds the write lock past this Ledger's timeout: the spend raises
    LedgerBusyError naming the file, the timeout and what to do (never SQLite's raw
    'database is locked'), nothing is recorded, and the ledger works once released.
    The holder is a plain SQLite connection in a write transaction, or another Ledger in
    the middle of its own write (which holds the OS write lock too)."""
    path = str(tmp_path / "t.db")
    Ledger(path, create=True).create_budget("data", 1e6, 1e-6)
    led = Ledger(path, timeout=0.05)
    release = _hold_the_write_lock(path, holder)
    try:
        t0 = time.monotonic()
        with pytest.raises(LedgerBusyError) as info:
            led.spend("data", Gaussian(100.0), label="while locked")
        waited = time.monotonic() - t0
    finally:
        release()
    err = info.value
    assert isinstance(err, TimeoutError) and not isinstance(err, sqlite3.Error)
    assert err.path == path and err.timeout == 0.05 and 0.04 <= waited < 5
    msg = str(err)
    assert path in msg and "timeout=0.05" in msg and "nothing was recorded" in msg
    assert "larger timeout=" in msg and "another writer" in msg
    assert err.__cause__ is None and err.__suppress_context__
    assert led.history("data") == [e for e in led.history("data") if e.kind != "spend"]
    led.spend("data", Gaussian(100.0), label="after")  # the connection is usable again
    assert [e.label for e in led.history("data") if e.kind == "spend"] == ["after"]


def test_a_busy_ledger_is_status_2_from_the_shell(tmp_path):
    from click.testing import CliRunner

    from privlearn.cli import cli

    path = str(tmp_path / "t.db")
    Ledger(path, create=True).create_budget("data", 1e6, 1e-6)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        res = CliRunner().invoke(cli, ["budget", "spend", path, "--dataset", "data",
                                       "--mechanism", "gaussian", "--noise-multiplier",
                                       "100", "--timeout", "0.05"])
    finally:
        other.close()
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and "timeout=0.05" in res.output


@pytest.mark.parametrize("holder", ["sqlite", "ledger"])
def test_the_shell_timeout_option_gives_up_after_its_seconds(tmp_path, holder):
    """`privlearn budget spend ... --timeout 0.2` behind another writer exits with the
    LedgerBusyError status (2) after about 0.2 s, not the default 60 s, naming the
    option; nothing is recorded."""
    from click.testing import CliRunner

    from privlearn.cli import cli

    path = str(tmp_path / "t.db")
    Ledger(path, create=True).create_budget("data", 1e6, 1e-6)
    release = _hold_the_write_lock(path, holder)
    try:
        t0 = time.monotonic()
        res = CliRunner().invoke(cli, ["budget", "spend", path, "--dataset", "data",
                                       "--noise-multiplier", "100", "--timeout", "0.2"])
        waited = time.monotonic() - t0
    finally:
        release()
    assert res.exit_code == 2, res.output
    assert 0.15 <= waited < 10, waited
    assert "timeout=0.2" in res.output and "--timeout SECONDS" in res.output
    assert "Traceback" not in res.output
    assert not [e for e in Ledger(path).history("data") if e.kind == "spend"]


@pytest.mark.parametrize("value", ["0", "-1", "nan", "soon"])
def test_the_shell_timeout_option_is_validated(tmp_path, value):
    from click.testing import CliRunner

    from privlearn.cli import cli

    path = str(tmp_path / "t.db")
    res = CliRunner().invoke(cli, ["budget", "init", path, "--dataset", "data",
                                   "--epsilon", "1", "--delta", "1e-6", "--timeout", value])
    assert res.exit_code == 2, res.output
    assert "--timeout" in res.output and "Traceback" not in res.output
    assert "No such option" not in res.output
    assert not os.path.exists(path)  # a refused init leaves no file
