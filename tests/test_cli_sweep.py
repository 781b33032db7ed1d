"""Every option of every command, swept over extreme well-typed values: the command
either succeeds (status 0, a result without nan) or refuses in ONE line ``error: ...``
on stderr with status 2 (3 for a ledger spend over the budget, 4 for a file that is not
a ledger), never with a traceback.

The command tree is read from click, so a new command or option is swept without
editing this file (a new command needs a valid invocation in ``BASES``: the test says
so). The long-running commands (``demo``, ``reproduce``, ``audit dpsgd``) are swept up to
the call that would run them: that call is replaced by a stub, so what is checked is
their validation of the options."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from privlearn.cli import cli

# the accountants evaluate at both ends of the float range here: numpy's overflow and
# division warnings on the way are expected, the outcome is what is checked
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

#: Valid invocations of each command (the options each sweep starts from); PATH stands
#: for a ledger holding a budget for dataset "d".
BASES: dict[str, list[list[str]]] = {
    "epsilon": [
        ["--noise-multiplier", "1", "--delta", "1e-5", "--steps", "10",
         "--sampling-rate", "0.01"],
        ["--noise-multiplier", "1", "--delta", "1e-5", "--batch-size", "10",
         "--dataset-size", "1000", "--epochs", "2"],
    ],
    "calibrate": [
        ["--target-epsilon", "1", "--delta", "1e-5", "--steps", "10"],
        ["--target-epsilon", "1", "--delta", "1e-5", "--batch-size", "10",
         "--dataset-size", "1000", "--epochs", "2"],
    ],
    "demo": [["--no-experiment"]],
    "reproduce": [["linear-regression", "--reps", "1"]],
    "budget init": [["PATH", "--dataset", "e", "--epsilon", "1", "--delta", "1e-5"]],
    "budget spend": [["PATH", "--dataset", "d", "--noise-multiplier", "10"]],
    "budget show": [["PATH", "--dataset", "d"]],
    "budget history": [["PATH", "--dataset", "d"]],
    "budget verify": [["PATH"]],
    "audit dpsgd": [["--epsilon", "1", "--delta", "1e-5"]],
}

FLOATS = ["0", "-0.0", "5e-324", "1e-300", "1e300", "1.7976931348623157e308", "inf",
          "-inf", "nan", "-1", ""]
INTS = ["0", "-1", "1", str(2**63), str(10**30), ""]
STRINGS = ["", " ", "x" * 300, "é/../\\"]


#: Values whose accounting takes seconds (a PLD grid for a delta near the smallest
#: float, a calibration over 1e18 steps): in the slow suite only.
SLOW = {("calibrate", "dataset_size", str(2**63)), ("calibrate", "sampling_rate", "1e-300"),
        ("calibrate", "sampling_rate", "5e-324"), ("epsilon", "delta", "5e-324"),
        ("epsilon", "delta", "1e-300"), ("epsilon", "dataset_size", str(2**63)),
        ("calibrate", "epochs", str(2**63)), ("calibrate", "dataset_size", str(10**30)),
        ("calibrate", "epochs", str(10**30))}


class _Reached(Exception):
    """Raised by the stub standing in for a long-running call: validation passed."""


def _stub(*args, **kwargs):
    raise _Reached


def _commands(group: click.Group, prefix: tuple[str, ...] = ()
              ) -> Iterator[tuple[str, click.Command]]:
    for name, cmd in sorted(group.commands.items()):
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*prefix, name))
        else:
            yield " ".join((*prefix, name)), cmd


COMMANDS = dict(_commands(cli))


def _values(param: click.Parameter, tmp: Path) -> list[str | None]:
    """Extreme values of ``param`` (None: a flag given)."""
    t = param.type
    if isinstance(param, click.Option) and param.is_flag:
        return [None]
    if isinstance(t, click.Choice):
        return [str(c) for c in t.choices]
    if isinstance(t, click.Path):
        afile = tmp / "a-file.txt"
        afile.write_text("not a ledger\n")
        return ["", str(tmp / "missing" / "dir" / "x"), str(tmp), str(afile)]
    if isinstance(t, click.types.FloatParamType):
        return FLOATS
    if isinstance(t, click.types.IntParamType):
        return INTS
    return STRINGS


def _given(param: click.Parameter, base: list[str]) -> bool:
    return isinstance(param, click.Argument) or any(o in base for o in param.opts)


def _cases() -> Iterator[tuple[str, int, str, str | int | None]]:
    """(command, base, option, value or index of a path value): every option on the
    first base, and on the other bases the options that only they give (the epoch form
    of a schedule)."""
    for name, cmd in COMMANDS.items():
        bases = BASES.get(name, [[]])
        for b, base in enumerate(bases):
            for param in cmd.params:
                if b > 0 and (not _given(param, base) or _given(param, bases[0])):
                    continue
                path = isinstance(param.type, click.Path)
                for v in range(4) if path else _values(param, Path("/nonexistent")):
                    yield name, b, param.name, v


def _invocation(name: str, base: list[str], cmd: click.Command, param: click.Parameter,
                value: str | None, ledger: Path) -> list[str]:
    args = [str(ledger) if a == "PATH" else a for a in base]
    if isinstance(param, click.Argument):
        pos = [i for i, a in enumerate(args) if not a.startswith("-")
               and (i == 0 or not args[i - 1].startswith("-"))]
        args[pos[0]] = value
        return [*name.split(), *args]
    opt = param.opts[0]
    if opt in args:
        i = args.index(opt)
        args[i:i + (1 if param.is_flag else 2)] = []
    args += [opt] if value is None else [opt, value]
    return [*name.split(), *args]


def test_every_command_has_a_base_invocation() -> None:
    missing = sorted(set(COMMANDS) - set(BASES))
    assert not missing, f"add a valid invocation of {missing} to BASES"


@pytest.fixture(autouse=True)
def _stub_long_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    import privlearn.demo
    import privlearn.experiments

    monkeypatch.setattr(privlearn.demo, "main", _stub)
    monkeypatch.setattr(privlearn.experiments, "run_experiment", _stub)
    try:
        import privlearn.auditing.torch
    except ImportError:  # no torch: the command refuses before it gets there
        return
    monkeypatch.setattr(privlearn.auditing.torch, "audit_dpsgd", _stub)


def _ledger(tmp_path: Path) -> Path:
    from privlearn.ledger import Ledger

    path = tmp_path / "ledger.db"
    Ledger(path, create=True).create_budget("d", 10.0, 1e-5)
    return path


@pytest.mark.parametrize(("name", "base", "param", "index"), [
    pytest.param(n, b, p, i, id=f"{n}[{b}]--{p}={i}",
                 marks=[pytest.mark.slow] if (n, p, i) in SLOW else [])
    for n, b, p, i in _cases()])
def test_extreme_value_is_a_result_or_one_line_error(
        name: str, base: int, param: str, index: str | int | None, tmp_path: Path) -> None:
    cmd = COMMANDS[name]
    par = next(p for p in cmd.params if p.name == param)
    value = _values(par, tmp_path)[index] if isinstance(index, int) else index
    args = _invocation(name, BASES[name][base], cmd, par, value, _ledger(tmp_path))
    r = CliRunner().invoke(cli, args)
    shown = f"privlearn {' '.join(args)}\nstatus {r.exit_code}\n{r.output}"
    if isinstance(r.exception, _Reached):  # the long run would start: options accepted
        return
    assert "Traceback" not in r.output, shown
    if r.exit_code == 0:
        assert r.stdout.strip(), shown
        assert not re.search(r"\bnan\b", r.stdout, re.IGNORECASE), shown
        return
    assert r.exit_code in (2, 3, 4), shown  # 3: over the budget, 4: not a ledger
    assert r.exception is None or isinstance(r.exception, SystemExit), shown
    lines = r.stderr.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1 and all(
        ln.startswith(("error: ", "warning: ")) for ln in lines), shown
    assert not r.stdout.strip(), shown
