"""DPSGDClassifier with three or more public classes: multinomial (softmax) logistic
regression by DP-SGD.

Ground truths: a naive per-example loop in NumPy (one record at a time, the gradient
``x (softmax(W^T x) - e_y)^T`` written out, clipped over the whole ``p x K`` matrix),
the closed-form noise scale ``sigma C / (q n)`` of one step on data whose gradients are
zero, the binary path's own accounting for the same settings, scikit-learn's
``LogisticRegression`` on load_iris / load_wine, and for two classes a naive
reimplementation of the binary path's steps and draws.
"""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.datasets import load_iris, load_wine
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import train_test_split

from privlearn.errors import ParameterTypeError, ParameterValueError, PrivacyLeakWarning
from privlearn.models import DPSGDClassifier
from privlearn.models._softmax import clipped_softmax_gradient_sum


def _naive_clipped_sum(Z, labels, theta, C, ord_):
    """One record at a time: the softmax cross-entropy's gradient, clipped as a vector."""
    total = np.zeros_like(theta)
    for z, label in zip(Z, labels, strict=True):
        s = theta.T @ z
        p = np.exp(s - s.max())
        p /= p.sum()
        e = np.zeros(theta.shape[1])
        e[label] = 1.0
        G = np.outer(z, p - e)
        norm = np.abs(G).sum() if ord_ == 1 else np.sqrt((G**2).sum())
        total += G * min(1.0, C / norm) if norm > 0 else G
    return total


def _naive_softmax_fit(X, labels, K, *, sigma, q, steps, C, lr, lam, seed, noise):
    """The module docstring's steps for the softmax loss, with the estimator's draws
    (Poisson mask, then one (p, K) noise array per step) from the same seed."""
    rng = np.random.default_rng(seed)
    Z = np.hstack([X, np.ones((X.shape[0], 1))])
    n = Z.shape[0]
    theta = np.zeros((Z.shape[1], K))
    ord_ = 2 if noise == "gaussian" else 1
    for _ in range(steps):
        keep = rng.random(n) < q if q < 1 else np.ones(n, bool)
        total = _naive_clipped_sum(Z[keep], labels[keep], theta, C, ord_)
        if noise == "gaussian":
            total = total + rng.normal(scale=sigma * C, size=theta.shape)
        else:
            total = total + rng.laplace(scale=sigma * C, size=theta.shape)
        theta = theta - lr * (total / (q * n) + lam * theta)
    return theta[:-1].T, theta[-1]


@pytest.mark.parametrize("ord_", [1, 2])
def test_clipped_gradient_sum_matches_a_per_example_loop(ord_):
    rng = np.random.default_rng(1)
    Z = rng.normal(size=(40, 5)) * rng.choice([0.05, 1.0, 8.0], size=(40, 1))
    labels = rng.integers(0, 4, size=40)
    theta = rng.normal(size=(5, 4))
    for C in (0.1, 1.0, 1e6):  # most clipped, some, none
        fast = clipped_softmax_gradient_sum(
            Z, np.ones(40), np.linalg.norm(Z, ord=ord_, axis=1), Z, labels, theta, C, ord_
        )
        np.testing.assert_allclose(
            fast, _naive_clipped_sum(Z, labels, theta, C, ord_), rtol=1e-10, atol=1e-12
        )
        # batch-size-1 calls add up to the batch's
        ones = [
            clipped_softmax_gradient_sum(
                Z[i : i + 1],
                np.ones(1),
                np.linalg.norm(Z[i : i + 1], ord=ord_, axis=1),
                Z[i : i + 1],
                labels[i : i + 1],
                theta,
                C,
                ord_,
            )
            for i in range(40)
        ]
        np.testing.assert_allclose(fast, np.sum(ones, axis=0), rtol=1e-10, atol=1e-12)
        # every record's clipped term has norm at most C
        for term in ones:
            assert np.linalg.norm(term.ravel(), ord=ord_) <= C * (1 + 1e-12)


