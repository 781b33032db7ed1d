"""Participation schemas: in which steps one record can contribute.

The sensitivity of a strategy ``C`` (:mod:`privlearn.correlated.sensitivity`) is the
largest ``||C sum_{i in pi} e_i g_i||`` over the patterns ``pi`` the schema allows and
clipped contributions ``||g_i|| <= 1``. The samplers of :mod:`privlearn.correlated.sampling`
say which schema they guarantee.

References
----------
.. [CC23] Choquette-Choo, McMahan, Rush & Thakurta (2023), Multi-Epoch Matrix Factorization
       Mechanisms for Private Machine Learning, ICML, Section 2 ((k, b)-participation).
.. [CC23b] Choquette-Choo et al. (2023), (Amplified) Banded Matrix Factorization, NeurIPS,
       Definition 1 (b-min-separation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from privlearn._validation import check_count
from privlearn.errors import ParameterValueError

__all__ = ["Participation", "SingleParticipation", "MinSeparation", "FixedEpochs"]


class Participation:
    """Base class of the participation schemas (frozen dataclasses)."""

    __slots__ = ()

    def participations(self, steps: int) -> int:
        """Most participations of one record in ``steps`` steps."""
        raise NotImplementedError


@dataclass(frozen=True)
class SingleParticipation(Participation):
    """Each record contributes to at most one step (one pass, or streaming)."""

    def participations(self, steps: int) -> int:
        return 1


@dataclass(frozen=True)
class MinSeparation(Participation):
    """b-min-separation ([CC23b], Definition 1): any two participations of a record are
    at least ``min_sep`` steps apart, and there are at most ``max_participations`` of
    them (None: as many as the separation allows, ``ceil(steps / min_sep)``).

    ``min_sep = 1`` allows consecutive steps; cyclic Poisson sampling and balls-in-bins
    with cycle length ``b`` guarantee ``MinSeparation(b)``.
    """

    min_sep: int
    max_participations: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "min_sep", check_count("min_sep", self.min_sep, minimum=1))
        if self.max_participations is not None:
            object.__setattr__(
                self,
                "max_participations",
                check_count("max_participations", self.max_participations, minimum=1),
            )

    def participations(self, steps: int) -> int:
        steps = check_count("steps", steps, minimum=1)
        k = math.ceil(steps / self.min_sep)
        return k if self.max_participations is None else min(k, self.max_participations)


@dataclass(frozen=True)
class FixedEpochs(Participation):
    """(k, b)-participation in a fixed order ([CC23], Section 2): the steps are
    ``epochs`` passes of ``b = steps / epochs`` steps over the data in the same order, so a
    record contributes exactly at steps ``j, j + b, ..., j + (k-1) b`` for one ``j``.

    ``epoch_length=b`` given: the same order of ``b`` batches, run for any ``steps``
    in ``((epochs - 1) b, epochs b]`` -- the last pass may stop early, and a record
    contributes at the steps ``j + m b < steps`` (a prefix of the full passes' release).
    """

    epochs: int
    epoch_length: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "epochs", check_count("epochs", self.epochs, minimum=1))
        if self.epoch_length is not None:
            object.__setattr__(self, "epoch_length", check_count(
                "epoch_length", self.epoch_length, minimum=1))

    def steps_per_epoch(self, steps: int) -> int:
        steps = check_count("steps", steps, minimum=1)
        per = self.epoch_length
        if per is not None:
            if not (self.epochs - 1) * per < steps <= self.epochs * per:
                raise ParameterValueError(
                    f"steps must be in ({(self.epochs - 1) * per}, {self.epochs * per}] for "
                    f"FixedEpochs({self.epochs}) of {per} steps per epoch (its last epoch "
                    f"may be cut short), got steps={steps}; pass epochs="
                    f"{-(-steps // per)} for {steps} steps")
            return per
        if steps % self.epochs:
            raise ParameterValueError(
                f"steps must be a multiple of epochs={self.epochs} for FixedEpochs, got "
                f"steps={steps}; for a last epoch cut short pass the epoch's length, "
                f"FixedEpochs({self.epochs}, epoch_length={-(-steps // self.epochs)}), "
                f"or use MinSeparation(steps // epochs)")
        return steps // self.epochs

    def participations(self, steps: int) -> int:
        self.steps_per_epoch(steps)
        return self.epochs
