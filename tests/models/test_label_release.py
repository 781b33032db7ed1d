"""PATE and Private kNN label release."""

import math

import numpy as np
import pytest

from privlearn.accounting import Gaussian, compose, subsample
from privlearn.accounting.analytic import gaussian_epsilon
from privlearn.models import PATE, PrivateKNN


def test_vote_histogram_hard_and_soft():
    votes = np.array([[0, 1, 2], [0, 1, 1], [2, 1, 1]])  # 3 teachers x 3 queries
    h = PATE.vote_histogram(votes, 3)
    np.testing.assert_array_equal(h, [[2, 0, 1], [0, 3, 0], [0, 2, 1]])
    soft = np.eye(3)[votes]
    np.testing.assert_array_equal(PATE.vote_histogram(soft), h)
    with pytest.raises(ValueError, match="probability"):
        PATE.vote_histogram(soft * 2)


def test_pate_gaussian_accounting_is_exact_composition():
    rng = np.random.default_rng(0)
    votes = rng.integers(0, 10, size=(50, 200))
    p = PATE(epsilon=2.0, delta=1e-6, random_state=0)
    p.release(votes, 10)
    s = p.noise_multiplier_
    assert p.mechanism_ == compose(Gaussian(s), steps=200)
    # 200 Gaussians with multiplier s = one Gaussian with s / sqrt(200)
    assert p.epsilon_ == pytest.approx(gaussian_epsilon(s / math.sqrt(200), 1e-6), rel=1e-9)
    assert p.epsilon_ <= 2.0


def test_pate_large_epsilon_returns_plurality():
    rng = np.random.default_rng(0)
    truth = rng.integers(0, 5, size=100)
    votes = np.where(rng.random((30, 100)) < 0.8, truth, rng.integers(0, 5, (30, 100)))
    lab = PATE(epsilon=1e4, delta=1e-6, random_state=0).release(votes, 5)
    np.testing.assert_array_equal(lab, np.argmax(PATE.vote_histogram(votes, 5), axis=1))


def test_pate_laplace_pure_dp():
    votes = np.random.default_rng(0).integers(0, 3, size=(20, 40))
    p = PATE(epsilon=1.0, delta=0.0, noise="laplace", random_state=0)
    p.release(votes, 3)
    # 40 Laplace releases with L1 sensitivity 2 and scale 2b: epsilon = 40 / b
    assert 40.0 / p.noise_multiplier_ <= 1.0 + 1e-12
    assert p.epsilon_ == pytest.approx(40.0 / p.noise_multiplier_, rel=1e-9)


def test_private_knn_matches_exact_knn_without_noise_and_full_sample():
    rng = np.random.default_rng(0)
    centers = np.array([[0.0, 0.0], [5.0, 5.0], [0.0, 5.0]])
    y = rng.integers(0, 3, size=600)
    X = centers[y] + rng.normal(scale=0.5, size=(600, 2))
    yq = rng.integers(0, 3, size=50)
    Q = centers[yq] + rng.normal(scale=0.5, size=(50, 2))
    knn = PrivateKNN(n_neighbors=15, sampling_rate=1.0, epsilon=1e4, delta=1e-6,
                     random_state=0).fit(X, y)
    lab = knn.release(Q)
    d = ((Q[:, None, :] - X[None]) ** 2).sum(-1)
    nn = np.argsort(d, axis=1)[:, :15]
    expected = np.array([np.bincount(y[row], minlength=3).argmax() for row in nn])
    np.testing.assert_array_equal(lab, expected)
    # the exact histogram is no longer stored (votes_ removed for privacy); at epsilon
    # 1e4 the noisy votes are within 0.5 of it
    assert np.all(np.round(knn.noisy_votes_).sum(axis=1) == 15)
    assert not hasattr(knn, "votes_")


def test_private_knn_subsampled_mechanism(monkeypatch):
    seen = []
    noisy_votes = PrivateKNN._noisy_votes

    def spy(votes, noise, s, rng):  # test-only view of the exact histogram
        seen.append(votes.copy())
        return noisy_votes(votes, noise, s, rng)

    monkeypatch.setattr(PrivateKNN, "_noisy_votes", staticmethod(spy))
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(500, 4)), rng.integers(0, 2, 500)
    knn = PrivateKNN(n_neighbors=5, sampling_rate=0.05, epsilon=1.0, delta=1e-6,
                     random_state=0).fit(X, y)
    knn.release(X[:100])
    assert knn.mechanism_ == compose(subsample(Gaussian(knn.noise_multiplier_), 0.05), 100)
    assert knn.epsilon_ <= 1.0
    # each sampled neighbour set has at most k members
    assert np.all(seen[0].sum(axis=1) <= 5) and seen[0].shape == (100, 2)


@pytest.mark.parametrize(
    "params,match",
    [
        ({"epsilon": 0.0}, "epsilon must be in"),
        ({"delta": 1.0}, "delta must be in"),
        ({"delta": 0.0}, "Gaussian noise.*laplace"),
        ({"noise": "x"}, "noise must be one of"),
    ],
)
def test_bad_input(params, match):
    votes = np.zeros((3, 4), dtype=int)
    with pytest.raises(ValueError, match=match):
        PATE(**params).release(votes, 2)
    knn = PrivateKNN(**params).fit(np.zeros((5, 2)), np.arange(5) % 2)
    with pytest.raises(ValueError, match=match):
        knn.release(np.zeros((2, 2)))


def test_knn_bad_shapes():
    with pytest.raises(ValueError, match="NaN"):
        PrivateKNN().fit(np.array([[np.nan, 1.0]]), [0])
    knn = PrivateKNN().fit(np.zeros((5, 2)), np.arange(5) % 2)
    with pytest.raises(ValueError, match="shape"):
        knn.release(np.zeros((2, 3)))
