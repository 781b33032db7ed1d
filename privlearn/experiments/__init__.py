"""End-to-end experiments, as functions the CLI calls.

``privlearn reproduce NAME [--out DIR] [--reps N] [--seed S]`` calls
:func:`run_experiment`; ``privlearn demo`` calls :func:`demo_linear_regression`.
Each experiment writes a CSV of its numbers and a PNG plot into the output directory,
by default ``./privlearn-output/`` (:data:`DEFAULT_OUT_DIR`, relative to the current
working directory).

privlearn's experiments are declared by name and the path of their runner, and an
experiment's module (with scikit-learn or torch behind it) is imported only when it
runs; another experiment registers its runner with
``@register_experiment("name", description=...)``. :data:`EXPERIMENTS` /
:data:`DATA_EXPERIMENTS` are read-only views of the registry.
"""

from __future__ import annotations

from pathlib import Path

from privlearn._validation import check_repetitions
from privlearn.experiments._common import DEFAULT_OUT_DIR
from privlearn.experiments._registry import (
    DATA_EXPERIMENTS,
    EXPERIMENTS,
    Experiment,
    get_experiment,
    register_experiment,
)

__all__ = ["EXPERIMENTS", "DATA_EXPERIMENTS", "Experiment", "register_experiment",
           "run_experiment", "demo_linear_regression", "DEFAULT_OUT_DIR"]


def run_experiment(name: str, out_dir: str | Path | None = None, reps: int | None = None,
                   seed: int = 0, **options):
    """Run the experiment ``name``; returns an ``ExperimentResult`` (``.paths`` lists the
    CSV and PNG written). ``reps=None`` uses the experiment's default; ``out_dir=None``
    writes to ``./privlearn-output/``."""
    experiment = get_experiment(name)
    if reps is not None:
        reps = check_repetitions("reps", reps)
    options.setdefault("verbose", True)
    return experiment.run(out_dir, reps, seed, **options)


def demo_linear_regression(out_dir: str | Path | None = None, seed: int = 0) -> list[Path]:
    """A short linear-regression run (10 epsilons x 10 repetitions, both NoisyGD regimes): prints
    the table, saves ``linear_regression.png`` and ``.csv`` into ``out_dir`` (default
    ``./privlearn-output/``, created if needed; the directory is printed), returns their
    paths."""
    import numpy as np

    from privlearn.experiments.linear_regression import run_linear_regression

    out = Path(out_dir if out_dir is not None else DEFAULT_OUT_DIR)
    print(f"writing the linear-regression demo to {out.resolve()}/")
    res = run_linear_regression(out, reps=10, seed=seed,
                                epsilons=np.linspace(0.1, 2.0, 10), verbose=True)
    for p in res.paths:
        print(f"wrote {p}")
    return res.paths
