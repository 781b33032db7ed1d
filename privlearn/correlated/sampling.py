"""Batch samplers that bound how often, and how far apart, a record participates.

Each sampler yields the dataset indices of every step's batch and states the
participation schema it guarantees (``participation``), which is what the sensitivity
and the accounting of :mod:`privlearn.correlated.accounting` assume.
:func:`check_participation` verifies a realised sequence of batches against a schema
(the tests use it to catch a sampler that breaks its separation).

Each record's group is drawn independently and uniformly (not by splitting a shuffled
dataset into equal parts), so that adding or removing a record leaves the others'
distribution unchanged: the add/remove relation the accounting uses.

References
----------
.. [CC23b] Choquette-Choo et al. (2023), (Amplified) Banded Matrix Factorization, NeurIPS,
       Algorithm 2 (cyclic Poisson sampling).
.. [CGHKMSZ25] Chua, Ghazi, Harrison, Kumar, Manurangsi, Sinha & Zhang (2025),
       Balls-and-Bins Sampling for DP-SGD, AISTATS.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from privlearn._validation import check_count, check_rate
from privlearn.correlated.participation import FixedEpochs, MinSeparation, Participation

__all__ = ["CyclicPoissonSampler", "BallsInBinsSampler", "check_participation"]


def _set_count(obj: object, name: str) -> None:
    object.__setattr__(obj, name, check_count(name, getattr(obj, name), minimum=1))


def _bins(dataset_size: int, cycle_length: int, rng: np.random.Generator) -> list[np.ndarray]:
    bins = rng.integers(0, cycle_length, size=dataset_size)
    order = np.argsort(bins, kind="stable")
    counts = np.bincount(bins, minlength=cycle_length)
    return np.split(order, np.cumsum(counts)[:-1])


@dataclass(frozen=True)
class CyclicPoissonSampler:
    """Cyclic Poisson sampling ([CC23b], Algorithm 2).

    Every record is put in one of ``cycle_length`` groups uniformly at random; step ``t``
    Poisson-samples group ``t mod cycle_length`` with rate ``sampling_rate``. A record
    therefore participates only in steps ``j, j + b, j + 2 b, ...`` (``b`` the cycle
    length), each independently with probability ``sampling_rate``. ``cycle_length = 1``
    is ordinary Poisson sampling (DP-SGD).

    Parameters
    ----------
    dataset_size : int >= 1
    sampling_rate : float in (0, 1]
        Inclusion probability in each step where the record is eligible; the expected
        batch size is ``sampling_rate * dataset_size / cycle_length``.
    steps : int >= 1
    cycle_length : int >= 1
    """

    dataset_size: int
    sampling_rate: float
    steps: int
    cycle_length: int = 1

    def __post_init__(self) -> None:
        _set_count(self, "dataset_size")
        object.__setattr__(self, "sampling_rate", check_rate("sampling_rate", self.sampling_rate))
        _set_count(self, "steps")
        _set_count(self, "cycle_length")

    @property
    def participation(self) -> MinSeparation:
        """``MinSeparation(cycle_length)`` with at most ``ceil(steps / cycle_length)``
        participations."""
        return MinSeparation(self.cycle_length, math.ceil(self.steps / self.cycle_length))

    @property
    def participations(self) -> int:
        """Most participations of one record (its group's number of steps)."""
        return math.ceil(self.steps / self.cycle_length)

    def batches(self, rng: np.random.Generator | int | None = None) -> Iterator[np.ndarray]:
        """Yield the index array of each step's batch."""
        rng = np.random.default_rng(rng)
        groups = _bins(self.dataset_size, self.cycle_length, rng)
        for t in range(self.steps):
            group = groups[t % self.cycle_length]
            yield group[rng.random(group.size) < self.sampling_rate]


@dataclass(frozen=True)
class BallsInBinsSampler:
    """Balls-in-bins sampling ([CGHKMSZ25]): every record is put in one of
    ``cycle_length`` bins uniformly at random, and step ``t`` uses the whole bin
    ``t mod cycle_length``: a record participates in exactly the steps
    ``j, j + b, j + 2 b, ...`` of its bin ``j`` (``b`` the cycle length).

    Parameters
    ----------
    dataset_size : int >= 1
    steps : int >= 1
    cycle_length : int >= 1
        Steps per epoch; the expected batch size is ``dataset_size / cycle_length``.
    """

    dataset_size: int
    steps: int
    cycle_length: int

    def __post_init__(self) -> None:
        _set_count(self, "dataset_size")
        _set_count(self, "steps")
        _set_count(self, "cycle_length")

    @property
    def participation(self) -> MinSeparation:
        """``MinSeparation(cycle_length)`` with at most ``ceil(steps / cycle_length)``
        participations."""
        return MinSeparation(self.cycle_length, math.ceil(self.steps / self.cycle_length))

    def batches(self, rng: np.random.Generator | int | None = None) -> Iterator[np.ndarray]:
        """Yield the index array of each step's batch."""
        rng = np.random.default_rng(rng)
        bins = _bins(self.dataset_size, self.cycle_length, rng)
        for t in range(self.steps):
            yield bins[t % self.cycle_length]


def check_participation(
    batches: Iterable[np.ndarray], participation: Participation, steps: int | None = None
) -> None:
    """Raise ``ValueError`` naming the first record whose participations in ``batches``
    break ``participation`` (too close together, too many, or, for
    :class:`~privlearn.correlated.participation.FixedEpochs`, off its fixed positions)."""
    batches = [np.asarray(b, dtype=np.int64) for b in batches]
    n = len(batches) if steps is None else check_count("steps", steps, minimum=1)
    if not batches:
        return
    step_of = np.concatenate([np.full(b.size, t) for t, b in enumerate(batches)])
    ids = np.concatenate(batches)
    order = np.lexsort((step_of, ids))
    ids, step_of = ids[order], step_of[order]
    same = ids[1:] == ids[:-1]
    gaps = np.diff(step_of)
    counts = np.bincount(np.unique(ids, return_inverse=True)[1])
    limit = participation.participations(n)
    if counts.max() > limit:
        worst = np.unique(ids)[int(np.argmax(counts))]
        raise ValueError(
            f"record {int(worst)} participates {int(counts.max())} times, more than the "
            f"{limit} that {participation!r} allows in {n} steps"
        )
    if isinstance(participation, MinSeparation):
        bad = np.nonzero(same & (gaps < participation.min_sep))[0]
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"record {int(ids[i])} participates in steps {int(step_of[i])} and "
                f"{int(step_of[i + 1])}, closer than min_sep={participation.min_sep}"
            )
    elif isinstance(participation, FixedEpochs):
        per = participation.steps_per_epoch(n)
        bad = np.nonzero(same & (gaps != per))[0]
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"record {int(ids[i])} participates in steps {int(step_of[i])} and "
                f"{int(step_of[i + 1])}, not one epoch ({per} steps) apart"
            )
