"""Command line interface: a thin layer over :mod:`privlearn.accounting`, the ledger and
the audits.

Commands
--------
``privlearn epsilon``    certified epsilon of a (subsampled, composed) Gaussian/Laplace
``privlearn calibrate``  smallest noise multiplier meeting an (epsilon, delta) target
``privlearn demo``       accounting table of four DP learning algorithms, then a short
                         linear-regression experiment
``privlearn reproduce``  run one of the end-to-end experiments (CSV + PNG)
``privlearn budget``     a persistent privacy ledger (init, spend, show, history, verify)
``privlearn audit dpsgd`` empirical privacy audit of the DP-SGD engine (canaries)

Errors and exit statuses
------------------------
An error caused by the input or by the state of a ledger is reported as ONE line
``error: ...`` on stderr (with what to try, where there is a suggestion), never as a
traceback. The exit status is chosen by the *type* of the error (:data:`EXIT_STATUS`, a
table keyed by the classes of :mod:`privlearn.errors`, looked up along the MRO), never by
its message: see :class:`ExitStatus`. Any other exception is a bug and shows its
traceback (status 1).

Length: one click application; each command is a thin block over the library and the
options are shared between commands, so they live together (see docs/guides/cli.md).
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import Any

import click

from privlearn import __version__
from privlearn._validation import (
    check_count,
    check_delta,
    check_gaussian_delta,
    check_positive,
    check_rate,
)
from privlearn.accounting import (
    Gaussian,
    Laplace,
    Mechanism,
    available_accountants,
    calibrate,
    compose,
    planned_steps,
    subsample,
    warn_if_delta_large,
)
from privlearn.errors import (
    AccountingError,
    BudgetExceededError,
    CalibrationError,
    CertificationError,
    DataNotFoundError,
    LedgerConflictError,
    LedgerIntegrityError,
    LedgerNotFoundError,
    ParameterTypeError,
    ParameterValueError,
    PrivacyLossOverflowError,
    UnknownBudgetError,
    UnsupportedMechanismError,
)

__all__ = ["cli", "main", "build_mechanism", "ExitStatus", "EXIT_STATUS"]

MECHANISMS = ("gaussian", "laplace")
SAMPLINGS = ("poisson", "fixed")


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
    DataNotFoundError: ExitStatus.USAGE,
    BudgetExceededError: ExitStatus.BUDGET_EXCEEDED,
    LedgerIntegrityError: ExitStatus.LEDGER_TAMPERED,
}

_NON_PRIVATE = ("try a larger --noise-multiplier (with this little noise the mechanism is "
                "essentially non-private)")


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
    UnsupportedMechanismError: lambda e, c: "try --accountant pld or --accountant rdp",
    CertificationError: lambda e, c: (
        "try --accountant rdp (Renyi DP needs no tail certification and gives a valid, "
        "looser bound) or a larger --delta"),
    PrivacyLossOverflowError: _overflow_hint,
    AccountingError: lambda e, c: _HINT_DEFAULT,
    CalibrationError: _calibration_hint,
    DataNotFoundError: lambda e, c: (
        "run again with --data-home DIR (a directory holding the files) or --download"),
    LedgerNotFoundError: lambda e, c: (
        "create one with `privlearn budget init PATH --dataset NAME --epsilon E --delta D`"),
}


def _lookup(table: dict[type[BaseException], Any], err: BaseException) -> Any:
    for cls in type(err).__mro__:
        if cls in table:
            return table[cls]
    return None


def _hint(err: BaseException, command: str) -> str | None:
    fn = _lookup(HINTS, err)
    return None if fn is None else fn(err, command)


#: One-line descriptions of the built-in accountants for ``--help``; the list of names
#: itself comes from the registry (:func:`privlearn.accounting.available_accountants`).
_ACCOUNTANT_HELP = {
    "pld": "privacy loss distributions (certified upper and lower bounds)",
    "rdp": "Renyi DP (a looser upper bound, always available)",
    "analytic": "exact, Gaussian compositions without subsampling only",
}


def _accountant_names() -> list[str]:
    """Accountant names as the registry lists them (``available_accountants``)."""
    return list(available_accountants())


def build_mechanism(
    mechanism: str,
    noise_multiplier: float,
    sampling_rate: float | None = None,
    sampling: str = "poisson",
    steps: int = 1,
) -> Mechanism:
    """The privlearn mechanism the ``epsilon``/``calibrate`` options describe.

    ``compose(subsample(Base(noise_multiplier), sampling_rate, sampling), steps)``, with
    no subsampling when ``sampling_rate`` is None.

    Parameters
    ----------
    mechanism : {"gaussian", "laplace"}
        The base mechanism.
    noise_multiplier : float
        Gaussian standard deviation over the L2 sensitivity, or Laplace scale over the
        L1 sensitivity.
    sampling_rate : float, optional
        Subsampling rate in (0, 1].
    sampling : {"poisson", "fixed"}
        Subsampling scheme.
    steps : int
        Number of compositions.

    Returns
    -------
    Mechanism
        The composed mechanism.
    """
    base_cls = {"gaussian": Gaussian, "laplace": Laplace}[mechanism]
    m: Mechanism = base_cls(noise_multiplier)
    if sampling_rate is not None:
        m = subsample(m, sampling_rate, scheme=sampling)
    return compose(m, steps=steps)


def _schedule(
    sampling_rate: float | None,
    steps: int | None,
    batch_size: int | None,
    dataset_size: int | None,
    epochs: int | None,
) -> tuple[float | None, int, str]:
    """(sampling rate, steps, a sentence on how they were obtained) from either form.

    The epoch form counts steps with :func:`privlearn.accounting.planned_steps`, the rule
    :func:`privlearn.torch.make_private`'s loader follows (``E x round(N / B)``).
    """
    epoch_form = {"--batch-size": batch_size, "--dataset-size": dataset_size,
                  "--epochs": epochs}
    rate_form = {"--sampling-rate": sampling_rate, "--steps": steps}
    given_epoch = [k for k, v in epoch_form.items() if v is not None]
    given_rate = [k for k, v in rate_form.items() if v is not None]
    if given_epoch and given_rate:
        raise click.UsageError(
            f"{'/'.join(given_rate)} cannot be combined with {'/'.join(given_epoch)}: "
            "describe the run either by --sampling-rate and --steps, or by --batch-size, "
            "--dataset-size and --epochs (which set sampling rate = batch size / dataset "
            "size and steps = epochs x round(dataset size / batch size))"
        )
    if given_epoch:
        missing = [k for k, v in epoch_form.items() if v is None]
        if missing:
            raise click.UsageError(
                f"{', '.join(missing)} missing: --batch-size, --dataset-size and --epochs "
                "go together (or use --sampling-rate and --steps instead)"
            )
        b = check_count("--batch-size", batch_size, minimum=1)
        n = check_count("--dataset-size", dataset_size, minimum=1)
        e = check_count("--epochs", epochs, minimum=1)
        if b > n:
            raise ParameterValueError(
                f"--batch-size must be <= --dataset-size (the sampling rate batch / dataset "
                f"size must be in (0, 1]), got --batch-size {b} and --dataset-size {n}; "
                "try a smaller --batch-size"
            )
        q = b / n
        total = planned_steps(q, e)
        note = (f"sampling rate = {b}/{n}; steps = {e} epochs x {total // e} steps per "
                f"epoch (round({n} / {b})) = {total}, the steps "
                "privlearn.torch.make_private's loader runs")
        return q, total, note
    rate = None if sampling_rate is None else check_rate("--sampling-rate", sampling_rate)
    t = check_count("--steps", 1 if steps is None else steps, minimum=1)
    return rate, t, ""


def _warn_delta(delta: float, dataset_size: int | None) -> None:
    """Print :func:`privlearn.accounting.warn_if_delta_large`'s warning (delta >= 1/n) on
    stderr as ``warning: ...``; the command goes on."""
    if dataset_size is None:
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_if_delta_large(delta, dataset_size, name="--delta")
    for w in caught:
        click.echo(f"warning: {_one_line(str(w.message))}", err=True)


def _run_json(rate: float | None, sampling: str, steps: int) -> dict[str, Any]:
    """The schedule's fields of the ``--json`` objects of ``epsilon`` and ``calibrate``."""
    return {"sampling_rate": rate, "sampling": sampling if rate is not None else None,
            "steps": steps}


