"""The mechanism of each (strategy, sampler) combination against its closed form."""

from __future__ import annotations

import math

import numpy as np
import pytest

from privlearn.accounting import Gaussian, compose, subsample
from privlearn.accounting.matrix_mechanism import MatrixMechanism
from privlearn.correlated import BandedToeplitz, BufferedToeplitz, MinSeparation, sensitivity
from privlearn.correlated.accounting import correlated_mechanism, is_amplified
from privlearn.correlated.sampling import CyclicPoissonSampler

#: the accounted sensitivity is that of C times the certified factor of its float32 noise
#: recurrence's rounding (privlearn.correlated._recurrence_fidelity): at most this, here
ROUNDING = 1e-5


def _covers(got: MatrixMechanism, sigma: float, sens: float) -> bool:
    """``got`` is the Gaussian mechanism of ``sens`` at ``sigma``, charged for the
    rounding of the noise recurrence (a sensitivity at most ``ROUNDING`` above)."""
    return (isinstance(got, MatrixMechanism) and got.noise_multiplier == sigma
            and sens <= got.sensitivity <= sens * (1 + ROUNDING))


def test_cyclic_poisson_amplifies_a_banded_strategy_with_trailing_zeros():
    # (1, -0.5, 0, 0) is 2-banded: with 2 groups its participations land in disjoint
    # rows, each a Poisson-subsampled Gaussian of the column norm sqrt(1.25)
    # (Choquette-Choo et al. 2023, Theorem 4): 10 steps are 5 such participations
    C = BandedToeplitz((1.0, -0.5, 0.0, 0.0))
    sampler = CyclicPoissonSampler(100, 0.1, 10, 2)
    assert is_amplified(C, sampler)
    want = compose(subsample(Gaussian(1.3 / math.sqrt(1.25)), rate=0.1), steps=5)
    got = correlated_mechanism(C, sampler, 1.3)
    assert got.epsilon(1e-5) == pytest.approx(want.epsilon(1e-5), rel=ROUNDING)
    assert got.epsilon(1e-5) >= want.epsilon(1e-5)


@pytest.mark.parametrize("strategy", [BandedToeplitz((1.0, -0.5, 0.25)),
                                      BufferedToeplitz((0.9,), (0.2,))])
def test_more_bands_than_the_cycle_is_not_amplified(strategy):
    # 3 bands (or a BLT) over a cycle of 2: neighbouring participations share rows, so
    # the run is the un-amplified Gaussian of the 2-min-separation sensitivity
    sampler = CyclicPoissonSampler(100, 0.1, 10, 2)
    assert not is_amplified(strategy, sampler)
    sens = sensitivity(strategy, MinSeparation(2, 5), 10).value
    got = correlated_mechanism(strategy, sampler, 1.3)
    assert _covers(got, 1.3, sens)


@pytest.mark.parametrize("strategy", [BandedToeplitz((1.0, -0.5, 0.25, 0.1, 0.3, 0.2)),
                                      BufferedToeplitz((0.9,), (0.2,))], ids=repr)
def test_a_run_no_longer_than_the_cycle_is_amplified_whatever_the_bands(strategy):
    # 4 steps in 4 groups: each record may take part in one step only, with probability
    # q, and the 4 x 4 C has at most 4 bands: one Poisson-subsampled Gaussian of the
    # largest column norm ([CC23b] Theorem 4), as for a strategy of at most 4 bands
    sampler = CyclicPoissonSampler(100, 0.1, 4, 4)
    assert is_amplified(strategy, sampler)
    column = float(np.linalg.norm(strategy.toeplitz_coefs(4)))
    want = subsample(Gaussian(1.3 / column), rate=0.1)
    got = correlated_mechanism(strategy, sampler, 1.3)
    assert got.epsilon(1e-5) == pytest.approx(want.epsilon(1e-5), rel=ROUNDING)
    assert got.epsilon(1e-5) >= want.epsilon(1e-5)
    assert got.epsilon(1e-5) < MatrixMechanism(1.3, column).epsilon(1e-5)
    # one step more than the cycle: two participations sharing rows, not amplified
    longer = CyclicPoissonSampler(100, 0.1, 5, 4)
    assert not is_amplified(strategy, longer)
    sens = sensitivity(strategy, MinSeparation(4, 2), 5).value
    assert _covers(correlated_mechanism(strategy, longer, 1.3), 1.3, sens)
