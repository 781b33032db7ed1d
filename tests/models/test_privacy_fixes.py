"""Issue 9 (NumPy estimators): each privacy bug reproduced; these tests fail on the code
before the fix (commit b9715e0) and pass after it.

Names introduced by the fix are imported inside the tests, so that on the old code each
test fails on its own assertion rather than the whole module on an import.
"""

import dataclasses
import math
import pickle
import warnings

import numpy as np
import pytest

import privlearn.models.linear as linear_mod
from privlearn.accounting import Gaussian, compose, subsample
from privlearn.accounting.analytic import gaussian_epsilon
from privlearn.errors import PrivacyLeakWarning
from privlearn.models import (
    PATE,
    AdaSSPRegressor,
    DPSGDClassifier,
    NoisyGDRegressor,
    PrivateKNN,
    SSPRegressor,
)

SEED_KW = dict(delta=1e-6, x_bound=1.0, y_bound=5.0, fit_intercept=False)


def _knn_data(seed=0, n=400):
    rng = np.random.default_rng(seed)
    centers = np.array([[0.0, 0.0], [4.0, 4.0], [0.0, 4.0]])
    y = rng.integers(0, 3, size=n)
    X = centers[y] + rng.normal(scale=0.7, size=(n, 2))
    return X, y, centers


# --- PrivateKNN: no exact votes, a shareable release ---------------------------------

def test_knn_release_keeps_no_exact_vote_histogram():
    X, y, centers = _knn_data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrivacyLeakWarning)  # classes inferred
        knn = PrivateKNN(n_neighbors=9, sampling_rate=0.5, epsilon=1.0,
                         random_state=0).fit(X, y)
    knn.release(centers[[0, 1, 2, 0]])
    integer_valued = [k for k, v in vars(knn).items()
                      if isinstance(v, np.ndarray) and v.ndim == 2 and v.shape[0] == 4
                      and np.all(v == np.round(v))]
    assert integer_valued == []  # the exact histogram (integers) is nowhere on the object
    with pytest.raises(AttributeError, match="removed for privacy"):
        knn.votes_  # noqa: B018


def test_knn_public_release_is_shareable_and_holds_no_private_data():
    from privlearn.models import LabelRelease

    X, y, centers = _knn_data()
    X[17, 0] = 1.2345678901234567  # a distinctive private value
    knn = PrivateKNN(n_neighbors=9, epsilon=1.0, classes=[0, 1, 2], random_state=0).fit(X, y)
    labels = knn.release(centers)
    pub = knn.public_release()
    assert isinstance(pub, LabelRelease)
    np.testing.assert_array_equal(pub.labels, labels)
    assert pub.noisy_votes.shape == (3, 3) and pub.epsilon == knn.epsilon_
    blob = pickle.dumps(pub)
    assert np.float64(1.2345678901234567).tobytes() not in blob
    # the fitted object itself holds the data, as documented
    assert np.float64(1.2345678901234567).tobytes() in pickle.dumps(knn)
    assert "never" in PrivateKNN.__doc__ and "share" in PrivateKNN.__doc__
    with pytest.raises(dataclasses.FrozenInstanceError):
        pub.epsilon = 0.0
    assert not pub.labels.flags.writeable


# --- budget accumulates ---------------------------------------------------------------

def test_knn_second_release_reports_the_composed_total():
    X, y, centers = _knn_data()
    q = 0.2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrivacyLeakWarning)  # classes inferred
        knn = PrivateKNN(n_neighbors=9, sampling_rate=q, epsilon=1.0,
                         random_state=0).fit(X, y)
    knn.release(centers)
    first, m1 = knn.epsilon_, knn.mechanism_
    knn.release(centers[:2])
    m2 = compose(subsample(Gaussian(knn.noise_multiplier_), q), steps=2)
    total = compose([m1, m2])
    # the old code reported the second call alone
    assert knn.epsilon_ == pytest.approx(total.epsilon(1e-6, "pld"), rel=1e-12)
    assert knn.epsilon_ > max(first, m2.epsilon(1e-6, "pld")) + 0.1
    assert knn.mechanism_ == total == knn.public_release().mechanism
    assert knn.last_mechanism_ == m2
    assert knn.last_epsilon_ <= 1.0 and knn.n_queries_ == 5
    # fit starts a new account
    knn.fit(X, y)
    assert not hasattr(knn, "epsilon_")
    knn.release(centers[:2])
    assert knn.epsilon_ == knn.last_epsilon_


