"""Private label release in the knowledge-transfer model (seed 001, sections 3-5).

A private labelled data set is used to label public, unlabelled queries.

* **PATE** (Papernot et al. 2017, 2018): ``k`` teachers trained on disjoint parts of
  the private data vote on each query; the vote histogram (hard votes) or the sum of the
  teachers' probability vectors (soft votes) is released with noise and the label is its
  argmax. Adding/removing one private record changes one teacher, hence the histogram by
  at most ``sqrt(2)`` in L2 and ``2`` in L1. Releasing ``m`` queries is the composition of
  ``m`` Gaussian mechanisms with noise std ``sigma sqrt(2)`` (seed 001: ``N(0, 2
  sigma^2 I_C)``), or of ``m`` Laplace mechanisms with scale ``2 b``.
* **Private kNN** (Zhu, Yu & Wang 2020): for each query, a Poisson subsample of the
  private set (rate ``q``) is drawn, the ``k`` nearest sampled neighbours vote, and the
  histogram is released as above. One record changes at most one neighbour, so the
  sensitivity is again ``sqrt(2)`` / ``2``, and the release is the composition of ``m``
  Poisson-subsampled Gaussian (or Laplace) mechanisms.

Noise multipliers are calibrated to (epsilon, delta) through
:mod:`privlearn.accounting` and rounded up. The data-dependent analyses of PATE
(smooth sensitivity, confident-GNMax) are not used: the cost reported is data-independent.

References
----------
.. [1] N. Papernot et al. (2017), Semi-supervised knowledge transfer for deep learning
       from private training data, ICLR.
.. [2] N. Papernot et al. (2018), Scalable private learning with PATE, ICLR (GNMax).
.. [3] Y. Zhu, X. Yu, M. Chandraker, Y.-X. Wang (2020), Private-kNN: practical
       differential privacy for computer vision, CVPR.
.. [4] Seed 001 (autodp tutorial), sections 3-5.
"""

from __future__ import annotations

import math

import numpy as np

from privlearn.accounting import Gaussian, Laplace, calibrate, compose, subsample
from privlearn.models._base import (
    check_choice,
    check_int_param,
    check_positive_param,
    check_privacy_budget,
    make_rng,
    spent_epsilon,
)

__all__ = ["PATE", "PrivateKNN", "label_release_mechanism"]

_SQRT2 = math.sqrt(2.0)


def label_release_mechanism(
    noise: str, noise_multiplier: float, n_queries: int, sampling_rate: float = 1.0
):
    """``n_queries`` compositions of Gaussian(noise_multiplier) or Laplace(noise_multiplier)
    (Poisson-subsampled when ``sampling_rate < 1``). The multiplier is the noise
    std (resp. Laplace scale) divided by the vote histogram's L2 (resp. L1) sensitivity."""
    base = Gaussian(noise_multiplier) if noise == "gaussian" else Laplace(noise_multiplier)
    if sampling_rate < 1.0:
        base = subsample(base, sampling_rate, scheme="poisson")
    return compose(base, steps=n_queries)


class _LabelReleaseBase:
    def _validate(self):
        noise = check_choice("noise", self.noise, ("gaussian", "laplace"))
        eps, delta = check_privacy_budget(self.epsilon, self.delta, noise=noise)
        check_positive_param("noise_multiplier", self.noise_multiplier, allow_none=True)
        return noise, eps, delta

    def _calibrate(self, noise, eps, delta, m, q=1.0) -> float:
        if self.noise_multiplier is not None:
            s = float(self.noise_multiplier)
            spent = spent_epsilon(label_release_mechanism(noise, s, m, q), delta, self.accountant)
            if spent > eps:
                raise ValueError(
                    f"noise_multiplier={s} spends epsilon={spent:.6g} > epsilon={eps} for "
                    f"{m} queries at delta={delta}; leave it None to calibrate"
                )
            return s
        return float(
            calibrate(
                lambda s: label_release_mechanism(noise, s, m, q),
                eps,
                delta,
                accountant=self.accountant,
            )
        )

    def _noisy_argmax(self, votes: np.ndarray, noise: str, s: float, rng) -> np.ndarray:
        if noise == "gaussian":
            noisy = votes + rng.normal(scale=s * _SQRT2, size=votes.shape)
        else:
            noisy = votes + rng.laplace(scale=s * 2.0, size=votes.shape)
        self.noisy_votes_ = noisy
        return np.argmax(noisy, axis=1)


