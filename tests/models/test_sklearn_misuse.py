"""Real misuse of the estimators by data scientists, reproduced on the public API: a
target passed as a column, a label pair given in another order than scikit-learn's, a
public range as wide as the floats allow. Each case compares against scikit-learn's own
behaviour or a naive ground truth."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import cross_val_score

from privlearn.models import DPSGDClassifier, PrivateSearchCV
from privlearn.models.preprocessing import private_quantile

RNG = np.random.default_rng(11)
X = RNG.uniform(-1.0, 1.0, size=(200, 3))
Y = (X @ np.array([2.0, -1.0, 0.5]) > 0).astype(int)


def _search(**params):
    return PrivateSearchCV(
        DPSGDClassifier(n_iter=10, classes=[0, 1]),
        {"epsilon": [0.5, 1.0]},
        method="composition",
        random_state=0,
        **params,
    )


@pytest.mark.parametrize(
    "column",
    [lambda y: y[:, None], lambda y: __import__("pandas").DataFrame({"t": y})],
    ids=["array", "frame"],
)
def test_a_search_scores_a_column_target_as_the_flat_one(column):
    """The private score of a classifier's run is a noisy sum of 0-1 losses, one per
    record (sensitivity 1). A column y (n, 1) against the flat predictions broadcast to
    an (n, n) table: its sum moved by up to 2n - 1 per record under the same noise (and
    every score was about 0)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flat = _search().fit(X, Y)
        col = _search().fit(X, column(Y))
    assert col.scores_ == flat.scores_
    assert col.best_score_ == flat.best_score_ > 0.5
    # the released model's score on held-out data, too
    assert col.score(X, column(Y)) == flat.score(X, Y) == np.mean(flat.predict(X) == Y)


def test_public_validation_scores_a_column_target_as_the_flat_one():
    X_val = RNG.uniform(-1.0, 1.0, size=(50, 3))
    y_val = (X_val @ np.array([2.0, -1.0, 0.5]) > 0).astype(int)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flat = _search().fit(X, Y, X_val=X_val, y_val=y_val)
        col = _search().fit(X, Y, X_val=X_val, y_val=y_val[:, None])
    truth = [np.mean(m.predict(X_val) == y_val) for m in (flat.best_estimator_,)]
    assert col.scores_ == flat.scores_
    assert flat.best_score_ == pytest.approx(truth[0])


@pytest.mark.parametrize("scoring", ["roc_auc", "neg_log_loss"])
def test_a_label_pair_given_in_reverse_scores_as_scikit_learn_s_sorted_pair(scoring):
    """scikit-learn's scorers read predict_proba's columns in sorted label order (its
    classifiers' classes_ is np.unique(y)); a public pair given as [1, 0] was kept in
    that order, and a near-perfect model scored an AUC of 0."""
    Xs = 4 * X
    kw = dict(epsilon=1e3, delta=1e-5, n_iter=200, random_state=0)
    ours = [
        cross_val_score(DPSGDClassifier(classes=c, **kw), Xs, Y, scoring=scoring, cv=2)
        for c in ([0, 1], [1, 0])
    ]
    np.testing.assert_array_equal(ours[1], ours[0])
    peer = cross_val_score(LogisticRegression(C=1e3), Xs, Y, scoring=scoring, cv=2)
    if scoring == "roc_auc":
        assert np.all(ours[1] > 0.95) and np.all(peer > 0.95)
    clf = DPSGDClassifier(classes=["yes", "no"], **kw).fit(Xs, np.where(Y == 1, "yes", "no"))
    assert clf.classes_.tolist() == sorted(["yes", "no"])
    proba = clf.predict_proba(Xs)
    # column j is the probability of classes_[j], as scikit-learn's
    assert np.mean(clf.classes_[np.argmax(proba, axis=1)] == clf.predict(Xs)) == 1.0


def test_a_label_pair_that_cannot_be_ordered_is_refused_before_anything():
    mixed = np.array([1, "a"], dtype=object)
    with pytest.raises(ValueError, match="classes must be .*labels of one kind"):
        DPSGDClassifier(n_iter=2, classes=mixed).planned_mechanism(X, Y)