def test_pate_releases_accumulate_with_exact_gaussian_composition():
    rng = np.random.default_rng(0)
    p = PATE(epsilon=1.0, delta=1e-6, random_state=0)
    p.release(rng.integers(0, 4, size=(20, 30)), 4)
    s1 = p.noise_multiplier_
    p.release(rng.integers(0, 4, size=(20, 50)), 4)
    s2 = p.noise_multiplier_
    # Gaussians compose exactly: 1/mu^2 adds up
    mu = 1 / math.sqrt(30 / s1**2 + 50 / s2**2)
    assert p.epsilon_ == pytest.approx(gaussian_epsilon(mu, 1e-6), rel=1e-6)
    assert p.epsilon_ > 1.0 >= p.last_epsilon_
    assert p.n_queries_ == 80 and p.public_release().labels.shape == (80,)


def test_repeated_release_with_an_int_seed_draws_fresh_noise():
    # Reusing the first call's noise would let the two releases be subtracted.
    votes = np.random.default_rng(1).integers(0, 3, size=(10, 40))
    p = PATE(epsilon=1.0, random_state=5)
    p.release(votes, 3)
    a = p.noisy_votes_.copy()
    p.release(votes, 3)
    assert not np.allclose(a, p.noisy_votes_)
    # the first call is unchanged (reproducible)
    np.testing.assert_array_equal(PATE(epsilon=1.0, random_state=5).release(votes, 3),
                                  np.argmax(a, axis=1))


# --- PATE orientation -----------------------------------------------------------------

def test_pate_refuses_transposed_votes():
    rng = np.random.default_rng(0)
    votes = rng.integers(0, 10, size=(10, 111))  # 10 teachers x 111 queries
    with pytest.raises(ValueError, match=r"ambiguous.*\(n_teachers, n_queries"):
        PATE(epsilon=1.0).release(votes.T, 10)  # 111 x 10: would give 10 labels
    with pytest.raises(ValueError, match="transposed"):
        PATE(epsilon=1.0).release(votes.T, 10, n_teachers=10)
    assert PATE(epsilon=1.0, random_state=0).release(votes, 10, n_teachers=10).shape == (111,)
    # more teachers than queries is fine once confirmed
    few = rng.integers(0, 10, size=(50, 3))
    assert PATE(epsilon=1.0, random_state=0).release(few, 10, n_teachers=50).shape == (3,)
    with pytest.raises(ValueError, match="n_classes is required"):
        PATE(epsilon=1.0).release(votes, n_teachers=10)
    soft = np.full((10, 5, 4), 0.25)
    with pytest.raises(ValueError, match="does not match"):
        PATE(epsilon=1.0).release(soft, 3, n_teachers=10)


# --- linear estimators: no clipping counts --------------------------------------------

@pytest.mark.parametrize("cls", [SSPRegressor, AdaSSPRegressor, NoisyGDRegressor])
def test_linear_models_store_no_clipping_counts(cls):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 3))
    y = rng.normal(scale=3.0, size=200)
    kw = dict(epsilon=1.0, delta=1e-6, x_bound=1.0, y_bound=2.0, random_state=0)
    if cls is NoisyGDRegressor:
        kw.update(noise_multiplier=None, n_iter=20)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = cls(**kw).fit(X, y)
    for name in ("n_rows_clipped_", "n_labels_clipped_"):
        assert name not in vars(m)
        with pytest.raises(AttributeError, match="removed for privacy"):
            getattr(m, name)
    # the person fitting is told instead
    from privlearn.models import DataClippedWarning

    clip = [w for w in caught if issubclass(w.category, DataClippedWarning)]
    assert len(clip) == 1 and "rows" in str(clip[0].message)
    fitted_ints = [k for k, v in vars(m).items() if k.endswith("_")
                   and isinstance(v, int | np.integer) and not isinstance(v, bool)]
    assert set(fitted_ints) <= {"n_features_in_", "n_iter_"}


# --- label interval -------------------------------------------------------------------

def _capture(monkeypatch, name):
    seen = {}
    orig = getattr(linear_mod, name)

    def spy(*args, **kwargs):
        seen["args"] = args
        return orig(*args, **kwargs)

    monkeypatch.setattr(linear_mod, name, spy)
    return seen


