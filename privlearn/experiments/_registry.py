"""The experiment registry: each experiment module registers its runner with
:func:`register_experiment`; :mod:`privlearn.experiments` imports every module of the
package (which registers them) and exposes read-only views for the CLI."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Set
from dataclasses import dataclass

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
        ``run(out_dir, reps, seed, **options) -> ExperimentResult``.
    needs_data : bool
        It reads data not bundled with privlearn (it accepts ``data_home`` and
        ``download``).
    quick : bool
        It accepts ``quick=True``: a small configuration that runs in seconds (a smoke
        test, not a result; ``privlearn reproduce NAME --quick``).
    """

    name: str
    description: str
    run: Callable
    needs_data: bool = False
    quick: bool = False


_REGISTRY: dict[str, Experiment] = {}


def register_experiment(name: str, *, description: str, needs_data: bool = False,
                        quick: bool = False) -> Callable[[Callable], Callable]:
    """Decorator registering ``run(out_dir=None, reps=None, seed=0, **options)`` as the
    experiment ``name`` (``privlearn reproduce NAME`` runs it); the function is returned
    unchanged. A name already registered to another function is refused. ``quick``: the
    runner accepts ``quick=True`` (a configuration that runs in seconds)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"an experiment name must be a non-empty string, got {name!r}")

    def register(run: Callable) -> Callable:
        known = _REGISTRY.get(name)
        if known is not None and known.run is not run:
            raise ValueError(
                f"experiment {name!r} is already registered by "
                f"{known.run.__module__}.{known.run.__qualname__}; pick another name")
        _REGISTRY[name] = Experiment(name, description, run, needs_data, quick)
        return run

    return register


def get_experiment(name: str) -> Experiment:
    """The experiment ``name``; ``ValueError`` listing the known names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
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
