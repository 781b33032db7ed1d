"""The mechanism of each (strategy, sampler) combination against its closed form."""

from __future__ import annotations

import math

import pytest

from privlearn.accounting import Gaussian, compose, subsample
from privlearn.accounting.matrix_mechanism import MatrixMechanism
from privlearn.correlated import BandedToeplitz, BufferedToeplitz, MinSeparation, sensitivity
from privlearn.correlated.accounting import correlated_mechanism, is_amplified
from privlearn.correlated.sampling import CyclicPoissonSampler


def test_cyclic_poisson_amplifies_a_banded_strategy_with_trailing_zeros():
    # (1, -0.5, 0, 0) is 2-banded: with 2 groups its participations land in disjoint
    # rows, each a Poisson-subsampled Gaussian of the column norm sqrt(1.25)
    # (Choquette-Choo et al. 2023, Theorem 4): 10 steps are 5 such participations
    C = BandedToeplitz((1.0, -0.5, 0.0, 0.0))
    sampler = CyclicPoissonSampler(100, 0.1, 10, 2)
    assert is_amplified(C, sampler)
    want = compose(subsample(Gaussian(1.3 / math.sqrt(1.25)), rate=0.1), steps=5)
    got = correlated_mechanism(C, sampler, 1.3)
    assert got.epsilon(1e-5) == pytest.approx(want.epsilon(1e-5), rel=1e-9)


@pytest.mark.parametrize("strategy", [BandedToeplitz((1.0, -0.5, 0.25)),
                                      BufferedToeplitz((0.9,), (0.2,))])
def test_more_bands_than_the_cycle_is_not_amplified(strategy):
    # 3 bands (or a BLT) over a cycle of 2: neighbouring participations share rows, so
    # the run is the un-amplified Gaussian of the 2-min-separation sensitivity
    sampler = CyclicPoissonSampler(100, 0.1, 10, 2)
    assert not is_amplified(strategy, sampler)
    sens = sensitivity(strategy, MinSeparation(2, 5), 10).value
    got = correlated_mechanism(strategy, sampler, 1.3)
    assert got == MatrixMechanism(1.3, sens)
