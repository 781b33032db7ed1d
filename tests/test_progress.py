"""The one progress bar (privlearn._progress): standard error only, off unless a
terminal or asked for, never in a returned value."""

from __future__ import annotations

import io
import sys

import pytest

from privlearn._progress import check_show_progress, progress, stderr_is_terminal
from privlearn.errors import ParameterTypeError


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(enabled, delay=0.0):
    with progress(total=3, desc="work", enabled=enabled, delay=delay) as bar:
        for _ in range(3):
            bar.update(1)
    return list(progress(range(3), desc="work", enabled=enabled, delay=delay))


def test_forced_on_writes_to_stderr_only_and_the_values_are_unchanged(capsys):
    assert _run(True) == [0, 1, 2]
    out, err = capsys.readouterr()
    assert out == "" and "work" in err and "/3" in err


@pytest.mark.parametrize("enabled", [False, None])
def test_off_or_not_a_terminal_writes_nothing(capsys, enabled):
    assert not stderr_is_terminal()  # captured: not a terminal
    assert _run(enabled) == [0, 1, 2]
    assert capsys.readouterr() == ("", "")


def test_automatic_bar_shows_on_a_terminal_and_waits_for_its_delay(monkeypatch):
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert stderr_is_terminal()
    _run(None)
    assert "work" in term.getvalue()
    quiet = _Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    _run(None, delay=60.0)  # quick work under its delay: nothing shown
    assert quiet.getvalue() == ""
    forced = _Terminal()
    monkeypatch.setattr(sys, "stderr", forced)
    _run(True, delay=60.0)  # asked for: shown at once
    assert "work" in forced.getvalue()


def test_show_progress_is_none_or_a_bool():
    assert check_show_progress(None) is None
    assert check_show_progress(True) is True and check_show_progress(False) is False
    for bad in ("yes", 1, 0.0):
        with pytest.raises(ParameterTypeError, match="show_progress must be None"):
            check_show_progress(bad)