@pytest.mark.parametrize(
    "lower, upper",
    [(-1e308, 1e308), (-np.finfo(float).max, np.finfo(float).max), (0.0, np.finfo(float).max)],
)
def test_private_quantile_on_the_widest_finite_range_releases_a_candidate_inside_it(lower, upper):
    """The candidates were np.linspace(lower, upper): its step overflowed to inf on a
    range wider than the largest float, and the release was inf or NaN."""
    values = RNG.uniform(0.0, 10.0, 100)
    for seed in range(5):
        q, _ = private_quantile(values, 0.5, 1.0, lower, upper, random_state=seed)
        assert np.isfinite(q) and lower <= q <= upper
    # at a huge epsilon on a small range the candidates are those of np.linspace
    q, _ = private_quantile(values, 0.5, 1e6, 0.0, 10.0, n_candidates=11, random_state=0)
    grid = np.linspace(0.0, 10.0, 11)
    best = grid[np.argmin(np.abs((values[:, None] <= grid).sum(0) - 50))]
    assert q == best


def test_a_public_constant_imputer_dropping_an_empty_column_is_refused():
    """scikit-learn's SimpleImputer(strategy="constant") drops a column with no observed
    value (keep_empty_features=False, its default): on a data set whose column 1 is all
    missing and on its neighbour with one value there, the fitted imputer (statistics_
    NaN or not) and the model's number of coefficients differ, un-noised. The pipeline
    refuses it on both before anything is fitted, and fits keep_empty_features=True alike
    on both."""
    from sklearn.base import clone
    from sklearn.impute import SimpleImputer

    from privlearn.errors import ConfigurationError
    from privlearn.models import PrivatePipeline, SSPRegressor

    X0 = RNG.uniform(-0.5, 0.5, size=(50, 3))
    X0[:, 1] = np.nan
    X1 = X0.copy()
    X1[0, 1] = 0.3  # the neighbour: one record has a value in column 1
    y = RNG.uniform(-1.0, 1.0, 50)
    default = SimpleImputer(strategy="constant", fill_value=0.0)
    widths = {clone(default).fit(D).transform(X1).shape[1] for D in (X0, X1)}
    assert widths == {2, 3}  # scikit-learn's own fit follows the record

    def pipe(imputer):
        return PrivatePipeline(
            [("impute", imputer), ("model", SSPRegressor(random_state=0))],
            public_steps=("impute",),
        )

    for D in (X0, X1):
        est = pipe(clone(default))
        with pytest.raises(ConfigurationError, match="keep_empty_features=True"):
            est.fit(D, y)
        assert not hasattr(est[-1], "coef_")
    kept = [
        pipe(SimpleImputer(strategy="constant", fill_value=0.0, keep_empty_features=True)).fit(D, y)
        for D in (X0, X1)
    ]
    assert [k[0].statistics_.tolist() for k in kept] == [[0.0] * 3] * 2
    assert [k[-1].coef_.shape for k in kept] == [(3,), (3,)]
    assert kept[0].planned_mechanism(X0, y) == kept[0].mechanism_


def test_complex_values_are_refused_by_the_private_bounds_not_truncated():
    """np.asarray(values, dtype=float) dropped the imaginary parts (with a NumPy
    ComplexWarning only): the quantile of the real parts was released as if they were
    the values. The estimators refuse complex data (scikit-learn's check); so do the
    bounds."""
    from privlearn.errors import ParameterTypeError
    from privlearn.models.preprocessing import choose_x_bound, choose_y_bound

    z = RNG.uniform(0.0, 1.0, 20) + 1j * RNG.uniform(0.0, 1.0, 20)
    for call, name in (
        (lambda: private_quantile(z, 0.5, 1.0, 0.0, 2.0), "values"),
        (lambda: choose_y_bound(list(z), 1.0, 2.0), "y"),
        (lambda: choose_x_bound(z.reshape(-1, 2), 1.0, 2.0), "X"),
    ):
        with pytest.raises(ParameterTypeError, match=rf"{name} must be real numbers"):
            call()
    with pytest.raises(ParameterTypeError, match="values must be numbers"):  # still typed
        private_quantile([[1.0, 2.0], [3.0]], 0.5, 1.0, 0.0, 2.0)


