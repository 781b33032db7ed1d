"""The label-release experiment's teachers: PATE's accounting assumes one record moves
one teacher's votes (sensitivity sqrt(2) in L2, 2 in L1), under add/remove neighbouring."""

from __future__ import annotations

import numpy as np
import pytest

from privlearn.experiments.label_release import nearest_centroid_teachers
from privlearn.models import PATE


@pytest.mark.parametrize("seed", range(5))
def test_adding_a_record_changes_one_teachers_votes(seed: int) -> None:
    """Add one record (the same partition draw otherwise, i.e. the same generator seed):
    at most one teacher's votes change, so every query's histogram moves by at most
    sqrt(2) in L2 and 2 in L1 -- what PATE's noise is calibrated to."""
    data = np.random.default_rng(100 + seed)
    n, k, n_classes = 400, 20, 4
    X = data.normal(size=(n, 3))
    y = data.integers(n_classes, size=n)
    Q = data.normal(size=(50, 3))
    # a record far from the others in its class, so its teacher's centroid moves
    z, label = 6.0 * data.normal(size=(1, 3)), data.integers(n_classes, size=1)
    before = nearest_centroid_teachers(X, y, k, Q, np.random.default_rng(seed), n_classes)
    after = nearest_centroid_teachers(np.vstack([X, z]), np.concatenate([y, label]), k, Q,
                                      np.random.default_rng(seed), n_classes)
    changed = np.flatnonzero(np.any(before != after, axis=1))
    assert changed.size <= 1, f"teachers {changed} changed their votes"
    diff = PATE.vote_histogram(after, n_classes) - PATE.vote_histogram(before, n_classes)
    assert np.all(np.linalg.norm(diff, axis=1) <= np.sqrt(2) + 1e-12)
    assert np.all(np.abs(diff).sum(axis=1) <= 2)


def test_teachers_partition_the_records() -> None:
    """Every record trains exactly one teacher: the teachers' votes are those of
    nearest-centroid classifiers on disjoint parts whose union is the data."""
    data = np.random.default_rng(0)
    X = data.normal(size=(300, 2))
    y = data.integers(3, size=300)
    Q = X[:40]
    votes = nearest_centroid_teachers(X, y, 5, Q, np.random.default_rng(7), 3)
    owner = np.random.default_rng(7).integers(5, size=300)  # the documented draw
    assert sorted(np.concatenate([np.flatnonzero(owner == t) for t in range(5)])) == list(
        range(300))
    for t in range(5):  # each teacher is the nearest-centroid rule on its own part
        Xi, yi = X[owner == t], y[owner == t]
        cent = np.stack([Xi[yi == c].mean(axis=0) for c in range(3)])
        expect = np.argmin(((Q[:, None, :] - cent[None]) ** 2).sum(axis=2), axis=1)
        np.testing.assert_array_equal(votes[t], expect)
