"""``privlearn demo`` and ``privlearn reproduce``: the end-to-end experiments."""

from __future__ import annotations

from typing import Any

import click

from privlearn._validation import check_repetitions
from privlearn.cli._app import ExitStatus, cli, one_line
from privlearn.cli._options import check_out_dir

__all__ = ["demo", "reproduce"]


def _only_for(options: str, names, name: str, why: str) -> None:
    """Refuse ``options`` (e.g. ``"--quick applies"``) for the experiment ``name`` unless
    it is one of ``names``, saying which experiments take them and ``why`` ``name`` does
    not."""
    if name not in names:
        raise click.UsageError(f"{options} only to {', '.join(sorted(names))}; {name} {why}")


def _bad_input(message: str) -> click.ClickException:
    """A one-line error about the input (status 2, :data:`ExitStatus.USAGE`)."""
    error = click.ClickException(message)
    error.exit_code = ExitStatus.USAGE
    return error


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
    help="Output directory (default: ./privlearn-output).",
)
@click.option("--reps", type=int, default=None,
              help="Number of repetitions, an integer >= 1 (default: each experiment's own).")
@click.option("--seed", type=click.IntRange(min=0, max=2**32 - 1), default=None,
              help="Random seed in [0, 2**32) (default: 0).")
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
    "correlated-noise and correlated-noise-adult-bert only.",
)
@click.option(
    "--variant", default=None, metavar="VARIANT",
    help="Which version of the algorithms to run. linear-regression only: 'default' (the "
    "estimators' defaults) or 'seed' (the study's own SSP and AdaSSP: upper-triangle noise "
    "on X^T X, no projection, ridge for AdaSSP).",
)
def reproduce(name: str, out_dir: str | None, reps: int | None, seed: int | None,
              data_home: str | None, download: bool, quick: bool,
              variant: str | None) -> None:
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
      correlated-noise-adult-bert
                             the same with DP-Adam on a BERT classifier of
                             width 128 over UCI Adult records as token
                             sequences, epsilon 4 and 8, and a non-private
                             reference (needs torch and transformers; about
                             20 minutes on two cores, --quick for seconds)
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
        kwargs["reps"] = check_repetitions("--reps", reps)
    if seed is not None:
        kwargs["seed"] = seed
    if data_home is not None or download:
        _only_for("--data-home/--download apply", DATA_EXPERIMENTS, name,
                  "uses data bundled with privlearn, so drop them")
        if data_home is not None:
            kwargs["data_home"] = data_home
        if download:
            kwargs["download"] = True
    if quick:
        from privlearn.experiments import get_experiment

        _only_for("--quick applies", [n for n in EXPERIMENTS if get_experiment(n).quick], name,
                  "has no small configuration, so drop it (or use --reps 1)")
        kwargs["quick"] = True
    if variant is not None:
        from privlearn.experiments import get_experiment

        _only_for("--variant applies", [n for n in EXPERIMENTS if get_experiment(n).variants],
                  name, "has one version, so drop it")
        variants = get_experiment(name).variants
        if variant not in variants:
            raise click.BadParameter(
                f"{name} has the variants {', '.join(variants)}, got {variant!r}",
                param_hint="'--variant'")
        kwargs["variant"] = variant
    if out_dir is not None:  # before the run: a directory that cannot be written fails now
        check_out_dir(out_dir)
    try:
        result = run_experiment(name, **kwargs)
    except ImportError as e:  # an experiment that needs an optional extra (torch)
        raise _bad_input(f"{name}: {one_line(str(e))}") from None
    except FileNotFoundError as e:
        from privlearn.datasets import DATA_ENV

        searched = getattr(e, "searched", ())
        said = (f"{e.what} not found in {', '.join(searched)} (--data-home, "  # type: ignore
                f"${DATA_ENV}, the user cache)" if searched and getattr(e, "what", None)
                else one_line(str(e)).rstrip("."))  # in the shell's words, not Python's
        raise _bad_input(  # missing data is bad input (status 2)
            f"{name}: {said}; run again with --data-home DIR (a directory holding the "
            "files) or --download") from None
    for path in getattr(result, "paths", None) or ():
        click.echo(f"wrote {path}")