def test_label_interval_sensitivity(monkeypatch):
    rng = np.random.default_rng(0)
    X = rng.uniform(-0.5, 0.5, size=(300, 2))
    y = 11.0 + X @ [1.0, -1.0] + rng.normal(scale=0.1, size=300)
    seen = _capture(monkeypatch, "ssp_coefficients")
    # with an intercept: centred at the public midpoint 11, Y = half-width 1
    m = SSPRegressor(epsilon=5.0, x_bound=1.0, y_bound=(10.0, 12.0),
                     random_state=0).fit(X, y)
    assert seen["args"][5] == 1.0
    assert abs(m.intercept_ - 11.0) < 0.5  # the midpoint is added back
    # without an intercept no shift is possible: Y = max(|lo|, |hi|)
    SSPRegressor(epsilon=5.0, x_bound=1.0, y_bound=(10.0, 12.0), fit_intercept=False,
                 random_state=0).fit(X, y)
    assert seen["args"][5] == 12.0
    SSPRegressor(epsilon=5.0, x_bound=1.0, y_bound=(-7.0, 3.0), fit_intercept=False,
                 random_state=0).fit(X, np.clip(y, -7, 3))
    assert seen["args"][5] == 7.0
    # a float keeps its meaning [-Y, Y]
    SSPRegressor(epsilon=5.0, x_bound=1.0, y_bound=12.0, random_state=0).fit(X, y)
    assert seen["args"][5] == 12.0


def test_label_interval_is_never_optimistic():
    """Naive ground truth: the largest change of X^T (y - c) from adding one record within
    the bounds never exceeds x_bound * Y, for the Y the estimator uses."""
    rng = np.random.default_rng(1)
    for lo, hi, icpt in [(10.0, 12.0, True), (10.0, 12.0, False), (-7.0, 3.0, False),
                         (-7.0, 3.0, True), (0.0, 5.0, False)]:
        est = SSPRegressor(y_bound=(lo, hi), fit_intercept=icpt)
        Y = est._label_sensitivity_bound(lo, hi)
        c = est._label_centre() if icpt else 0.0
        for yv in np.concatenate([[lo, hi], rng.uniform(lo, hi, 50)]):
            # x with ||x|| = 1 (augmented rows are scaled with x_bound_eff likewise)
            assert abs(yv - c) <= Y + 1e-12
        assert Y == (hi - lo) / 2 if icpt else Y == max(abs(lo), abs(hi))


def test_label_interval_clips_to_the_interval_and_fits():
    rng = np.random.default_rng(0)
    X = rng.uniform(-0.5, 0.5, size=(2000, 2))
    y = 3.0 + X @ [1.0, -1.0]
    y[:5] = 100.0  # clipped to 4, not to 100
    m = NoisyGDRegressor(epsilon=1e3, x_bound=1.0, y_bound=(2.0, 4.0), noise_multiplier=None,
                         n_iter=3000, learning_rate=1e-3, random_state=0)
    with pytest.warns(UserWarning, match="5 labels"):
        m.fit(X, y)
    pred = m.predict(X[5:])
    assert np.mean((pred - y[5:]) ** 2) < 0.05


@pytest.mark.parametrize("bad", [(5.0, 1.0), (1.0, 1.0), (0.0, np.inf), (1.0,), "a",
                                 -1.0, 0.0, (0.0, 1.0, 2.0), (np.nan, 1.0), (True, 2.0)])
def test_label_interval_validation(bad):
    X, y = np.zeros((5, 2)), np.zeros(5)
    with pytest.raises(ValueError, match=r"y_bound.*got"):
        SSPRegressor(y_bound=bad).fit(X, y)


# --- NoisyGD's default learning rate --------------------------------------------------

def test_noisygd_default_learning_rate_is_accounted(monkeypatch):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(500, 3))
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    y = np.clip(X @ [1.0, 2.0, 0.5], -1, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyLeakWarning)
        m = NoisyGDRegressor(epsilon=1.0, x_bound=1.0, fit_intercept=False,
                             random_state=0).fit(X, y)
    lam = np.linalg.eigvalsh(X.T @ X)[-1]
    assert m.smoothness_ != pytest.approx(lam, rel=1e-9)  # not the exact eigenvalue
    # the smoothness release is part of what is accounted
    (sl, one), (gd, steps) = m.mechanism_.parts
    assert one == 1 and gd == Gaussian(500.0) and steps == m.n_iter_
    assert m.epsilon_ == pytest.approx(m.mechanism_.epsilon(1e-6, "pld"), rel=1e-12)
    assert m.epsilon_ <= 1.0
    # the learning rate depends on the data only through the noisy release:
    # the noise multiplier of the release is a function of (epsilon, delta) alone
    m2 = NoisyGDRegressor(epsilon=1.0, x_bound=1.0, fit_intercept=False,
                          random_state=0).fit(X[:250], y[:250])
    assert m2.mechanism_.parts[0][0] == sl
    for mode, match in [("data", "eigenvalue"), ("public", "number of rows")]:
        with pytest.warns(PrivacyLeakWarning, match=match):
            NoisyGDRegressor(epsilon=1.0, x_bound=1.0, fit_intercept=False, smoothness=mode,
                             random_state=0).fit(X, y)


