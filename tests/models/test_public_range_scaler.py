"""PublicRangeScaler: scaling by declared public bounds, learning nothing from the data.

Compared against scikit-learn's MinMaxScaler fitted on the two corners of the bounds
(the closed form of the map), and against the estimators' own accounting in a
PrivatePipeline (the scaler adds nothing to mechanism_ and nothing to a ledger)."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.preprocessing import MinMaxScaler
from sklearn.utils.estimator_checks import parametrize_with_checks

from privlearn.errors import (
    ConfigurationError,
    DataClippedWarning,
    ParameterTypeError,
    ParameterValueError,
)
from privlearn.ledger import Ledger
from privlearn.models import (
    DPSGDClassifier,
    PrivatePipeline,
    PublicRangeScaler,
    SSPRegressor,
)

LOWER, UPPER = np.array([0.0, -1.0, 2.0]), np.array([10.0, 5.0, 3.0])


def _data(n=200, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.uniform(LOWER - 1.0, UPPER + 1.0, size=(n, 3))  # some values outside
    return X, X[:, 0] - X[:, 1]


def _corners(feature_range=(0, 1)):
    """MinMaxScaler fitted on the bound corners: the map from the public bounds."""
    return MinMaxScaler(feature_range=feature_range, clip=True).fit(np.stack([LOWER, UPPER]))


@pytest.mark.parametrize("feature_range", [(0, 1), (-1, 1), (-3.5, 7.25)])
def test_equals_min_max_scaler_fitted_on_the_bounds(feature_range):
    X, _ = _data()
    sc = PublicRangeScaler(bounds=(LOWER, UPPER), feature_range=feature_range)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DataClippedWarning)
        Xt = sc.fit_transform(X)
    ref = _corners(feature_range)
    np.testing.assert_array_equal(Xt, ref.transform(X))
    inside = np.clip(X, LOWER, UPPER)
    np.testing.assert_allclose(
        sc.inverse_transform(Xt), ref.inverse_transform(Xt), rtol=1e-15, atol=1e-15
    )
    np.testing.assert_allclose(sc.inverse_transform(Xt), inside, rtol=1e-12, atol=1e-12)


def test_scalar_bounds_apply_to_every_feature():
    X, _ = _data()
    Xc = np.clip(X, -1.0, 10.0)
    sc = PublicRangeScaler(bounds=(-1, 10)).fit(Xc)
    ref = MinMaxScaler().fit([[-1.0] * 3, [10.0] * 3])
    np.testing.assert_array_equal(sc.transform(Xc), ref.transform(Xc))


def test_fit_learns_nothing_from_the_values():
    """Two data sets of one shape give the same fitted state and the same transform."""
    X1, _ = _data(seed=1)
    X2 = np.clip(_data(seed=2)[0], LOWER, UPPER) * 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DataClippedWarning)
        a = PublicRangeScaler(bounds=(LOWER, UPPER)).fit(X1)
        b = PublicRangeScaler(bounds=(LOWER, UPPER)).fit(X2)
        Q = _data(seed=3)[0]
        np.testing.assert_array_equal(a.transform(Q), b.transform(Q))
    assert vars(a).keys() == vars(b).keys() == {"bounds", "feature_range", "n_features_in_"}
    assert pickle.dumps(a) == pickle.dumps(b)


def test_clipping_warns_with_the_count_and_stores_nothing():
    X = np.array([[5.0, 0.0, 2.5], [11.0, 0.0, 2.5], [-3.0, 6.0, 2.5]])
    sc = PublicRangeScaler(bounds=(LOWER, UPPER)).fit(X)
    with pytest.warns(DataClippedWarning, match=r"3 values in 2 of 3 rows.*features \[0, 1\]"):
        Xt = sc.transform(X)
    np.testing.assert_array_equal(Xt[:, 0], [0.5, 1.0, 0.0])
    np.testing.assert_array_equal(Xt[:, 1], [1 / 6, 1 / 6, 1.0])
    assert Xt.min() >= 0.0 and Xt.max() <= 1.0
    assert set(vars(sc)) == {"bounds", "feature_range", "n_features_in_"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sc.transform(np.clip(X, LOWER, UPPER))  # nothing outside: no warning


def test_pandas_output_and_feature_names():
    pd = pytest.importorskip("pandas")
    X, _ = _data()
    df = pd.DataFrame(np.clip(X, LOWER, UPPER), columns=["a", "b", "c"])
    sc = PublicRangeScaler(bounds=(LOWER, UPPER)).set_output(transform="pandas").fit(df)
    out = sc.transform(df)
    assert list(out.columns) == ["a", "b", "c"] and list(sc.get_feature_names_out()) == [
        "a",
        "b",
        "c",
    ]
    np.testing.assert_array_equal(out.to_numpy(), _corners().transform(df.to_numpy()))
    assert list(sc.feature_names_in_) == ["a", "b", "c"]


@pytest.mark.parametrize(
    "bounds, match",
    [
        (None, "bounds is required"),
        ((0, 0), r"lower < upper.*feature 0"),
        ((5, 1), r"lower < upper"),
        (([0, 1, 2], [1, 1, 3]), r"lower < upper.*feature 1 has \(1, 1\)"),
        ((np.nan, 1), "lower must be finite"),
        ((0, np.inf), "upper must be finite"),
        (([0, 0], [1, 1]), r"lower must be a number or an array of 3 values.*shape \(2,\)"),
        ((0, [1, 2, 3, 4]), r"upper must be .* 3 values"),
        ((0, 1, 2), r"must be a pair \(lower, upper\)"),
        ({"lower": 0, "upper": 1}, r"must be a pair"),
        ((-1e308, 1e308), "overflows float64"),
    ],
)
def test_bad_bounds_are_typed_errors(bounds, match):
    with pytest.raises(ParameterValueError, match=match):
        PublicRangeScaler(bounds=bounds).fit(np.zeros((2, 3)))


def test_non_numeric_bounds_are_a_type_error():
    with pytest.raises(ParameterTypeError, match="lower must be a number"):
        PublicRangeScaler(bounds=("a", 1)).fit(np.zeros((2, 3)))


@pytest.mark.parametrize(
    "feature_range", [(1, 1), (1, 0), (0, np.nan), (0, np.inf), (0,), "ab", (-1e308, 1e308)]
)
def test_bad_feature_range_is_a_typed_error(feature_range):
    with pytest.raises(ParameterValueError, match="feature_range"):
        PublicRangeScaler(bounds=(0, 1), feature_range=feature_range).fit(np.zeros((2, 3)))


def test_nan_in_x_and_wrong_width_are_refused():
    sc = PublicRangeScaler(bounds=(0, 1)).fit(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="NaN"):
        sc.transform(np.array([[np.nan, 0.0, 0.0]]))
    with pytest.raises(ParameterValueError, match="3 features"):
        sc.transform(np.zeros((2, 4)))
    with pytest.raises(ParameterValueError, match="fitted on 3"):
        sc.inverse_transform(np.zeros((2, 4)))


def test_pickle_and_clone():
    X, _ = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DataClippedWarning)
        sc = PublicRangeScaler(bounds=(LOWER, UPPER), feature_range=(-1, 1)).fit(X)
        back = pickle.loads(pickle.dumps(sc))
        np.testing.assert_array_equal(back.transform(X), sc.transform(X))
    c = clone(sc)
    assert c.feature_range == (-1, 1) and not hasattr(c, "n_features_in_")
    np.testing.assert_array_equal(c.bounds[0], LOWER)


@pytest.mark.filterwarnings("ignore::privlearn.errors.DataClippedWarning")
@pytest.mark.parametrize(
    "make_model",
    [
        lambda led: SSPRegressor(y_bound=(-6.0, 12.0), random_state=0, ledger=led),
        lambda led: DPSGDClassifier(n_iter=20, classes=[0, 1], random_state=0, ledger=led),
    ],
)
def test_pipeline_charges_exactly_the_estimators_budget(make_model, tmp_path):
    X, y = _data()
    if "Classifier" in type(make_model(None)).__name__:
        y = (y > 0).astype(int)
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=10.0, delta=1e-4)
    pipe = PrivatePipeline(
        [
            ("scale", PublicRangeScaler(bounds=(LOWER, UPPER))),
            ("model", make_model(led.budget("d"))),
        ]
    )
    planned = pipe.planned_mechanism(X, y)
    pipe.fit(X, y)
    model = pipe.named_steps["model"]
    # the model alone, fitted on the scaled data, spends the same mechanism
    alone = make_model(None).fit(_corners().transform(X), y)
    assert pipe.mechanism_ == model.mechanism_ == alone.mechanism_ == planned
    assert pipe.epsilon_ == pytest.approx(model.epsilon_, rel=1e-12)
    settled = [e.mechanism for e in led.history("d") if e.kind == "settle"]
    assert settled == [model.mechanism_]
    np.testing.assert_array_equal(model.coef_, alone.coef_)  # same data, same seed


def test_pipeline_refuses_wrong_bounds_before_reserving(tmp_path):
    X, y = _data()
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=10.0, delta=1e-4)
    pipe = PrivatePipeline(
        [
            ("scale", PublicRangeScaler(bounds=([0, 1], [2, 3]))),
            ("model", SSPRegressor(y_bound=6.0, ledger=led.budget("d"))),
        ]
    )
    with pytest.raises(ParameterValueError, match="3 values"):
        pipe.fit(X, y)
    assert [e.kind for e in led.history("d")] == ["budget"]


def test_pipeline_still_refuses_min_max_scaler():
    X, y = _data()
    with pytest.raises(ParameterTypeError, match="learns from the data.*PublicRangeScaler"):
        PrivatePipeline([("scale", MinMaxScaler()), ("model", SSPRegressor(y_bound=6.0))]).fit(X, y)
    with pytest.raises(ConfigurationError, match="data_min_.*PublicRangeScaler"):
        PrivatePipeline(
            [("scale", MinMaxScaler()), ("model", SSPRegressor(y_bound=6.0))],
            public_steps=("scale",),
        ).fit(X, y)


@pytest.mark.filterwarnings("ignore::privlearn.errors.DataClippedWarning")
def test_listed_in_public_steps_is_accepted_too():
    X, y = _data()
    pipe = PrivatePipeline(
        [
            ("scale", PublicRangeScaler(bounds=(LOWER, UPPER))),
            ("model", SSPRegressor(y_bound=6.0, random_state=0)),
        ],
        public_steps=("scale",),
    ).fit(X, y)
    assert pipe.mechanism_ == pipe.named_steps["model"].mechanism_


@parametrize_with_checks([PublicRangeScaler(bounds=(-100, 100))])
@pytest.mark.filterwarnings("ignore::privlearn.errors.DataClippedWarning")
def test_sklearn_compatible(estimator, check):
    check(estimator)
