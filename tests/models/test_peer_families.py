"""diffprivlib's test families (``tests/models/test_LinearRegression.py``,
``test_LogisticRegression.py``, ``test_StandardScaler.py``, ``test_BudgetAccountant.py``)
ported to privlearn's estimators, for what their counterparts do here.

Where diffprivlib's behaviour differs by design the test states ours: bounds are public
parameters with defaults (never computed from the data, so no ``PrivacyLeakWarning``
for a missing bound: rows and labels are clipped to them), ``sample_weight`` and
multi-output targets are typed refusals, ``epsilon=inf`` is refused (a non-private fit
has no accountant), and the classifier takes its classes as a public parameter (three or
more: one multinomial model). The references are scikit-learn's non-private fits on the
same data, and closed forms.
"""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
from sklearn.base import clone
from sklearn.linear_model import LinearRegression, LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from privlearn.accounting import Gaussian, calibrate, compose, subsample
from privlearn.datasets import load_california_housing, make_logistic_data
from privlearn.errors import BudgetExceededError, ParameterValueError, PrivacyLossOverflowError
from privlearn.ledger import Ledger
from privlearn.models import (
    AdaSSPRegressor,
    DPSGDClassifier,
    DPSGDRegressor,
    NoisyGDRegressor,
    PrivatePipeline,
    PrivateStandardScaler,
    SSPRegressor,
)
from privlearn.models.base import clip_rows

RNG = np.random.default_rng(0)
X0 = RNG.uniform(-1.0, 1.0, size=(200, 3)) / np.sqrt(3.0)  # rows of norm <= 1
Y_REG = X0 @ [0.3, -0.2, 0.1]
Y_CLF = (Y_REG > 0).astype(int)

#: name -> (factory of a quick estimator at epsilon ``eps``, supervised target or None)
MAKERS = {
    "SSPRegressor": (lambda eps=1.0, **kw: SSPRegressor(epsilon=eps, delta=1e-5, **kw), Y_REG),
    "AdaSSPRegressor": (
        lambda eps=1.0, **kw: AdaSSPRegressor(epsilon=eps, delta=1e-5, **kw),
        Y_REG,
    ),
    "NoisyGDRegressor": (
        lambda eps=1.0, **kw: NoisyGDRegressor(
            epsilon=eps, delta=1e-5, noise_multiplier=None, n_iter=20, **kw
        ),
        Y_REG,
    ),
    "DPSGDRegressor": (
        lambda eps=1.0, **kw: DPSGDRegressor(epsilon=eps, delta=1e-5, n_iter=20, **kw),
        Y_REG,
    ),
    "DPSGDClassifier": (
        lambda eps=1.0, **kw: DPSGDClassifier(
            epsilon=eps, delta=1e-5, n_iter=20, **{"classes": [0, 1], **kw}
        ),
        Y_CLF,
    ),
    "PrivateStandardScaler": (
        lambda eps=1.0, **kw: PrivateStandardScaler(
            epsilon=eps, delta=1e-5, feature_range=(-1.0, 1.0), **kw
        ),
        None,
    ),
}


def _fit(name, X, y="default", eps=1.0, **kw):
    make, target = MAKERS[name]
    y = target if isinstance(y, str) else y
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # clipping / delta notices are not under test
        return make(eps, **kw).fit(X, y)


def _output(est, X):
    return est.transform(X) if hasattr(est, "transform") else est.predict(X)


def _released(est):
    return est.mean_ if hasattr(est, "mean_") else est.coef_


# -- edge inputs (test_simple, test_large_data, dtype and container variants) ----------


EDGE_X = {
    "one sample": X0[:1],
    "two samples": X0[:2],
    "one feature": X0[:, :1],
    "constant column": np.c_[X0[:, :2], np.full(200, 0.5)],
    "all zero": np.zeros((200, 3)),
    "float32": X0.astype(np.float32),
    "integers": np.rint(3 * X0).astype(np.int64),
    "booleans": X0 > 0,
    "nested lists": X0.tolist(),
    "DataFrame": pd.DataFrame(X0, columns=["a", "b", "c"]),
}


