"""Planning a PrivatePipeline whose public encoding step changes the number of columns
before a private step: the width comes from the encoder's given categories and X's schema,
and the plan is what the fit then accounts."""

import numpy as np
import pytest
from scipy.sparse import csr_matrix
from sklearn.base import clone
from sklearn.compose import ColumnTransformer
from sklearn.preprocessing import FunctionTransformer, OneHotEncoder

from privlearn.datasets import ADULT_COLUMNS, _adult_categories, load_adult
from privlearn.models import (
    AdaSSPRegressor,
    PrivatePipeline,
    PrivateSearchCV,
    PrivateStandardScaler,
)

pytestmark = pytest.mark.filterwarnings("ignore::privlearn.errors.DataClippedWarning")

NUMERIC = ["age", "education-num", "hours-per-week"]
CATEGORICAL = ["sex", "race", "relationship"]


@pytest.fixture(scope="module")
def adult():
    """A small subset of the bundled Adult training split: three numeric columns (fixed
    public scaling) and three text columns, as an object array."""
    raw = load_adult(features="raw")
    rows = raw.data[:300]
    num = np.column_stack([rows[:, ADULT_COLUMNS.index(c)].astype(float) / 100.0
                           for c in NUMERIC])
    cat = np.column_stack([rows[:, ADULT_COLUMNS.index(c)] for c in CATEGORICAL])
    X = np.column_stack([num.astype(object), cat])
    return X, raw.target[:300].astype(float)


def _pipeline(drop=None, categories=None):
    cats = _adult_categories()
    categories = categories or [cats[c] for c in CATEGORICAL]
    encode = ColumnTransformer(
        [("cat", OneHotEncoder(categories=categories, drop=drop, sparse_output=False,
                               handle_unknown="ignore" if drop is None else "error"),
          [3, 4, 5])],
        remainder="passthrough")
    return PrivatePipeline(
        [("encode", encode),
         ("scale", PrivateStandardScaler(epsilon=0.5, delta=1e-6, feature_range=(0, 1),
                                         random_state=0)),
         ("model", AdaSSPRegressor(epsilon=1.0, delta=1e-6, x_bound=5.0, y_bound=1.0,
                                   random_state=1))],
        public_steps=("encode",))


@pytest.mark.parametrize("drop", [None, "first"])
def test_plan_of_a_public_encoder_before_private_steps_is_the_fit_accounting(adult, drop):
    X, y = adult
    pipe = _pipeline(drop)
    planned = pipe.planned_mechanism(X, y)
    pipe.fit(X, y)
    cats = _adult_categories()
    width = len(NUMERIC) + sum(len(cats[c]) - (drop == "first") for c in CATEGORICAL)
    assert pipe.named_steps["scale"].n_features_in_ == width
    assert planned == pipe.mechanism_
    assert planned.epsilon(pipe.delta_) == pytest.approx(pipe.epsilon_, rel=1e-9)
    # the scaler is planned at the encoder's output width
    scaler = PrivateStandardScaler(epsilon=0.5, delta=1e-6, feature_range=(0, 1))
    assert scaler.planned_mechanism(np.zeros((300, width)), y) == \
        pipe.named_steps["scale"].mechanism_


def test_categories_learned_from_the_data_cannot_be_planned(adult):
    X, y = adult
    pipe = _pipeline()
    pipe.steps[0] = ("encode", ColumnTransformer(
        [("cat", OneHotEncoder(sparse_output=False), [3, 4, 5])], remainder="passthrough"))
    with pytest.raises(ValueError, match=r"categories='auto'.*categories=\[\[") as e:
        pipe.planned_mechanism(X, y)
    assert "'encode__cat'" in str(e.value)


def test_a_selector_reading_the_data_cannot_be_planned(adult):
    from sklearn.compose import make_column_selector

    X, y = adult
    pipe = _pipeline()
    pipe.steps[0] = ("encode", ColumnTransformer(
        [("f", FunctionTransformer(), make_column_selector(dtype_include=object))],
        sparse_threshold=0))
    with pytest.raises(TypeError, match="callable column selector"):
        pipe.planned_mechanism(X, y)


def test_search_over_a_pipeline_with_a_public_encoder(adult):
    X, y = adult
    pipe = _pipeline()
    search = PrivateSearchCV(pipe, {"model__epsilon": [0.5, 1.0]}, method="composition",
                             score_epsilon=0.1, loss_bound=1.0, random_state=0)
    planned = search.planned_mechanism(X, y)
    search.fit(X, y)
    assert planned == search.mechanism_
    assert np.isfinite(search.epsilon_)


