"""``privlearn epsilon`` and ``privlearn calibrate``: the accountants on the command line."""

from __future__ import annotations

import json
import math

import click

from privlearn._validation import check_positive
from privlearn.accounting import Mechanism, calibrate
from privlearn.cli._app import cli, one_line
from privlearn.cli._options import (
    accountant_opt,
    build_mechanism,
    check_mechanism_delta,
    delta_opt,
    describe,
    explain_unsupported,
    json_opt,
    mechanism_opt,
    none_if_inf,
    relation_line,
    run_json,
    run_options,
    schedule_opts,
)
from privlearn.errors import AccountingError, CalibrationError, PrivacyLossOverflowError

__all__ = ["epsilon", "calibrate_cmd"]


@cli.command()
@mechanism_opt
@click.option("--noise-multiplier", type=float, required=True, help="Noise multiplier (> 0).")
@schedule_opts
@delta_opt
@accountant_opt
@json_opt
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
    kind, rate, samp, t, note = run_options(mechanism, sampling, sampling_rate, steps,
                                            batch_size, dataset_size, epochs, epoch_form=True)
    acc = accountant.lower()
    d = check_mechanism_delta(kind, delta, dataset_size)
    m = build_mechanism(kind, nm, rate, samp, t)
    try:
        with explain_unsupported(acc, kind, nm, rate, samp, t):
            bound = m.epsilon_bounds(d, acc)
    except PrivacyLossOverflowError as e:  # the run as the options describe it, not the
        # accountant's reduced form (e.g. the one Gaussian of a composition's noise)
        raise PrivacyLossOverflowError(
            f"epsilon of {describe(kind, nm, rate, samp, t)} at delta={d:g} cannot be "
            f"represented ({acc} accountant: {one_line(str(e))})") from e
    if not math.isfinite(bound.upper):
        raise PrivacyLossOverflowError(
            f"epsilon is infinite for {describe(kind, nm, rate, samp, t)} at delta={d:g} "
            f"({acc} accountant)"
        )
    if as_json:
        out = {
            "epsilon": none_if_inf(bound.upper),
            "epsilon_lower": none_if_inf(bound.lower),
            "delta": d,
            "accountant": bound.accountant or acc,
            "mechanism": kind,
            "noise_multiplier": nm,
            **run_json(rate, samp, t),
        }
        click.echo(json.dumps(out))
        return
    click.echo(f"epsilon: {bound.upper!r} (certified upper bound, "
               f"{bound.accountant or acc} accountant)")
    if bound.lower is not None:
        click.echo(f"epsilon lower bound: {bound.lower!r} (the exact epsilon of this "
                   "mechanism is at least this)")
    click.echo(f"delta: {d:g}")
    click.echo(f"mechanism: {describe(kind, nm, rate, samp, t)}")
    click.echo(relation_line(m))
    if note:
        click.echo(f"schedule: {note}")


@cli.command(name="calibrate")
@mechanism_opt
@click.option("--target-epsilon", type=float, required=True, help="Target epsilon (> 0).")
@delta_opt
@schedule_opts
@accountant_opt
@json_opt
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
    and --epochs. With --json: one object with noise_multiplier, epsilon (the certified
    upper bound at that noise), epsilon_lower (a lower bound on the exact epsilon at that
    noise, null when the accountant has none; the same keys as ``privlearn epsilon
    --json``), target_epsilon, delta, accountant and the mechanism's parameters.
    """
    target = check_positive("--target-epsilon", target_epsilon)
    kind, rate, samp, t, note = run_options(mechanism, sampling, sampling_rate, steps,
                                            batch_size, dataset_size, epochs, epoch_form=True)
    acc = accountant.lower()
    d = check_mechanism_delta(kind, delta, dataset_size)

    def factory(x: float) -> Mechanism:
        return build_mechanism(kind, x, rate, samp, t)

    try:
        with explain_unsupported(acc, kind, None, rate, samp, t):
            nm = calibrate(factory, target, d, accountant=acc)
    except AccountingError as e:
        # an accounting failure during the search is a failed calibration: report it as
        # one, with the accountant's error as its cause (whose type gives the hint)
        raise CalibrationError(f"calibration failed: {one_line(str(e))}") from e
    bound = factory(nm).epsilon_bounds(d, acc)
    achieved = bound.upper
    if as_json:
        out = {
            "noise_multiplier": nm,
            "epsilon": none_if_inf(achieved),
            "epsilon_lower": none_if_inf(bound.lower),
            "target_epsilon": target,
            "delta": d,
            "accountant": bound.accountant or acc,
            "mechanism": kind,
            **run_json(rate, samp, t),
        }
        click.echo(json.dumps(out))
        return
    click.echo(f"noise multiplier: {nm!r} (smallest meeting epsilon <= {target:g} at "
               f"delta = {d:g}, rounded up)")
    click.echo(f"epsilon: {achieved!r} (certified upper bound, "
               f"{bound.accountant or acc} accountant)")
    if bound.lower is not None:
        click.echo(f"epsilon lower bound: {bound.lower!r} (the exact epsilon of this "
                   "mechanism is at least this)")
    click.echo(f"mechanism: {describe(kind, None, rate, samp, t)}")
    click.echo(relation_line(factory(nm)))
    if note:
        click.echo(f"schedule: {note}")