@pytest.mark.parametrize("kind", sorted(EDGE_X))
@pytest.mark.parametrize("name", sorted(MAKERS))
def test_edge_inputs_fit_and_give_finite_outputs_of_the_right_shape(name, kind):
    X = EDGE_X[kind]
    n = len(X)
    target = MAKERS[name][1]
    est = _fit(name, X, None if target is None else target[:n])
    out = np.asarray(_output(est, X))
    n_features = np.asarray(X).shape[1]
    assert out.shape == ((n, n_features) if target is None else (n,))
    if name == "DPSGDClassifier":
        assert set(out.tolist()) <= {0, 1}
    else:
        assert np.all(np.isfinite(out))
    assert est.n_features_in_ == n_features
    assert 0.0 <= est.epsilon_ <= 1.0


@pytest.mark.parametrize("name", sorted(n for n, (_, t) in MAKERS.items() if t is not None))
def test_a_column_target_is_the_same_fit_as_a_flat_one(name):
    """y of shape (n, 1) is read as (n,), as scikit-learn's single-output estimators do."""
    target = MAKERS[name][1]
    flat = _fit(name, X0, target, random_state=3)
    column = _fit(name, X0, target[:, None], random_state=3)
    np.testing.assert_array_equal(flat.coef_, column.coef_)
    assert _output(column, X0).shape == (200,)


@pytest.mark.parametrize("name", sorted(n for n, (_, t) in MAKERS.items() if t is not None))
def test_multi_output_and_transposed_targets_are_typed_refusals_naming_y(name):
    """diffprivlib's LinearRegression fits several targets at once; ours are single-output:
    a ``ParameterValueError`` that names y and its shape (nothing is fitted)."""
    target = MAKERS[name][1]
    est = MAKERS[name][0]()
    for y in (np.c_[target, target], np.c_[target, target].T):
        with pytest.raises(ParameterValueError, match=r"y should be a 1d array.*shape"):
            est.fit(X0, y)
        assert not hasattr(est, "coef_")


# -- classifier labels (test_one_class, test_trinomial, string labels) -----------------


def test_classifier_labels_are_the_public_classes_whatever_their_type():
    text = np.where(Y_CLF == 1, "yes", "no")
    for y in (text, text.astype(object), pd.Series(text), pd.Series(text).astype("category")):
        clf = _fit("DPSGDClassifier", X0, y, classes=["no", "yes"], random_state=0)
        assert clf.classes_.tolist() == ["no", "yes"]
        assert set(clf.predict(X0).tolist()) <= {"no", "yes"}
    signs = _fit("DPSGDClassifier", X0, 2 * Y_CLF - 1, classes=[-1, 1], random_state=0)
    assert set(signs.predict(X0).tolist()) <= {-1, 1}


def test_one_observed_class_fits_with_public_classes_and_is_refused_without():
    y = np.zeros(200, dtype=int)
    clf = _fit("DPSGDClassifier", X0, y, classes=[0, 1], random_state=0)
    assert clf.predict_proba(X0).shape == (200, 2)
    assert set(clf.predict(X0).tolist()) <= {0, 1}
    with pytest.raises(ParameterValueError, match="only one class.*classes="):
        DPSGDClassifier(epsilon=1.0, delta=1e-5, n_iter=5).fit(X0, y)


def test_a_third_class_outside_a_public_pair_is_a_typed_refusal():
    clf = DPSGDClassifier(epsilon=1.0, delta=1e-5, n_iter=5, classes=[0, 1])
    with pytest.raises(ParameterValueError, match="binary"):
        clf.fit(X0, np.arange(200) % 3)
    assert not hasattr(clf, "coef_")