@pytest.mark.parametrize("encoder", [OneHotEncoder(sparse_output=False),
                                     OneHotEncoder(categories=[["Male", "Female"]],
                                                   min_frequency=5, sparse_output=False)])
def test_fit_refuses_a_public_encoder_learning_categories_from_the_data(adult, encoder):
    """categories_ learned from the private data would be released un-noised: the fit
    refuses it before any step runs, whatever public_steps says."""
    X, y = adult
    pipe = _pipeline()
    pipe.steps[0] = ("encode", ColumnTransformer([("cat", encoder, [3])],
                                                 remainder="drop"))
    with pytest.raises(ValueError, match="'encode__cat'") as e:
        pipe.fit(X, y)
    assert "categories=[[" in str(e.value) or "Leave min_frequency=None" in str(e.value)
    assert not hasattr(pipe.named_steps["scale"], "mechanism_")
    assert not hasattr(pipe, "mechanism_")


def _steps_and_data():
    """Public encoding steps, and data holding every category, so that scikit-learn's own
    fit gives the width each should have (the reference)."""
    from sklearn.pipeline import FeatureUnion, Pipeline
    from sklearn.preprocessing import MinMaxScaler, OrdinalEncoder

    a, b = ["x", "y", "z"], ["u", "v"]
    rng = np.random.default_rng(0)
    X = np.column_stack([rng.choice(a, 40), rng.choice(b, 40), rng.random(40),
                         rng.random(40)]).astype(object)
    X[:3, 0], X[:2, 1] = a, b
    cases = {
        "drop if_binary": ColumnTransformer(
            [("c", OneHotEncoder(categories=[a, b], drop="if_binary"), [0, 1])],
            remainder="passthrough"),
        "drop per column": ColumnTransformer(
            [("c", OneHotEncoder(categories=[a, b], drop=["y", "v"]), [0, 1])],
            remainder="drop"),
        "mask, ordinal, remainder estimator": ColumnTransformer(
            [("c", OrdinalEncoder(categories=[a]), [True, False, False, False]),
             ("none", OneHotEncoder(categories=[]), [])],
            remainder=Pipeline([("pick", ColumnTransformer([("b", "drop", [0])],
                                                           remainder="passthrough")),
                                ("scale", MinMaxScaler())])),
        "negative positions and a union": Pipeline([
            ("ct", ColumnTransformer([("c", OneHotEncoder(categories=[b, a]), [-3, 0])],
                                     remainder="drop")),
            ("union", FeatureUnion([("id", "passthrough"),
                                    ("sq", FunctionTransformer(np.square))]))]),
    }
    return X, cases


@pytest.mark.parametrize("case", list(_steps_and_data()[1]))
def test_width_read_off_the_parameters_is_scikit_learns(case):
    from privlearn.models._public_width import public_output_width
    from privlearn.models.preprocessing import _probe_width

    X, cases = _steps_and_data()
    step = cases[case]
    expected = clone(step).fit_transform(X).shape[1]  # dense or sparse
    assert public_output_width("encode", step, X.shape[1], None, _probe_width) == expected


def test_columns_by_name_in_a_dataframe():
    pd = pytest.importorskip("pandas")
    from privlearn.models._public_width import public_output_width

    X = pd.DataFrame({"region": ["north", "south"], "age": [0.2, 0.4], "h": [0.1, 0.3]})
    step = ColumnTransformer(
        [("c", OneHotEncoder(categories=[["north", "south", "east", "west"]]), ["region"]),
         ("n", "passthrough", slice("age", "age"))], remainder="drop")
    width = public_output_width("encode", step, 3, list(X.columns))
    assert width == clone(step).fit_transform(X).shape[1] == 5