def _none_if_inf(x: float | None) -> float | str | None:
    if x is None:
        return None
    return x if math.isfinite(x) else "inf"


class _OneLineErrors(click.Group):
    """A click group that reports usage errors and the error types of
    :data:`EXIT_STATUS` as one ``error: ...`` line on stderr, with the table's exit
    status and the hint of :data:`HINTS`; other exceptions propagate (a traceback)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except tuple(EXIT_STATUS) as err:
            command = ctx.invoked_subcommand or ""
            msg = _one_line(str(err)).rstrip(".") or type(err).__name__
            hint = _hint(err, command)
            click.echo(f"error: {msg}" + (f"; {hint}" if hint else ""), err=True)
            raise click.exceptions.Exit(int(_lookup(EXIT_STATUS, err))) from None

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
        except click.exceptions.Abort:
            click.echo("error: aborted", err=True)
            code = 1
        except click.UsageError as e:
            click.echo(f"error: {_one_line(e.format_message())}", err=True)
            code = ExitStatus.USAGE
        except click.ClickException as e:
            click.echo(f"error: {_one_line(e.format_message())}", err=True)
            code = e.exit_code
        if standalone_mode:
            sys.exit(code)
        return code


def _one_line(msg: str) -> str:
    return " ".join(msg.split())


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="privlearn")
def cli() -> None:
    """privlearn: differentially private learning with certified privacy accounting.

    \b
    Exit status: 0 success; 2 bad usage or input, or a run that cannot be accounted;
    3 a ledger spend refused (budget exceeded); 4 a ledger that failed its integrity
    check; 5 an audit VIOLATION; 1 an unexpected error (with a traceback).
    """


_mechanism_opt = click.option(
    "--mechanism",
    type=click.Choice(MECHANISMS, case_sensitive=False),
    default="gaussian",
    show_default=True,
    help="Base mechanism (noise multiplier = Gaussian std / L2 sensitivity, or Laplace "
    "scale / L1 sensitivity).",
)
_rate_opt = click.option(
    "--sampling-rate",
    type=float,
    default=None,
    help="Subsampling rate in (0, 1] (default: no subsampling).",
)
_sampling_opt = click.option(
    "--sampling",
    type=click.Choice(SAMPLINGS, case_sensitive=False),
    default="poisson",
    show_default=True,
    help="Subsampling scheme: Poisson (add/remove-one) or fixed-size without replacement "
    "(replace-one).",
)
_steps_opt = click.option(
    "--steps", type=int, default=None, help="Number of compositions (integer; default 1)."
)
_batch_opt = click.option(
    "--batch-size", type=int, default=None,
    help="Expected batch size B; with --dataset-size N and --epochs E instead of "
    "--sampling-rate/--steps: sampling rate B/N and steps E x round(N/B), the steps "
    "privlearn.torch.make_private's loader runs.",
)
_dataset_opt = click.option(
    "--dataset-size", type=int, default=None,
    help="Number of training examples N (a --delta of 1/N or more is warned about).",
)
_epochs_opt = click.option("--epochs", type=int, default=None, help="Number of epochs E.")
_delta_opt = click.option("--delta", type=float, required=True, help="Target delta in [0, 1).")
_accountant_opt = click.option(
    "--accountant",
    type=click.Choice(_accountant_names(), case_sensitive=False),
    default="pld",
    show_default=True,
    help="; ".join(f"{name}: {_ACCOUNTANT_HELP.get(name, 'registered accountant')}"
                   for name in _accountant_names()) + ".",
)
_json_opt = click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")

def _check_delta(mechanism: str, delta: float, dataset_size: int | None) -> float:
    """``--delta`` for ``--mechanism``: in [0, 1), positive for Gaussian noise (no pure-DP
    guarantee), and warned about when it is at least 1 / ``--dataset-size``."""
    if mechanism == "gaussian":
        d = check_gaussian_delta("--delta", delta, pure_dp_alternative="--mechanism laplace")
    else:
        d = check_delta("--delta", delta)
    _warn_delta(d, dataset_size)
    return d


def _describe(mechanism: str, nm: float | None, rate: float | None, sampling: str,
              steps: int) -> str:
    noise = "" if nm is None else f", noise multiplier {nm:g}"
    samp = "no subsampling" if rate is None else f"{sampling} sampling at rate {rate:.6g}"
    return f"{mechanism}{noise}, {samp}, {steps} step{'s' if steps != 1 else ''}"


@cli.command()
@_mechanism_opt
@click.option("--noise-multiplier", type=float, required=True, help="Noise multiplier (> 0).")
@_rate_opt
@_sampling_opt
@_steps_opt
@_batch_opt
@_dataset_opt
@_epochs_opt
@_delta_opt
@_accountant_opt
@_json_opt
def epsilon(
    mechanism: str,
    noise_multiplier: float,
    sampling_rate: float | None,
    sampling: str,
    steps: int | None,
    batch_size: int | None,
    dataset_size: int | None,
    epochs: int | None,
    delta: float,
    accountant: str,
    as_json: bool,
) -> None:
    """Certified epsilon of a (subsampled) mechanism composed STEPS times.

    Describe the run by --sampling-rate and --steps, or by --batch-size, --dataset-size
    and --epochs. With --json: one object with epsilon (certified upper bound),
    epsilon_lower (null when the accountant has no lower bound), delta, accountant and the
    mechanism's parameters.
    """
    nm = check_positive("--noise-multiplier", noise_multiplier)
    rate, t, note = _schedule(sampling_rate, steps, batch_size, dataset_size, epochs)
    kind, samp, acc = mechanism.lower(), sampling.lower(), accountant.lower()
    d = _check_delta(kind, delta, dataset_size)
    bound = build_mechanism(kind, nm, rate, samp, t).epsilon_bounds(d, acc)
    if not math.isfinite(bound.upper):
        raise PrivacyLossOverflowError(
            f"epsilon is infinite for {_describe(kind, nm, rate, samp, t)} at delta={d:g} "
            f"({acc} accountant)"
        )
    if as_json:
        out = {
            "epsilon": _none_if_inf(bound.upper),
            "epsilon_lower": _none_if_inf(bound.lower),
            "delta": d,
            "accountant": bound.accountant or acc,
            "mechanism": kind,
            "noise_multiplier": nm,
            **_run_json(rate, samp, t),
        }
        click.echo(json.dumps(out))
        return
    click.echo(f"epsilon: {bound.upper!r} (certified upper bound, "
               f"{bound.accountant or acc} accountant)")
    if bound.lower is not None:
        click.echo(f"epsilon lower bound: {bound.lower!r} (the exact epsilon of this "
                   "mechanism is at least this)")
    click.echo(f"delta: {d:g}")
    click.echo(f"mechanism: {_describe(kind, nm, rate, samp, t)}")
    if note:
        click.echo(f"schedule: {note}")


@cli.command(name="calibrate")
@_mechanism_opt
@click.option("--target-epsilon", type=float, required=True, help="Target epsilon (> 0).")
@_delta_opt
@_rate_opt
@_sampling_opt
@_steps_opt
@_batch_opt
@_dataset_opt
@_epochs_opt
@_accountant_opt
@_json_opt
def calibrate_cmd(
    mechanism: str,
    target_epsilon: float,
    delta: float,
    sampling_rate: float | None,
    sampling: str,
    steps: int | None,
    batch_size: int | None,
    dataset_size: int | None,
    epochs: int | None,
    accountant: str,
    as_json: bool,
) -> None:
    """Smallest noise multiplier whose epsilon(delta) meets the target (rounded up).

    Describe the run by --sampling-rate and --steps, or by --batch-size, --dataset-size
    and --epochs.
    """
    target = check_positive("--target-epsilon", target_epsilon)
    rate, t, note = _schedule(sampling_rate, steps, batch_size, dataset_size, epochs)
    kind, samp, acc = mechanism.lower(), sampling.lower(), accountant.lower()
    d = _check_delta(kind, delta, dataset_size)

    def factory(x: float) -> Mechanism:
        return build_mechanism(kind, x, rate, samp, t)

    try:
        nm = calibrate(factory, target, d, accountant=acc)
    except AccountingError as e:
        # an accounting failure during the search is a failed calibration: report it as
        # one, with the accountant's error as its cause (whose type gives the hint)
        raise CalibrationError(f"calibration failed: {_one_line(str(e))}") from e
    achieved = factory(nm).epsilon(d, acc)
    if as_json:
        out = {
            "noise_multiplier": nm,
            "epsilon": achieved,
            "target_epsilon": target,
            "delta": d,
            "accountant": acc,
            "mechanism": kind,
            **_run_json(rate, samp, t),
        }
        click.echo(json.dumps(out))
        return
    click.echo(f"noise multiplier: {nm!r} (smallest meeting epsilon <= {target:g} at "
               f"delta = {d:g}, rounded up)")
    click.echo(f"epsilon: {achieved!r} (certified, {acc} accountant)")
    click.echo(f"mechanism: {_describe(kind, None, rate, samp, t)}")
    if note:
        click.echo(f"schedule: {note}")


@cli.command()
@click.option(
    "--no-experiment", is_flag=True, help="Print only the accounting table (skip the experiment)."
)
def demo(no_experiment: bool) -> None:
    """Privacy accounting of four DP learning algorithms, then a short experiment.

    Recomputes the epsilons of NoisyGD, NoisySGD, PATE and Private kNN (and their Laplace
    variants) with privlearn's certified accountants next to the values published with
    them, then runs a short SSP / AdaSSP / NoisyGD linear regression on California
    housing that prints a table and saves a plot.
    """
    from privlearn.demo import main as demo_main

    demo_main(experiment=not no_experiment, echo=click.echo)


@cli.command()
@click.argument("name")
@click.option(
    "--out", "out_dir", type=click.Path(file_okay=False), default=None,
    help="Output directory (default ./privlearn-output).",
)
@click.option("--reps", type=int, default=None, help="Number of repetitions.")
@click.option("--seed", type=int, default=None, help="Random seed (default 0).")
@click.option(
    "--data-home", type=click.Path(file_okay=False), default=None,
    help="Directory holding the data files (label-release: the four MNIST .gz files). "
    "Default: $PRIVLEARN_DATA, then the user cache ~/.cache/privlearn.",
)
@click.option(
    "--download", is_flag=True,
    help="Download missing data (checksums verified) into --data-home or the user cache.",
)
@click.option(
    "--quick", is_flag=True,
    help="Run the experiment's small configuration (seconds; a smoke test, not a result). "
    "correlated-noise only.",
)
def reproduce(name: str, out_dir: str | None, reps: int | None, seed: int | None,
              data_home: str | None, download: bool, quick: bool) -> None:
    """Run the experiment NAME, writing a CSV and a PNG plot.

    \b
    NAME is one of:
      linear-regression      SSP, AdaSSP and NoisyGD on California housing:
                             median MSE vs epsilon
      noisygd-learning-rate  NoisyGD's sensitivity to its learning rate
      logistic-regression    DP-SGD logistic regression scenarios: test accuracy
      adult                  DP logistic regression on UCI Adult vs non-private
      label-release          PATE and Private kNN on MNIST (needs the MNIST files:
                             --data-home DIR, $PRIVLEARN_DATA, or --download)
      correlated-noise       DP-SGD vs banded vs BLT noise on MNIST (an MLP, learning
                             rates tuned on a validation split; needs the MNIST files
                             and the torch extra; about 15 minutes on two cores,
                             --quick for seconds)
    """
    try:
        from privlearn.experiments import (  # type: ignore[attr-defined]
            DATA_EXPERIMENTS,
            EXPERIMENTS,
            run_experiment,
        )
    except ImportError as e:
        raise click.ClickException(f"the experiments are not available ({e})") from None
    if name not in EXPERIMENTS:
        valid = ", ".join(sorted(EXPERIMENTS))
        raise click.BadParameter(f"must be one of {valid}, got {name!r}", param_hint="'NAME'")
    kwargs: dict[str, Any] = {}
    if out_dir is not None:
        kwargs["out_dir"] = out_dir
    if reps is not None:
        kwargs["reps"] = check_count("--reps", reps, minimum=1)
    if seed is not None:
        kwargs["seed"] = seed
    if data_home is not None or download:
        if name not in DATA_EXPERIMENTS:
            raise click.UsageError(
                f"--data-home/--download apply only to {', '.join(sorted(DATA_EXPERIMENTS))}; "
                f"{name} uses data bundled with privlearn, so drop them"
            )
        if data_home is not None:
            kwargs["data_home"] = data_home
        if download:
            kwargs["download"] = True
    if quick:
        from privlearn.experiments import get_experiment

        if not get_experiment(name).quick:
            with_quick = sorted(n for n in EXPERIMENTS if get_experiment(n).quick)
            raise click.UsageError(
                f"--quick applies only to {', '.join(with_quick)}; {name} has no small "
                "configuration, so drop it (or use --reps 1)")
        kwargs["quick"] = True
    try:
        result = run_experiment(name, **kwargs)
    except ImportError as e:  # an experiment that needs an optional extra (torch)
        missing = click.ClickException(f"{name}: {_one_line(str(e))}")
        missing.exit_code = ExitStatus.USAGE
        raise missing from None
    except FileNotFoundError as e:
        raise click.ClickException(
            f"{name}: {_one_line(str(e)).rstrip('.')}; run again with --data-home DIR "
            "(a directory holding the files) or --download"
        ) from None
    for path in getattr(result, "paths", None) or ():
        click.echo(f"wrote {path}")


# ----------------------------------------------------------------------------------
# privlearn budget: the persistent privacy ledger (privlearn.ledger)
# ----------------------------------------------------------------------------------


def _open_ledger(path: str, *, create: bool = False):
    """The ledger at ``path``; its errors (none there, not a ledger, tampered) are typed
    and reported by :class:`_OneLineErrors`."""
    from privlearn.ledger import Ledger

    return Ledger(path, create=create)


def _spent_json(s) -> dict[str, Any]:
    return {
        "dataset": s.dataset,
        "privacy_unit": s.privacy_unit,
        "epsilon_spent": _none_if_inf(s.epsilon_spent),
        "epsilon_lower": _none_if_inf(s.epsilon_lower),
        "epsilon_budget": s.epsilon_budget,
        "epsilon_remaining": s.epsilon_remaining,
        "delta": s.delta,
        "entries": s.entries,
        "pending": s.pending,
        "accountant": s.accountant,
        "adaptive": s.adaptive,
        "adaptive_epsilon": _none_if_inf(s.adaptive_epsilon),
        "adaptive_order": s.adaptive_order,
        "neighbouring": None if s.neighbouring is None else s.neighbouring.value,
    }


def _relation(r) -> str:
    """A budget's neighbouring relation as the budget commands print it."""
    return "relation not fixed yet" if r is None else r.value


