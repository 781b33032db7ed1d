"""PATE and Private kNN label release: accounting, the account across calls, what may be
shared, orientation and classes, bad input."""

import dataclasses
import math
import pickle
import warnings

import numpy as np
import pytest

from privlearn.accounting import Gaussian, compose, subsample
from privlearn.accounting.analytic import gaussian_epsilon
from privlearn.errors import PrivacyLeakWarning
from privlearn.models import PATE, LabelRelease, PrivateKNN

#: PrivateKNN's notice for classes=None (a leak of the label set) is the subject of one test,
#: which expects it with pytest.warns; the others leave classes to their defaults
pytestmark = pytest.mark.filterwarnings(
    "ignore:PrivateKNN. classes=None:privlearn.errors.PrivacyLeakWarning")


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
    # the exact histogram is not stored; at epsilon 1e4 the noisy votes are within 0.5
    # of it
    assert np.all(np.round(knn.noisy_votes_).sum(axis=1) == 15)


def test_private_knn_subsampled_mechanism(monkeypatch):
    seen = []
    noisy_votes = PrivateKNN._noisy_votes

    def spy(votes, plan, rng):  # test-only view of the exact histogram
        seen.append(votes.copy())
        return noisy_votes(votes, plan, rng)

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


def test_knn_public_release_is_shareable_and_holds_no_private_data():
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
    # the total of both calls, not the second call alone
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


def test_pate_votes_without_a_query_are_refused_as_such_not_as_transposed():
    """(10 teachers, 0 queries): the orientation was said to be ambiguous, and the advice
    to transpose or pass n_teachers could not help."""
    votes = np.zeros((10, 0), dtype=int)
    for kw in ({}, {"n_teachers": 10}):
        with pytest.raises(ValueError, match=r"at least one query.*\(10, 0\)"):
            PATE(epsilon=1.0).release(votes, 3, **kw)
    with pytest.raises(ValueError, match="n_classes is required"):
        PATE(epsilon=1.0).release(votes, n_teachers=10)
    soft = np.full((10, 5, 4), 0.25)
    with pytest.raises(ValueError, match="does not match"):
        PATE(epsilon=1.0).release(soft, 3, n_teachers=10)


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


def test_knn_refuses_a_continuous_target_without_public_classes():
    """A regression target with classes=None would make every distinct value a class,
    published in classes_ (scikit-learn's classifiers refuse it the same way); refused
    before anything is stored. With the public label set given, non-integer labels that
    are in it are fine."""
    X, _, _ = _knn_data()
    y = np.random.default_rng(0).normal(size=X.shape[0])
    knn = PrivateKNN()
    with pytest.raises(ValueError, match="continuous"):
        knn.fit(X, y)
    assert not hasattr(knn, "classes_") and not hasattr(knn, "_X")
    halves = np.where(y > 0, 1.5, 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyLeakWarning)
        knn = PrivateKNN(classes=[0.5, 1.5], random_state=0).fit(X, halves)
    assert set(knn.release(X[:5]).tolist()) <= {0.5, 1.5}


