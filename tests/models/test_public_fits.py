"""The public steps a PrivatePipeline may fit on the private data: only those whose fit
learns nothing from the values (privlearn.models._public_fits). Each refused step is
shown to leak by scikit-learn alone (its fit differs between neighbouring data sets);
each allowed one is shown to fit alike on neighbours."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.compose import ColumnTransformer
from sklearn.decomposition import PCA
from sklearn.impute import MissingIndicator, SimpleImputer
from sklearn.pipeline import FeatureUnion, Pipeline
from sklearn.preprocessing import (
    FunctionTransformer,
    KBinsDiscretizer,
    MinMaxScaler,
    OneHotEncoder,
    OrdinalEncoder,
    PolynomialFeatures,
    QuantileTransformer,
    SplineTransformer,
    StandardScaler,
    TargetEncoder,
)
from sklearn.random_projection import GaussianRandomProjection

from privlearn.errors import ConfigurationError
from privlearn.ledger import Ledger
from privlearn.models import (
    PrivatePipeline,
    PrivateSearchCV,
    PrivateStandardScaler,
    SSPRegressor,
)


def _neighbours():
    """A data set (a category code in column 0, two values in [-1, 1]) and its neighbour
    with one record changed."""
    rng = np.random.default_rng(0)
    n = 80
    X = np.column_stack([rng.integers(0, 3, n), rng.uniform(-1, 1, (n, 2))]).astype(float)
    y = np.clip(X[:, 1] - X[:, 2] + 0.1 * rng.normal(size=n), -2, 2)
    X2, y2 = X.copy(), y.copy()
    X2[5] = [2.0, 0.99, -0.99]
    y2[5] = 2.0
    return (X, y), (X2, y2)


def _state(value, depth=0):
    """``value`` as nested lists of plain numbers and strings: arrays by their entries,
    objects (a fitted sub-transformer, a B-spline) by their attributes."""
    if depth > 6 or (callable(value) and not hasattr(value, "__dict__")):
        return repr(value)
    if isinstance(value, np.ndarray):
        return [_state(v, depth + 1) for v in value.ravel().tolist()] + [list(value.shape)]
    if isinstance(value, list | tuple):
        return [_state(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return sorted((str(k), _state(v, depth + 1)) for k, v in value.items())
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return [type(value).__name__, _state(vars(value), depth + 1)]
    return value if isinstance(value, int | float | str | bool | None) else repr(value)


def _fitted_state(step, X, y):
    """Everything a fit of ``step`` stores (the release), as plain values."""
    return _state(clone(step).fit(X, y))


#: Steps that used to be accepted in public_steps, and what their fit releases.
_LEAKING = {
    "StandardScaler": lambda: StandardScaler(),
    "MinMaxScaler": lambda: MinMaxScaler(),
    "QuantileTransformer": lambda: QuantileTransformer(n_quantiles=10),
    "PCA": lambda: PCA(2),
    "TargetEncoder": lambda: ColumnTransformer(
        [("cat", TargetEncoder(categories=[[0.0, 1.0, 2.0]], target_type="continuous"), [0])],
        remainder="passthrough",
    ),
    "KBinsDiscretizer": lambda: KBinsDiscretizer(
        3, encode="ordinal", quantile_method="averaged_inverted_cdf"
    ),
    "SplineTransformer": lambda: SplineTransformer(n_knots=3, degree=1),
    "scaler in a ColumnTransformer": lambda: ColumnTransformer(
        [
            ("cat", OneHotEncoder(categories=[[0.0, 1.0, 2.0]], sparse_output=False), [0]),
            ("num", StandardScaler(), [1, 2]),
        ]
    ),
    "PCA in a FeatureUnion": lambda: FeatureUnion(
        [("keep", FunctionTransformer()), ("pca", PCA(1))]
    ),
    "callable column selector": lambda: ColumnTransformer(
        [("f", FunctionTransformer(), lambda X: [1] if X[5, 0] == 2.0 else [2])]
    ),
    "scaler in a Pipeline": lambda: Pipeline(
        [("f", FunctionTransformer()), ("s", StandardScaler())]
    ),
}


@pytest.mark.parametrize("kind", sorted(_LEAKING))
def test_a_public_step_that_learns_from_the_values_is_refused_before_anything(kind, tmp_path):
    """An unfitted StandardScaler, QuantileTransformer, PCA, TargetEncoder (from y), ...
    listed in public_steps was fitted on the private data and its exact statistics
    released with the pipeline. By scikit-learn alone its fit differs between two
    neighbouring data sets; the pipeline now refuses it (ConfigurationError naming the
    step and what to do) before any step is fitted and before any budget is reserved,
    in fit, fit_transform, planned_mechanism and a search alike."""
    (X, y), (X2, y2) = _neighbours()
    step = _LEAKING[kind]()
    assert _fitted_state(step, X, y) != _fitted_state(step, X2, y2)  # the premise

    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=50.0, delta=1e-5)
    scaler = PrivateStandardScaler(feature_range=(-5, 5), random_state=0, ledger=led.budget("d"))
    pipe = PrivatePipeline(
        [
            ("prep", step),
            (
                "model",
                SSPRegressor(x_bound=5.0, y_bound=2.0, random_state=1, ledger=led.budget("d")),
            ),
        ],
        public_steps=("prep",),
    )
    first = PrivatePipeline(
        [
            ("scale", scaler),
            ("prep", clone(step)),
            ("model", SSPRegressor(x_bound=5.0, y_bound=2.0)),
        ],
        public_steps=("prep",),
    )
    for call in (
        pipe.fit,
        pipe.fit_transform if hasattr(pipe, "fit_transform") else None,
        pipe.planned_mechanism,
        first.fit,
    ):
        if call is None:
            continue
        with pytest.raises(ConfigurationError, match=r"'prep.*FrozenEstimator") as e:
            call(X, y)
        assert "public_steps does not make them public" in str(e.value)
    search = PrivateSearchCV(
        clone(pipe).set_params(model__ledger=None),
        {"model__epsilon": [0.5, 1.0]},
        loss_bound=4.0,
        ledger=led.budget("d"),
        random_state=0,
    )
    with pytest.raises(ConfigurationError, match="'prep"):
        search.fit(X, y)
    assert [e.kind for e in led.history("d")] == ["budget"]  # nothing reserved
    assert not hasattr(scaler, "mean_") and not hasattr(pipe[-1], "coef_")
    assert not hasattr(step, "n_features_in_")  # the public step was not fitted


def test_the_refusal_names_what_the_step_learns_and_its_private_counterpart():
    (X, y), _ = _neighbours()
    pipe = PrivatePipeline(
        [("scale", StandardScaler()), ("model", SSPRegressor())], public_steps=("scale",)
    )
    with pytest.raises(
        ConfigurationError,
        # what is released un-noised is the refused step's fit, said before the
        # counterpart is named (after it, "its fitted attributes" read as the counterpart's)
        match=r"exact mean and variance.*its fitted attributes would be released.*un-noised"
        r".*Use its private counterpart instead: a PrivateStandardScaler step "
        r"\(not in public_steps\) with feature_range",
    ):
        pipe.fit(X, y)
    target = PrivatePipeline(
        [("enc", TargetEncoder()), ("model", SSPRegressor())], public_steps=("enc",)
    )
    with pytest.raises(ConfigurationError, match=r"'enc'.*private labels y"):
        target.fit(X[:, :1], y)


#: Steps whose fit reads the schema only: allowed, and they fit alike on neighbours.
_ALLOWED = {
    "OneHotEncoder": lambda: ColumnTransformer(
        [
            (
                "cat",
                OneHotEncoder(categories=[[0.0, 1.0, 2.0]], drop="first", sparse_output=False),
                [0],
            )
        ],
        remainder="passthrough",
    ),
    "OrdinalEncoder": lambda: ColumnTransformer(
        [("cat", OrdinalEncoder(categories=[[0.0, 1.0, 2.0]]), [0])], remainder="passthrough"
    ),
    "constant imputation": lambda: FeatureUnion(
        [
            ("fill", SimpleImputer(strategy="constant", fill_value=0.0, keep_empty_features=True)),
            ("missing", MissingIndicator(features="all")),
        ]
    ),
    "FunctionTransformer": lambda: FunctionTransformer(np.tanh),
    "PolynomialFeatures": lambda: PolynomialFeatures(2),
    "GaussianRandomProjection": lambda: GaussianRandomProjection(2, random_state=0),
    "SplineTransformer with knots": lambda: SplineTransformer(
        knots=np.linspace(-2.0, 2.0, 4)[:, None] * np.ones((1, 3)), degree=1
    ),
    "a Pipeline of them": lambda: Pipeline(
        [("poly", PolynomialFeatures(2)), ("tanh", FunctionTransformer(np.tanh))]
    ),
}


@pytest.mark.parametrize("kind", sorted(_ALLOWED))
def test_a_public_step_that_learns_nothing_from_the_values_is_fitted(kind):
    """The allowed steps still fit in public_steps, are planned as they are fitted, and
    (the ground truth of the allow-list) fit alike on neighbouring data sets: the same
    fitted state, the same transform of public rows."""
    (X, y), (X2, y2) = _neighbours()
    step = _ALLOWED[kind]()
    probe = np.array([[0.0, 0.5, -0.5], [2.0, -1.0, 1.0]])
    fits = [clone(step).fit(A, b) for A, b in ((X, y), (X2, y2))]
    assert _fitted_state(step, X, y) == _fitted_state(step, X2, y2)
    np.testing.assert_array_equal(fits[0].transform(probe), fits[1].transform(probe))

    pipe = PrivatePipeline(
        [("prep", step), ("model", SSPRegressor(x_bound=50.0, y_bound=2.0, random_state=1))],
        public_steps=("prep",),
    )
    assert pipe.fit(X, y).mechanism_ == pipe[-1].mechanism_
    if kind != "SplineTransformer with knots":  # its width is not planned (fits anyway)
        assert pipe.planned_mechanism(X, y) == pipe.mechanism_