def test_unclipped_gradient_is_at_most_sqrt2_times_the_row_norm():
    """``||x (p - e_y)^T||_F = ||x|| ||p - e_y|| <= sqrt(2) ||x||``; reached as p -> e_k,
    k != y (the bound the docstring states against the binary loss's ``||x||``)."""
    rng = np.random.default_rng(2)
    Z = rng.normal(size=(200, 3))
    labels = rng.integers(0, 3, size=200)
    big = np.max(
        [
            np.linalg.norm(
                _naive_clipped_sum(
                    Z[i : i + 1], labels[i : i + 1], rng.normal(size=(3, 3)) * 30, 1e9, 2
                )
            )
            / np.linalg.norm(Z[i])
            for i in range(200)
        ]
    )
    assert np.sqrt(2) * 0.99 < big <= np.sqrt(2) * (1 + 1e-12)


@pytest.mark.parametrize("noise", ["gaussian", "laplace"])
def test_fit_equals_the_naive_loop(noise):
    rng = np.random.default_rng(3)
    X = rng.normal(size=(60, 3))
    y = rng.integers(0, 3, size=60)
    kw = dict(sigma=1.5, q=0.5, steps=7, C=0.7, lr=0.8, lam=0.01, seed=11, noise=noise)
    clf = DPSGDClassifier(
        epsilon=50.0,
        delta=1e-5 if noise == "gaussian" else 0.0,
        noise=noise,
        noise_multiplier=1.5,
        sampling_rate=0.5,
        n_iter=7,
        max_grad_norm=0.7,
        learning_rate=0.8,
        l2_regularization=0.01,
        classes=[0, 1, 2],
        random_state=11,
    ).fit(X, y)
    coef, intercept = _naive_softmax_fit(X, y, 3, **kw)
    np.testing.assert_allclose(clf.coef_, coef, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(clf.intercept_, intercept, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("noise", ["gaussian", "laplace"])
def test_noise_scale_is_sigma_c_over_the_expected_batch(noise):
    """On rows of zeros (no intercept) every gradient is 0: one step leaves
    ``-lr * noise / (q n)``, of std ``sigma C / (q n)`` (Gaussian) or
    ``sqrt(2) sigma C / (q n)`` (Laplace of scale ``sigma C``) per coordinate."""
    n, d, K, sigma, C, q = 50, 100, 10, 2.0, 3.0, 0.4
    clf = DPSGDClassifier(
        epsilon=100.0,
        delta=1e-5 if noise == "gaussian" else 0.0,
        noise=noise,
        noise_multiplier=sigma,
        max_grad_norm=C,
        sampling_rate=q,
        n_iter=1,
        learning_rate=1.0,
        l2_regularization=0.0,
        fit_intercept=False,
        classes=list(range(K)),
        random_state=0,
    )
    clf.fit(np.zeros((n, d)), np.arange(n) % K)
    want = sigma * C / (q * n) * (np.sqrt(2) if noise == "laplace" else 1.0)
    assert clf.coef_.shape == (K, d)
    # 1000 coordinates: the sample std is within 10% with overwhelming probability
    assert np.std(clf.coef_) == pytest.approx(want, rel=0.1)
    assert abs(np.mean(clf.coef_)) < 4 * want / np.sqrt(d * K)


def test_accounting_is_the_binary_paths():
    rng = np.random.default_rng(4)
    X = rng.normal(size=(80, 2))
    kw = dict(
        epsilon=2.0, delta=1e-5, sampling_rate=0.3, n_iter=40, random_state=0, trajectory_points=5
    )
    three = DPSGDClassifier(classes=[0, 1, 2], **kw).fit(X, np.arange(80) % 3)
    two = DPSGDClassifier(classes=[0, 1], **kw).fit(X, np.arange(80) % 2)
    assert repr(three.mechanism_) == repr(two.mechanism_)
    assert three.noise_multiplier_ == two.noise_multiplier_
    assert three.epsilon_ == two.epsilon_ and three.delta_ == two.delta_
    np.testing.assert_array_equal(three.trajectory_steps_, two.trajectory_steps_)
    np.testing.assert_array_equal(three.epsilon_trajectory_, two.epsilon_trajectory_)


@pytest.mark.parametrize("loader", [load_iris, load_wine], ids=["iris", "wine"])
def test_accuracy_near_scikit_learns_at_a_generous_epsilon(loader):
    X, y = loader(return_X_y=True)
    X = (X - X.mean(0)) / X.std(0)
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.3, random_state=0, stratify=y)
    ref = LogisticRegression().fit(Xtr, ytr).score(Xte, yte)
    scores = [
        DPSGDClassifier(epsilon=5.0, n_iter=200, classes=[0, 1, 2], random_state=s)
        .fit(Xtr, ytr)
        .score(Xte, yte)
        for s in range(3)
    ]
    assert np.median(scores) >= ref - 0.1, (scores, ref)


def test_probabilities_scores_and_predictions_agree():
    X, y = load_iris(return_X_y=True)
    clf = DPSGDClassifier(epsilon=5.0, n_iter=50, classes=[0, 1, 2], random_state=0).fit(X, y)
    s = clf.decision_function(X)
    np.testing.assert_allclose(s, X @ clf.coef_.T + clf.intercept_)
    P = clf.predict_proba(X)
    np.testing.assert_allclose(P.sum(axis=1), 1.0)
    np.testing.assert_allclose(P, np.exp(s) / np.exp(s).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(np.exp(clf.predict_log_proba(X)), P)
    np.testing.assert_array_equal(clf.predict(X), clf.classes_[np.argmax(s, axis=1)])


def test_record_path_has_scikit_learns_shapes():
    X, y = load_iris(return_X_y=True)
    clf = DPSGDClassifier(
        epsilon=5.0, n_iter=6, classes=[0, 1, 2], record_path=True, random_state=0
    ).fit(X, y)
    assert clf.coef_path_.shape == (6, 3, 4) and clf.intercept_path_.shape == (6, 3)
    np.testing.assert_array_equal(clf.coef_path_[-1], clf.coef_)
    np.testing.assert_array_equal(clf.intercept_path_[-1], clf.intercept_)


def test_public_classes_absent_from_y_get_a_column():
    rng = np.random.default_rng(5)
    X = rng.normal(size=(90, 2))
    y = np.array(["b", "a", "c"])[np.arange(90) % 3]
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyLeakWarning)  # public classes: no warning
        clf = DPSGDClassifier(
            epsilon=5.0, n_iter=30, classes=["d", "c", "b", "a"], random_state=0
        ).fit(X, y)
    assert clf.classes_.tolist() == ["a", "b", "c", "d"]
    assert clf.coef_.shape == (4, 2) and clf.predict_proba(X).shape == (90, 4)
    assert set(clf.predict(X)) <= {"a", "b", "c", "d"}


def test_inferred_classes_warn():
    X = np.random.default_rng(6).normal(size=(30, 2))
    with pytest.warns(PrivacyLeakWarning, match="infers"):
        clf = DPSGDClassifier(n_iter=3, random_state=0).fit(X, np.arange(30) % 3)
    assert clf.classes_.tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    "classes, y, error, match",
    [
        ([0, 0, 1], None, ParameterValueError, "more than once"),
        ([0, "a", 1], None, ParameterValueError, "one kind"),
        ("abc", None, ParameterTypeError, "classes"),
        ([0], None, ParameterValueError, "at least 2"),
        ([[0, 1], [2, 3]], None, ParameterValueError, "1-D"),
        ([0, 1, 2], np.arange(30) % 4, ParameterValueError, "not in classes"),
        ([0, 1, 2], np.linspace(0, 2.5, 30), ParameterValueError, "Unknown label type"),
    ],
)
def test_bad_classes_are_typed_refusals(classes, y, error, match):
    X = np.random.default_rng(7).normal(size=(30, 2))
    clf = DPSGDClassifier(n_iter=3, classes=classes, random_state=0)
    with pytest.raises(error, match=match):
        clf.fit(X, np.arange(30) % 3 if y is None else y)
    assert not hasattr(clf, "coef_")


