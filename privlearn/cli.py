"""Command line interface: a thin layer over :mod:`privlearn.accounting`.

Commands
--------
``privlearn epsilon``    certified epsilon of a (subsampled, composed) Gaussian/Laplace
``privlearn calibrate``  smallest noise multiplier meeting an (epsilon, delta) target
``privlearn demo``       seed 001's accounting table (and a short experiment if present)
``privlearn reproduce``  run one of the seeds' experiments
``privlearn budget``     a persistent privacy ledger (init, spend, show, history, verify)

Every error caused by the input (a bad value, an unknown choice, an unreachable target,
a failed numerical certification) is reported as ONE line ``error: ...`` on stderr with
exit status 2, never as a traceback.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from typing import Any

import click

from privlearn import __version__
from privlearn.accounting import (
    AccountingError,
    Gaussian,
    Laplace,
    Mechanism,
    calibrate,
    compose,
    subsample,
)
from privlearn.accounting._validation import (
    check_count,
    check_delta,
    check_positive,
    check_rate,
)

__all__ = ["cli", "main", "build_mechanism"]

MECHANISMS = ("gaussian", "laplace")
ACCOUNTANTS = ("pld", "rdp", "analytic")
SAMPLINGS = ("poisson", "fixed")


def build_mechanism(
    mechanism: str,
    noise_multiplier: float,
    sampling_rate: float | None = None,
    sampling: str = "poisson",
    steps: int = 1,
) -> Mechanism:
    """The privlearn mechanism the ``epsilon``/``calibrate`` options describe:
    ``compose(subsample(Base(noise_multiplier), sampling_rate, sampling), steps)``
    (no subsampling when ``sampling_rate`` is None or 1 with Poisson sampling)."""
    base_cls = {"gaussian": Gaussian, "laplace": Laplace}[mechanism]
    m: Mechanism = base_cls(noise_multiplier)
    if sampling_rate is not None:
        m = subsample(m, sampling_rate, scheme=sampling)
    return compose(m, steps=steps)


def _validated(
    sampling_rate: float | None, steps: float, delta: float
) -> tuple[float | None, int, float]:
    rate = None if sampling_rate is None else check_rate("--sampling-rate", sampling_rate)
    t = check_count("--steps", steps, minimum=1)
    d = check_delta("--delta", delta)
    return rate, t, d


def _none_if_inf(x: float | None) -> float | str | None:
    if x is None:
        return None
    return x if math.isfinite(x) else "inf"


class _OneLineErrors(click.Group):
    """A click group that reports every input error as one ``error: ...`` line on
    stderr with exit status 2 (usage errors included), and no traceback."""

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
            code = 2
        except click.ClickException as e:
            click.echo(f"error: {_one_line(e.format_message())}", err=True)
            code = e.exit_code
        except (ValueError, AccountingError) as e:
            click.echo(f"error: {_one_line(str(e))}", err=True)
            code = 2
        if standalone_mode:
            sys.exit(code)
        return code


def _one_line(msg: str) -> str:
    return " ".join(msg.split())


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="privlearn")
def cli() -> None:
    """privlearn: differentially private learning with certified privacy accounting."""


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
    "--steps", type=float, default=1, show_default=True, help="Number of compositions (integer)."
)
_delta_opt = click.option("--delta", type=float, required=True, help="Target delta in [0, 1).")
_accountant_opt = click.option(
    "--accountant",
    type=click.Choice(ACCOUNTANTS, case_sensitive=False),
    default="pld",
    show_default=True,
    help="pld: privacy loss distributions; rdp: Renyi DP; analytic: exact, Gaussian "
    "compositions without subsampling only.",
)
_json_opt = click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")


@cli.command()
@_mechanism_opt
@click.option("--noise-multiplier", type=float, required=True, help="Noise multiplier (> 0).")
@_rate_opt
@_sampling_opt
@_steps_opt
@_delta_opt
@_accountant_opt
@_json_opt
def epsilon(
    mechanism: str,
    noise_multiplier: float,
    sampling_rate: float | None,
    sampling: str,
    steps: float,
    delta: float,
    accountant: str,
    as_json: bool,
) -> None:
    """Certified epsilon of a (subsampled) mechanism composed STEPS times.

    With --json: one object with epsilon (certified upper bound), epsilon_lower (null
    when the accountant has no lower bound), delta, accountant and the mechanism's
    parameters; an infinite epsilon is written as the string "inf".
    """
    nm = check_positive("--noise-multiplier", noise_multiplier)
    rate, t, d = _validated(sampling_rate, steps, delta)
    mech = build_mechanism(mechanism.lower(), nm, rate, sampling.lower(), t)
    bound = mech.epsilon_bounds(d, accountant.lower())
    if as_json:
        out = {
            "epsilon": _none_if_inf(bound.upper),
            "epsilon_lower": _none_if_inf(bound.lower),
            "delta": d,
            "accountant": bound.accountant or accountant.lower(),
            "mechanism": mechanism.lower(),
            "noise_multiplier": nm,
            "sampling_rate": rate,
            "sampling": sampling.lower() if rate is not None else None,
            "steps": t,
        }
        click.echo(json.dumps(out))
    else:
        click.echo(repr(bound.upper))


@cli.command(name="calibrate")
@_mechanism_opt
@click.option("--target-epsilon", type=float, required=True, help="Target epsilon (> 0).")
@_delta_opt
@_rate_opt
@_sampling_opt
@_steps_opt
@_accountant_opt
@_json_opt
def calibrate_cmd(
    mechanism: str,
    target_epsilon: float,
    delta: float,
    sampling_rate: float | None,
    sampling: str,
    steps: float,
    accountant: str,
    as_json: bool,
) -> None:
    """Smallest noise multiplier whose epsilon(delta) meets the target (rounded up)."""
    target = check_positive("--target-epsilon", target_epsilon)
    rate, t, d = _validated(sampling_rate, steps, delta)
    kind, samp, acc = mechanism.lower(), sampling.lower(), accountant.lower()

    def factory(x: float) -> Mechanism:
        return build_mechanism(kind, x, rate, samp, t)

    nm = calibrate(factory, target, d, accountant=acc)
    achieved = factory(nm).epsilon(d, acc)
    if as_json:
        out = {
            "noise_multiplier": nm,
            "epsilon": achieved,
            "target_epsilon": target,
            "delta": d,
            "accountant": acc,
            "mechanism": kind,
            "sampling_rate": rate,
            "sampling": samp if rate is not None else None,
            "steps": t,
        }
        click.echo(json.dumps(out))
    else:
        click.echo(repr(nm))


@cli.command()
@click.option(
    "--no-experiment", is_flag=True, help="Print only the accounting table (skip the experiment)."
)
def demo(no_experiment: bool) -> None:
    """Seed 001's accounting table recomputed with privlearn (and a short experiment)."""
    from privlearn.demo import main as demo_main

    demo_main(experiment=not no_experiment, echo=click.echo)


