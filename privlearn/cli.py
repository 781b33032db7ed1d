"""Command line interface: a thin layer over :mod:`privlearn.accounting`.

Commands
--------
``privlearn epsilon``    certified epsilon of a (subsampled, composed) Gaussian/Laplace
``privlearn calibrate``  smallest noise multiplier meeting an (epsilon, delta) target
``privlearn demo``       seed 001's accounting table (and a short experiment if present)
``privlearn reproduce``  run one of the seeds' experiments
``privlearn audit dpsgd`` empirical privacy audit of the DP-SGD engine (canaries)

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


# ---------------------------------------------------------------------------- audit (issue 10)
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
@click.option("--inject-bug", type=click.Choice(_AUDIT_BUGS), default="none", show_default=True,
              help="Plant a known defect (self-test of the audit).")
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
@click.option("--seed", type=int, default=None, help="Seed (default: fresh entropy).")
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
    the claim is a VIOLATION: the run leaked more than accounted. --inject-bug plants a
    known defect to show that the audit catches it.
    """
    eps = check_positive("--epsilon", epsilon)
    d = check_delta("--delta", delta)
    if d == 0:
        raise click.BadParameter("must be in (0, 1) (DP-SGD has no delta=0 guarantee), "
                                 "got 0", param_hint="'--delta'")
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
        raise click.ClickException(f"privlearn audit dpsgd needs torch ({e})") from None
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
        return
    verdict = "VIOLATION" if res.violation else "no violation"
    click.echo(f"planted bug:            {inject_bug}")
    click.echo(f"claimed epsilon:        {res.claimed_epsilon:.4f}  (accountant, delta={d:g}, "
               f"sigma={run.noise_multiplier:.4f}, q={run.sampling_rate:.4f}, "
               f"{run.steps} steps)")
    click.echo(f"epsilon lower bound:    {res.epsilon_lower_bound:.4f}  ({method}, "
               f"{res.confidence:.0%} confidence, {m} canaries, AUC {res.auc:.3f})")
    click.echo(f"verdict:                {verdict}")
    for path in paths:
        click.echo(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``privlearn`` console script (exits with the status code)."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="privlearn")


if __name__ == "__main__":  # pragma: no cover
    main()