def test_pickle_and_clone_round_trip():
    X, y = load_iris(return_X_y=True)
    clf = DPSGDClassifier(epsilon=5.0, n_iter=20, classes=[0, 1, 2], random_state=0).fit(X, y)
    back = pickle.loads(pickle.dumps(clf))
    np.testing.assert_array_equal(back.predict_proba(X), clf.predict_proba(X))
    np.testing.assert_array_equal(back.classes_, clf.classes_)
    again = clone(clf).fit(X, y)  # same parameters, same seed: same model
    np.testing.assert_array_equal(again.coef_, clf.coef_)
    assert clone(clf).get_params()["classes"] == [0, 1, 2]


def _naive_binary_fit(X, y01, *, sigma, q, steps, C, lr, lam, seed):
    """The binary path's steps, one record at a time: Poisson mask, logistic gradient
    ``(sigmoid(theta.z) - y) z`` clipped in L2, one ``N(0, (sigma C)^2 I)`` draw."""
    rng = np.random.default_rng(seed)
    Z = np.hstack([X, np.ones((X.shape[0], 1))])
    n, p = Z.shape
    theta = np.zeros(p)
    for _ in range(steps):
        keep = rng.random(n) < q if q < 1 else np.ones(n, bool)
        total = np.zeros(p)
        for z, t in zip(Z[keep], y01[keep], strict=True):
            g = (1 / (1 + np.exp(-z @ theta)) - t) * z
            total += g * min(1.0, C / np.linalg.norm(g)) if np.linalg.norm(g) > 0 else g
        total = total + rng.normal(scale=sigma * C, size=p)
        theta = theta - lr * (total / (q * n) + lam * theta)
    return theta[:-1], theta[-1]