@cli.command()
@click.argument("name")
@click.option(
    "--out", "out_dir", type=click.Path(file_okay=False), default=None, help="Output directory."
)
@click.option("--reps", type=int, default=None, help="Number of repetitions.")
@click.option("--seed", type=int, default=None, help="Random seed.")
def reproduce(name: str, out_dir: str | None, reps: int | None, seed: int | None) -> None:
    """Run the seeds' experiment NAME, writing a CSV and a PNG plot.

    \b
    NAME is one of:
      linear-regression      seed 000: median MSE vs epsilon (SSP, AdaSSP, NoisyGD)
      noisygd-learning-rate  seed 000: NoisyGD learning-rate sensitivity
      logistic-regression    seed 002: DP-SGD scenario table, repeated seeds
      adult                  DP logistic regression on Adult vs non-private
      label-release          PATE and Private kNN on MNIST
    """
    try:
        from privlearn.experiments import EXPERIMENTS, run_experiment  # type: ignore[attr-defined]
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
    result = run_experiment(name, **kwargs)
    for path in getattr(result, "paths", None) or ():
        click.echo(f"wrote {path}")


# ----------------------------------------------------------------------------------
# privlearn budget: the persistent privacy ledger (privlearn.ledger)
# ----------------------------------------------------------------------------------


class _BudgetError(click.ClickException):
    exit_code = 2


def _open_ledger(path: str, must_exist: bool = True):
    import os

    from privlearn.ledger import Ledger

    if must_exist and not os.path.exists(path):
        raise _BudgetError(f"no ledger at {path}; create one with `privlearn budget init`")
    import sqlite3

    try:
        return Ledger(path)
    except sqlite3.Error as e:
        raise _BudgetError(f"{path} is not a readable privacy ledger ({e})") from None


def _ledger_call(fn, *args, **kwargs):
    from privlearn.errors import BudgetExceededError
    from privlearn.ledger import LedgerIntegrityError

    try:
        return fn(*args, **kwargs)
    except (BudgetExceededError, LedgerIntegrityError) as e:
        raise _BudgetError(_one_line(str(e))) from None
    except KeyError as e:
        raise _BudgetError(_one_line(str(e.args[0]) if e.args else str(e))) from None


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
    }


def _print_spent(s) -> None:
    lower = "" if s.epsilon_lower is None else f" (certified lower bound {s.epsilon_lower:.6g})"
    click.echo(f"dataset {s.dataset} ({s.privacy_unit}): epsilon spent {s.epsilon_spent:.6g}"
               f"{lower} of {s.epsilon_budget:g} at delta {s.delta:g}, {s.entries} release(s)"
               + (f", {s.pending} pending reservation(s)" if s.pending else ""))
    if s.adaptive:
        click.echo(f"  adaptive rule (Renyi filter, order {s.adaptive_order:.4g}): "
                   f"epsilon {s.adaptive_epsilon:.6g}")