@pytest.mark.parametrize("epsilon", [1e307, float(np.finfo(float).max)])
def test_private_quantile_at_the_largest_finite_epsilons_draws_a_best_candidate(epsilon):
    """0.5 epsilon utility overflowed to -inf for every candidate, and subtracting the
    largest (-inf) made every probability NaN: NumPy's bare "probabilities contain NaN".
    At such an epsilon the mechanism picks a candidate of the largest utility, and its
    PureDP(epsilon) is accounted."""
    values = np.arange(100.0)
    grid = np.linspace(0.0, 100.0, 1024)
    utility = -np.abs((values[:, None] <= grid).sum(0) - 30.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seed in range(3):
            got, mech = private_quantile(values, 0.3, epsilon, 0.0, 100.0, random_state=seed)
            assert -abs(np.sum(values <= got) - 30.0) == utility.max()
    assert mech.epsilon(0.0) == epsilon


def test_teacher_votes_in_pandas_nullable_columns_are_numbers():
    """Teachers' predicted labels kept in a DataFrame of pandas' nullable Int64 columns
    (NumPy sees an object array) were refused as "got an array of dtype object"; they are
    the same release as the plain integer votes, and a missing vote is refused as
    missing."""
    import pandas as pd

    from privlearn.errors import NonFiniteInputError
    from privlearn.models import PATE

    votes = RNG.integers(0, 3, size=(7, 40))
    plain = PATE(epsilon=2.0, random_state=0).release(votes, n_classes=3)
    for frame in (pd.DataFrame(votes).astype("Int64"), pd.DataFrame(votes).astype("Float64")):
        pate = PATE(epsilon=2.0, random_state=0)
        np.testing.assert_array_equal(pate.release(frame, n_classes=3), plain)
    missing = pd.DataFrame(votes).astype("Int64")
    missing.iloc[2, 5] = pd.NA
    with pytest.raises(NonFiniteInputError, match="NaN"):
        PATE(epsilon=2.0).release(missing, n_classes=3)
    with pytest.raises(TypeError, match="must be numbers"):
        PATE(epsilon=2.0).release(votes.astype(str).astype(object), n_classes=3)


@pytest.mark.parametrize("all_sparse", [True, False])
def test_a_frame_of_sparse_columns_is_refused_before_the_ledger_is_charged(all_sparse, tmp_path):
    """A DataFrame of pandas.SparseDtype columns is sparse data by its schema
    (scikit-learn's validation turns it into a SciPy sparse matrix): refused before the
    reservation, as a SciPy sparse X is, not after it (which charged the budget in
    full for a mistake of type)."""
    import pandas as pd

    from privlearn.errors import ParameterTypeError
    from privlearn.ledger import Ledger
    from privlearn.models import PrivateStandardScaler, SSPRegressor

    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=10.0, delta=1e-5)
    frame = pd.DataFrame(X)
    cols = list(frame.columns) if all_sparse else [1]
    frame[cols] = frame[cols].astype(pd.SparseDtype(float, 0.0))
    for est in (
        SSPRegressor(ledger=led.budget("d")),
        PrivateStandardScaler(feature_range=(-1.0, 1.0), ledger=led.budget("d")),
    ):
        with pytest.raises(ParameterTypeError, match=r"X.sparse.to_dense\(\).*before anything"):
            est.fit(frame, X[:, 0])
    assert [e for e in led.history("d") if e.kind != "budget"] == []


