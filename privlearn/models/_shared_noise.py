"""Which private steps of a pipeline would draw the same noise (private helper of
:mod:`privlearn.models.preprocessing`).

A release draws its noise from ``make_rng(random_state)``
(:func:`privlearn.models.base.make_rng`). Two steps draw the very same normals when their
sources start alike: the same integer seed, or two generator objects in the same state --
``np.random.default_rng(0)`` passed twice, or one ``Generator`` / ``RandomState`` copied
by ``sklearn.base.clone`` (which deep-copies each step's parameters separately, so a
pipeline cloned by ``cross_val_score`` or ``GridSearchCV`` holds one copy per step, all
in the state of the original). A combination of such steps' releases cancels their
noise, which a composition of independent mechanisms does not cover. One generator
*object* shared by several steps is not such a case: they draw from it one after the
other, and their noise is independent.
"""

from __future__ import annotations

import copy
import numbers
import pickle
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["frozen_seeds", "shared_noise_groups"]


def _first_state(source: Any) -> bytes:
    """The state of the generator that ``make_rng(source)`` would return, read from a
    copy (``source`` itself is not advanced)."""
    from privlearn.models.base import make_rng

    return pickle.dumps(make_rng(copy.deepcopy(source)).bit_generator.state)


def shared_noise_groups(sources: Iterable[tuple[str, Any]]) -> list[tuple[str, list[str]]]:
    """``[(description, step names)]`` of the groups of private steps that would draw the
    same noise, from ``(step name, random_state)`` pairs.

    Parameters
    ----------
    sources : iterable of (str, object)
        Each private step's name and ``random_state`` (None, an int, a
        ``numpy.random.Generator`` or a ``numpy.random.RandomState``).

    Returns
    -------
    list of (str, list of str)
        For each group of two or more steps whose noise would start alike: how they share
        it (``"random_state=7"``, or the generator's type) and the steps' names. Steps
        with ``random_state=None`` draw fresh entropy and are never grouped; steps holding
        one generator object count once per object (they draw from it in turn).
    """
    groups: dict[bytes, tuple[str, list[str], set[int]]] = {}
    for name, source in sources:
        if isinstance(source, numbers.Integral) and not isinstance(source, bool):
            label, obj = f"random_state={int(source)}", None
        elif isinstance(source, np.random.Generator | np.random.RandomState):
            label, obj = f"random_state=<{type(source).__name__} copies in one state>", id(source)
        else:
            continue  # None (fresh entropy) or a value the step's own check refuses
        entry = groups.setdefault(_first_state(source), (label, [], set()))
        if obj is not None and obj in entry[2]:
            continue  # the same object: drawn from in turn, independent noise
        if obj is not None:
            entry[2].add(obj)
        entry[1].append(name)
    return [(label, names) for label, names, _ in groups.values() if len(names) > 1]


def frozen_seeds(sources: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The ``(step name, random_state)`` pairs of ``sources`` that hold an integer seed:
    those of the private fits a pipeline's ``sklearn.frozen.FrozenEstimator`` steps
    keep. Such a fit drew its noise from the seed's stream when it was made, so a step of
    the pipeline seeded alike draws the same normals. A generator has advanced since
    that fit (its state now says nothing of the noise drawn then) and is left out."""
    return [(name, source) for name, source in sources
            if isinstance(source, numbers.Integral) and not isinstance(source, bool)]
