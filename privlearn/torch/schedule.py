"""How a run's steps are accounted: :class:`RunAccounting`, the description the
accountant, the budget cap, calibration and the ledger all read. It reads the run's
sampling from the one registry of samplings
(:data:`privlearn.correlated.sampling.SAMPLINGS`, re-exported here), whose entry owns both
the batch draw and the law assumed here.

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
                   fixed order                 (certified, without amplification) under
                                               **replace-one** only (twice the add/remove
                                               sensitivity); refused on add/remove budgets
=================  ==========================  ===========================================

Every entry but ``fixed`` and ``shuffled_epochs`` is accounted under add/remove.

``q`` is the rate an example is drawn at when it may be; the normaliser of the noisy sum
is the expected batch size. With privacy units of several examples (users) every count
here is of units.
"""

from __future__ import annotations

from dataclasses import dataclass

from privlearn.accounting import Mechanism, compose
from privlearn.correlated import Identity, optimize_banded_toeplitz, optimize_blt
from privlearn.correlated.accounting import correlated_mechanism, stated_under
from privlearn.correlated.sampling import SAMPLINGS, SamplingLaw
from privlearn.correlated.strategies import ToeplitzStrategy

__all__ = ["SamplingKind", "SAMPLINGS", "RunAccounting", "choose_strategy"]


#: The former name of a registry entry (:class:`privlearn.correlated.sampling.SamplingLaw`,
#: which has the same ``rate``, ``per_epoch``, ``expected_batch``, ``describe`` and
#: ``cycled``); deprecated.
SamplingKind = SamplingLaw


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
        law = SAMPLINGS[self.sampling]
        if self.stepwise:
            from privlearn.torch.accountant import dpsgd_step

            return compose(dpsgd_step(noise_multiplier, self.sampling_rate, law.scheme),
                           steps=steps)
        desc = law.describe(self.units, self.sampling_rate, steps, self.cycle)
        mech = correlated_mechanism(self.strategy, desc, noise_multiplier, steps=steps)
        return stated_under(mech, law.relation)

    @property
    def law(self) -> SamplingLaw:
        """The registry entry of the run's sampling."""
        return SAMPLINGS[self.sampling]
