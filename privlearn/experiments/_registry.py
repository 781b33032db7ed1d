"""The experiment registry: name -> :class:`Experiment`.

privlearn's own experiments are declared here by the path of their runner
(``"privlearn.experiments.adult:run_adult"``), and their module is imported only when
the experiment runs: listing the experiments (``privlearn reproduce --help``, the CLI's
check of NAME) imports neither scikit-learn nor torch. Other experiments register a
runner with :func:`register_experiment`."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping, Set
from dataclasses import dataclass
from typing import Any

from privlearn.errors import ConfigurationError, ParameterValueError

__all__ = ["Experiment", "register_experiment", "EXPERIMENTS", "DATA_EXPERIMENTS",
           "get_experiment"]


@dataclass(frozen=True)
class Experiment:
    """A registered experiment.

    Attributes
    ----------
    name : str
        Its name on the command line (``privlearn reproduce NAME``).
    description : str
        One line for the CLI's list.
    run : callable
        ``run(out_dir, reps, seed, **options) -> ExperimentResult`` (for privlearn's own
        experiments, a :class:`LazyRunner` that imports the runner's module on the first
        call).
    needs_data : bool
        It reads data not bundled with privlearn (it accepts ``data_home`` and
        ``download``).
    quick : bool
        It accepts ``quick=True``: a small configuration that runs in seconds (a smoke
        test, not a result; ``privlearn reproduce NAME --quick``).
    variants : tuple of str
        The values its ``variant=`` option accepts, the first being the default
        (``privlearn reproduce NAME --variant V``); empty when it has none.
    """

    name: str
    description: str
    run: Callable
    needs_data: bool = False
    quick: bool = False
    variants: tuple[str, ...] = ()


@dataclass(frozen=True)
class LazyRunner:
    """A runner named by ``"module:function"``, imported when first called (its module
    may import scikit-learn or torch)."""

    target: str

    def load(self) -> Callable:
        module, _, function = self.target.partition(":")
        return getattr(importlib.import_module(module), function)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.load()(*args, **kwargs)


_PKG = "privlearn.experiments"

#: privlearn's own experiments (name, runner, description, needs_data, quick).
_BUILTIN = (
    Experiment(
        "linear-regression", "Linear regression on California housing: median training "
        "MSE vs epsilon (0.1..2, delta=1e-6) for SSP, AdaSSP, NoisyGD (two regimes), "
        "non-private and trivial baselines",
        LazyRunner(f"{_PKG}.linear_regression:run_linear_regression"),
        variants=("default", "seed")),
    Experiment(
        "noisygd-learning-rate",
        "NoisyGD learning-rate sensitivity (theoretical rate, x10, x0.1)",
        LazyRunner(f"{_PKG}.linear_regression:run_noisygd_learning_rate")),
    Experiment(
        "logistic-regression", "DP-SGD logistic regression scenarios on synthetic data "
        "(non-private, pure DP and (epsilon, delta)-DP, with and without subsampling): "
        "test accuracy over repetitions",
        LazyRunner(f"{_PKG}.logistic:run_logistic_regression")),
    Experiment(
        "adult", "DP-SGD logistic regression on UCI Adult vs non-private logistic "
        "regression, across epsilon", LazyRunner(f"{_PKG}.adult:run_adult")),
    Experiment(
        "label-release", "PATE and Private kNN label release on MNIST (PCA features): "
        "label accuracy vs epsilon", LazyRunner(f"{_PKG}.label_release:run_label_release"),
        needs_data=True),
    Experiment(
        "correlated-noise", "DP-SGD vs banded (cyclic Poisson) vs BLT (balls-in-bins) "
        "noise on MNIST: test accuracy vs epsilon, learning rates tuned on a validation "
        "split", LazyRunner(f"{_PKG}.correlated_noise:run_correlated_noise"),
        needs_data=True, quick=True),
    Experiment(
        "correlated-noise-adult-bert", "The correlated-noise study's language-model row: "
        "DP-Adam with DP-SGD, banded and BLT noise on a 2-block BERT classifier of width "
        "128 over UCI Adult records as token sequences, epsilon 4 and 8, vs non-private",
        LazyRunner(f"{_PKG}.correlated_noise:run_correlated_noise_adult_bert"),
        quick=True),
)

_REGISTRY: dict[str, Experiment] = {e.name: e for e in _BUILTIN}


def register_experiment(name: str, *, description: str, needs_data: bool = False,
                        quick: bool = False, variants: tuple[str, ...] = ()
                        ) -> Callable[[Callable], Callable]:
    """Decorator registering ``run(out_dir=None, reps=None, seed=0, **options)`` as the
    experiment ``name`` (``privlearn reproduce NAME`` runs it); the function is returned
    unchanged. A name already registered to another function is refused. ``quick``: the
    runner accepts ``quick=True`` (a configuration that runs in seconds). ``variants``:
    the values the runner's ``variant=`` option accepts, default first."""
    if not isinstance(name, str) or not name:
        raise ParameterValueError(f"an experiment name must be a non-empty string, got {name!r}")
    variants = tuple(variants)
    if not all(isinstance(v, str) and v for v in variants):
        raise ParameterValueError(
            f"variants must be non-empty strings, got {variants!r}")

    def register(run: Callable) -> Callable:
        known = _REGISTRY.get(name)
        if known is not None and known.run is not run:
            raise ConfigurationError(
                f"experiment {name!r} is already registered by "
                f"{known.run.__module__}.{known.run.__qualname__}; pick another name")
        _REGISTRY[name] = Experiment(name, description, run, needs_data, quick, variants)
        return run

    return register


def get_experiment(name: str) -> Experiment:
    """The experiment ``name``; ``ValueError`` listing the known names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ParameterValueError(
            f"unknown experiment {name!r}; choose one of {sorted(_REGISTRY)}") from None


class _Descriptions(Mapping[str, str]):
    """name -> one-line description, a live read-only view of the registry."""

    def __getitem__(self, name: str) -> str:
        return _REGISTRY[name].description

    def __iter__(self) -> Iterator[str]:
        return iter(_REGISTRY)

    def __len__(self) -> int:
        return len(_REGISTRY)

    def __repr__(self) -> str:
        return f"EXPERIMENTS({dict(self)!r})"


class _NeedsData(Set[str]):
    """The names of the experiments that read data not bundled with privlearn (a live
    read-only view of the registry)."""

    def _names(self) -> list[str]:
        return [n for n, e in _REGISTRY.items() if e.needs_data]

    def __contains__(self, name: object) -> bool:
        e = _REGISTRY.get(name) if isinstance(name, str) else None
        return e is not None and e.needs_data

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def __repr__(self) -> str:
        return f"DATA_EXPERIMENTS({set(self)!r})"


#: name -> one-line description (the CLI lists these).
EXPERIMENTS: Mapping[str, str] = _Descriptions()

#: Experiments that read data not bundled with privlearn (they accept ``data_home`` and
#: ``download``); the others use bundled or synthetic data.
DATA_EXPERIMENTS: Set[str] = _NeedsData()