@cli.group()
def budget() -> None:
    """A persistent privacy ledger: one budget per dataset, tight composition of every
    release, hash-chained entries (see docs/budgeting.md)."""


_dataset_opt = click.option("--dataset", required=True, help="Dataset name.")
_unit_opt = click.option("--privacy-unit", default=None,
                         help="Privacy unit of the budget (default: record).")


@budget.command(name="init")
@click.argument("path", type=click.Path(dir_okay=False))
@_dataset_opt
@click.option("--epsilon", type=float, required=True, help="Budget epsilon (> 0).")
@click.option("--delta", type=float, required=True, help="Budget delta in [0, 1).")
@_unit_opt
@_accountant_opt
@click.option("--adaptive", is_flag=True,
              help="Enforce the cap with a Renyi filter (valid under fully adaptive choice "
              "of releases; admits less than the tight total).")
def budget_init(path: str, dataset: str, epsilon: float, delta: float,
                privacy_unit: str | None, accountant: str, adaptive: bool) -> None:
    """Create the ledger at PATH (if needed) and set DATASET's budget."""
    led = _open_ledger(path, must_exist=False)
    b = _ledger_call(led.create_budget, dataset, epsilon, delta, privacy_unit=privacy_unit,
                     accountant=accountant, adaptive=adaptive)
    click.echo(f"budget for {b.dataset} ({b.privacy_unit}): epsilon {b.epsilon:g}, "
               f"delta {b.delta:g} ({'adaptive, Renyi filter' if b.adaptive else b.accountant})")


@budget.command(name="spend")
@click.argument("path", type=click.Path(dir_okay=False))
@_dataset_opt
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
                 sampling_rate: float | None, sampling: str, steps: float, label: str | None,
                 who: str | None, privacy_unit: str | None, as_json: bool) -> None:
    """Record a release on DATASET; refused (status 2, nothing recorded) if it would
    exceed the budget."""
    rate = None if sampling_rate is None else check_rate("--sampling-rate", sampling_rate)
    t = check_count("--steps", steps, minimum=1)
    mech = build_mechanism(mechanism.lower(), check_positive("--noise-multiplier",
                           noise_multiplier), rate, sampling.lower(), t)
    led = _open_ledger(path)
    entry = _ledger_call(led.spend, dataset, mech, label=label, who=who,
                         privacy_unit=privacy_unit)
    s = led.spent(dataset, privacy_unit=privacy_unit)
    if as_json:
        click.echo(json.dumps({"seq": entry.seq, "hash": entry.hash, **_spent_json(s)}))
    else:
        click.echo(f"recorded entry {entry.seq}")
        _print_spent(s)


@budget.command(name="show")
@click.argument("path", type=click.Path(dir_okay=False))
@_dataset_opt
@_unit_opt
@_json_opt
def budget_show(path: str, dataset: str, privacy_unit: str | None, as_json: bool) -> None:
    """What has been spent on DATASET (tight composition, certified bounds)."""
    led = _open_ledger(path)
    s = _ledger_call(led.spent, dataset, privacy_unit=privacy_unit)
    if as_json:
        click.echo(json.dumps(_spent_json(s)))
    else:
        _print_spent(s)


@budget.command(name="history")
@click.argument("path", type=click.Path(dir_okay=False))
@_dataset_opt
@_unit_opt
@_json_opt
def budget_history(path: str, dataset: str, privacy_unit: str | None, as_json: bool) -> None:
    """Every entry of DATASET, oldest first."""
    from privlearn.accounting.serialization import mechanism_to_dict

    led = _open_ledger(path)
    _ledger_call(led.budget_info, dataset, privacy_unit=privacy_unit)
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
        what = "" if e.mechanism is None else f"  {_describe(e.mechanism)}"
        ref = f" (reservation {e.ref})" if e.ref is not None else ""
        click.echo(f"{e.seq:>6}  {e.time}  {e.kind:<7} {e.label or '-'}  [{e.who or '-'}]"
                   f"{ref}{what}")


def _describe(m: Mechanism) -> str:
    """A short human-readable description of a mechanism (for ``budget history``)."""
    from privlearn.accounting import Composed, Subsampled

    if isinstance(m, Composed):
        return " + ".join(
            (f"{k} x " if k > 1 else "") + _describe(mm) for mm, k in m.parts
        ) or "nothing"
    if isinstance(m, Subsampled):
        return (f"{_describe(m.base)} subsampled q={m.rate:g} ({m.scheme.value}, "
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
    """Check the hash chain of the ledger at PATH: status 0 when intact, 1 when an entry
    was edited, removed or the ledger truncated."""
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
    sys.exit(1)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``privlearn`` console script (exits with the status code)."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="privlearn")


if __name__ == "__main__":  # pragma: no cover
    main()