def test_two_classes_keep_the_binary_model():
    rng = np.random.default_rng(8)
    X = rng.normal(size=(50, 3))
    y = np.where(X[:, 0] > 0, "yes", "no")
    clf = DPSGDClassifier(
        epsilon=50.0,
        noise_multiplier=1.2,
        sampling_rate=0.6,
        n_iter=9,
        max_grad_norm=0.8,
        learning_rate=1.0,
        l2_regularization=1e-3,
        classes=["no", "yes"],
        random_state=21,
    ).fit(X, y)
    coef, intercept = _naive_binary_fit(
        X, (y == "yes").astype(float), sigma=1.2, q=0.6, steps=9, C=0.8, lr=1.0, lam=1e-3, seed=21
    )
    assert clf.coef_.shape == (3,) and isinstance(clf.intercept_, float)
    np.testing.assert_allclose(clf.coef_, coef, rtol=1e-9, atol=1e-12)
    assert clf.intercept_ == pytest.approx(intercept, rel=1e-9, abs=1e-12)
    assert clf.decision_function(X).shape == (50,)
    assert clf.predict_proba(X).shape == (50, 2)


@pytest.mark.parametrize("noise", ["gaussian", "laplace"])
def test_one_extreme_finite_record_is_clipped_not_a_failure(noise):
    """A finite but extreme row (its norm, or its scores, overflow) is clipped like any
    other: the fit returns a finite model without a RuntimeWarning, and one step from
    zero moves by at most ``lr 2 C / n`` when it replaces an ordinary record (each
    record's clipped term has norm at most C)."""
    rng = np.random.default_rng(9)
    X = rng.normal(size=(150, 3))
    y = np.arange(150) % 3
    C, lr = 0.5, 0.5
    kw = dict(
        noise=noise,
        delta=1e-5 if noise == "gaussian" else 0.0,
        max_grad_norm=C,
        learning_rate=lr,
        l2_regularization=0.0,
        classes=[0, 1, 2],
        random_state=0,
    )
    ord_ = 2 if noise == "gaussian" else 1
    for row in ([1e308, 1e308, 0.0], [1e300, -1e300, 1e300], [-1e200, 0.0, 0.0]):
        Xe = X.copy()
        Xe[0] = row
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            model = DPSGDClassifier(n_iter=30, **kw).fit(Xe, y)
            # a large step makes theta large enough for the extreme row's scores to
            # overflow (inf - inf in the softmax): that record then adds nothing
            big = DPSGDClassifier(n_iter=30, **{**kw, "learning_rate": 100.0}).fit(Xe, y)
        for m in (model, big):
            assert np.all(np.isfinite(m.coef_)) and np.all(np.isfinite(m.intercept_))
        a, b = (DPSGDClassifier(n_iter=1, **kw).fit(Z, y) for Z in (X, Xe))
        step = np.append(a.coef_ - b.coef_, a.intercept_ - b.intercept_)
        assert 0 < np.linalg.norm(step, ord=ord_) <= lr * 2 * C / len(y) * (1 + 1e-9)