def _print_spent(s) -> None:
    lower = "" if s.epsilon_lower is None else f" (certified lower bound {s.epsilon_lower:.6g})"
    click.echo(f"dataset {s.dataset} ({s.privacy_unit}, {_relation(s.neighbouring)}): "
               f"epsilon spent {s.epsilon_spent:.6g}"
               f"{lower} of {s.epsilon_budget:g} at delta {s.delta:g}, {s.entries} release(s)"
               + (f", {s.pending} pending reservation(s)" if s.pending else ""))
    if s.adaptive:
        click.echo(f"  adaptive rule (Renyi filter, order {s.adaptive_order:.4g}): "
                   f"epsilon {s.adaptive_epsilon:.6g}")


@cli.group()
def budget() -> None:
    """A persistent privacy ledger: one budget per dataset, tight composition of every
    release, hash-chained entries (see docs/guides/ledger.md)."""


_ledger_dataset_opt = click.option("--dataset", required=True, help="Dataset name.")
_unit_opt = click.option("--privacy-unit", default=None,
                         help="Privacy unit of the budget (default: record).")


@budget.command(name="init")
@click.argument("path", type=click.Path(dir_okay=False))
@_ledger_dataset_opt
@click.option("--epsilon", type=float, required=True, help="Budget epsilon (> 0).")
@click.option("--delta", type=float, required=True, help="Budget delta in [0, 1).")
@_unit_opt
@_accountant_opt
@click.option("--adaptive", is_flag=True,
              help="Enforce the cap with a Renyi filter (valid under fully adaptive choice "
              "of releases; admits less than the tight total).")