def test_knn_an_extreme_private_row_is_a_neighbour_like_any_other():
    """A finite private row whose squared norm overflows (distance inf - inf, not a
    number) is ordered with the points at infinity, by index: with every record a
    neighbour (k = n, q = 1) the votes are the class counts, that row's included (naive
    ground truth). It used to leave the neighbour selection short and fail the release
    with a reshape error after the budget was spent."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(30, 2))
    y = (X[:, 0] > 0).astype(int)
    X[0] = [1e308, 1e308]
    knn = PrivateKNN(n_neighbors=30, sampling_rate=1.0, classes=[0, 1], noise_multiplier=0.01,
                     epsilon=1e5, random_state=0).fit(X, y)
    counts = np.bincount(y, minlength=2)
    knn.release(rng.normal(size=(4, 2)))
    np.testing.assert_allclose(knn.noisy_votes_, np.tile(counts, (4, 1)), atol=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no overflow warning escapes
        knn.release(rng.normal(size=(4, 2)))


def test_soft_votes_within_the_tolerance_are_put_on_the_simplex():
    """Rows summing to 1 + 9e-6 pass the tolerance; unscaled, one teacher would move the
    vote sum by more than the accounted sqrt(2) (L2) / 2 (L1). They are released as
    their rescaled copy: same noise, same noisy votes as the exact probabilities."""
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(3), size=(9, 4))
    exact = PATE(noise_multiplier=1.0, epsilon=100.0, random_state=0)
    loose = PATE(noise_multiplier=1.0, epsilon=100.0, random_state=0)
    exact.release(probs, n_teachers=9)
    loose.release(probs * (1 + 9e-6), n_teachers=9)
    np.testing.assert_allclose(loose.noisy_votes_, exact.noisy_votes_, rtol=0, atol=1e-12)
    np.testing.assert_allclose(PATE.vote_histogram(probs * (1 + 9e-6)).sum(axis=1), 9.0,
                               rtol=1e-12)


def test_knn_votes_move_by_the_accounted_sensitivity_with_tied_neighbours(monkeypatch):
    """Duplicated rows tie at the k-th distance. Removing one private record must change
    each query's exact vote histogram by at most sqrt(2) in L2 and 2 in L1 (the accounted
    sensitivity); choosing an arbitrary subset of the tied records moved it by up to
    2 sqrt(2). The exact votes are read by releasing without noise (test only), at
    sampling rate 1, against a brute-force histogram (stable sort: lower index first)."""
    from privlearn.models import label_release

    monkeypatch.setattr(label_release._LabelReleaseBase, "_noisy_votes",
                        staticmethod(lambda votes, plan, rng: votes.copy()))
    rng = np.random.default_rng(0)
    Q = np.array([[0.5, 0.5], [0.0, 0.0], [1.0, 1.0]])

    def votes(X, y, k):
        knn = PrivateKNN(n_neighbors=k, sampling_rate=1.0, noise_multiplier=1.0,
                         epsilon=100.0, delta=1e-5, classes=[0, 1, 2], random_state=0)
        knn.fit(X, y).release(Q)
        return knn.noisy_votes_

    def brute(X, y, k):
        d = ((Q[:, None, :] - X[None]) ** 2).sum(-1)
        nn = np.argsort(d, axis=1, kind="stable")[:, :k]
        return np.stack([np.bincount(y[row], minlength=3) for row in nn]).astype(float)

    for _ in range(40):
        n, k = int(rng.integers(20, 120)), int(rng.integers(2, 15))
        X = np.zeros((n, 2))
        X[: n // 2] = 1.0  # two blocks of duplicated rows: every distance is tied
        y = rng.integers(0, 3, size=n)
        i = int(rng.integers(0, n))
        v, v2 = votes(X, y, k), votes(np.delete(X, i, 0), np.delete(y, i), k)
        np.testing.assert_array_equal(v, brute(X, y, k))
        assert np.linalg.norm(v - v2, axis=1).max() <= math.sqrt(2) + 1e-12
        assert np.abs(v - v2).sum(axis=1).max() <= 2 + 1e-12


def _knn_in_a_pipeline_or_a_search():
    from privlearn.models import PrivatePipeline, PrivateSearchCV, PrivateStandardScaler

    def pipe():
        return PrivatePipeline([
            ("scale", PrivateStandardScaler(feature_range=(-3, 3))),
            ("knn", PrivateKNN(classes=[0, 1]))])

    return [(pipe(), "pipeline step 'knn' (PrivateKNN)"),
            (PrivateSearchCV(PrivateKNN(classes=[0, 1]), {"n_neighbors": [5, 10]},
                             loss_bound=1.0), "PrivateSearchCV: PrivateKNN"),
            (PrivateSearchCV(pipe(), {"knn__n_neighbors": [5, 10]}, loss_bound=1.0),
             "pipeline step 'knn' (PrivateKNN)")]


@pytest.mark.parametrize("case", range(3), ids=["pipeline", "search", "search-of-pipeline"])
def test_knn_as_a_pipeline_step_or_search_candidate_is_refused_saying_why(case):
    """PrivateKNN spends at release, not at fit: refused before any step is fitted, with
    a message naming it and the way to use it on its own (not "call fit before release")."""
    est, label = _knn_in_a_pipeline_or_a_search()[case]
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 3))
    y = (X[:, 0] > 0).astype(int)
    with pytest.raises(TypeError) as err:
        est.fit(X, y)
    msg = str(err.value)
    assert f"{label} cannot be a step of a PrivatePipeline" in msg
    assert "release(X_query)" in msg and "on its own" in msg and "before release" not in msg
    pipe = getattr(est, "estimator", est)
    if hasattr(pipe, "named_steps"):
        assert not hasattr(pipe.named_steps["scale"], "mean_")  # nothing was fitted
        with pytest.raises(TypeError, match="cannot be a step"):
            pipe.planned_mechanism(X, y)


def test_public_release_names_the_accountant_that_certified_its_epsilon():
    """The shared LabelRelease carries ``epsilon`` with the accountant that computed it:
    changing the ``accountant`` parameter after the releases (without a new one) must not
    relabel a PLD epsilon as an RDP one (re-certifying with the stated accountant gives
    another number)."""
    votes = np.random.default_rng(0).integers(0, 2, size=(10, 20))
    p = PATE(random_state=0)
    p.release(votes, 2)
    p.release(votes, 2)
    p.set_params(accountant="rdp")
    r = p.public_release()
    assert r.accountant == "pld"
    assert r.epsilon == r.mechanism.epsilon(r.delta, r.accountant)
    p.release(votes, 2)  # a release under the new accountant certifies the total with it
    r = p.public_release()
    assert r.accountant == "rdp" and r.epsilon == r.mechanism.epsilon(r.delta, "rdp")


def test_non_finite_or_fractional_teacher_votes_are_refused_with_what_to_do(tmp_path):
    """A NaN or an infinity among the teachers' votes is a NonFiniteInputError (as a NaN
    in an estimator's X), a fractional hard vote a ParameterValueError naming the vote
    and the two accepted shapes; either is refused before anything is released (a
    release with a ledger is charged in full: the refusal depends on the votes' values)."""
    from privlearn.errors import NonFiniteInputError, ParameterValueError
    from privlearn.ledger import Ledger

    ledger = Ledger(tmp_path / "l.db", create=True)
    ledger.create_budget("d", epsilon=5.0, delta=1e-5)
    budget = ledger.budget("d")
    rng = np.random.default_rng(0)
    hard = rng.integers(0, 3, size=(10, 40)).astype(float)
    soft = rng.dirichlet(np.ones(3), size=(10, 40))
    p = PATE(random_state=0, ledger=budget)
    for bad in (np.nan, np.inf):
        with pytest.raises(NonFiniteInputError, match="hard teacher votes contain a NaN"):
            p.release(np.where(hard == 1, bad, hard), 3, n_teachers=10)
        s = soft.copy()
        s[2, 3, 0] = bad
        with pytest.raises(NonFiniteInputError, match="probabilities contain a NaN"):
            p.release(s, n_teachers=10)
    with pytest.raises(ParameterValueError, match=r"non-integer vote 0\.5.*soft votes"):
        p.release(np.where(hard == 1, 0.5, hard), 3, n_teachers=10)
    assert budget.spent().entries == 5 and ledger.pending("d") == []
    assert not hasattr(p, "mechanism_")


def test_pate_refuses_a_vote_array_past_memory_before_anything_is_charged(tmp_path):
    """n_classes so large that the (n_queries, n_classes) vote histogram cannot be held
    is refused while planning (typed, naming the size and what to do), not with a bare
    MemoryError once the release has been reserved on the ledger."""
    from privlearn.errors import ParameterValueError
    from privlearn.ledger import Ledger
    from privlearn.models._vote_limits import max_vote_entries

    ledger = Ledger(tmp_path / "l.db", create=True)
    ledger.create_budget("d", epsilon=5.0, delta=1e-5)
    budget = ledger.budget("d")
    votes = np.zeros((5, 20), dtype=int)
    huge = 10**13  # 20 x 10**13 float64 entries: 1.4 PiB
    assert 20 * huge > max_vote_entries()
    p = PATE(epsilon=1.0, delta=1e-6, random_state=0, ledger=budget)
    with pytest.raises(ParameterValueError, match=r"n_classes=10000000000000.*smaller pub"):
        p.release(votes, huge, n_teachers=5)
    assert budget.spent().entries == 0 and ledger.pending("d") == []
    with pytest.raises(ParameterValueError, match="batches of at most 10 "):
        p.release(votes, max_vote_entries() // 10, n_teachers=5)  # 20 queries: too many
    assert budget.spent().entries == 0
    p.release(votes, 3, n_teachers=5)  # a sensible size still releases
    assert budget.spent().entries == 1