# The utility acceptance (median training MSE <= 0.655 over 50 fits on California,
# epsilon 2, delta 1e-6, seed preprocessing) with the new default is tested in
# tests/models/test_linear.py: test_noisygd_seed000_* (fast, 50 batched chains) and
# test_noisygd_seed000_public_fits_50 (slow, 50 public fits, random_state 0..49).


# --- classes learned from the data ----------------------------------------------------

def test_dpsgd_classes_inferred_from_private_labels_warn():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(100, 2))
    y = np.where(X[:, 0] > 0, 7, 3)
    with pytest.warns(PrivacyLeakWarning, match="classes"):
        DPSGDClassifier(n_iter=5, random_state=0).fit(X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyLeakWarning)
        clf = DPSGDClassifier(n_iter=5, classes=[3, 7], random_state=0).fit(X, y)
        # with public classes, a private set with one class present is fine (not refused)
        DPSGDClassifier(n_iter=5, classes=[3, 7], random_state=0).fit(X, np.full(100, 3))
    assert list(clf.classes_) == [3, 7]
    with pytest.raises(ValueError, match="not in classes"):
        DPSGDClassifier(n_iter=5, classes=[0, 1]).fit(X, y)
    with pytest.raises(ValueError, match="exactly 2"):
        DPSGDClassifier(n_iter=5, classes=[0, 1, 2]).fit(X, y)


def test_knn_classes_inferred_from_private_labels_warn():
    X, y, _ = _knn_data()
    with pytest.warns(PrivacyLeakWarning, match="classes"):
        PrivateKNN().fit(X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyLeakWarning)
        knn = PrivateKNN(classes=[2, 1, 0, 5]).fit(X, y)
    assert knn.classes_.tolist() == [2, 1, 0, 5]
    np.testing.assert_array_equal(knn.classes_[knn._y], y)
    with pytest.raises(ValueError, match="not in classes"):
        PrivateKNN(classes=[0, 1]).fit(X, y)


# --- parameter validation: name, range, value, suggestion ------------------------------

@pytest.mark.parametrize("make", [
    lambda v: SSPRegressor(epsilon=v),
    lambda v: NoisyGDRegressor(n_iter=v, noise_multiplier=None),
    lambda v: DPSGDClassifier(noise=v, classes=[0, 1]),
])
def test_wrong_types_raise_type_error_that_is_also_a_value_error(make):
    X, y = np.zeros((4, 2)), np.array([0.0, 1.0, 0.0, 1.0])
    with pytest.raises(TypeError, match="must be") as info:
        make([1]).fit(X, y)
    assert isinstance(info.value, ValueError)  # earlier versions raised ValueError
    assert "[1]" in str(info.value)


def test_error_messages_name_range_value_and_suggest():
    X, y = np.zeros((4, 2)), np.array([0.0, 1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match=r"epsilon must be in \(0, inf\).*-1.*typically"):
        SSPRegressor(epsilon=-1).fit(X, y)
    with pytest.raises(ValueError, match=r"delta must be in \[0, 1\).*2.*e\.g\. 1e-6"):
        SSPRegressor(delta=2).fit(X, y)
    with pytest.raises(ValueError, match="noise must be one of.*'gausian'.*did you mean "
                                         "'gaussian'"):
        DPSGDClassifier(noise="gausian", classes=[0, 1]).fit(X, y)
    with pytest.raises(ValueError, match="smoothness must be one of.*'privat'.*did you mean"):
        NoisyGDRegressor(smoothness="privat").fit(X, y)
    with pytest.raises(ValueError, match=r"sampling_rate must be in \(0, 1\].*1.5.*Poisson"):
        DPSGDClassifier(sampling_rate=1.5, classes=[0, 1]).fit(X, y)