def _sparse_case(drop=None, handle_unknown="error", sparse_threshold=0.3, function=False):
    """Two neighbouring data sets (one row's value changed) and a pipeline fitting a public
    ColumnTransformer that one-hot encodes column 0 (categories 0..3) and passes column 1
    through, before a private scaler and a private model. With ``drop="first"`` the
    neighbour moves one row to the dropped category; with ``handle_unknown="ignore"`` to
    a value outside the categories; with ``function`` the transformer is a
    FunctionTransformer returning column 1 as a sparse matrix and the neighbour sets one
    of its values to 0: either way the neighbour has one fewer non-zero entry, and the
    data sets sit on either side of the density threshold."""
    rng = np.random.default_rng(0)
    n = 200
    if function:  # density = #non-zero values / n: < 0.3 below 60
        cat = rng.integers(0, 4, n).astype(float)
        value = np.where(np.arange(n) < 60, rng.uniform(0.1, 1, n), 0.0)
    else:
        value = rng.uniform(-1, 1, n)
    if function:
        changed = (0, 1, 0.0)
    elif drop is not None:  # density = (#rows not in category 0 + n) / (4 n): < 0.3 below 40
        cat = np.zeros(n)
        cat[:40] = rng.integers(1, 4, 40)
        changed = (0, 0, 0.0)
    else:  # density = (#rows with a known category + n) / (5 n): < 0.3 below 100
        cat = rng.integers(0, 4, n).astype(float)
        cat[:100] = 9.0
        changed = (150, 0, 9.0)
    X = np.column_stack([cat, value])
    X_neighbour = X.copy()
    X_neighbour[changed[0], changed[1]] = changed[2]
    y = rng.uniform(-1, 1, n)
    if function:
        block = ("f", FunctionTransformer(csr_matrix, accept_sparse=True), [1])
        width, rest = 1, "drop"
    else:
        block = ("cat", OneHotEncoder(categories=[[0.0, 1.0, 2.0, 3.0]], drop=drop,
                                      handle_unknown=handle_unknown), [0])
        width, rest = (3 if drop is not None else 4) + 1, "passthrough"
    encode = ColumnTransformer([block], remainder=rest, sparse_threshold=sparse_threshold)
    pipe = PrivatePipeline(
        [("encode", encode),
         ("scale", PrivateStandardScaler(feature_range=[(-1, 1)] * width, random_state=0)),
         ("model", AdaSSPRegressor(x_bound=3.0, y_bound=1.0, random_state=1))],
        public_steps=("encode",))
    return pipe, X, X_neighbour, y


@pytest.mark.parametrize("case", [{"drop": "first"}, {"handle_unknown": "ignore"},
                                  {"function": True}])
def test_public_encoder_whose_output_sparsity_follows_the_data_is_refused(case):
    """A public ColumnTransformer chooses sparse or dense output by comparing the density
    of its output with sparse_threshold; when a block's number of non-zero entries
    depends on the values (a dropped category, ignored unknown values, a function
    returning the values as a sparse matrix), one record decides it: on one data set the
    pipeline fits and releases, on its neighbour its scaler gets a sparse matrix (and the
    fitted sparse_output_ differs). Refused before any step is fitted, on both, naming
    sparse_threshold."""
    pipe, X, X_neighbour, y = _sparse_case(**case)
    # the premise, by scikit-learn alone: the neighbours fall on either side
    flags = [clone(pipe.steps[0][1]).fit(D).sparse_output_ for D in (X, X_neighbour)]
    assert flags == [False, True]
    for D in (X, X_neighbour):
        with pytest.raises(ValueError, match=r"sparse_threshold=0\.3.*sparse_threshold=0"):
            clone(pipe).fit(D, y)
        with pytest.raises(ValueError, match="sparse_threshold"):
            PrivateSearchCV(clone(pipe), {"model__epsilon": [0.5, 1.0]}, loss_bound=4.0,
                            random_state=0).fit(D, y)
    assert not hasattr(pipe.steps[0][1], "sparse_output_")  # nothing was fitted


@pytest.mark.parametrize("fix", [{"sparse_threshold": 0.0}, {"handle_unknown": "error"}])
def test_public_encoder_with_a_fixed_output_format_fits_alike_on_neighbours(fix):
    """What the refusal asks for: dense output whatever the data (sparse_threshold=0), or
    an encoder with one non-zero per row and column (no drop, unknown values refused), so
    the density is fixed by the parameters; both neighbours then fit, with the same
    sparse_output_."""
    if "handle_unknown" in fix:
        pipe, X, X_neighbour, y = _sparse_case(handle_unknown="error")
        X, X_neighbour = (np.column_stack([np.arange(len(D)) % 4, D[:, 1]])
                          for D in (X, X_neighbour))
        X_neighbour[0, 0] = 2.0
    else:
        pipe, X, X_neighbour, y = _sparse_case(drop="first", **fix)
    flags = [clone(pipe).fit(D, y).steps[0][1].sparse_output_ for D in (X, X_neighbour)]
    assert flags[0] == flags[1]


def test_width_of_a_step_returning_a_sparse_matrix_is_its_number_of_columns():
    """A step that needs no fitting and returns a scipy sparse matrix (probed on a row of
    zeros) hands on as many columns as the matrix has, as scikit-learn's own fit shows;
    the plan of the pipeline around it is then the fit's accounting."""
    from privlearn.models._public_width import public_output_width
    from privlearn.models.preprocessing import _probe_width

    X = np.random.default_rng(0).uniform(-1, 1, size=(60, 3))
    step = ColumnTransformer(
        [("f", FunctionTransformer(csr_matrix, accept_sparse=True), [1, 2])],
        remainder="passthrough", sparse_threshold=0)
    expected = clone(step).fit_transform(X).shape[1]
    assert public_output_width("encode", step, 3, None, _probe_width) == expected == 3
    pipe = PrivatePipeline(
        [("encode", step),
         ("scale", PrivateStandardScaler(feature_range=[(-1, 1)] * 3, random_state=0)),
         ("model", AdaSSPRegressor(x_bound=3.0, y_bound=1.0, random_state=1))],
        public_steps=("encode",))
    planned = pipe.planned_mechanism(X, X[:, 0])
    assert planned == pipe.fit(X, X[:, 0]).mechanism_