@click.option("--neighbouring", type=click.Choice(["add_remove", "replace_one"]),
              default=None,
              help="Neighbouring relation of the cap (default: that of the first release). "
              "replace_one also takes add/remove releases, at their replace-one cost.")
def budget_init(path: str, dataset: str, epsilon: float, delta: float,
                privacy_unit: str | None, accountant: str, adaptive: bool,
                neighbouring: str | None) -> None:
    """Create the ledger at PATH (if needed) and set DATASET's budget."""
    led = _open_ledger(path, create=True)
    b = led.create_budget(dataset, epsilon, delta, privacy_unit=privacy_unit,
                          accountant=accountant, adaptive=adaptive, neighbouring=neighbouring)
    click.echo(f"budget for {b.dataset} ({b.privacy_unit}, {_relation(b.neighbouring)}): "
               f"epsilon {b.epsilon:g}, delta {b.delta:g} "
               f"({'adaptive, Renyi filter' if b.adaptive else b.accountant})")


@budget.command(name="spend")
@click.argument("path", type=click.Path(dir_okay=False))
@_ledger_dataset_opt
@_mechanism_opt
@click.option("--noise-multiplier", type=float, required=True, help="Noise multiplier (> 0).")
@_rate_opt
@_sampling_opt
@_steps_opt
@click.option("--label", default=None, help="What was released.")
@click.option("--who", default=None, help="Who spent it (default: user@host).")
@_unit_opt
@_json_opt
def budget_spend(path: str, dataset: str, mechanism: str, noise_multiplier: float,
                 sampling_rate: float | None, sampling: str, steps: int | None,
                 label: str | None, who: str | None, privacy_unit: str | None,
                 as_json: bool) -> None:
    """Record a release on DATASET; refused (status 3, nothing recorded) if it would
    exceed the budget."""
    rate = None if sampling_rate is None else check_rate("--sampling-rate", sampling_rate)
    t = check_count("--steps", 1 if steps is None else steps, minimum=1)
    mech = build_mechanism(mechanism.lower(), check_positive("--noise-multiplier",
                           noise_multiplier), rate, sampling.lower(), t)
    led = _open_ledger(path)
    entry = led.spend(dataset, mech, label=label, who=who, privacy_unit=privacy_unit)
    s = led.spent(dataset, privacy_unit=privacy_unit)
    if as_json:
        click.echo(json.dumps({"seq": entry.seq, "hash": entry.hash, **_spent_json(s)}))
    else:
        click.echo(f"recorded entry {entry.seq}")
        _print_spent(s)


