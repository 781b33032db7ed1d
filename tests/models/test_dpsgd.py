"""DP-SGD estimators: accounting, algorithm against a naive loop, Adult utility, bad input."""

import math
import warnings

import numpy as np
import pytest
from scipy.special import expit

from privlearn.accounting import Gaussian, compose, subsample
from privlearn.datasets import load_adult, make_logistic_data
from privlearn.errors import PrivacyLeakWarning
from privlearn.models import DPSGDClassifier, DPSGDRegressor


@pytest.fixture(scope="module")
def synth():
    return make_logistic_data(2000, 2000, 5, random_state=0)


@pytest.mark.filterwarnings("ignore:.*classes=None infers:privlearn.errors.PrivacyLeakWarning")
def test_gaussian_full_batch_mechanism_and_epsilon(synth):
    clf = DPSGDClassifier(epsilon=1.0, delta=1e-5, n_iter=50, random_state=0)
    clf.fit(synth.X_train, synth.y_train)
    assert clf.mechanism_ == compose(Gaussian(clf.noise_multiplier_), steps=50)
    assert clf.epsilon_ <= 1.0 and clf.epsilon_ == pytest.approx(1.0, rel=1e-4)
    # the trajectory is increasing and ends at the spent epsilon
    assert np.all(np.diff(clf.epsilon_trajectory_) > 0)
    assert clf.trajectory_steps_[-1] == 50
    assert clf.epsilon_trajectory_[-1] == pytest.approx(clf.epsilon_)


@pytest.mark.filterwarnings("ignore:.*classes=None infers:privlearn.errors.PrivacyLeakWarning")
def test_laplace_pure_dp_closed_form(synth):
    # Pure DP of T compositions of the Poisson-subsampled Laplace mechanism with scale b:
    # T * log(1 + q (exp(1/b) - 1)) (Laplace: 1/b-DP; amplification by subsampling,
    # Balle, Barthe & Gaboardi 2018, Thm 8 for add/remove).
    for q in (1.0, 0.1):
        clf = DPSGDClassifier(epsilon=1.0, delta=0.0, noise="laplace", sampling_rate=q,
                              n_iter=100, random_state=0).fit(synth.X_train, synth.y_train)
        b = clf.noise_multiplier_
        closed = 100 * math.log1p(q * math.expm1(1.0 / b))
        assert closed <= 1.0 + 1e-9
        assert closed == pytest.approx(1.0, rel=1e-3)
        assert clf.epsilon_ == pytest.approx(closed, rel=1e-6)


@pytest.mark.filterwarnings("ignore:.*classes=None infers:privlearn.errors.PrivacyLeakWarning")
def test_gaussian_subsampled_delta_positive(synth):
    clf = DPSGDClassifier(epsilon=1.0, delta=1e-4, sampling_rate=0.1, n_iter=30,
                          random_state=0).fit(synth.X_train, synth.y_train)
    m = compose(subsample(Gaussian(clf.noise_multiplier_), 0.1), steps=30)
    assert clf.mechanism_ == m
    assert clf.epsilon_ <= 1.0
    # amplification: less noise than the full-batch run with the same budget
    full = DPSGDClassifier(epsilon=1.0, delta=1e-4, n_iter=30, random_state=0)
    full.fit(synth.X_train, synth.y_train)
    assert clf.noise_multiplier_ < full.noise_multiplier_


def _naive_dpsgd(Z, y, theta, C, noise_vec, denom, lr, lam):
    g = np.zeros_like(theta)
    for z, t in zip(Z, y, strict=True):  # per-example gradient, clipped, one at a time
        gi = (expit(z @ theta) - t) * z
        gi = gi * min(1.0, C / max(np.linalg.norm(gi), 1e-300))
        g += gi
    return theta - lr * ((g + noise_vec) / denom + lam * theta)


@pytest.mark.filterwarnings("ignore:.*classes=None infers:privlearn.errors.PrivacyLeakWarning")
def test_matches_naive_per_example_loop(synth):
    Z, y = synth.X_train[:300], synth.y_train[:300]
    clf = DPSGDClassifier(epsilon=2.0, delta=1e-5, n_iter=3, max_grad_norm=0.5,
                          learning_rate=0.7, l2_regularization=0.01, fit_intercept=False,
                          random_state=7).fit(Z, y)
    rng = np.random.default_rng(7)
    theta = np.zeros(Z.shape[1])
    for _ in range(3):
        noise = rng.normal(scale=clf.noise_multiplier_ * 0.5, size=Z.shape[1])
        theta = _naive_dpsgd(Z, y.astype(float), theta, 0.5, noise, 300.0, 0.7, 0.01)
    np.testing.assert_allclose(clf.coef_, theta, rtol=1e-10, atol=1e-12)


