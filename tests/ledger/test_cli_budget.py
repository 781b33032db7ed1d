"""`privlearn budget ...`: init, spend, show, history, verify (and tamper evidence)."""

from __future__ import annotations

import json
import math
import os
import random
import sqlite3
import subprocess
import sys

import pytest
from _tampering import non_ledger_files, tamper
from click.testing import CliRunner

from privlearn.accounting import Gaussian, compose, subsample
from privlearn.cli import cli


def run(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture
def db(tmp_path):
    path = str(tmp_path / "b.db")
    r = run("budget", "init", path, "--dataset", "adult", "--epsilon", "1", "--delta", "1e-6")
    assert r.exit_code == 0, r.output
    for i, nm in enumerate(["8", "9", "10"]):
        r = run("budget", "spend", path, "--dataset", "adult", "--noise-multiplier", nm,
                "--label", f"release {i}")
        assert r.exit_code == 0, r.output
    return path


def test_init_again_with_exist_ok(db):
    # a setup script run twice: the same budget again is fine with --exist-ok, another
    # one is still refused (usage status), and the message says what to do
    args = ["budget", "init", db, "--dataset", "adult", "--epsilon", "1", "--delta", "1e-6"]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 2 and "pass --exist-ok" in r.output
    assert run(*args, "--exist-ok").exit_code == 0
    r = CliRunner().invoke(cli, [*args[:6], "2", *args[7:], "--exist-ok"])
    assert r.exit_code == 2 and "epsilon=1.0 (asked 2.0)" in r.output
    r = run("budget", "show", db, "--dataset", "adult", "--json")
    assert json.loads(r.output)["entries"] == 3


def test_spend_show_history_json(db):
    r = run("budget", "spend", db, "--dataset", "adult", "--noise-multiplier", "2.0",
            "--sampling-rate", "0.01", "--steps", "50", "--label", "sgd", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["seq"] == 5
    r = run("budget", "show", db, "--dataset", "adult", "--json")
    s = json.loads(r.output)
    direct = compose([Gaussian(8.0), Gaussian(9.0), Gaussian(10.0),
                      compose(subsample(Gaussian(2.0), 0.01), steps=50)]).epsilon_bounds(1e-6)
    assert s["epsilon_spent"] == direct.upper
    assert s["epsilon_lower"] == direct.lower
    assert (s["epsilon_budget"], s["delta"], s["entries"]) == (1.0, 1e-6, 4)
    r = run("budget", "history", db, "--dataset", "adult")
    assert r.exit_code == 0 and "sgd" in r.output and r.output.count("\n") == 5
    h = json.loads(run("budget", "history", db, "--dataset", "adult", "--json").output)
    assert [e["kind"] for e in h] == ["budget"] + ["spend"] * 4


def test_show_without_dataset_lists_every_budget(db, tmp_path):
    """`budget show PATH` without --dataset shows every budget of the file (a user who
    does not remember the dataset's name has no other way to find it from the shell),
    each as `--dataset` shows it; --json gives a list of the same objects."""
    assert run("budget", "init", db, "--dataset", "census", "--epsilon", "2", "--delta",
               "1e-7", "--privacy-unit", "user").exit_code == 0
    assert run("budget", "spend", db, "--dataset", "census", "--privacy-unit", "user",
               "--noise-multiplier", "3").exit_code == 0
    one = {(d, u): json.loads(run("budget", "show", db, "--dataset", d, "--privacy-unit", u,
                                  "--json").output)
           for d, u in (("adult", "record"), ("census", "user"))}
    r = run("budget", "show", db, "--json")
    assert r.exit_code == 0, r.output
    assert sorted(json.loads(r.output), key=lambda s: s["dataset"]) == list(one.values())
    assert one["census", "user"]["epsilon_spent"] == Gaussian(3.0).epsilon(1e-7)
    r = run("budget", "show", db)
    assert r.exit_code == 0 and r.output.count("\n") == 2
    assert "dataset adult (record" in r.output and "dataset census (user" in r.output
    r = run("budget", "show", db, "--privacy-unit", "user", "--json")
    assert [s["dataset"] for s in json.loads(r.output)] == ["census"]
    empty = str(tmp_path / "empty.db")
    from privlearn.ledger import Ledger
    Ledger(empty, create=True).close()
    assert json.loads(run("budget", "show", empty, "--json").output) == []
    r = run("budget", "show", empty)
    assert r.exit_code == 0 and "privlearn budget init" in r.output


def test_history_without_dataset_lists_every_entry(db):
    """`budget history PATH` without --dataset: every entry of the file, oldest first,
    each naming its budget; the entries of one budget are those `--dataset` lists."""
    from privlearn.ledger import Ledger

    assert run("budget", "init", db, "--dataset", "census", "--epsilon", "2", "--delta",
               "1e-7").exit_code == 0
    assert run("budget", "spend", db, "--dataset", "census", "--noise-multiplier", "3",
               "--label", "census count").exit_code == 0
    r = run("budget", "history", db, "--json")
    assert r.exit_code == 0, r.output
    every = json.loads(r.output)
    direct = Ledger(db).history()
    assert [(e["seq"], e["dataset"], e["privacy_unit"], e["kind"], e["label"])
            for e in every] == [(e.seq, e.dataset, e.privacy_unit, e.kind, e.label)
                                for e in direct]
    assert [e["dataset"] for e in every] == ["adult"] * 4 + ["census"] * 2
    one = json.loads(run("budget", "history", db, "--dataset", "census", "--json").output)
    assert one == [e for e in every if e["dataset"] == "census"]
    lines = run("budget", "history", db).output.splitlines()
    assert len(lines) == 6 and "census/record  census count" in lines[-1]


def test_str_of_spent_is_what_budget_show_prints(db, tmp_path):
    """print(ledger.spent(name)) in Python reads as `privlearn budget show` does (not
    as a dataclass repr), adaptive budgets with their filter's line."""
    from privlearn.ledger import Ledger

    led = Ledger(db)
    s = led.spent("adult")
    assert str(s) + "\n" == run("budget", "show", db, "--dataset", "adult").output
    assert str(s).startswith("dataset adult (record, add_remove): epsilon spent "
                             f"{s.epsilon_spent:.6g} (certified lower bound ")
    assert str(s).endswith(f"of 1 at delta 1e-06, {s.entries} release(s)")
    path = str(tmp_path / "adaptive.db")
    assert run("budget", "init", path, "--dataset", "a", "--epsilon", "2", "--delta",
               "1e-6", "--adaptive").exit_code == 0
    assert run("budget", "spend", path, "--dataset", "a", "--noise-multiplier",
               "5").exit_code == 0
    a = Ledger(path).spent("a")
    assert str(a) + "\n" == run("budget", "show", path, "--dataset", "a").output
    assert str(a).splitlines()[1] == (f"  adaptive rule (Renyi filter, order "
                                      f"{a.adaptive_order:.4g}): epsilon "
                                      f"{a.adaptive_epsilon:.6g}")
    assert repr(s).startswith("Spent(dataset='adult'")


def test_a_release_the_budgets_accountant_cannot_account_is_said_in_the_options_words(
        tmp_path):
    """A budget created with --accountant analytic refuses a subsampled or Laplace
    release: one line naming the budget's accountant and the release as the options gave
    it, nothing recorded, and no --accountant to try (budget spend has none)."""
    path = str(tmp_path / "a.db")
    assert run("budget", "init", path, "--dataset", "d", "--epsilon", "3", "--delta", "1e-6",
               "--accountant", "analytic").exit_code == 0
    for args, passed in (
            (["--noise-multiplier", "5", "--sampling-rate", "0.01", "--steps", "100"],
             "gaussian, noise multiplier 5, poisson sampling at rate 0.01, 100 steps"),
            (["--noise-multiplier", "5", "--mechanism", "laplace"],
             "laplace, noise multiplier 5, no subsampling, 1 step")):
        r = CliRunner().invoke(cli, ["budget", "spend", path, "--dataset", "d", *args])
        assert r.exit_code == 2 and r.stdout == ""
        line = r.stderr.strip()
        assert "\n" not in line
        assert line.startswith(f"error: the budget of dataset 'd', accounted with analytic, "
                               f"cannot account {passed} (analytic: ")
        assert "nothing was recorded" in line and "privlearn budget init" in line
        assert "try --accountant" not in line and "Subsampled(" not in line
    assert json.loads(run("budget", "show", path, "--dataset", "d", "--json").output
                      )["entries"] == 0
    assert run("budget", "spend", path, "--dataset", "d", "--noise-multiplier", "5"
               ).exit_code == 0  # a plain Gaussian it accounts


def test_exceeding_the_budget_is_one_line_status_3_and_records_nothing(db):
    before = run("budget", "show", db, "--dataset", "adult", "--json").output
    r = CliRunner().invoke(cli, ["budget", "spend", db, "--dataset", "adult",
                                 "--noise-multiplier", "0.5"])
    assert r.exit_code == 3
    assert r.output.startswith("error: spend refused") and r.output.count("\n") == 1
    assert run("budget", "show", db, "--dataset", "adult", "--json").output == before


def test_the_budget_commands_show_the_neighbouring_relation(db, tmp_path):
    r = run("budget", "show", db, "--dataset", "adult")
    assert r.output.startswith("dataset adult (record, add_remove): epsilon spent")
    assert json.loads(run("budget", "show", db, "--dataset", "adult", "--json").output)[
        "neighbouring"] == "add_remove"
    before = run("budget", "show", db, "--dataset", "adult", "--json").output
    r = CliRunner().invoke(cli, ["budget", "spend", db, "--dataset", "adult",
                                 "--noise-multiplier", "20", "--sampling-rate", "0.1",
                                 "--sampling", "fixed"])
    assert r.exit_code == 2 and r.output.count("\n") == 1
    assert r.output.startswith("error: spend refused") and "replace_one" in r.output
    assert run("budget", "show", db, "--dataset", "adult", "--json").output == before
    path = str(tmp_path / "r.db")
    r = run("budget", "init", path, "--dataset", "d", "--epsilon", "10", "--delta", "1e-6",
            "--neighbouring", "replace_one")
    assert r.output.startswith("budget for d (record, replace_one): epsilon 10")
    r = run("budget", "init", path, "--dataset", "e", "--epsilon", "10", "--delta", "1e-6")
    assert r.output.startswith(
        "budget for e (record, neighbouring relation to be fixed by the first release)")
    r = run("budget", "spend", path, "--dataset", "d", "--noise-multiplier", "4", "--json")
    out = json.loads(r.output)
    assert out["neighbouring"] == "replace_one"
    assert out["epsilon_spent"] == Gaussian(2.0).epsilon(1e-6)  # twice the sensitivity


def test_bad_input_is_status_2(db, tmp_path):
    for args in (
        ["budget", "spend", db, "--dataset", "adult", "--noise-multiplier", "-1"],
        ["budget", "spend", db, "--dataset", "nope", "--noise-multiplier", "5"],
        ["budget", "show", str(tmp_path / "missing.db"), "--dataset", "adult"],
        ["budget", "init", db, "--dataset", "adult", "--epsilon", "1", "--delta", "1e-6"],
    ):
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 2, (args, r.output)
        assert r.output.startswith("error:") and r.output.count("\n") == 1, r.output
    assert not (tmp_path / "missing.db").exists()  # reading never creates a ledger


def test_a_file_that_is_not_a_ledger_is_a_usage_error(tmp_path):
    """A file that is no ledger at all (random bytes, text, an SQLite database of other
    tables) is a wrong path, status 2, naming the path and what to do; it is left as it
    was. Status 4 stays for a ledger that fails its integrity check."""
    rand, text = tmp_path / "random.bin", tmp_path / "notes.txt"
    rand.write_bytes(bytes(random.Random(0).getrandbits(8) for _ in range(4096)))
    text.write_text("dataset,epsilon\nadult,1.0\n")
    junk, other = non_ledger_files(tmp_path)
    for path in (junk, other, rand, text):
        before = path.read_bytes()
        for args in (["budget", "show", str(path), "--dataset", "adult"],
                     ["budget", "history", str(path)], ["budget", "verify", str(path)],
                     ["budget", "init", str(path), "--dataset", "a", "--epsilon", "1",
                      "--delta", "1e-6"]):
            r = CliRunner().invoke(cli, args)
            assert r.exit_code == 2, (args, r.output)
            assert r.output.startswith(f"error: {path} is ") and "not a privacy ledger" in r.output
            assert "pass the path of a ledger" in r.output and "budget init" in r.output
            assert r.output.count("\n") == 1
        assert path.read_bytes() == before  # an SQLite database: not switched to WAL


def test_a_damaged_ledger_file_stays_status_4(db):
    """A real ledger whose pages were overwritten (its SQLite header intact) is a ledger
    that fails its check, not a wrong path."""
    con = sqlite3.connect(db)  # every entry into the main file first
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    con.close()
    size = os.path.getsize(db)
    with open(db, "r+b") as fh:  # everything after SQLite's 100-byte file header
        fh.seek(100)
        fh.write(b"\xff" * (size - 100))
    r = CliRunner().invoke(cli, ["budget", "verify", db])
    assert r.exit_code == 4, r.output
    assert r.output.startswith("error: ") and r.output.count("\n") == 1


def test_verify_intact(db):
    r = run("budget", "verify", db)
    assert r.exit_code == 0 and r.output.startswith("ok: 4 entries")


def test_append_only_triggers(db):
    con = sqlite3.connect(db)
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        con.execute("UPDATE entries SET label = 'x' WHERE seq = 2")
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        con.execute("DELETE FROM entries WHERE seq = 2")
    con.close()


@pytest.mark.parametrize(
    "sql",
    [
        # edit a release's mechanism (make it look cheaper)
        ["UPDATE entries SET mechanism = replace(mechanism, '8.0', '80.0') WHERE seq = 2"],
        ["UPDATE entries SET label = 'nothing to see' WHERE seq = 3"],
        # edit the budget cap
        ["UPDATE entries SET payload = replace(payload, '1.0', '9.0') WHERE seq = 1"],
        # delete a row in the middle
        ["DELETE FROM entries WHERE seq = 3"],
        # truncate: remove the last row
        ["DELETE FROM entries WHERE seq = 4"],
        # delete and renumber the rest to close the gap
        ["DELETE FROM entries WHERE seq = 2", "UPDATE entries SET seq = seq - 1 WHERE seq > 2"],
        # remove the head record
        ["DELETE FROM head"],
    ],
)
def test_verify_detects_editing_deleting_truncating(db, sql):
    tamper(db, *sql)
    r = CliRunner().invoke(cli, ["budget", "verify", db])
    assert r.exit_code == 4, r.output
    assert "TAMPERED" in r.output


@pytest.mark.parametrize("sql", [
    ["DELETE FROM entries WHERE seq = 3"],
    ["UPDATE entries SET mechanism = replace(mechanism, '8.0', '80.0') WHERE seq = 2"],
    ["DELETE FROM entries WHERE seq = 2", "UPDATE entries SET seq = seq - 1 WHERE seq > 2"],
])
def test_every_budget_command_refuses_a_tampered_ledger(db, sql):
    """Entries deleted or edited (triggers dropped first): show, spend and history refuse
    with status 4 and one line saying what was found and what to do, instead of reporting
    or extending a total that is too low; nothing is appended."""
    honest = json.loads(run("budget", "show", db, "--dataset", "adult", "--json").output)
    tamper(db, *sql)
    for args in (["show", db, "--dataset", "adult"],
                 ["show", db, "--dataset", "adult", "--json"],
                 ["spend", db, "--dataset", "adult", "--noise-multiplier", "30"],
                 ["history", db, "--dataset", "adult"]):
        r = CliRunner().invoke(cli, ["budget", *args])
        assert r.exit_code == 4, (args, r.output)
        assert r.stdout == "" and r.stderr.count("\n") == 1
        assert r.stderr.startswith(f"error: ledger {db} failed its integrity check (")
        assert "restore the file from a backup" in r.stderr
    con = sqlite3.connect(db)
    assert con.execute("SELECT count(*) FROM entries WHERE kind = 'spend' AND "
                       "mechanism LIKE '%30.0%'").fetchone()[0] == 0
    con.close()
    assert honest["entries"] == 3


def test_truncation_with_rewritten_head_needs_an_external_anchor(db):
    head = run("budget", "verify", db).output.split("head ")[1].strip()
    con = sqlite3.connect(db)
    prev = con.execute("SELECT hash FROM entries WHERE seq = 3").fetchone()[0]
    con.close()
    tamper(db, "DELETE FROM entries WHERE seq = 4",
            f"UPDATE head SET count = 3, hash = '{prev}'")
    # a consistent shorter chain: only an anchor kept elsewhere reveals it
    assert run("budget", "verify", db).exit_code == 0
    r = CliRunner().invoke(cli, ["budget", "verify", db, "--expect-head", head])
    assert r.exit_code == 4 and "does not extend the head" in r.output


def test_python_dash_m_privlearn(tmp_path):
    path = str(tmp_path / "m.db")
    base = [sys.executable, "-m", "privlearn", "budget"]
    ok = subprocess.run(base + ["init", path, "--dataset", "d", "--epsilon", "0.5", "--delta",
                                "1e-5"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(base + ["spend", path, "--dataset", "d", "--mechanism", "laplace",
                                 "--noise-multiplier", "1.0"], capture_output=True, text=True)
    assert bad.returncode == 3 and bad.stderr.startswith("error:")
    assert bad.stderr.count("\n") == 1
    assert subprocess.run(base + ["verify", path]).returncode == 0


def test_adaptive_budget_from_the_cli(tmp_path):
    path = str(tmp_path / "a.db")
    assert run("budget", "init", path, "--dataset", "d", "--epsilon", "1", "--delta", "1e-6",
               "--adaptive").exit_code == 0
    assert run("budget", "spend", path, "--dataset", "d", "--noise-multiplier", "10").exit_code == 0
    s = json.loads(run("budget", "show", path, "--dataset", "d", "--json").output)
    assert s["adaptive"] is True and s["adaptive_order"] > 1
    assert s["epsilon_spent"] < s["adaptive_epsilon"] <= 1.0


def test_a_missing_directory_is_one_line_naming_it(tmp_path):
    path = tmp_path / "newdir" / "x.db"
    r = CliRunner().invoke(cli, ["budget", "init", str(path), "--dataset", "a", "--epsilon",
                                 "1", "--delta", "1e-6"])
    assert r.exit_code == 2, r.output
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.output
    assert f"directory {tmp_path / 'newdir'} " in r.stderr


def test_messages_name_commands_and_options_not_python(db, tmp_path):
    for args in (["budget", "show", str(tmp_path / "none.db"), "--dataset", "adult"],
                 ["budget", "show", db, "--dataset", "mnist"],
                 ["budget", "spend", db, "--dataset", "mnist", "--noise-multiplier", "5"]):
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 2, r.output
        assert "privlearn budget init" in r.stderr, r.stderr
        assert not any(w in r.stderr for w in ("create=True", "create_budget", "key=")), r.stderr


def test_verify_refuses_an_expected_head_that_is_not_hex(db):
    # a 64-character head that is not hexadecimal is a usage error (status 2), not a
    # tampered ledger (status 4)
    r = run("budget", "verify", db, "--expect-head", "1:" + "z" * 64)
    assert r.exit_code == 2, r.output
    assert "COUNT:HASH" in r.output


def test_expected_head_in_upper_case_is_the_same_head(db):
    # verify accepted an upper-case head as well-formed, then compared it with the stored
    # lower-case hash and reported the intact ledger as tampered (status 4)
    head = run("budget", "verify", db).output.split("head ")[1].strip()
    r = run("budget", "verify", db, "--expect-head", head.upper())
    assert r.exit_code == 0, r.output
    count, h = head.split(":")
    other = ("0" if h[0] != "0" else "1") + h[1:]
    assert run("budget", "verify", db, "--expect-head", f"{count}:{other.upper()}").exit_code == 4


@pytest.mark.parametrize("count", ["\u00b2", "\u0661", "-1", "1.0", ""])
def test_expected_head_count_that_is_not_ascii_digits_is_a_usage_error(db, count):
    # str.isdigit took '\u00b2' (superscript two) and int() then raised: a traceback, status 1
    r = run("budget", "verify", db, "--expect-head", f"{count}:" + "a" * 64)
    assert r.exit_code == 2, r.output
    assert "COUNT:HASH" in r.output


@pytest.mark.parametrize(("args", "said"), [
    (["--dataset", "", "--epsilon", "1", "--delta", "1e-6"], "--dataset must be"),
    (["--dataset", "d", "--epsilon", "1", "--delta", "1e-6", "--privacy-unit", " "],
     "--privacy-unit must be"),
    (["--dataset", "d", "--epsilon", "-1", "--delta", "1e-6"], "--epsilon must be in (0, inf)"),
    (["--dataset", "d", "--epsilon", "1", "--delta", "2"], "--delta must be in [0, 1)"),
    (["--dataset", "d", "--epsilon", "1", "--delta", "0", "--adaptive"],
     "--delta must be in (0, 1) with --adaptive"),
])
def test_a_refused_init_names_the_option_and_leaves_no_file(tmp_path, args, said):
    path = tmp_path / "new.db"
    r = CliRunner().invoke(cli, ["budget", "init", str(path), *args])
    assert r.exit_code == 2
    assert r.stderr.startswith(f"error: {said}") and r.stderr.count("\n") == 1, r.stderr
    assert not path.exists()


# -- keyed ledgers: the HMAC key from --key-file or PRIVLEARN_LEDGER_KEY ------------------
KEY = b"a-secret-hmac-key"


def _keyed(tmp_path, key=KEY):
    from privlearn.ledger import Ledger

    path = str(tmp_path / "k.db")
    with Ledger(path, create=True, key=key) as led:
        led.create_budget("adult", 2.0, 1e-6)
        led.spend("adult", Gaussian(8.0), label="first")
    return path


def _invoke(args, env=None):
    env = {"PRIVLEARN_LEDGER_KEY": None, **(env or {})}  # unset unless given
    return CliRunner().invoke(cli, args, env=env)


def test_a_keyed_ledger_opens_with_key_file_or_environment_variable(tmp_path):
    from privlearn.ledger import Ledger

    path = _keyed(tmp_path)
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY + b"\n")  # one trailing newline, as an editor writes it
    show = ["budget", "show", path, "--dataset", "adult", "--json"]
    by_file = _invoke(show[:3] + ["--key-file", str(key_file)] + show[3:])
    assert by_file.exit_code == 0, by_file.output
    by_env = _invoke(show, env={"PRIVLEARN_LEDGER_KEY": KEY.decode()})
    assert by_env.exit_code == 0, by_env.output
    with Ledger(path, key=KEY) as led:
        expected = led.spent("adult").epsilon_spent
    assert json.loads(by_file.output)["epsilon_spent"] == expected
    assert json.loads(by_env.output)["epsilon_spent"] == expected
    # every budget subcommand takes the key; a spend is recorded under it
    r = _invoke(["budget", "spend", path, "--key-file", str(key_file), "--dataset", "adult",
                 "--noise-multiplier", "9"])
    assert r.exit_code == 0, r.output
    r = _invoke(["budget", "history", path, "--dataset", "adult"],
                env={"PRIVLEARN_LEDGER_KEY": KEY.decode()})
    assert r.exit_code == 0 and r.output.count("\n") == 3, r.output
    r = _invoke(["budget", "verify", path, "--key-file", str(key_file)])
    assert r.exit_code == 0 and r.output.startswith("ok: 3 entries"), r.output
    with Ledger(path, key=KEY) as led:  # what the CLI wrote verifies in Python
        assert led.verify().ok and len(led.history("adult")) == 3


def test_init_creates_a_keyed_ledger_from_the_key_file(tmp_path):
    from privlearn.ledger import Ledger

    path, key_file = str(tmp_path / "new.db"), tmp_path / "key"
    key_file.write_bytes(KEY)  # no trailing newline: taken as is
    r = _invoke(["budget", "init", path, "--key-file", str(key_file), "--dataset", "adult",
                 "--epsilon", "1", "--delta", "1e-6"])
    assert r.exit_code == 0, r.output
    with Ledger(path, key=KEY) as led:
        assert led.verify().ok and led.budget_info("adult").epsilon == 1.0
    with pytest.raises(ValueError, match="pass key=") as info:  # Python: key=; and the CLI's
        Ledger(path)
    assert "--key-file" in str(info.value)
    key_file.write_bytes(KEY + b"\r\n")  # one Windows line ending, stripped too
    r = _invoke(["budget", "verify", path, "--key-file", str(key_file)])
    assert r.exit_code == 0, r.output
    key_file.write_bytes(KEY + b"\n\n")  # only one newline is stripped: another key
    r = _invoke(["budget", "verify", path, "--key-file", str(key_file)])
    assert r.exit_code == 4, r.output


def test_a_keyed_ledger_without_its_key_is_refused_naming_key_file(tmp_path):
    path = _keyed(tmp_path)
    for args in (["show", path, "--dataset", "adult"], ["verify", path],
                 ["spend", path, "--dataset", "adult", "--noise-multiplier", "9"]):
        r = _invoke(["budget", *args])
        assert r.exit_code == 2, r.output
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.output
        assert "--key-file" in r.stderr and "PRIVLEARN_LEDGER_KEY" in r.stderr, r.stderr
        assert "key=" not in r.stderr, r.stderr


def test_a_wrong_key_is_refused_with_status_4_and_records_nothing(tmp_path):
    from privlearn.ledger import Ledger

    path = _keyed(tmp_path)
    key_file = tmp_path / "wrong"
    key_file.write_bytes(b"not-the-key\n")
    for args, env in (
        (["show", path, "--key-file", str(key_file), "--dataset", "adult"], None),
        (["spend", path, "--dataset", "adult", "--noise-multiplier", "9"],
         {"PRIVLEARN_LEDGER_KEY": "not-the-key"}),
        (["verify", path, "--key-file", str(key_file)], None),
    ):
        r = _invoke(["budget", *args], env=env)
        assert r.exit_code == 4, r.output
        assert "key" in r.stderr and "Traceback" not in r.output, r.stderr
    with Ledger(path, key=KEY) as led:
        assert led.verify().ok and len(led.history("adult")) == 2


def test_a_key_for_an_unkeyed_ledger_or_an_empty_key_is_refused(db, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    r = _invoke(["budget", "show", db, "--key-file", str(key_file), "--dataset", "adult"])
    assert r.exit_code == 2 and "without an HMAC key" in r.stderr, r.output
    assert "--key-file" in r.stderr
    r = _invoke(["budget", "show", db, "--dataset", "adult"],
                env={"PRIVLEARN_LEDGER_KEY": KEY.decode()})
    assert r.exit_code == 2 and "unset PRIVLEARN_LEDGER_KEY" in r.stderr, r.output
    key_file.write_bytes(b"\n")
    r = _invoke(["budget", "show", db, "--key-file", str(key_file), "--dataset", "adult"])
    assert r.exit_code == 2 and "--key-file" in r.stderr and "empty" in r.stderr, r.output
    r = _invoke(["budget", "show", db, "--key-file", str(tmp_path / "none"),
                 "--dataset", "adult"])
    assert r.exit_code == 2 and "--key-file" in r.stderr, r.output


def test_the_ledger_refuses_an_empty_key(tmp_path):
    from privlearn.errors import ParameterValueError
    from privlearn.ledger import Ledger

    with pytest.raises(ParameterValueError, match="key must be a non-empty"):
        Ledger(str(tmp_path / "e.db"), create=True, key=b"")
    assert not (tmp_path / "e.db").exists()


@pytest.mark.parametrize("command", ["init", "spend", "show", "history"])
@pytest.mark.parametrize("option", ["--dataset", "--privacy-unit"])
def test_an_empty_name_is_refused_naming_the_option(db, command, option):
    rest = {"init": ["--epsilon", "1", "--delta", "1e-6"],
            "spend": ["--noise-multiplier", "5"]}.get(command, [])
    names = {"--dataset": "adult", "--privacy-unit": "record", option: " "}
    r = CliRunner().invoke(cli, ["budget", command, db, "--dataset", names["--dataset"],
                                 "--privacy-unit", names["--privacy-unit"], *rest],
                           env={"PRIVLEARN_LEDGER_KEY": None})
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith(f"error: {option} must be a non-empty name"), r.stderr
    assert "privacy_unit" not in r.stderr and "string" not in r.stderr


def test_spend_sampling_without_rate_is_a_usage_error(db):
    # --sampling describes subsampling; without --sampling-rate it was silently ignored
    # and the release counted without subsampling
    r = CliRunner().invoke(cli, ["budget", "spend", db, "--dataset", "adult",
                                 "--noise-multiplier", "20", "--sampling", "fixed"])
    assert r.exit_code == 2, r.output
    assert "--sampling fixed needs --sampling-rate" in r.output
    assert json.loads(run("budget", "show", db, "--dataset", "adult",
                          "--json").output)["entries"] == 3  # nothing recorded
    # the default scheme without a rate is no subsampling, as documented
    assert run("budget", "spend", db, "--dataset", "adult",
               "--noise-multiplier", "20").exit_code == 0


@pytest.mark.parametrize("label", ["two\nlines", "cr\rhere", "esc\x1b[31m", "ls\u2028x"])
def test_label_with_a_line_break_is_refused(db, label):
    r = CliRunner().invoke(cli, ["budget", "spend", db, "--dataset", "adult",
                                 "--noise-multiplier", "20", "--label", label])
    assert r.exit_code == 2 and "--label must be one line" in r.output, r.output
    r = CliRunner().invoke(cli, ["budget", "spend", db, "--dataset", "adult",
                                 "--noise-multiplier", "20", "--who", label])
    assert r.exit_code == 2 and "--who must be one line" in r.output, r.output
    from privlearn.errors import ParameterValueError
    from privlearn.ledger import Ledger

    led = Ledger(db)
    with pytest.raises(ParameterValueError, match="label must be one line"):
        led.spend("adult", Gaussian(20.0), label=label)
    with pytest.raises(ParameterValueError, match="who must be one line"):
        led.reserve("adult", Gaussian(20.0), who=label)
    assert led.spent("adult").entries == 3  # nothing recorded
    led.spend("adult", Gaussian(20.0), label="tab-free, unicode ok: é → ü")


def test_history_escapes_a_line_break_already_in_the_ledger(db, monkeypatch):
    # a label written before they were refused: history keeps one line per entry
    import privlearn.ledger._ledger as ledger_mod
    from privlearn.ledger import Ledger

    monkeypatch.setattr(ledger_mod, "_check_opt_str", lambda name, v: v)  # the old check
    Ledger(db).spend("adult", Gaussian(20.0), label="old\nlabel")
    monkeypatch.undo()
    lines = run("budget", "history", db, "--dataset", "adult").output.splitlines()
    assert len(lines) == 5 and lines[-1].split()[3] == "old\\nlabel", lines


def test_history_into_a_closed_pipe_exits_quietly(tmp_path):
    # `privlearn budget history | head`: the reader leaves; no traceback, and not
    # status 1 (an internal error): 141, as a command killed by SIGPIPE
    from privlearn.ledger import Ledger

    path = str(tmp_path / "big.db")
    led = Ledger(path, create=True)
    led.create_budget("a", 1e6, 1e-6)
    for i in range(1500):  # more than a pipe's buffer (64 KiB)
        led.spend("a", Gaussian(1000.0), label=f"release number {i}")
    led.close()
    proc = subprocess.Popen([sys.executable, "-m", "privlearn", "budget", "history", path,
                             "--dataset", "a"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()  # as head does after its lines
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert err == ""


@pytest.mark.parametrize("who", ["", "  "])
def test_a_blank_who_is_refused_not_replaced_by_user_at_host(db, who):
    r = CliRunner().invoke(cli, ["budget", "spend", db, "--dataset", "adult",
                                 "--noise-multiplier", "20", "--who", who])
    assert r.exit_code == 2 and r.stdout == "", r.output
    assert r.stderr.startswith("error: --who must name who makes the entry"), r.stderr
    assert json.loads(run("budget", "show", db, "--dataset", "adult",
                          "--json").output)["entries"] == 3  # nothing recorded


@pytest.mark.parametrize("eps", [0.3, 0.9, 0.45, 2.0])
def test_spend_a_laplace_release_by_its_epsilon(tmp_path, eps):
    """A Laplace release made at epsilon E (scale = L1 sensitivity / E) is recorded with
    `--mechanism laplace --epsilon E`: a Laplace mechanism of noise multiplier b with
    1/b >= E (never more noise than was added; for 0.9 and 0.45, 1/(1/E) < E in floats)
    and b no further than one float below 1/E."""
    db = str(tmp_path / "l.db")
    assert run("budget", "init", db, "--dataset", "adult", "--epsilon", "5", "--delta",
               "1e-6").exit_code == 0
    r = run("budget", "spend", db, "--dataset", "adult", "--mechanism", "laplace",
            "--epsilon", str(eps), "--label", "histogram")
    assert r.exit_code == 0, r.output
    entry = json.loads(run("budget", "history", db, "--dataset", "adult", "--json").output)[-1]
    assert entry["label"] == "histogram"
    (part,) = entry["mechanism"]["parts"]
    assert part["count"] == 1 and part["mechanism"]["kind"] == "laplace"
    b = part["mechanism"]["noise_multiplier"]
    assert 1.0 / b >= eps
    assert b <= 1.0 / eps and math.nextafter(b, math.inf) >= 1.0 / eps


def test_spend_by_epsilon_is_refused_where_it_cannot_describe_the_release(db):
    """--epsilon is for Laplace releases only; with --noise-multiplier it is ambiguous;
    without either the command names both. Nothing is recorded."""
    before = json.loads(run("budget", "show", db, "--dataset", "adult", "--json").output)
    cases = [
        (["--epsilon", "0.3"], ["--mechanism laplace", "privlearn calibrate"]),
        (["--mechanism", "laplace", "--epsilon", "0.3", "--noise-multiplier", "2"],
         ["one of --noise-multiplier and --epsilon"]),
        ([], ["--noise-multiplier", "--epsilon"]),
        (["--mechanism", "laplace", "--epsilon", "-1"], ["--epsilon", "(0, inf)", "-1"]),
    ]
    for extra, said in cases:
        r = CliRunner().invoke(cli, ["budget", "spend", db, "--dataset", "adult", *extra])
        assert r.exit_code == 2, (extra, r.output)
        assert all(s in r.output for s in said), (extra, r.output)
    after = json.loads(run("budget", "show", db, "--dataset", "adult", "--json").output)
    assert after == before