@budget.command(name="show")
@click.argument("path", type=click.Path(dir_okay=False))
@_ledger_dataset_opt
@_unit_opt
@_json_opt
def budget_show(path: str, dataset: str, privacy_unit: str | None, as_json: bool) -> None:
    """What has been spent on DATASET (tight composition, certified bounds)."""
    s = _open_ledger(path).spent(dataset, privacy_unit=privacy_unit)
    if as_json:
        click.echo(json.dumps(_spent_json(s)))
    else:
        _print_spent(s)


@budget.command(name="history")
@click.argument("path", type=click.Path(dir_okay=False))
@_ledger_dataset_opt
@_unit_opt
@_json_opt
def budget_history(path: str, dataset: str, privacy_unit: str | None, as_json: bool) -> None:
    """Every entry of DATASET, oldest first."""
    from privlearn.accounting.serialization import mechanism_to_dict

    led = _open_ledger(path)
    led.budget_info(dataset, privacy_unit=privacy_unit)
    entries = led.history(dataset, privacy_unit=privacy_unit)
    if as_json:
        click.echo(json.dumps([
            {"seq": e.seq, "kind": e.kind, "time": e.time, "label": e.label, "who": e.who,
             "ref": e.ref, "hash": e.hash,
             "mechanism": None if e.mechanism is None else mechanism_to_dict(e.mechanism)}
            for e in entries
        ]))
        return
    for e in entries:
        what = "" if e.mechanism is None else f"  {_describe_mechanism(e.mechanism)}"
        ref = f" (reservation {e.ref})" if e.ref is not None else ""
        click.echo(f"{e.seq:>6}  {e.time}  {e.kind:<7} {e.label or '-'}  [{e.who or '-'}]"
                   f"{ref}{what}")