class PATE(_LabelReleaseBase):
    """PATE noisy-argmax label release from teachers' votes (seed 001, section 3).

    Parameters
    ----------
    epsilon : float > 0
        Budget for the whole batch of queries released by one :meth:`release` call.
    delta : float in [0, 1)
        Must be > 0 for Gaussian noise.
    noise : {"gaussian", "laplace"}
    noise_multiplier : float or None
        Gaussian: the std of the noise on each vote count is ``noise_multiplier *
        sqrt(2)``; Laplace: the scale is ``noise_multiplier * 2``. None: calibrated.
    accountant : str
    random_state : None, int, Generator

    Attributes (after :meth:`release`)
    ----------------------------------
    labels_, noisy_votes_, noise_multiplier_, mechanism_, epsilon_, delta_, n_queries_
    """

    def __init__(
        self,
        epsilon: float = 1.0,
        delta: float = 1e-6,
        noise: str = "gaussian",
        noise_multiplier: float | None = None,
        accountant: str = "pld",
        random_state=None,
    ):
        self.epsilon = epsilon
        self.delta = delta
        self.noise = noise
        self.noise_multiplier = noise_multiplier
        self.accountant = accountant
        self.random_state = random_state

    @staticmethod
    def vote_histogram(teacher_outputs, n_classes: int | None = None) -> np.ndarray:
        """Aggregate teachers' outputs into per-query vote vectors (n_queries, C).

        ``teacher_outputs`` is either integer labels of shape (n_teachers, n_queries)
        (hard votes: the histogram) or probabilities of shape (n_teachers, n_queries, C)
        (soft votes: their sum; each row must lie in the probability simplex so that one
        teacher moves the sum by at most sqrt(2) in L2 and 2 in L1).
        """
        T = np.asarray(teacher_outputs)
        if T.ndim == 2:
            if not np.issubdtype(T.dtype, np.integer):
                if not np.all(np.isfinite(T)) or not np.all(T == np.round(T)):
                    raise ValueError("hard teacher votes must be integer class labels")
                T = T.astype(np.int64)
            if T.size and T.min() < 0:
                raise ValueError(f"class labels must be >= 0, got min {T.min()}")
            C = int(n_classes) if n_classes is not None else int(T.max()) + 1
            if T.size and T.max() >= C:
                raise ValueError(f"label {T.max()} out of range for n_classes={C}")
            votes = np.zeros((T.shape[1], C))
            for row in T:
                np.add.at(votes, (np.arange(T.shape[1]), row), 1.0)
            return votes
        if T.ndim == 3:
            T = T.astype(float)
            if not np.all(np.isfinite(T)):
                raise ValueError("teacher probabilities contain NaN or infinity")
            if np.any(T < 0) or not np.allclose(T.sum(axis=2), 1.0, atol=1e-6):
                raise ValueError("soft teacher votes must be probability vectors (>= 0, sum 1)")
            return T.sum(axis=0)
        raise ValueError(
            "teacher_outputs must have shape (n_teachers, n_queries) or "
            f"(n_teachers, n_queries, n_classes), got shape {T.shape}"
        )

    def release(self, teacher_outputs, n_classes: int | None = None) -> np.ndarray:
        """Release one noisy label per query; the whole call is (epsilon, delta)-DP."""
        noise, eps, delta = self._validate()
        votes = self.vote_histogram(teacher_outputs, n_classes)
        m = votes.shape[0]
        if m < 1:
            raise ValueError("need at least one query")
        rng = make_rng(self.random_state)
        s = self._calibrate(noise, eps, delta, m)
        self.labels_ = self._noisy_argmax(votes, noise, s, rng)
        self.noise_multiplier_ = s
        self.mechanism_ = label_release_mechanism(noise, s, m)
        self.n_queries_ = m
        self.delta_ = delta
        self.epsilon_ = spent_epsilon(self.mechanism_, delta, self.accountant)
        return self.labels_


