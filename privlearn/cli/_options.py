"""Options shared by the commands, and the mechanism and schedule they describe."""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, TypeVar

import click

from privlearn._validation import (
    check_count,
    check_delta,
    check_gaussian_delta,
    check_rate,
)
from privlearn.accounting import (
    Gaussian,
    Laplace,
    Mechanism,
    compose,
    planned_steps,
    subsample,
    warn_if_delta_large,
)
from privlearn.cli._app import one_line
from privlearn.errors import ParameterValueError, UnsupportedMechanismError

__all__ = ["build_mechanism", "explain_unsupported", "unsupported", "MECHANISMS",
           "SAMPLINGS", "check_sampling_has_rate", "stacked", "schedule_opts", "RunOptions",
           "run_options", "relation_line"]

_F = TypeVar("_F", bound=Callable[..., Any])

MECHANISMS = ("gaussian", "laplace")
SAMPLINGS = ("poisson", "fixed")

#: One-line descriptions of the built-in accountants for ``--help``; the list of names
#: itself comes from the registry (:func:`privlearn.accounting.available_accountants`).
_ACCOUNTANT_HELP = {
    "pld": "privacy loss distributions (certified upper and lower bounds)",
    "rdp": "Renyi DP (a looser upper bound, always available)",
    "analytic": "exact, Gaussian compositions without subsampling only",
}


def _accountant_names() -> list[str]:
    """Accountant names as the registry lists them (``available_accountants``)."""
    import privlearn.accounting

    return list(privlearn.accounting.available_accountants())


class _AccountantChoice(click.Choice):
    """The accountants registered when the command runs (also those registered after
    this module was imported)."""

    def __init__(self) -> None:
        super().__init__(_accountant_names(), case_sensitive=False)

    @property  # type: ignore[override]
    def choices(self) -> list[str]:
        return _accountant_names()

    @choices.setter
    def choices(self, value: object) -> None:  # set by click.Choice.__init__
        pass


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