def _describe_mechanism(m: Mechanism) -> str:
    """A short human-readable description of a mechanism (for ``budget history``)."""
    from privlearn.accounting import Composed, Subsampled

    if isinstance(m, Composed):
        return " + ".join(
            (f"{k} x " if k > 1 else "") + _describe_mechanism(mm) for mm, k in m.parts
        ) or "nothing"
    if isinstance(m, Subsampled):
        return (f"{_describe_mechanism(m.base)} subsampled q={m.rate:g} ({m.scheme.value}, "
                f"{m.neighbouring.value})")
    fields = getattr(m, "__dataclass_fields__", {})
    args = ", ".join(f"{getattr(m, f):g}" if isinstance(getattr(m, f), float)
                     else str(getattr(m, f)) for f in fields if f != "rdp_function")
    return f"{type(m).__name__}({args})"


@budget.command(name="verify")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--expect-head", default=None, metavar="COUNT:HASH",
              help="A head printed earlier by `verify` (kept outside the file): also fail "
              "unless the ledger extends it (detects truncation with the head rewritten).")
def budget_verify(path: str, expect_head: str | None) -> None:
    """Check the hash chain of the ledger at PATH: status 0 when intact, 4 (listing the
    problems) when an entry was edited, removed or the ledger truncated. Every other
    budget command also refuses a ledger that fails this check (status 4)."""
    expected = None
    if expect_head is not None:
        count, _, h = expect_head.partition(":")
        if not count.isdigit() or len(h) != 64:
            raise click.BadParameter(f"must be COUNT:HASH (64 hex digits), got {expect_head!r}",
                                     param_hint="'--expect-head'")
        expected = (int(count), h)
    led = _open_ledger(path)
    report = led.verify(expected_head=expected)
    if report.ok:
        n, h = led.head()
        click.echo(f"ok: {report.entries} entries, hash chain intact; head {n}:{h}")
        return
    for p in report.problems:
        click.echo(f"TAMPERED: {p}", err=True)
    raise click.exceptions.Exit(ExitStatus.LEDGER_TAMPERED)


