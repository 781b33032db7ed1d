"""`privlearn budget init` without `--neighbouring` says what the neighbouring relation is,
that the first release fixes it, and which option fixes it at creation."""

from __future__ import annotations

import click
from click.testing import CliRunner

from privlearn.cli import cli


def _invoke(*args: str):
    r = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r


def _neighbouring_option() -> click.Option:
    init = cli.commands["budget"].commands["init"]
    return next(p for p in init.params if p.name == "neighbouring")


def test_init_without_a_relation_explains_it(tmp_path):
    path = str(tmp_path / "l.db")
    r = _invoke("budget", "init", path, "--dataset", "a", "--epsilon", "3", "--delta", "1e-6")
    out = " ".join(r.output.split())  # the note may wrap
    assert "not fixed yet" not in out
    assert "first release" in out
    option = _neighbouring_option()
    assert option.opts[0] in out  # the option that exists, by its name
    for choice in option.type.choices:  # each relation it takes, by its name, explained
        assert f"{choice} (a record" in out
    # nothing is spent yet: `budget show` says the same, in its one line
    r = _invoke("budget", "show", path, "--dataset", "a")
    assert "not fixed yet" not in r.output and "first release" in r.output


def test_init_with_a_relation_prints_no_note(tmp_path):
    path = str(tmp_path / "l.db")
    r = _invoke(
        "budget",
        "init",
        path,
        "--dataset",
        "a",
        "--epsilon",
        "3",
        "--delta",
        "1e-6",
        "--neighbouring",
        "replace_one",
    )
    assert r.output.splitlines() == [
        "budget for a (record, replace_one): epsilon 3, delta 1e-06 (pld)"
    ]


def test_init_again_with_another_relation_names_the_unset_one_in_words(tmp_path):
    # a budget created without --neighbouring, asked again with one: the conflict says the
    # relation is still to be fixed, not "neighbouring='None'"; the other way round the
    # relation asked for is "none", never the string 'None'
    path = str(tmp_path / "l.db")
    args = ["budget", "init", path, "--dataset", "a", "--epsilon", "3", "--delta", "1e-6"]
    _invoke(*args)
    r = CliRunner().invoke(cli, [*args, "--neighbouring", "replace_one", "--exist-ok"])
    out = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert "'None'" not in out and "None" not in out
    assert "neighbouring to be fixed by the first release (asked 'replace_one')" in out
    other = str(tmp_path / "m.db")
    fixed = ["budget", "init", other, "--dataset", "a", "--epsilon", "3", "--delta", "1e-6"]
    _invoke(*fixed, "--neighbouring", "add_remove")
    r = CliRunner().invoke(cli, [*fixed, "--exist-ok"])
    out = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert "None" not in out and "neighbouring='add_remove' (asked none)" in out