def test_regressor_learns_with_large_budget():
    rng = np.random.default_rng(0)
    X = rng.uniform(-1, 1, size=(3000, 3)) / 2
    y = X @ [1.0, -2.0, 0.5] + 0.3
    reg = DPSGDRegressor(epsilon=20.0, delta=1e-5, n_iter=500, learning_rate=1.0,
                         max_grad_norm=5.0, l2_regularization=0.0, random_state=0).fit(X, y)
    assert reg.score(X, y) > 0.95


@pytest.mark.slow  # ~15 s; tests/experiments runs a reduced Adult check by default
def test_adult_within_two_points_of_nonprivate():
    from sklearn.linear_model import LogisticRegression

    from privlearn.experiments.adult import ADULT_DPSGD

    tr, te = load_adult("train"), load_adult("test")
    base = LogisticRegression(max_iter=1000).fit(tr.data, tr.target).score(te.data, te.target)
    clf = DPSGDClassifier(epsilon=1.0, delta=1e-5, random_state=0, trajectory_points=2,
                          **ADULT_DPSGD).fit(tr.data, tr.target)
    assert clf.epsilon_ <= 1.0
    assert clf.score(te.data, te.target) >= base - 0.02


XB = np.random.default_rng(1).uniform(-1, 1, size=(40, 3))
YB = (XB[:, 0] > 0).astype(int)


@pytest.mark.parametrize("cls", [DPSGDClassifier, DPSGDRegressor])
@pytest.mark.parametrize(
    "params,X,y,match",
    [
        ({}, np.where(np.eye(40, 3) > 0, np.nan, XB), YB, "NaN"),
        ({}, np.where(np.eye(40, 3) > 0, -np.inf, XB), YB, "infinity"),
        ({}, XB, YB[:-2], "inconsistent numbers of samples"),
        ({}, XB[:, 0], YB, "2D array"),
        ({"epsilon": 0.0}, XB, YB, "epsilon must be in"),
        ({"epsilon": float("nan")}, XB, YB, "epsilon must be in"),
        ({"delta": 1.5}, XB, YB, "delta must be in"),
        ({"delta": 0.0}, XB, YB, "delta=0 is impossible with Gaussian noise.*laplace"),
        ({"sampling_rate": 0.0}, XB, YB, "sampling_rate"),
        ({"sampling_rate": 1.5}, XB, YB, "sampling_rate"),
        ({"noise": "cauchy"}, XB, YB, "noise must be one of"),
        ({"max_grad_norm": -1.0}, XB, YB, "max_grad_norm"),
        ({"n_iter": 0}, XB, YB, "n_iter"),
    ],
)
def test_bad_input(cls, params, X, y, match):
    kw = {"n_iter": 5, **params}
    with pytest.raises(ValueError, match=match):
        cls(**kw).fit(X, y)


def test_classifier_rejects_non_binary_labels():
    # three labels are a multinomial fit; a third label outside a public pair is refused
    with pytest.raises(ValueError, match="binary"):
        DPSGDClassifier(n_iter=5, classes=[0, 1]).fit(XB, np.arange(40) % 3)
    with pytest.raises(ValueError, match="only one class"):
        DPSGDClassifier(n_iter=5).fit(XB, np.zeros(40))
    with pytest.raises(ValueError):
        DPSGDClassifier(n_iter=5).fit(XB, XB[:, 0])  # continuous labels


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
    with pytest.raises(ValueError, match="not in classes"):
        DPSGDClassifier(n_iter=5, classes=[0, 1, 2]).fit(X, y)