# ----------------------------------------------------------------------------------
# privlearn audit: empirical privacy audits (privlearn.auditing)
# ----------------------------------------------------------------------------------
_AUDIT_BUGS = ("none", "no-noise", "noise-x0.1", "no-clipping", "rate-x10")
_AUDIT_METHODS = ("one_run", "one_run_fdp")


@cli.group()
def audit() -> None:
    """Empirical privacy audits: train with canaries, bound epsilon from below."""


@audit.command(name="dpsgd")
@click.option("--epsilon", type=float, required=True, help="Target epsilon of the training.")
@click.option("--delta", type=float, required=True, help="Target delta in (0, 1).")
@click.option("--canaries", type=int, default=1000, show_default=True,
              help="Number of canaries (each included with probability 1/2).")
@click.option("--inject-bug", "--bug", "inject_bug", type=click.Choice(_AUDIT_BUGS),
              default="none", show_default=True,
              help="Plant a known defect (self-test of the audit); --bug is an alias.")
@click.option("--method", type=click.Choice(_AUDIT_METHODS), default="one_run",
              show_default=True,
              help="Lower bound: one_run is valid for any (epsilon, delta) claim; "
              "one_run_fdp assumes a Gaussian trade-off curve.")
@click.option("--confidence", type=float, default=0.95, show_default=True)
@click.option("--steps", type=int, default=50, show_default=True, help="DP-SGD steps.")
@click.option("--sampling-rate", type=float, default=0.1, show_default=True,
              help="Poisson sampling rate q in (0, 0.1].")
