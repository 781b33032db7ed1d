"""``privlearn audit``: empirical privacy audits (:mod:`privlearn.auditing`)."""

from __future__ import annotations

import json
import warnings

import click

from privlearn._validation import check_count, check_delta, check_positive
from privlearn.auditing.harness import MAX_AUDIT_STEPS, MAX_CANARIES, check_audit_steps
from privlearn.cli._app import ExitStatus, cli, one_line
from privlearn.cli._options import check_out_dir, json_opt

__all__ = ["audit"]


_AUDIT_BUGS = ("none", "no-noise", "noise-x0.1", "no-clipping", "rate-x10",
               "noise-reused")
_AUDIT_METHODS = ("one_run", "one_run_fdp")


@cli.group()
def audit() -> None:
    """Empirical privacy audits: train with canaries, bound epsilon from below."""


@audit.command(name="dpsgd")
@click.option("--epsilon", type=float, required=True, help="Target epsilon of the training.")
@click.option("--delta", type=float, required=True, help="Target delta in (0, 1).")
@click.option("--canaries", type=click.IntRange(min=2, max=MAX_CANARIES), default=1000,
              show_default=True,
              help=f"Number of canaries in [2, {MAX_CANARIES:_}] (each included with "
              "probability 1/2).")
@click.option("--inject-bug", "--bug", "inject_bug", type=click.Choice(_AUDIT_BUGS),
              default="none", show_default=True,
              help="Plant a known defect (self-test of the audit); --bug is an alias.")
@click.option("--method", type=click.Choice(_AUDIT_METHODS), default="one_run",
              show_default=True,
              help="Lower bound: one_run is valid for any (epsilon, delta) claim; "
              "one_run_fdp assumes a Gaussian trade-off curve.")
@click.option("--confidence", type=float, default=0.95, show_default=True,
              help="Confidence level in (0, 1) of the empirical lower bound.")
@click.option("--steps", type=int, default=50, show_default=True,
              help=f"DP-SGD steps, in [1, {MAX_AUDIT_STEPS:_}] (the audit trains each one).")
@click.option("--sampling-rate", type=float, default=0.1, show_default=True,
              help="Poisson sampling rate q in (0, 0.1].")
@click.option("--score", type=click.Choice(("trajectory", "final", "increments")),
              default="trajectory", show_default=True,
              help="Canary score: per-step likelihood ratio, final movement, or squared "
              "changes of the per-step movement (catches noise reused across steps).")
@click.option("--seed", type=click.IntRange(min=0, max=2**64 - 1), default=None,
              help="Seed in [0, 2**64) (default: fresh entropy; the seed used is printed, so "
              "a run can be repeated).")
@click.option("--progress/--no-progress", "show_progress", default=None,
              help="A progress bar of the training steps on standard error (default: when "
              "standard error is a terminal).")
@json_opt
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Directory for the ROC plot (PNG) and the scores (CSV).")
def audit_dpsgd_cmd(epsilon: float, delta: float, canaries: int, inject_bug: str, method: str,
                    confidence: float, steps: int, sampling_rate: float, score: str,
                    seed: int | None, show_progress: bool | None, as_json: bool,
                    out_dir: str | None) -> None:
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
    steps = check_audit_steps("--steps", steps)
    if not 0 < confidence < 1:
        raise click.BadParameter(f"must be in (0, 1), got {confidence!r}",
                                 param_hint="'--confidence'")
    if not 0 < sampling_rate <= 0.1:
        raise click.BadParameter(f"must be in (0, 0.1] (so that rate-x10 stays a rate), got "
                                 f"{sampling_rate!r}", param_hint="'--sampling-rate'")
    if out_dir is not None:  # before training: a directory that cannot be written fails now
        check_out_dir(out_dir)
    try:
        from privlearn.auditing.torch import audit_dpsgd
    except ImportError as e:  # torch missing
        missing = click.ClickException(f"privlearn audit dpsgd needs torch ({e})")
        missing.exit_code = ExitStatus.USAGE
        raise missing from None
    with warnings.catch_warnings(record=True) as caught:  # e.g. a claim no outcome refutes
        warnings.simplefilter("default")
        run = audit_dpsgd(epsilon=eps, delta=d, n_canaries=m, bug=inject_bug, steps=steps,
                          sampling_rate=sampling_rate, score=score, method=method,
                          confidence=confidence, seed=seed, show_progress=show_progress)
    for w in caught:
        click.echo(f"warning: {one_line(str(w.message))}", err=True)
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
               f"noise_multiplier={run.noise_multiplier:.4f}, "
               f"sampling_rate={run.sampling_rate:.4f}, "
               f"{run.steps} steps)")
    click.echo(f"epsilon lower bound:    {res.epsilon_lower_bound:.4f}  ({method}, "
               f"{res.confidence:.0%} confidence, {m} canaries, AUC {res.auc:.3f})")
    click.echo(f"verdict:                {verdict}")
    click.echo(f"seed:                   {res.seed}  (--seed {res.seed} repeats this run)")
    for path in paths:
        click.echo(f"wrote {path}")