def schedule(
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
        note = (f"sampling rate = {b}/{n}; steps = {e} epoch{'' if e == 1 else 's'} x "
                f"{total // e} steps per "
                f"epoch (round({n} / {b})) = {total}, the steps "
                "privlearn.torch.make_private's loader runs")
        return q, total, note
    rate = None if sampling_rate is None else check_rate("--sampling-rate", sampling_rate)
    t = check_count("--steps", 1 if steps is None else steps, minimum=1)
    return rate, t, ""


def _warn_delta(delta: float, dataset_size: int | None, name: str = "--delta") -> None:
    """Print :func:`privlearn.accounting.warn_if_delta_large`'s warning (delta >= 1/n) on
    stderr as ``warning: ...``, naming the delta ``name``; the command goes on."""
    if dataset_size is None:
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_if_delta_large(delta, dataset_size, name=name)
    for w in caught:
        click.echo(f"warning: {one_line(str(w.message))}", err=True)


def check_out_dir(out_dir: str, option: str = "--out") -> str:
    """Create the output directory ``out_dir`` if needed and check that a file can be
    written in it, before any work (a read-only file system, a directory of another
    user), as a usage error naming ``option``."""
    import tempfile

    try:
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as exc:
        raise click.BadParameter(
            f"cannot write in the directory {out_dir!r} ({exc.strerror or exc}); pass a "
            "directory you may write in", param_hint=f"'{option}'") from None
    return out_dir


def run_json(rate: float | None, sampling: str, steps: int) -> dict[str, Any]:
    """The schedule's fields of the ``--json`` objects of ``epsilon`` and ``calibrate``."""
    return {"sampling_rate": rate, "sampling": sampling if rate is not None else None,
            "steps": steps}


def none_if_inf(x: float | None) -> float | str | None:
    if x is None:
        return None
    return x if math.isfinite(x) else "inf"


mechanism_opt = click.option(
    "--mechanism",
    type=click.Choice(MECHANISMS, case_sensitive=False),
    default="gaussian",
    show_default=True,
    help="Base mechanism (noise multiplier = Gaussian std / L2 sensitivity, or Laplace "
    "scale / L1 sensitivity).",
)
rate_opt = click.option(
    "--sampling-rate",
    type=float,
    default=None,
    help="Subsampling rate in (0, 1] (default: no subsampling).",
)
sampling_opt = click.option(
    "--sampling",
    type=click.Choice(SAMPLINGS, case_sensitive=False),
    default="poisson",
    show_default=True,
    help="Subsampling scheme: Poisson (add/remove-one) or fixed-size without replacement "
    "(replace-one).",
)


def check_sampling_has_rate(ctx: click.Context, rate: float | None, *,
                            epoch_form: bool = False) -> None:
    """Refuse ``--sampling`` given on the command line without a sampling rate: the scheme
    describes subsampling, and without ``--sampling-rate`` there is none, so the option
    would be silently ignored (the release counted without subsampling). ``epoch_form``:
    the command also takes the rate as ``--batch-size``/``--dataset-size``/``--epochs``."""
    source = ctx.get_parameter_source("sampling")
    if rate is None and source is click.core.ParameterSource.COMMANDLINE:
        rate_from = ("--sampling-rate (the subsampling rate in (0, 1]) or --batch-size, "
                     "--dataset-size and --epochs" if epoch_form else
                     "--sampling-rate (the subsampling rate in (0, 1])")
        raise click.UsageError(
            f"--sampling {ctx.params['sampling']} needs {rate_from}; without a rate the "
            "release is counted without subsampling, so drop --sampling or pass e.g. "
            "--sampling-rate 0.01", ctx=ctx)


steps_opt = click.option(
    "--steps", type=int, default=None, help="Number of compositions (integer; default 1)."
)
batch_opt = click.option(
    "--batch-size", type=int, default=None,
    help="Expected batch size B; with --dataset-size N and --epochs E instead of "
    "--sampling-rate/--steps: sampling rate B/N and steps E x round(N/B), the steps "
    "privlearn.torch.make_private's loader runs.",
)
dataset_opt = click.option(
    "--dataset-size", type=int, default=None,
    help="Number of training examples N (a delta of 1/N or more is warned about: --delta, "
    "or for budget spend the budget's delta); for "
    "a user-level run (make_private(..., users=...)), the number of users, with "
    "--batch-size the expected users per batch.",
)
epochs_opt = click.option("--epochs", type=int, default=None, help="Number of epochs E.")
delta_opt = click.option("--delta", type=float, required=True, help="Target delta in [0, 1).")
accountant_opt = click.option(
    "--accountant",
    type=_AccountantChoice(),
    default="pld",
    show_default=True,
    help="; ".join(f"{name}: {_ACCOUNTANT_HELP.get(name, 'registered accountant')}"
                   for name in _accountant_names()) + ".",
)


def json_option(text: str = "Print one JSON object.") -> Callable[[_F], _F]:
    """The ``--json`` flag, with ``text`` (its help) saying what it prints (one object, or
    a list)."""
    return click.option("--json", "as_json", is_flag=True, help=text)


json_opt = json_option()


def stacked(*decorators: Callable[[_F], _F]) -> Callable[[_F], _F]:
    """One decorator applying ``decorators`` as if stacked above a function in this
    order (the first one outermost), so that a group of options shared by several
    commands is written once and lists in ``--help`` in the same order everywhere."""

    def apply(f: _F) -> _F:
        for decorator in reversed(decorators):
            f = decorator(f)
        return f

    return apply


#: The run's schedule: ``--sampling-rate``, ``--sampling`` and ``--steps``, or
#: ``--batch-size``, ``--dataset-size`` and ``--epochs`` (read by :func:`run_options`).
schedule_opts = stacked(rate_opt, sampling_opt, steps_opt, batch_opt, dataset_opt, epochs_opt)


class RunOptions(NamedTuple):
    """The run the mechanism and schedule options describe, checked (:func:`run_options`)."""

    mechanism: str
    sampling_rate: float | None
    sampling: str
    steps: int
    note: str


def run_options(
    mechanism: str,
    sampling: str,
    sampling_rate: float | None,
    steps: int | None,
    batch_size: int | None = None,
    dataset_size: int | None = None,
    epochs: int | None = None,
    *,
    epoch_form: bool,
) -> RunOptions:
    """``--mechanism``, ``--sampling`` and the schedule options checked as every command
    that builds a mechanism from them checks them: the rate and steps by
    :func:`schedule`, then ``--sampling`` refused without a rate
    (:func:`check_sampling_has_rate`; ``epoch_form``: the command also takes the rate as
    ``--batch-size``/``--dataset-size``/``--epochs``); names in lower case."""
    rate, t, note = schedule(sampling_rate, steps, batch_size, dataset_size, epochs)
    check_sampling_has_rate(click.get_current_context(), rate, epoch_form=epoch_form)
    return RunOptions(mechanism.lower(), rate, sampling.lower(), t, note)


def check_mechanism_delta(mechanism: str, delta: float, dataset_size: int | None) -> float:
    """``--delta`` for ``--mechanism``: in [0, 1), positive for Gaussian noise (no pure-DP
    guarantee), and warned about when it is at least 1 / ``--dataset-size``."""
    if mechanism == "gaussian":
        d = check_gaussian_delta("--delta", delta, pure_dp_alternative="--mechanism laplace")
    else:
        d = check_delta("--delta", delta)
    _warn_delta(d, dataset_size)
    return d


def relation_line(mechanism: Mechanism) -> str:
    """The neighbouring relation ``mechanism``'s epsilon holds under, in words, for the
    text output of ``epsilon`` and ``calibrate`` (fixed-size batches cost more than Poisson
    ones at the same noise: the numbers differ by the relation, not by a mistake)."""
    from privlearn.accounting.registry import stated_relations

    relations = sorted(r.value for r in stated_relations(mechanism))
    if relations == ["replace_one"]:
        return ("neighbouring: replace_one (datasets of one size that differ in one "
                "record; a replaced record moves a step by up to twice the sensitivity, so "
                "the same noise costs more than under add_remove, the relation of "
                "--sampling poisson)")
    if relations == ["add_remove"]:
        return "neighbouring: add_remove (datasets that differ by one record added or removed)"
    return f"neighbouring: {', '.join(relations)}"


def describe(mechanism: str, nm: float | None, rate: float | None, sampling: str,
              steps: int) -> str:
    noise = "" if nm is None else f", noise multiplier {nm:g}"
    samp = "no subsampling" if rate is None else f"{sampling} sampling at rate {rate:.6g}"
    return f"{mechanism}{noise}, {samp}, {steps} step{'s' if steps != 1 else ''}"


def unsupported(subject: str, accountant: str, err: BaseException, mechanism: str,
                nm: float | None, rate: float | None, sampling: str,
                steps: int) -> UnsupportedMechanismError:
    """An accountant's refusal of the mechanism (UnsupportedMechanismError) said in the
    command's words: ``subject`` (what chose the accountant), the run as the options
    described it and what the accountant covers (its ``--help`` line), instead of the
    library's message, which names the mechanism objects."""
    scope = _ACCOUNTANT_HELP.get(accountant)
    return UnsupportedMechanismError(
        f"{subject} cannot account {describe(mechanism, nm, rate, sampling, steps)}"
        + (f" ({accountant}: {scope})" if scope else f": {one_line(str(err))}"))


@contextlib.contextmanager
def explain_unsupported(accountant: str, mechanism: str, nm: float | None,
                        rate: float | None, sampling: str, steps: int) -> Iterator[None]:
    """:func:`unsupported` for an accountant chosen by ``--accountant``."""
    try:
        yield
    except UnsupportedMechanismError as e:
        raise unsupported(f"--accountant {accountant}", accountant, e, mechanism, nm, rate,
                          sampling, steps) from e
