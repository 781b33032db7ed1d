"""The ``privlearn`` click group and how errors become output: one line ``error: ...``
on stderr and an exit status chosen by the error's type (:data:`EXIT_STATUS`), with
what to try (:data:`HINTS`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import Any

import click

from privlearn import __version__
from privlearn._type_registry import first_in_mro
from privlearn.errors import (
    AccountingError,
    BudgetExceededError,
    CalibrationError,
    CertificationError,
    DataFormatError,
    DataNotFoundError,
    LedgerBusyError,
    LedgerConflictError,
    LedgerIntegrityError,
    LedgerNotFoundError,
    LedgerStorageError,
    ParameterTypeError,
    ParameterValueError,
    PrivacyLossOverflowError,
    UnknownBudgetError,
    UnsupportedMechanismError,
)

__all__ = ["cli", "main", "ExitStatus", "EXIT_STATUS", "HINTS", "one_line"]

class ExitStatus(IntEnum):
    """Exit statuses of the ``privlearn`` command."""

    OK = 0
    #: an unexpected error (a bug): Python's traceback and status
    INTERNAL_ERROR = 1
    #: bad usage or input, or a configuration that cannot be accounted
    USAGE = 2
    #: a ledger spend refused because it would exceed the budget (nothing recorded)
    BUDGET_EXCEEDED = 3
    #: the ledger file failed its integrity check (nothing reported or recorded)
    LEDGER_TAMPERED = 4
    #: ``privlearn audit`` found a VIOLATION (an empirical lower bound above the claim)
    AUDIT_VIOLATION = 5
    #: interrupted (Ctrl-C, SIGINT): 128 + SIGINT, the shell's status of an interrupted
    #: command, with one line ``error: interrupted`` and no traceback
    INTERRUPTED = 130
    #: the reader of the output closed the pipe (``privlearn budget history | head``):
    #: 128 + SIGPIPE, the status of a command killed by SIGPIPE, without a message
    BROKEN_PIPE = 141


#: Exit status of each error type the CLI reports in one line (looked up along the MRO).
EXIT_STATUS: dict[type[BaseException], ExitStatus] = {
    ParameterValueError: ExitStatus.USAGE,
    ParameterTypeError: ExitStatus.USAGE,
    UnsupportedMechanismError: ExitStatus.USAGE,
    AccountingError: ExitStatus.USAGE,
    CalibrationError: ExitStatus.USAGE,
    LedgerNotFoundError: ExitStatus.USAGE,
    UnknownBudgetError: ExitStatus.USAGE,
    LedgerConflictError: ExitStatus.USAGE,
    LedgerBusyError: ExitStatus.USAGE,
    LedgerStorageError: ExitStatus.USAGE,
    DataNotFoundError: ExitStatus.USAGE,
    DataFormatError: ExitStatus.USAGE,
    BudgetExceededError: ExitStatus.BUDGET_EXCEEDED,
    LedgerIntegrityError: ExitStatus.LEDGER_TAMPERED,
}

_NON_PRIVATE = ("try a larger --noise-multiplier or fewer --steps (with this little noise "
                "the run is essentially non-private)")


def _calibration_hint(err: BaseException, command: str) -> str:
    cause = err.__cause__
    if cause is not None:  # the accountant failed during the search
        return _hint(cause, command) or _HINT_DEFAULT
    return ("try a larger --target-epsilon or --delta, fewer --steps/--epochs, or a smaller "
            "--sampling-rate/--batch-size")


def _overflow_hint(err: BaseException, command: str) -> str:
    if command == "calibrate":
        return ("try a smaller --target-epsilon or --accountant rdp (the search reached "
                "noise so small that the privacy loss cannot be represented)")
    return _NON_PRIVATE


_HINT_DEFAULT = "try --accountant rdp, or a larger --noise-multiplier"

#: What to try after an error of each type (``fn(error, command name) -> hint``), looked
#: up along the MRO like :data:`EXIT_STATUS`.
HINTS: dict[type[BaseException], Callable[[BaseException, str], str | None]] = {
    UnsupportedMechanismError: lambda e, c: (
        "a budget's accountant is fixed when the budget is created (privlearn budget init "
        "... --accountant; pld, the default, accounts every release that budget spend "
        "describes)" if c == "budget" else "try --accountant pld or --accountant rdp"),
    CertificationError: lambda e, c: (
        "try --accountant rdp (Renyi DP needs no tail certification and gives a valid, "
        "looser bound) or a larger --delta"),
    PrivacyLossOverflowError: _overflow_hint,
    AccountingError: lambda e, c: _HINT_DEFAULT,
    LedgerBusyError: lambda e, c: (
        "from the shell, wait longer (or less) with privlearn budget ... --timeout SECONDS "
        "(default 60)" if c == "budget" else None),
    CalibrationError: _calibration_hint,
    DataNotFoundError: lambda e, c: (
        "run again with --data-home DIR (a directory holding the files) or --download"),
    LedgerNotFoundError: lambda e, c: _ledger_hint(e),
    UnknownBudgetError: lambda e, c: _budget_hint(e),
}


def _init_command(path: str | None, dataset: str | None = None,
                  unit: str | None = None) -> str:
    return (f"`privlearn budget init {path or 'PATH'} --dataset {dataset or 'NAME'}"
            + (f" --privacy-unit {unit}" if unit not in (None, "record") else "")
            + " --epsilon E --delta D`")


def _ledger_hint(err: BaseException) -> str | None:
    reason = getattr(err, "reason", None)
    path = getattr(err, "path", None)
    if reason in (None, "missing"):
        return f"create one with {_init_command(path)}"
    if reason == "empty":
        return f"{_init_command(path)} creates one there"
    return None  # the message says what to do (create the directory, pass a file)


def _budget_hint(err: BaseException) -> str:
    command = _init_command(getattr(err, "path", None), getattr(err, "dataset", None),
                            getattr(err, "privacy_unit", None))
    return f"create one with {command}"


def _ledger_message(err: BaseException) -> str:
    path, reason = getattr(err, "path", None), getattr(err, "reason", None)
    if reason == "missing":
        return f"no privacy ledger at {path}; check the path"
    if reason == "empty":
        return f"{path} is empty, not a privacy ledger"
    if reason == "not_a_ledger":
        return (f"{one_line(str(err)).split(';')[0]}; pass the path of a ledger, or create "
                f"one with {_init_command(None)} at a path where no file exists")
    return str(err)


def _budget_message(err: BaseException) -> str:
    if getattr(err, "dataset", None) is None:
        return str(err)
    known = ", ".join(err.known) or "none"  # type: ignore[attr-defined]
    return (f"no budget for dataset {err.dataset!r} (privacy unit "  # type: ignore[attr-defined]
            f"{err.privacy_unit!r}) in {err.path} (budgets there: {known})")  # type: ignore


#: The error's message in the shell's words (commands and options, not Python
#: arguments), built from the error's attributes; looked up along the MRO, the error's
#: own message otherwise.
MESSAGES: dict[type[BaseException], Callable[[BaseException], str]] = {
    LedgerNotFoundError: _ledger_message,
    UnknownBudgetError: _budget_message,
}


def _lookup(table: dict[type[BaseException], Any], err: BaseException) -> Any:
    cls = first_in_mro(err, table.__contains__)
    return None if cls is None else table[cls]


def _hint(err: BaseException, command: str) -> str | None:
    fn = _lookup(HINTS, err)
    return None if fn is None else fn(err, command)


class _OneLineErrors(click.Group):
    """A click group that reports usage errors and the error types of
    :data:`EXIT_STATUS` as one ``error: ...`` line on stderr, with the table's exit
    status and the hint of :data:`HINTS`; other exceptions propagate (a traceback)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except tuple(EXIT_STATUS) as err:
            command = ctx.invoked_subcommand or ""
            words = _lookup(MESSAGES, err)
            msg = one_line(str(err) if words is None else words(err)).rstrip(".")
            msg = msg or type(err).__name__
            hint = _hint(err, command)
            click.echo(f"error: {msg}" + (f"; {hint}" if hint else ""), err=True)
            raise click.exceptions.Exit(int(_lookup(EXIT_STATUS, err))) from None
        except BrokenPipeError:  # e.g. `privlearn budget history ... | head`: the reader left
            _silence_stdout()
            raise click.exceptions.Exit(ExitStatus.BROKEN_PIPE) from None

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        code: int | None = None
        try:
            rv = super().main(
                args=args,
                prog_name=prog_name or "privlearn",
                complete_var=complete_var,
                standalone_mode=False,
                **extra,
            )
            code = rv if isinstance(rv, int) else 0
        except (click.exceptions.Abort, KeyboardInterrupt):
            # click turns Ctrl-C (KeyboardInterrupt) during a command into Abort (after a
            # blank line closing the terminal's ``^C``); no command of ours prompts, so an
            # Abort is an interruption, never a bug
            click.echo("error: interrupted", err=True)
            code = ExitStatus.INTERRUPTED
        except _NO_ARGS_IS_HELP as e:  # a group without its command: its help, as written
            click.echo(e.format_message(), err=True)
            code = ExitStatus.USAGE
        except click.UsageError as e:
            click.echo(f"error: {_with_help(one_line(e.format_message()), e)}", err=True)
            code = ExitStatus.USAGE
        except click.ClickException as e:
            click.echo(f"error: {one_line(e.format_message())}", err=True)
            code = e.exit_code
        if standalone_mode:
            sys.exit(code)
        return code