def test_a_sparse_target_is_refused_before_the_ledger_is_charged(tmp_path):
    """A SciPy sparse y is refused by every supervised fit whatever its values (a type
    mistake, as a sparse X is): before the reservation, not after it, which charged the
    budget in full for it."""
    from scipy import sparse

    from privlearn.errors import ParameterTypeError
    from privlearn.ledger import Ledger
    from privlearn.models import DPSGDClassifier, PrivateSearchCV, SSPRegressor

    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=10.0, delta=1e-5)
    y = X[:, :1]
    for est, target in (
        (SSPRegressor(ledger=led.budget("d")), y),
        (DPSGDClassifier(n_iter=2, classes=[0, 1], ledger=led.budget("d")), y > 0),
        (
            PrivateSearchCV(
                SSPRegressor(), {"epsilon": [1.0]}, loss_bound=1.0, ledger=led.budget("d")
            ),
            y,
        ),
    ):
        with pytest.raises(ParameterTypeError, match="Sparse data.*y.*before anything"):
            est.fit(X, sparse.csr_matrix(target))
    assert [e for e in led.history("d") if e.kind != "budget"] == []


@pytest.mark.parametrize(
    "column, error",
    [
        (lambda n: np.arange(n) + 0j, ValueError),
        (lambda n: __import__("pandas").date_range("2020-01-01", periods=n), TypeError),
        (lambda n: __import__("pandas").to_timedelta(np.arange(n), unit="s"), TypeError),
    ],
    ids=["complex", "datetime", "timedelta"],
)
def test_columns_no_fit_takes_are_refused_by_their_dtype_before_the_ledger(column, error, tmp_path):
    """A complex, datetime or timedelta column is refused by every fit whatever its
    values (scikit-learn: "Complex data not supported", a failed dtype promotion): the
    refusal is decided by the dtype, the schema, so it comes before the reservation,
    and the budget is not charged."""
    import pandas as pd

    from privlearn.ledger import Ledger
    from privlearn.models import PrivateStandardScaler, SSPRegressor

    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=10.0, delta=1e-5)
    frame = pd.DataFrame({"a": X[:, 0], "b": column(len(X))})
    for est in (
        SSPRegressor(ledger=led.budget("d")),
        PrivateStandardScaler(feature_range=(-1.0, 1.0), ledger=led.budget("d")),
    ):
        with pytest.raises(error, match="before anything was reserved"):
            est.fit(frame, X[:, 0])
    with pytest.raises(ValueError, match="Complex data not supported.*before anything"):
        SSPRegressor(ledger=led.budget("d")).fit(X, X[:, 0] + 0j)
    assert [e for e in led.history("d") if e.kind != "budget"] == []


def test_a_search_over_a_pipeline_that_imputes_takes_the_missing_values_it_imputes():
    """The refusal of a NaN says to replace it with a public constant; a PrivatePipeline
    whose public SimpleImputer does so fits the data, but PrivateSearchCV over that very
    pipeline refused it (its own check of X as a private estimator's), on the training
    data and on public validation data alike. A pipeline whose first step is private
    still has the data refused by the search, before anything is reserved or fitted."""
    from sklearn.impute import SimpleImputer

    from privlearn.errors import NonFiniteInputError
    from privlearn.models import PrivatePipeline, SSPRegressor

    Xn = X.copy()
    Xn[3, 1] = np.nan
    y = X[:, 0]
    imputing = PrivatePipeline(
        [
            (
                "impute",
                SimpleImputer(strategy="constant", fill_value=0.0, keep_empty_features=True),
            ),
            ("model", SSPRegressor(x_bound=2.0, random_state=0)),
        ],
        public_steps=("impute",),
    )
    grid = {"model__epsilon": [0.5, 1.0]}
    alone = imputing.fit(Xn, y)
    assert alone[-1].n_features_in_ == X.shape[1]
    search = PrivateSearchCV(imputing, grid, loss_bound=4.0, random_state=0).fit(Xn, y)
    assert search.n_features_in_ == X.shape[1] and np.isfinite(search.predict(Xn)).all()
    public = PrivateSearchCV(imputing, grid, random_state=0).fit(Xn, y, X_val=Xn + 1.0, y_val=y)
    assert np.isfinite(public.best_score_)
    direct = PrivatePipeline([("model", SSPRegressor(x_bound=2.0))])
    with pytest.raises(NonFiniteInputError, match="PrivateSearchCV: Input X contains NaN"):
        PrivateSearchCV(direct, grid, loss_bound=4.0).fit(Xn, y)