@pytest.mark.parametrize("classes", [None, [0, 1, 2]])
def test_three_classes_fit_one_multinomial_model(classes):
    """diffprivlib's LogisticRegression fits K classes (one-vs-rest); ours fits one
    multinomial model with scikit-learn's shapes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clf = DPSGDClassifier(epsilon=1.0, delta=1e-5, n_iter=5, classes=classes,
                              random_state=0).fit(X0, np.arange(200) % 3)
    assert clf.coef_.shape == (3, X0.shape[1]) and clf.intercept_.shape == (3,)
    assert clf.predict_proba(X0).shape == (200, 3)


# -- epsilon edge values (test_bad_params, test_inf_epsilon) ---------------------------


@pytest.mark.parametrize("eps", [0.0, -1.0, float("inf"), float("nan")])
@pytest.mark.parametrize("name", sorted(MAKERS))
def test_epsilon_outside_the_open_positive_reals_is_refused_naming_it(name, eps):
    with pytest.raises(ParameterValueError, match="epsilon must be in"):
        _fit(name, X0, eps=eps)


@pytest.mark.parametrize("eps", [1e-6, 1e6])
@pytest.mark.parametrize("name", sorted(MAKERS))
def test_tiny_and_huge_epsilons_fit_within_their_budget(name, eps):
    est = _fit(name, X0, eps=eps, random_state=0)
    assert 0.0 <= est.epsilon_ <= eps
    assert np.all(np.isfinite(np.asarray(_output(est, X0), dtype=float)))


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_an_epsilon_beyond_what_can_be_certified_spends_the_largest_certifiable(name):
    """epsilon=1e300 (or 1e13) raised an AccountingError (an ArithmeticError) from the
    calibration, whose search met noise so small that its privacy loss cannot be
    represented. Such a parameter is now infeasible for the search, which settles on the
    smallest noise whose epsilon is certified (at most about 1e12 <= the budget)."""
    for eps in (1e13, 1e300):
        est = _fit(name, X0, eps=eps, random_state=0)
        assert 0.0 < est.epsilon_ <= eps and np.isfinite(est.epsilon_)
        assert est.epsilon_ == pytest.approx(est.mechanism_.epsilon(est.delta_))
        assert np.all(np.isfinite(np.asarray(_output(est, X0), dtype=float)))


def test_calibrate_meets_a_target_above_the_representable_epsilons_on_the_safe_side():
    sigma = calibrate(lambda s: Gaussian(s), 1e13, 1e-5)
    assert Gaussian(sigma).epsilon(1e-5) <= 1e13
    # a smaller multiplier is not certifiable: never chosen
    with pytest.raises(PrivacyLossOverflowError):
        Gaussian(sigma / 4).epsilon(1e-5)
    q = calibrate(lambda s: compose(subsample(Gaussian(s), 0.01), steps=100), 1e300, 1e-5)
    assert compose(subsample(Gaussian(q), 0.01), steps=100).epsilon(1e-5) <= 1e300


# -- random_state (test_random_state, test_same_results, test_different_results) -------


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_random_state_reproduces_and_distinguishes_fits(name):
    a, b = _fit(name, X0, random_state=0), _fit(name, X0, random_state=0)
    np.testing.assert_array_equal(_released(a), _released(b))
    c = _fit(name, X0, random_state=1)
    assert not np.allclose(_released(a), _released(c))
    d, e = _fit(name, X0, random_state=None), _fit(name, X0, random_state=None)
    assert not np.allclose(_released(d), _released(e))
    # a clone (scikit-learn's refit, GridSearchCV) with the same int seed refits the same
    np.testing.assert_array_equal(_released(clone(a).fit(X0, MAKERS[name][1])), _released(a))


# -- large epsilon approaches the non-private fit (test_inf_epsilon, test_similar) -----


@pytest.fixture(scope="module")
def california():
    d = load_california_housing(preprocessing="bounded")  # rows of norm 1, labels in [0, 5]
    return d.data, d.target


@pytest.mark.parametrize("cls", [SSPRegressor, AdaSSPRegressor])
def test_ssp_at_a_huge_epsilon_predicts_as_least_squares_with_an_intercept(cls, california):
    X, y = california
    ols = LinearRegression().fit(X, y)
    m = cls(epsilon=1e6, delta=1e-6, x_bound=1.0, y_bound=(0.0, 5.0), random_state=0).fit(X, y)
    mse_ols = np.mean((ols.predict(X) - y) ** 2)
    mse = np.mean((m.predict(X) - y) ** 2)
    assert mse == pytest.approx(mse_ols, rel=1e-3)
    # the design is ill-conditioned (coefficients move along its weak directions), the
    # predictions do not
    assert np.sqrt(np.mean((m.predict(X) - ols.predict(X)) ** 2)) < 0.02


def test_noisygd_at_a_huge_epsilon_with_a_given_n_iter_fits_near_least_squares(california):
    X, y = california
    mse_ols = np.mean((LinearRegression(fit_intercept=False).fit(X, y).predict(X) - y) ** 2)
    m = NoisyGDRegressor(
        epsilon=1e4,
        delta=1e-6,
        x_bound=1.0,
        y_bound=5.0,
        fit_intercept=False,
        noise_multiplier=None,
        n_iter=2000,
        random_state=0,
    ).fit(X, y)
    assert m.epsilon_ <= 1e4
    assert np.mean((m.predict(X) - y) ** 2) < 1.1 * mse_ols


def test_noisygd_budget_above_the_iteration_ceiling_is_refused_before_spending(tmp_path):
    """At the default noise_multiplier=500 a huge epsilon asks n_iter=None for billions of
    iterations (the rule floor(0.99 (sigma mu)^2) grows with epsilon squared): a fit that
    never ends. Refused while planning, with what to pass instead, and nothing spent."""
    reg = NoisyGDRegressor(epsilon=1e4, delta=1e-5)
    with pytest.raises(ParameterValueError, match=r"n_iter=None.*Pass n_iter"):
        reg.planned_mechanism(X0)
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=1e5, delta=1e-4)
    reg.set_params(ledger=led.budget("d"))
    with pytest.raises(ParameterValueError, match="noise_multiplier"):
        reg.fit(X0, Y_REG)
    assert not hasattr(reg, "coef_")
    assert led.spent("d").entries == 0
    # a smaller noise_multiplier at the same epsilon runs the rule's count (planned only)
    ok = NoisyGDRegressor(epsilon=1e4, delta=1e-5, noise_multiplier=20.0, smoothness=1.0)
    steps = ok.planned_mechanism(X0)
    assert steps.epsilon(1e-5) <= 1e4


def test_scaler_at_a_huge_epsilon_with_public_bounds_matches_standard_scaler():
    """diffprivlib's test_inf_epsilon: with the public range as the bounds (quantile=None)
    the released moments approach scikit-learn's exact ones."""
    X = np.random.default_rng(1).normal([5.0, -2.0, 0.0], [2.0, 0.5, 1.0], size=(5000, 3))
    exact = StandardScaler().fit(X)
    sc = PrivateStandardScaler(
        epsilon=1e6, delta=1e-6, feature_range=(-20.0, 20.0), quantile=None, random_state=0
    ).fit(X)
    np.testing.assert_allclose(sc.mean_, exact.mean_, atol=1e-3)
    np.testing.assert_allclose(sc.var_, exact.var_, rtol=1e-2)
    assert sc.n_samples_seen_ == pytest.approx(exact.n_samples_seen_, abs=1.0)
    np.testing.assert_allclose(sc.transform(X), exact.transform(X), atol=1e-2)
    np.testing.assert_allclose(sc.inverse_transform(sc.transform(X)), X, atol=1e-9)