@click.option("--score", type=click.Choice(("trajectory", "final")), default="trajectory",
              show_default=True, help="Canary score: per-step likelihood ratio or final "
              "movement.")
@click.option("--seed", type=click.IntRange(min=0), default=None,
              help="Seed >= 0 (default: fresh entropy; the seed used is printed, so a run "
              "can be repeated).")
@_json_opt
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Directory for the ROC plot (PNG) and the scores (CSV).")
def audit_dpsgd_cmd(epsilon: float, delta: float, canaries: int, inject_bug: str, method: str,
                    confidence: float, steps: int, sampling_rate: float, score: str,
                    seed: int | None, as_json: bool, out_dir: str | None) -> None:
    """Audit privlearn's DP-SGD engine in one training run.

    Trains logistic regression on synthetic data plus white-box Dirac-gradient canaries
    through privlearn.torch.make_private (noise calibrated to EPSILON, DELTA), then
    prints the accountant's epsilon beside the empirical lower bound. A lower bound above
    the claim is a VIOLATION: the run leaked more than accounted, and the command exits
    with status 5 (after printing its report), so it can gate a CI job; status 0 means no
    violation was found. --inject-bug plants a known defect to show that the audit
    catches it.
    """
    eps = check_positive("--epsilon", epsilon)
    if not 0 < delta < 1:
        raise click.BadParameter(f"must be in (0, 1) (DP-SGD has no delta=0 guarantee), got "
                                 f"{delta!r}; e.g. 1e-5", param_hint="'--delta'")
    d = check_delta("--delta", delta)
    m = check_count("--canaries", canaries, minimum=2)
    check_count("--steps", steps, minimum=1)
    if not 0 < confidence < 1:
        raise click.BadParameter(f"must be in (0, 1), got {confidence!r}",
                                 param_hint="'--confidence'")
    if not 0 < sampling_rate <= 0.1:
        raise click.BadParameter(f"must be in (0, 0.1] (so that rate-x10 stays a rate), got "
                                 f"{sampling_rate!r}", param_hint="'--sampling-rate'")
    try:
        from privlearn.auditing.torch import audit_dpsgd
    except ImportError as e:  # torch missing
        missing = click.ClickException(f"privlearn audit dpsgd needs torch ({e})")
        missing.exit_code = ExitStatus.USAGE
        raise missing from None
    run = audit_dpsgd(epsilon=eps, delta=d, n_canaries=m, bug=inject_bug, steps=steps,
                      sampling_rate=sampling_rate, score=score, method=method,
                      confidence=confidence, seed=seed)
    res = run.result
    paths: list[str] = []
    if out_dir is not None:
        from privlearn.auditing.report import write_report

        paths = write_report(run, out_dir)
    if as_json:
        out = run.to_dict()
        out["files"] = paths
        click.echo(json.dumps(out))
    else:
        _print_audit(run, inject_bug, method, d, m, paths)
    if res.violation:
        raise click.exceptions.Exit(ExitStatus.AUDIT_VIOLATION)


def _print_audit(run, inject_bug: str, method: str, d: float, m: int, paths: list[str]
                 ) -> None:
    res = run.result
    verdict = "VIOLATION" if res.violation else "no violation"
    click.echo(f"planted bug:            {inject_bug}")
    click.echo(f"claimed epsilon:        {res.claimed_epsilon:.4f}  (accountant, delta={d:g}, "
               f"sigma={run.noise_multiplier:.4f}, q={run.sampling_rate:.4f}, "
               f"{run.steps} steps)")
    click.echo(f"epsilon lower bound:    {res.epsilon_lower_bound:.4f}  ({method}, "
               f"{res.confidence:.0%} confidence, {m} canaries, AUC {res.auc:.3f})")
    click.echo(f"verdict:                {verdict}")
    click.echo(f"seed:                   {res.seed}  (--seed {res.seed} repeats this run)")
    for path in paths:
        click.echo(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``privlearn`` console script (exits with the status code)."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="privlearn")


if __name__ == "__main__":  # pragma: no cover
    main()