@pytest.mark.parametrize("n_categories", [3, 9, 40])
@pytest.mark.parametrize("threshold", [0.1, 0.3])
def test_a_public_encoding_that_outputs_sparse_data_is_refused_before_the_ledger(
    n_categories, threshold, tmp_path
):
    """scikit-learn's default OneHotEncoder(sparse_output=True) in a ColumnTransformer
    hands on a sparse matrix when the output's density is below sparse_threshold, which
    the private step after it refuses whatever the values: that refusal came after the
    pipeline's reservation, charged in full. It is now decided from the parameters and
    refused before; the ground truth is scikit-learn's own fitted sparse_output_."""
    import scipy.sparse as sp
    from sklearn.base import clone
    from sklearn.compose import ColumnTransformer
    from sklearn.preprocessing import OneHotEncoder

    from privlearn.errors import ParameterTypeError
    from privlearn.ledger import Ledger
    from privlearn.models import PrivatePipeline, SSPRegressor

    cats = list(range(n_categories))
    data = np.column_stack([RNG.integers(0, n_categories, 60), RNG.uniform(-1, 1, (60, 2))])
    y = RNG.uniform(-1.0, 1.0, 60)
    encode = ColumnTransformer(
        [("cat", OneHotEncoder(categories=[cats]), [0])],
        remainder="passthrough",
        sparse_threshold=threshold,
    )
    is_sparse = clone(encode).fit(data).sparse_output_
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=10.0, delta=1e-5)
    pipe = PrivatePipeline(
        [("encode", encode), ("model", SSPRegressor(x_bound=2.0, ledger=led.budget("d")))],
        public_steps=("encode",),
    )
    if is_sparse:
        with pytest.raises(ParameterTypeError, match="'encode'.*sparse.*before anything"):
            pipe.fit(data, y)
        assert [e.kind for e in led.history("d") if e.kind != "budget"] == []
    else:
        assert pipe.fit(data, y).mechanism_ == pipe[-1].mechanism_
    # a bare encoder with its default sparse output, and a sparse X, likewise
    bare = PrivatePipeline(
        [
            ("encode", OneHotEncoder(categories=[cats])),
            ("model", SSPRegressor(ledger=led.budget("d"))),
        ],
        public_steps=("encode",),
    )
    with pytest.raises(ParameterTypeError, match="sparse_output=False"):
        bare.fit(data[:, :1], y)
    direct = PrivatePipeline([("model", SSPRegressor(ledger=led.budget("d")))])
    with pytest.raises(ParameterTypeError, match="X is sparse"):
        direct.fit(sp.csr_matrix(data), y)
    assert [e.kind for e in led.history("d") if e.kind != "budget"] == (
        [] if is_sparse else ["reserve", "settle"]
    )


@pytest.mark.parametrize("memory", [False, True])
def test_a_failed_refit_of_a_nested_or_cached_pipeline_leaves_it_as_it_was(memory, tmp_path):
    """A refit that fails in its last step has refitted the steps before it (with
    memory=, scikit-learn puts fitted clones in steps); the pipeline, its nested
    pipeline and their steps are put back as they were, so predict does not combine a
    new scaler with the model fitted after the old one."""
    from privlearn.models import DPSGDRegressor, PrivatePipeline, PrivateStandardScaler

    y = X[:, 0]
    inner = PrivatePipeline(
        [("scale", PrivateStandardScaler(feature_range=(-1.0, 1.0), random_state=0))]
    )
    pipe = PrivatePipeline(
        [("pre", inner), ("model", DPSGDRegressor(n_iter=20, random_state=1))],
        memory=str(tmp_path) if memory else None,
    ).fit(X, y)
    before = (pipe.predict(X), pipe.epsilon_, [id(s) for _, s in pipe.steps])
    pipe.set_params(pre__scale__random_state=5, model__learning_rate=1e200)
    with pytest.raises(FloatingPointError, match="diverged"):
        pipe.fit(0.5 * X, y)
    np.testing.assert_array_equal(pipe.predict(X), before[0])
    assert pipe.epsilon_ == before[1] and [id(s) for _, s in pipe.steps] == before[2]
    assert pipe[0].epsilon_ == pipe[0][0].epsilon_