def test_scaler_with_private_bounds_at_a_huge_epsilon_is_the_clipped_data_s_moments():
    """With quantile set, the moments are those of the data clipped to the released
    bounds_ (by design not StandardScaler's on heavy tails): the closed form on them."""
    rng = np.random.default_rng(2)
    X = np.c_[rng.lognormal(0.0, 1.5, size=5000), rng.normal(size=5000)]
    sc = PrivateStandardScaler(
        epsilon=1e6, delta=1e-6, feature_range=(-1e3, 1e3), random_state=0
    ).fit(X)
    clipped = np.clip(X, sc.bounds_[:, 0], sc.bounds_[:, 1])
    np.testing.assert_allclose(sc.mean_, clipped.mean(axis=0), atol=1e-3)
    np.testing.assert_allclose(sc.var_, clipped.var(axis=0), rtol=1e-3)


def test_dpsgd_classifier_at_a_huge_epsilon_is_within_a_point_of_logistic_regression():
    d = make_logistic_data(3000, 3000, 5, random_state=0)
    ref = LogisticRegression().fit(d.X_train, d.y_train).score(d.X_test, d.y_test)
    clf = DPSGDClassifier(epsilon=1e4, delta=1e-6, n_iter=300, classes=[0, 1], random_state=0).fit(
        d.X_train, d.y_train
    )
    assert clf.epsilon_ <= 1e4
    assert clf.score(d.X_test, d.y_test) >= ref - 0.01


