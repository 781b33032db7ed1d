"""End-to-end experiments, as functions the CLI calls.

``privlearn reproduce NAME [--out DIR] [--reps N] [--seed S]`` calls
:func:`run_experiment`; ``privlearn demo`` calls :func:`demo_linear_regression`.
Each experiment writes a CSV of its numbers and a PNG plot into the output directory,
by default ``./privlearn-output/`` (:data:`DEFAULT_OUT_DIR`, relative to the current
working directory).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

__all__ = ["EXPERIMENTS", "DATA_EXPERIMENTS", "run_experiment", "demo_linear_regression",
           "DEFAULT_OUT_DIR"]

#: Default output directory of :func:`run_experiment` and :func:`demo_linear_regression`
#: (kept equal to ``privlearn.experiments._common.DEFAULT_OUT_DIR``).
DEFAULT_OUT_DIR = "privlearn-output"


def _lazy(module: str, func: str) -> Callable:
    def run(*args, **kwargs):
        import importlib

        return getattr(importlib.import_module(module), func)(*args, **kwargs)

    return run


#: name -> (description, runner(out_dir, reps, seed, **options) -> ExperimentResult)
_REGISTRY: dict[str, tuple[str, Callable]] = {
    "linear-regression": (
        "Linear regression on California housing: median training MSE vs epsilon "
        "(0.1..2, delta=1e-6) for SSP, AdaSSP, NoisyGD (two regimes), non-private and "
        "trivial baselines",
        _lazy("privlearn.experiments.linear_regression", "run_linear_regression"),
    ),
    "noisygd-learning-rate": (
        "NoisyGD learning-rate sensitivity (theoretical rate, x10, x0.1)",
        _lazy("privlearn.experiments.linear_regression", "run_noisygd_learning_rate"),
    ),
    "logistic-regression": (
        "DP-SGD logistic regression scenarios on synthetic data (non-private, pure DP "
        "and (epsilon, delta)-DP, with and without subsampling): test accuracy over "
        "repetitions",
        _lazy("privlearn.experiments.logistic", "run_logistic_regression"),
    ),
    "adult": (
        "DP-SGD logistic regression on UCI Adult vs non-private logistic regression, "
        "across epsilon",
        _lazy("privlearn.experiments.adult", "run_adult"),
    ),
    "label-release": (
        "PATE and Private kNN label release on MNIST (PCA features): label accuracy vs "
        "epsilon",
        _lazy("privlearn.experiments.label_release", "run_label_release"),
    ),
}

#: name -> one-line description (the CLI lists these)
EXPERIMENTS: dict[str, str] = {name: desc for name, (desc, _) in _REGISTRY.items()}

#: Experiments that read data not bundled with privlearn (they accept ``data_home`` and
#: ``download``); the others use bundled or synthetic data.
DATA_EXPERIMENTS: frozenset[str] = frozenset({"label-release"})


def run_experiment(name: str, out_dir: str | Path | None = None, reps: int | None = None,
                   seed: int = 0, **options):
    """Run the experiment ``name``; returns an ``ExperimentResult`` (``.paths`` lists the
    CSV and PNG written). ``reps=None`` uses the experiment's default; ``out_dir=None``
    writes to ``./privlearn-output/``."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown experiment {name!r}; choose one of {sorted(_REGISTRY)}")
    if reps is not None and (isinstance(reps, bool) or not isinstance(reps, int) or reps < 1):
        raise ValueError(f"reps must be an integer >= 1, got {reps!r}")
    options.setdefault("verbose", True)
    return _REGISTRY[name][1](out_dir, reps, seed, **options)


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