class PrivateKNN(_LabelReleaseBase):
    """Private kNN label release with Poisson-subsampled neighbours (seed 001, section 4).

    :meth:`fit` stores the private labelled set (no privacy spent); :meth:`release`
    labels a batch of public queries at total cost (epsilon, delta).

    Parameters
    ----------
    n_neighbors : int
        ``k``.
    sampling_rate : float in (0, 1]
        Poisson rate ``q`` of the private subsample drawn for each query.
    epsilon, delta, noise, noise_multiplier, accountant, random_state
        As :class:`PATE`.
    """

    def __init__(
        self,
        n_neighbors: int = 50,
        sampling_rate: float = 0.1,
        epsilon: float = 1.0,
        delta: float = 1e-6,
        noise: str = "gaussian",
        noise_multiplier: float | None = None,
        accountant: str = "pld",
        random_state=None,
    ):
        self.n_neighbors = n_neighbors
        self.sampling_rate = sampling_rate
        self.epsilon = epsilon
        self.delta = delta
        self.noise = noise
        self.noise_multiplier = noise_multiplier
        self.accountant = accountant
        self.random_state = random_state

    def fit(self, X, y) -> PrivateKNN:
        X = np.asarray(X, dtype=float)
        y = np.asarray(y)
        if X.ndim != 2:
            raise ValueError(f"X must be 2-D (n_samples, n_features), got shape {X.shape}")
        if y.ndim != 1 or y.shape[0] != X.shape[0]:
            raise ValueError(f"y must be 1-D with {X.shape[0]} labels, got shape {y.shape}")
        if not np.all(np.isfinite(X)):
            raise ValueError("X contains NaN or infinity")
        self.classes_, y_idx = np.unique(y, return_inverse=True)
        self._X = X
        self._y = y_idx
        self._sqnorm = np.einsum("ij,ij->i", X, X)
        self.n_features_in_ = X.shape[1]
        return self

    def release(self, X_query, batch_size: int = 256) -> np.ndarray:
        """Noisy kNN labels for the queries; the whole call is (epsilon, delta)-DP."""
        if not hasattr(self, "_X"):
            raise ValueError("call fit(X_private, y_private) before release")
        noise, eps, delta = self._validate()
        k = check_int_param("n_neighbors", self.n_neighbors, 1)
        q = self.sampling_rate
        if isinstance(q, bool) or not isinstance(q, int | float) or not 0 < float(q) <= 1:
            raise ValueError(f"sampling_rate must be in (0, 1], got {q!r}")
        q = float(q)
        Q = np.asarray(X_query, dtype=float)
        if Q.ndim != 2 or Q.shape[1] != self.n_features_in_:
            raise ValueError(
                f"X_query must have shape (n_queries, {self.n_features_in_}), got {Q.shape}"
            )
        if not np.all(np.isfinite(Q)):
            raise ValueError("X_query contains NaN or infinity")
        m = Q.shape[0]
        if m < 1:
            raise ValueError("need at least one query")
        rng = make_rng(self.random_state)
        s = self._calibrate(noise, eps, delta, m, q)
        C = self.classes_.size
        votes = np.zeros((m, C))
        n = self._X.shape[0]
        for start in range(0, m, batch_size):
            Qb = Q[start : start + batch_size]
            d2 = self._sqnorm[None, :] - 2.0 * Qb @ self._X.T
            # Poisson subsample per query: excluded points get infinite distance
            keep = rng.random((Qb.shape[0], n)) < q
            d2 = np.where(keep, d2, np.inf)
            kk = min(k, n)
            nn = np.argpartition(d2, kk - 1, axis=1)[:, :kk]
            valid = np.take_along_axis(keep, nn, axis=1)
            labels = self._y[nn]
            for c in range(C):
                votes[start : start + Qb.shape[0], c] = np.sum((labels == c) & valid, axis=1)
        self.votes_ = votes
        idx = self._noisy_argmax(votes, noise, s, rng)
        self.labels_ = self.classes_[idx]
        self.noise_multiplier_ = s
        self.mechanism_ = label_release_mechanism(noise, s, m, q)
        self.n_queries_ = m
        self.delta_ = delta
        self.epsilon_ = spent_epsilon(self.mechanism_, delta, self.accountant)
        return self.labels_