@pytest.mark.parametrize("cls", [DPSGDRegressor, DPSGDClassifier])
@pytest.mark.parametrize("noise", ["gaussian", "laplace"])
def test_one_extreme_finite_record_is_clipped_not_a_failure(cls, noise):
    """A finite but extreme row (its norm, or x . theta, overflows) is clipped like any
    other: the fit returns a model, as without it (it used to turn one per-example
    gradient into NaN and the whole fit into a FloatingPointError after the release,
    an outcome one record decides). Naive bound on one step from theta = 0: replacing
    one record moves the noisy sum by at most 2 C, the iterate by lr 2 C / n."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 3))
    y = (X[:, 0] > 0).astype(float)
    kw = dict(noise=noise, delta=1e-5 if noise == "gaussian" else 0.0, max_grad_norm=0.5,
              learning_rate=0.5, l2_regularization=0.0, random_state=0)
    if cls is DPSGDClassifier:
        kw["classes"] = [0.0, 1.0]
    ord_ = 2 if noise == "gaussian" else 1
    for row in ([1e308, 1e308, 0.0], [1e300, -1e300, 1e300], [-1e200, 0.0, 0.0]):
        Xe = X.copy()
        Xe[0] = row
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # nor an overflow warning
            model = cls(n_iter=30, **kw).fit(Xe, y)
        assert np.all(np.isfinite(model.coef_)) and np.isfinite(model.intercept_)
        a, b = (cls(n_iter=1, **kw).fit(Z, y) for Z in (X, Xe))
        step = np.append(a.coef_ - b.coef_, a.intercept_ - b.intercept_)
        assert np.linalg.norm(step, ord=ord_) <= 0.5 * 2 * 0.5 / len(y) * (1 + 1e-9)


@pytest.mark.parametrize("noise", ["gaussian", "laplace"])
def test_a_row_whose_norm_overflows_is_clipped_in_its_own_direction(noise):
    """A row of entries near 1e308 (its norm exceeds the largest float) contributes its
    gradient clipped to norm C in its own direction, as clip_rows scales it, not zero.
    Naive ground truth for one step from theta = 0 with every example (the same noise
    draw with and without the row): r_0 = -y_0, so the clipped gradient is
    -sign(y_0) C z_0 / ||z_0||, with ||z_0|| computed on z_0 / 1e300."""
    rng = np.random.default_rng(1)
    X = rng.normal(size=(50, 3))
    y = X[:, 0] + 0.1
    y[0] = 2.0
    C, lr = 0.5, 0.5
    kw = dict(noise=noise, delta=1e-5 if noise == "gaussian" else 0.0, max_grad_norm=C,
              learning_rate=lr, l2_regularization=0.0, n_iter=1, random_state=0)
    ord_ = 2 if noise == "gaussian" else 1
    Xe = X.copy()
    Xe[0] = [1.5e308, 1.5e308, 0.0]
    a, b = (DPSGDRegressor(**kw).fit(Z, y) for Z in (X, Xe))

    def clipped(z, r):
        u = np.append(z, 1.0) / 1e300 if np.max(np.abs(z)) > 1e300 else np.append(z, 1.0)
        g = r * u
        if np.max(np.abs(z)) > 1e300:  # |r| ||z|| > C: the unit direction times C
            return np.sign(r) * C * u / np.linalg.norm(u, ord=ord_)
        return g * min(1.0, C / np.linalg.norm(g, ord=ord_))

    want = -lr / len(y) * (clipped(Xe[0], -y[0]) - clipped(X[0], -y[0]))
    got = np.append(b.coef_ - a.coef_, b.intercept_ - a.intercept_)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-15)
    assert np.linalg.norm(got[:2]) > 0  # the extreme row moves the model along itself


@pytest.mark.parametrize("cls", [DPSGDClassifier, DPSGDRegressor])
def test_verbose_shows_the_steps_and_changes_nothing(cls, synth, capfd):
    """A long fit (the default n_iter=1000 full-batch steps on Adult takes about a minute)
    can show its progress: verbose=1 is a bar on standard error over the n_iter steps; the
    default writes nothing, and the fit is the same either way at a fixed seed."""
    from sklearn.base import clone

    X, y = synth.X_train[:300], synth.y_train[:300]
    kw = dict(epsilon=1.0, delta=1e-5, sampling_rate=0.1, n_iter=37, random_state=3)
    if cls is DPSGDClassifier:
        kw["classes"] = [0, 1]
    quiet = cls(**kw).fit(X, y)
    out, err = capfd.readouterr()
    assert out == err == ""
    loud = clone(cls(verbose=1, **kw))
    assert loud.get_params()["verbose"] == 1
    loud.fit(X, y)
    out, err = capfd.readouterr()
    assert out == "" and cls.__name__ in err and "37/37" in err
    np.testing.assert_array_equal(loud.coef_, quiet.coef_)
    assert loud.epsilon_ == quiet.epsilon_
    with pytest.raises(ValueError, match="verbose"):
        cls(verbose=-1, **kw).fit(X, y)
