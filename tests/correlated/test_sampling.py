"""Samplers keep the participation schema they state; a sampler that breaks its
separation is caught by check_participation."""

from __future__ import annotations

import numpy as np
import pytest

from privlearn.correlated import FixedEpochs, MinSeparation
from privlearn.correlated.sampling import (
    BallsInBinsSampler,
    CyclicPoissonSampler,
    check_participation,
)


@pytest.mark.parametrize("cycle", [1, 3, 8])
def test_cyclic_poisson_keeps_separation_and_rate(cycle):
    s = CyclicPoissonSampler(dataset_size=2000, sampling_rate=0.3, steps=5 * cycle + 2,
                             cycle_length=cycle)
    batches = list(s.batches(0))
    check_participation(batches, s.participation, s.steps)
    sizes = np.array([b.size for b in batches])
    assert abs(sizes.mean() - 0.3 * 2000 / cycle) < 6 * np.sqrt(2000 / cycle * 0.3)
    assert s.participation == MinSeparation(cycle, -(-s.steps // cycle))


def test_balls_in_bins_uses_every_record_once_per_cycle():
    s = BallsInBinsSampler(dataset_size=500, steps=20, cycle_length=5)
    batches = list(s.batches(1))
    check_participation(batches, s.participation, 20)
    for start in range(0, 20, 5):
        ids = np.concatenate(batches[start:start + 5])
        assert np.array_equal(np.sort(ids), np.arange(500))
    check_participation(batches, FixedEpochs(4), 20)


def test_planted_sampler_bugs_are_caught():
    s = BallsInBinsSampler(dataset_size=200, steps=12, cycle_length=4)
    good = list(s.batches(2))
    # a sampler that re-draws the bins each epoch can put a record in adjacent steps
    rng = np.random.default_rng(3)
    redrawn = [b for _ in range(3) for b in BallsInBinsSampler(200, 4, 4).batches(rng)]
    with pytest.raises(ValueError, match="closer than min_sep=4"):
        check_participation(redrawn, s.participation, 12)
    # a sampler that adds one record to a neighbouring batch
    leaky = [b.copy() for b in good]
    leaky[5] = np.append(leaky[5], good[4][0])
    with pytest.raises(ValueError, match="closer than min_sep|participates"):
        check_participation(leaky, s.participation, 12)
    # too many participations
    with pytest.raises(ValueError, match="more than the 2"):
        check_participation(good, MinSeparation(4, 2), 12)


def test_samplers_validate_arguments():
    with pytest.raises(ValueError, match="sampling_rate must be in \\(0, 1\\]"):
        CyclicPoissonSampler(100, 1.5, 10)
    with pytest.raises(ValueError, match="cycle_length must be an integer >= 1"):
        BallsInBinsSampler(100, 10, 0)