def _imputers() -> dict:
    from sklearn.impute import KNNImputer, MissingIndicator, SimpleImputer

    return {"add_indicator": SimpleImputer(strategy="constant", fill_value=0.0,
                                           add_indicator=True),
            "mean": SimpleImputer(strategy="mean"),
            "indicator": MissingIndicator(),
            "knn": KNNImputer(n_neighbors=2)}


@pytest.mark.parametrize("imputer", list(_imputers()))
def test_public_imputer_learning_from_the_data_is_refused(imputer):
    """A public imputing step that the pipeline fits: on a data set without a missing
    value and on its neighbour with one, scikit-learn's own fit differs (the indicator's
    columns and output width, the column mean, the stored rows), a release no mechanism
    covers; the pipeline refuses it on both before any step is fitted."""
    from sklearn.impute import MissingIndicator, SimpleImputer
    from sklearn.pipeline import FeatureUnion

    rng = np.random.default_rng(0)
    X = rng.uniform(-1, 1, size=(60, 2))
    X_neighbour = X.copy()
    X_neighbour[0, 0] = np.nan
    y = rng.uniform(-1, 1, 60)
    step = _imputers()[imputer]
    fits = [clone(step).fit(D) for D in (X, X_neighbour)]
    assert (fits[0].transform(X).shape != fits[1].transform(X).shape
            or not np.array_equal(fits[0].transform(X_neighbour[:1]),
                                  fits[1].transform(X_neighbour[:1]), equal_nan=True)
            or getattr(fits[1], "_fit_X", np.zeros(0)).size > 0)
    if isinstance(step, MissingIndicator):  # keep the values next to their indicators
        step = FeatureUnion([("fill", SimpleImputer(strategy="constant", fill_value=0.0,
                                                   keep_empty_features=True)),
                             ("missing", step)])
    pipe = PrivatePipeline(
        [("impute", step),
         ("scale", PrivateStandardScaler(feature_range=(-1, 1), random_state=0))],
        public_steps=("impute",))
    for D in (X, X_neighbour):
        with pytest.raises(ValueError, match=r"'impute.*public_steps does not"):
            clone(pipe).fit(D, y)


def test_public_constant_imputer_is_fitted_alike_on_neighbours():
    """What the refusal asks for fits, and learns nothing from the values: a constant
    fill and one indicator per column."""
    from sklearn.impute import MissingIndicator, SimpleImputer
    from sklearn.pipeline import FeatureUnion

    rng = np.random.default_rng(0)
    X = rng.uniform(-1, 1, size=(60, 2))
    X_neighbour = X.copy()
    X_neighbour[0, 0] = np.nan
    step = FeatureUnion([("fill", SimpleImputer(strategy="constant", fill_value=0.0,
                                               keep_empty_features=True)),
                         ("missing", MissingIndicator(features="all"))])
    pipe = PrivatePipeline(
        [("impute", step),
         ("scale", PrivateStandardScaler(feature_range=(-1, 1), random_state=0))],
        public_steps=("impute",))
    fits = [clone(pipe).fit(D).steps[0][1] for D in (X, X_neighbour)]
    assert np.array_equal(fits[0].transform(X_neighbour), fits[1].transform(X_neighbour))


def test_a_category_list_that_is_not_a_list_is_refused_naming_its_entry():
    """``categories=[[...], None]`` (a column left to the data) crashed the planning with
    a bare ``TypeError: object of type 'NoneType' has no len()`` (scikit-learn's own fit
    an ``IndexError``); it is a ParameterValueError naming the entry and what to pass."""
    from privlearn.errors import ParameterValueError

    X = np.zeros((20, 2))
    for bad in (None, "ab", 3):
        pipe = PrivatePipeline(
            [("encode", OneHotEncoder(categories=[[0.0, 1.0], bad], sparse_output=False)),
             ("model", AdaSSPRegressor(random_state=0))], public_steps=("encode",))
        with pytest.raises(ParameterValueError,
                           match=rf"'encode'.*entry 1 = {bad!r}.*one input column"):
            pipe.planned_mechanism(X, np.zeros(20))
