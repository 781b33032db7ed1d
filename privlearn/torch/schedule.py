"""How a run draws its batches and how its steps are accounted: one registry entry per
sampling, and :class:`RunAccounting`, the description the accountant, the budget cap,
calibration and the ledger all read.

=================  ==========================  ===========================================
sampling           batch of step ``t``         accounted as
=================  ==========================  ===========================================
``poisson``        every example with          ``t`` compositions of the Poisson-subsampled
                   probability ``q``           Gaussian (DP-SGD); with correlated noise:
                                               refused
``fixed``          ``B`` distinct examples     ``t`` compositions, replace-one
``cyclic_poisson`` Poisson within group        the strategy's matrix mechanism: amplified
                   ``t mod b``                 (Choquette-Choo et al. 2023, Theorem 4) for
                                               DP-SGD and ``bands <= b``, else by its
                                               b-min-separation sensitivity
``balls_in_bins``  bin ``t mod b``             the matrix mechanism of b-min-separation
                                               (certified, without amplification)
``shuffled_epochs``batch ``t mod b`` of one    the matrix mechanism of (k, b)-participation
                   fixed order                 (certified, without amplification)
=================  ==========================  ===========================================

``q`` is the rate an example is drawn at when it may be; the normaliser of the noisy sum
is the expected batch size. With privacy units of several examples (users) every count
here is of units.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from privlearn.accounting import Mechanism, compose, steps_per_epoch
from privlearn.correlated import (
    FixedEpochs,
    Identity,
    MinSeparation,
    optimize_banded_toeplitz,
    optimize_blt,
)
from privlearn.correlated.accounting import correlated_mechanism
from privlearn.correlated.sampling import BallsInBinsSampler, CyclicPoissonSampler
from privlearn.correlated.strategies import ToeplitzStrategy

__all__ = ["SamplingKind", "SAMPLINGS", "RunAccounting", "choose_strategy"]


@dataclass(frozen=True)
class SamplingKind:
    """What privlearn knows about one way of sampling batches.

    Attributes
    ----------
    rate : callable
        ``rate(batch_size, n, cycle) -> q``.
    per_epoch : callable
        ``per_epoch(q, cycle) -> steps`` in one epoch.
    expected_batch : callable
        ``expected_batch(q, n, cycle) -> float``, the normaliser of the noisy sum.
    describe : callable or None
        ``describe(n, q, steps, cycle)``: the :mod:`privlearn.correlated` sampler or
        participation schema the accounting assumes (None: step-by-step DP-SGD
        composition, no matrix mechanism).
    cycled : bool
        Whether it has a cycle length.
    """

    rate: Callable[[float, int, int], float]
    per_epoch: Callable[[float, int], int]
    expected_batch: Callable[[float, int, int], float]
    describe: Callable | None
    cycled: bool


def _fixed_epochs(n: int, q: float, steps: int, cycle: int):
    return FixedEpochs(steps // cycle) if steps % cycle == 0 else \
        MinSeparation(cycle, math.ceil(steps / cycle))


SAMPLINGS: dict[str, SamplingKind] = {
    "poisson": SamplingKind(lambda b, n, c: b / n, lambda q, c: steps_per_epoch(q),
                            lambda q, n, c: q * n, None, False),
    "fixed": SamplingKind(lambda b, n, c: b / n, lambda q, c: steps_per_epoch(q),
                          lambda q, n, c: q * n, None, False),
    "cyclic_poisson": SamplingKind(
        lambda b, n, c: b * c / n, lambda q, c: max(1, round(c / q)),
        lambda q, n, c: q * n / c,
        lambda n, q, steps, c: CyclicPoissonSampler(n, q, steps, c), True),
    "balls_in_bins": SamplingKind(
        lambda b, n, c: 1.0 / c, lambda q, c: c, lambda q, n, c: n / c,
        lambda n, q, steps, c: BallsInBinsSampler(n, steps, c), True),
    "shuffled_epochs": SamplingKind(
        lambda b, n, c: 1.0 / c, lambda q, c: c, lambda q, n, c: n / c,
        _fixed_epochs, True),
}


def choose_strategy(noise, planned: int, participation, bands: int | None,
                    buffers: int | None) -> ToeplitzStrategy:
    """The strategy of ``noise``: the identity (DP-SGD), an optimised banded Toeplitz or
    BLT for ``planned`` steps under ``participation``, or the strategy given."""
    if not isinstance(noise, str):
        return noise
    if noise == "dpsgd":
        return Identity()
    if noise == "banded":
        return optimize_banded_toeplitz(planned, min(bands or 8, planned), participation)
    return optimize_blt(planned, buffers or 4, participation)


@dataclass(frozen=True)
class RunAccounting:
    """How a run's steps are accounted: step by step (DP-SGD with Poisson or fixed-size
    sampling, ``strategy=None``) or as one matrix-factorization mechanism of the steps
    taken (:func:`privlearn.correlated.accounting.correlated_mechanism`).

    Attributes
    ----------
    sampling : str
    units : int
        Examples (or users) the sampler draws from.
    sampling_rate : float
    cycle : int
    strategy : ToeplitzStrategy or None
    """

    sampling: str
    units: int
    sampling_rate: float
    cycle: int
    strategy: ToeplitzStrategy | None = None

    @property
    def stepwise(self) -> bool:
        return self.strategy is None

    def mechanism(self, noise_multiplier: float, steps: int) -> Mechanism:
        """The mechanism of ``steps`` steps at ``noise_multiplier`` (sigma: the noise of
        step ``t`` is ``sigma C (C^{-1} z)_t``)."""
        if self.stepwise:
            from privlearn.torch.accountant import dpsgd_step

            return compose(dpsgd_step(noise_multiplier, self.sampling_rate, self.sampling),
                           steps=steps)
        kind = SAMPLINGS[self.sampling]
        desc = kind.describe(self.units, self.sampling_rate, steps, self.cycle)
        return correlated_mechanism(self.strategy, desc, noise_multiplier, steps=steps)