def test_dpsgd_regressor_at_a_huge_epsilon_is_near_least_squares():
    rng = np.random.default_rng(3)
    X = rng.uniform(-0.5, 0.5, size=(2000, 3))
    y = X @ [1.0, -2.0, 0.5] + 0.3 + 0.05 * rng.normal(size=2000)
    ref = LinearRegression().fit(X, y).score(X, y)
    reg = DPSGDRegressor(
        epsilon=1e4,
        delta=1e-6,
        n_iter=500,
        learning_rate=1.0,
        max_grad_norm=5.0,
        l2_regularization=0.0,
        random_state=0,
    ).fit(X, y)
    assert reg.score(X, y) > ref - 0.01


# -- repeated fits on one budget (test_accountant) -------------------------------------


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_a_budget_for_one_fit_refuses_the_second_and_keeps_the_first(name, tmp_path):
    """diffprivlib: BudgetAccountant(3, 0) admits one fit at epsilon 2 and raises
    BudgetError on the next. Here a ledger budget of the first fit's own epsilon admits
    it, refuses the refit before reading anything, records nothing for it, and the first
    model stays as it was."""
    led = Ledger(tmp_path / "l.db", create=True)
    make, target = MAKERS[name]
    est = make(1.0, random_state=0)
    cost = est.planned_mechanism(X0, target).epsilon(1e-5)
    led.create_budget("d", epsilon=cost * 1.001, delta=1e-5)
    est.set_params(ledger=led.budget("d"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est.fit(X0, target)
    first, spent = _released(est).copy(), led.spent("d")
    assert spent.epsilon_spent == pytest.approx(cost, rel=1e-6)
    with pytest.raises(BudgetExceededError):
        est.fit(X0, target)
    np.testing.assert_array_equal(_released(est), first)
    assert led.spent("d").entries == spent.entries


# -- the clipping building block (diffprivlib's test_clip_to_norm) ---------------------


@pytest.mark.parametrize("bound", [0.0, -1.0, float("nan"), float("inf")])
def test_clip_rows_refuses_a_bound_that_is_not_a_finite_positive_number(bound):
    """A NaN bound clipped nothing and a negative one flipped every row, silently."""
    with pytest.raises(ParameterValueError, match="bound must be in"):
        clip_rows(X0 * 10.0, bound)


def test_clip_rows_refuses_a_single_row_typed_and_clips_every_row_to_the_bound():
    with pytest.raises(ParameterValueError, match="2-D"):
        clip_rows(X0[0], 1.0)
    X = np.random.default_rng(4).normal(size=(500, 4)) * 3.0
    for ord_ in (1, 2, np.inf):
        clipped, n = clip_rows(X, 2.0, ord=ord_)
        norms, before = np.linalg.norm(clipped, ord_, axis=1), np.linalg.norm(X, ord_, axis=1)
        assert np.all(norms <= 2.0 * (1 + 1e-12))
        assert n == np.count_nonzero(before > 2.0)
        inside = before <= 2.0
        np.testing.assert_array_equal(clipped[inside], X[inside])
        # clipped rows keep their direction
        np.testing.assert_allclose(
            clipped[~inside] / norms[~inside, None], X[~inside] / before[~inside, None]
        )


# -- public bounds whose square overflows (extreme but finite parameters) ---------------


@pytest.mark.parametrize("cls", [SSPRegressor, AdaSSPRegressor, NoisyGDRegressor])
def test_an_x_bound_whose_square_overflows_is_refused_before_spending(cls, tmp_path):
    """x_bound=1e160 made the release raise a bare OverflowError (its square is the
    sensitivity of X^T X) after the reservation, so the budget was spent for nothing."""
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=5.0, delta=1e-4)
    est = cls(epsilon=1.0, delta=1e-5, x_bound=1e160, ledger=led.budget("d"))
    with pytest.raises(ParameterValueError, match=r"x_bound=1e\+160 is too large"):
        est.fit(X0, Y_REG)
    assert led.spent("d").entries == 0
    # a huge bound whose square is finite still fits (and clips nothing)
    big = cls(epsilon=1.0, delta=1e-5, x_bound=1e100, fit_intercept=False, random_state=0)
    assert np.all(np.isfinite(big.fit(X0, Y_REG).predict(X0)))


def test_a_feature_range_whose_variance_overflows_is_refused_naming_the_features():
    """A range of half-width 1e160 gave var_ = inf, scale_ = inf and a transform of all
    zeros, silently."""
    ranges = [(-1.0, 1.0), (-1e160, 1e160), (0.0, 1.0)]
    with pytest.raises(ParameterValueError, match=r"feature_range is too wide for features \[1\]"):
        PrivateStandardScaler(epsilon=1.0, delta=1e-5, feature_range=ranges).fit(X0)
    with pytest.raises(ParameterValueError, match="too wide"):
        PrivateStandardScaler(feature_range=(-1e300, 1e300), quantile=None).fit(X0)
    sc = PrivateStandardScaler(feature_range=(-1e100, 1e100), quantile=None, random_state=0)
    assert np.all(np.isfinite(sc.fit(X0).scale_))


# -- pipelines and searches at a huge epsilon ------------------------------------------


def test_private_pipeline_at_a_huge_epsilon_predicts_as_scikit_learn_s_pipeline():
    """PrivateStandardScaler (public range as bounds) then AdaSSP, each at epsilon 1e6,
    against StandardScaler then LinearRegression; the pipeline's epsilon_ is the tight
    composition of its steps (below their sum)."""
    rng = np.random.default_rng(5)
    X = rng.normal([3.0, -1.0, 0.0], [1.0, 2.0, 0.5], size=(4000, 3))
    y = X @ [0.5, -0.25, 1.0] + 0.1 * rng.normal(size=4000)
    ref = make_pipeline(StandardScaler(), LinearRegression()).fit(X, y)
    pipe = PrivatePipeline(
        [
            (
                "scale",
                PrivateStandardScaler(
                    epsilon=1e6, delta=1e-7, feature_range=(-10, 10), quantile=None, random_state=0
                ),
            ),
            (
                "model",
                AdaSSPRegressor(
                    epsilon=1e6, delta=1e-7, x_bound=15.0, y_bound=(-10.0, 10.0), random_state=1
                ),
            ),
        ]
    ).fit(X, y)
    assert pipe.epsilon_ <= 2e6
    assert pipe.delta_ == pytest.approx(2e-7)
    np.testing.assert_allclose(pipe.predict(X), ref.predict(X), atol=0.02)


@pytest.mark.parametrize(
    "make",
    [
        lambda: DPSGDRegressor(n_iter=10, noise_multiplier=1e-9),
        lambda: DPSGDClassifier(n_iter=10, noise_multiplier=1e-9, classes=[0, 1]),
        lambda: NoisyGDRegressor(noise_multiplier=1e-9, n_iter=10),
        lambda: NoisyGDRegressor(noise_multiplier=1e-9),
    ],
)
def test_a_given_noise_multiplier_too_small_to_account_is_refused_naming_it(make):
    """A noise_multiplier whose epsilon cannot be represented raised the accountant's
    AccountingError (an ArithmeticError about its internal multiplier); it is over any
    budget: the estimator's own ParameterValueError, naming noise_multiplier."""
    est = make()
    with pytest.raises(ParameterValueError, match="noise_multiplier=1e-09"):
        est.fit(X0, Y_CLF if isinstance(est, DPSGDClassifier) else Y_REG)