#: What click raises for a group called without its command (click >= 8.2; before, the
#: group printed its help and exited itself).
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


def _with_help(msg: str, err: click.UsageError) -> str:
    """``msg`` and where the usage of the command that refused the call is (``see
    `privlearn epsilon --help```): the one line replaces click's usage block."""
    ctx = getattr(err, "ctx", None)
    see = f"`{ctx.command_path if ctx is not None else 'privlearn'} --help`"
    return f"{msg} See {see}" if msg.endswith("?") else f"{msg.rstrip('.')}; see {see}"


def _silence_stdout() -> None:
    """Point stdout at the null device, so that the interpreter's last flush of what is
    left in its buffer does not raise ``BrokenPipeError`` again (the recipe of Python's
    ``signal`` module documentation, "Note on SIGPIPE")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout (e.g. captured by a test runner)
        pass


def one_line(msg: str) -> str:
    return " ".join(msg.split())


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="privlearn")
def cli() -> None:
    """privlearn: differentially private learning with certified privacy accounting.

    \b
    Exit status: 0 success; 2 bad usage or input, or a run that cannot be accounted;
    3 a ledger spend refused (budget exceeded); 4 a ledger that failed its integrity
    check; 5 an audit VIOLATION; 130 interrupted (Ctrl-C); 141 the reader of the
    output closed the pipe (e.g. `| head`); 1 an unexpected error (with a traceback).
    """


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``privlearn`` console script (exits with the status code)."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="privlearn")
