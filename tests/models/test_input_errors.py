"""Bad data at the public boundary: typed errors that name the input and say what to try
in a private setting, raised before anything is released (nothing spent on a ledger)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import scipy.sparse as sp
from estimators import assert_covers
from sklearn.preprocessing import Normalizer

import privlearn.models as M
from privlearn.accounting import compose
from privlearn.errors import NonFiniteInputError, ParameterTypeError, ParameterValueError
from privlearn.ledger import Ledger

pytestmark = pytest.mark.filterwarnings("ignore::privlearn.errors.DataClippedWarning")

#: one configured instance of each estimator that is fitted on (X, y); PATE has no fit
CASES = {
    "SSPRegressor": lambda: M.SSPRegressor(random_state=0),
    "AdaSSPRegressor": lambda: M.AdaSSPRegressor(random_state=0),
    "NoisyGDRegressor": lambda: M.NoisyGDRegressor(noise_multiplier=None, n_iter=5,
                                                 random_state=0),
    "DPSGDClassifier": lambda: M.DPSGDClassifier(n_iter=5, classes=[0, 1], random_state=0),
    "DPSGDRegressor": lambda: M.DPSGDRegressor(n_iter=5, random_state=0),
    "PrivateStandardScaler": lambda: M.PrivateStandardScaler(feature_range=(-1, 1),
                                                             random_state=0),
    "PrivateKNN": lambda: M.PrivateKNN(n_neighbors=3, classes=[0, 1], random_state=0),
    "PrivateSearchCV": lambda: M.PrivateSearchCV(M.SSPRegressor(), {"epsilon": [0.5, 1.0]},
                                                 loss_bound=4.0, random_state=0),
    "PrivatePipeline": lambda: M.PrivatePipeline(
        [("scale", M.PrivateStandardScaler(feature_range=(-1, 1), random_state=0)),
         ("ssp", M.SSPRegressor(random_state=0))]),
}


def test_cases_cover_every_fitted_estimator():
    assert_covers(CASES, "CASES", except_for=("PATE",))


def _data(n=40):
    rng = np.random.default_rng(0)
    X = rng.uniform(-1, 1, size=(n, 3))
    return X, (X[:, 0] > 0).astype(float)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("where", ["X", "y"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_is_a_typed_error_with_private_advice(name, where, bad):
    est = CASES[name]()
    if where == "y" and name in ("PrivateStandardScaler",):
        pytest.skip("the scaler takes no y")
    X, y = _data()
    (X if where == "X" else y)[3] = bad
    with pytest.raises(NonFiniteInputError) as info:
        est.fit(X, y)
    msg = str(info.value)
    # sklearn's wording kept (its check_estimators_nan_inf matches on it) ...
    assert ("NaN" if np.isnan(bad) else "infinity") in msg
    # ... names the input and says what to do without a data-dependent release
    assert f"{where} contains" in msg and "public" in msg
    # never advises a non-private estimator
    assert "HistGradientBoosting" not in msg


@pytest.mark.parametrize("where", ["X", "y"])
@pytest.mark.parametrize("bad,found", [([np.nan], "NaN"), ([np.inf], "infinity"),
                                       ([-np.inf, np.nan], "NaN and infinity")])
def test_non_finite_message_is_one_sentence_naming_the_input_and_what_it_holds(
        where, bad, found):
    X, y = _data()
    for i, v in enumerate(bad):
        (X if where == "X" else y)[3 + i] = v
    with pytest.raises(NonFiniteInputError) as info:
        M.SSPRegressor(random_state=0).fit(X, y)
    msg = str(info.value)
    assert msg.startswith(f"SSPRegressor: Input {where} contains {found}, but ")
    assert msg.count("contains") == 1 and msg.count(f" {where} ") == 1  # said once
    assert "public constant" in msg and msg.endswith("accounts.")
    assert not re.search(r"[a-z]\. [A-Z]", msg)  # one sentence


def test_non_finite_predict_input_is_typed():
    X, y = _data()
    m = M.SSPRegressor(random_state=0).fit(X, y)
    X[0, 0] = np.nan
    with pytest.raises(NonFiniteInputError, match="X contains NaN"):
        m.predict(X)


@pytest.mark.parametrize("name", ["SSPRegressor", "DPSGDClassifier", "PrivateStandardScaler",
                                  "PrivateKNN"])
def test_other_bad_data_is_typed(name):
    X, y = _data()
    with pytest.raises(ParameterValueError, match="0 sample"):
        CASES[name]().fit(X[:0], y[:0])
    with pytest.raises(ParameterTypeError, match="dense"):
        CASES[name]().fit(sp.csr_matrix(X), y)


@pytest.mark.parametrize("name", sorted(CASES))
def test_text_in_x_says_how_to_encode_it_without_a_release(name):
    """A text column (a category) in X: the estimator names it and says how to encode it
    with public categories, not with categories found in the private data."""
    X, y = _data()
    X = X.astype(object)
    X[:, 1] = np.where(X[:, 1].astype(float) > 0, "north", "south")
    with pytest.raises(ParameterValueError) as info:
        CASES[name]().fit(X, y)
    msg = str(info.value)
    # the estimator that read X (a pipeline's or a search's step) names itself
    assert re.match(r"\w+: could not convert string to float", msg), msg
    assert "OneHotEncoder(categories=" in msg and "not found in the data" in msg
    # numbers stored as objects are numbers: no such refusal
    CASES[name]().fit(_data()[0].astype(object), y)


def test_non_finite_data_is_charged_as_its_release_would_be(tmp_path):
    """A NaN in X is refused before anything is released, but after the reservation:
    whether it is refused depends on one record's value, so the plan is charged in full
    (a cancelled reservation would tell the ledger's readers that the data held one)."""
    ledger = Ledger(tmp_path / "l.json", create=True)
    ledger.create_budget("d", epsilon=1.0, delta=1e-5)
    X, y = _data()
    X[0, 0] = np.nan
    est = M.SSPRegressor(epsilon=0.5, random_state=0, ledger=ledger.budget("d"))
    with pytest.raises(NonFiniteInputError):
        est.fit(X, y)
    assert ledger.pending("d") == [] and not hasattr(est, "coef_")
    assert ledger.mechanism("d") == compose([est.planned_mechanism(X, y)])


def test_pipeline_refuses_a_non_finite_y_before_any_step_releases(tmp_path):
    """Refused before any step is fitted; the steps' plans, reserved before any value
    is read, are charged in full (a NaN is one record's value: a cancelled entry would
    tell the ledger's readers)."""
    ledger = Ledger(tmp_path / "l.json", create=True)
    ledger.create_budget("d", epsilon=2.0, delta=1e-5)
    scaler = M.PrivateStandardScaler(feature_range=(-1, 1), random_state=0,
                                   ledger=ledger.budget("d"))
    pipe = M.PrivatePipeline([("scale", scaler), ("ssp", M.SSPRegressor(random_state=0))])
    X, y = _data()
    y[5] = np.nan
    with pytest.raises(NonFiniteInputError, match="y contains"):
        pipe.fit(X, y)
    assert ledger.mechanism("d") == compose([scaler.planned_mechanism(X)])
    assert ledger.pending("d") == [] and not hasattr(scaler, "mean_")


def _ledger_scaler(tmp_path):
    ledger = Ledger(tmp_path / "l.json", create=True)
    ledger.create_budget("d", epsilon=10.0, delta=1e-5)
    return ledger, M.PrivateStandardScaler(feature_range=(-1, 1), random_state=0,
                                           ledger=ledger.budget("d"))


def test_pipeline_delta_0_with_gaussian_noise_is_refused_before_any_step_releases(tmp_path):
    """``PrivatePipeline(..., delta=0)`` over Gaussian steps reported ``epsilon_ = inf``
    after fitting (and charging) every step; refused first, as a single estimator
    refuses ``delta=0`` with Gaussian noise, naming the step."""
    ledger, scaler = _ledger_scaler(tmp_path)
    pipe = M.PrivatePipeline([("scale", scaler), ("ssp", M.SSPRegressor(random_state=0))],
                             delta=0)
    X, y = _data()
    with pytest.raises(ParameterValueError, match=r"delta=0 is impossible with Gaussian "
                       r"noise(.|\n)*pipeline step 'scale' \(PrivateStandardScaler\)(.|\n)*"
                       r"delta=None") as info:
        pipe.fit(X, y)
    with pytest.raises(ParameterValueError, match="delta=0 is impossible with Gaussian"):
        M.SSPRegressor(delta=0.0, random_state=0).fit(X, y)  # the single estimator's
    assert "1e-6" in str(info.value)
    assert ledger.spent("d").epsilon_spent == 0.0 and ledger.pending("d") == []
    assert not hasattr(scaler, "mean_") and not hasattr(pipe, "epsilon_")


def test_pipeline_delta_0_over_pure_steps_reports_their_pure_epsilon():
    """delta=0 is refused only where a step has no pure-DP guarantee: a Laplace DP-SGD
    step (pure DP) reports its epsilon at delta 0 (basic composition of Laplace steps)."""
    X, y = _data()
    clf = M.DPSGDClassifier(noise="laplace", epsilon=1.0, delta=0.0, classes=[0.0, 1.0],
                            random_state=0)
    pipe = M.PrivatePipeline([("norm", Normalizer()), ("clf", clf)], delta=0).fit(X, y)
    assert np.isfinite(pipe.epsilon_) and pipe.epsilon_ <= 1.0
    assert pipe.epsilon_ == clf.mechanism_.epsilon(0.0)


@pytest.mark.parametrize("bad", ["y_bound", "y 2-D", "y length", "y strings", "y None",
                                 "classes"])
def test_a_later_step_s_refusal_comes_before_the_first_step_releases(bad, tmp_path):
    """The final step's invalid parameters (``y_bound`` is checked when it plans) and its
    checks of ``y``'s shape and type ran only after the scaler had been fitted and
    charged; they are now run (each step's own checks, on zeros of its input's shape)
    before any step is fitted. Those that read values (continuous labels for a
    classifier) come after the steps' plans are reserved, and charge them in full."""
    ledger, scaler = _ledger_scaler(tmp_path)
    X, y = _data()
    model = M.SSPRegressor(random_state=0, y_bound=-1.0 if bad == "y_bound" else 1.0)
    if bad == "classes":
        model, y = M.DPSGDClassifier(random_state=0), X[:, 0]  # continuous labels
    y = {"y 2-D": np.c_[y, y], "y length": y[:-3], "y strings": y.astype(str),
         "y None": None}.get(bad, y)
    pipe = M.PrivatePipeline([("scale", scaler), ("model", model)])
    with pytest.raises((ParameterValueError, ParameterTypeError)) as before:
        pipe.fit(X, y)
    charged = [scaler.planned_mechanism(X)] if bad == "classes" else []
    assert ledger.mechanism("d") == compose(charged) and ledger.pending("d") == []
    assert not hasattr(scaler, "mean_")
    # the same refusal as the step's own, on the data it would have seen
    Z = M.PrivateStandardScaler(feature_range=(-1, 1), random_state=0).fit_transform(X)
    with pytest.raises(type(before.value)) as own:
        model.fit(Z, y)
    assert str(own.value) == str(before.value)


def test_a_pipeline_that_cannot_be_planned_past_a_public_step_still_fits():
    """A public step that changes the number of features ends the checks before the
    fit (the next step's input shape is unknown): the pipeline fits as before."""
    from sklearn.preprocessing import SplineTransformer

    X, y = _data()
    knots = np.linspace(-1.0, 1.0, 3)[:, None] * np.ones((1, 3))  # public knots
    pipe = M.PrivatePipeline([("spline", SplineTransformer(knots=knots, degree=1)),
                              ("ssp", M.SSPRegressor(random_state=0))],
                             public_steps=("spline",)).fit(X, y)
    assert pipe.named_steps["ssp"].coef_.shape == (9,)


@pytest.mark.parametrize("make, attr", [
    (lambda: M.SSPRegressor(x_bound=2.0, y_bound=(-3.0, 3.0), random_state=1), "coef_"),
    (lambda: M.AdaSSPRegressor(x_bound=2.0, y_bound=3.0, fit_intercept=False,
                               random_state=1), "coef_"),
    (lambda: M.NoisyGDRegressor(x_bound=2.0, y_bound=3.0, noise_multiplier=None, n_iter=20,
                                random_state=1), "coef_"),
    (lambda: M.PrivateStandardScaler(feature_range=(-2.0, 2.0), quantile=None,
                                     random_state=1), "scale_"),
    (lambda: M.PrivateStandardScaler(feature_range=(-2.0, 2.0), random_state=1), "scale_"),
], ids=["SSP", "AdaSSP", "NoisyGD", "scaler-public-bounds", "scaler-private-bounds"])
def test_a_record_outside_the_bounds_releases_what_its_clipped_copy_does(make, attr):
    """Data outside the declared bounds is clipped before anything is computed: with the
    same noise, a far outlier gives the release of the record at the bound (naive ground
    truth: the clipped dataset)."""
    X, y = _data(200)
    X_out, y_out = X.copy(), y.copy()
    X_out[0], y_out[0] = [1e9, 0.0, 0.0], 1e9
    X_clip, y_clip = X.copy(), y.copy()
    X_clip[0] = [2.0, 0.0, 0.0]
    y_clip[0] = 3.0
    if "Scaler" in type(make()).__name__:
        X_out[0], X_clip[0] = [1e9, -1e9, 0.0], [2.0, -2.0, 0.0]
    a = getattr(make().fit(X_out, y_out), attr)
    b = getattr(make().fit(X_clip, y_clip), attr)
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(CASES))
def test_sample_weight_is_a_typed_refusal_before_anything_is_spent(name, tmp_path):
    """A per-record weight above 1 would exceed the sensitivity the noise is calibrated
    to: refused with a typed error naming it (a TypeError, as scikit-learn's estimators
    without sample_weight raise), before the ledger is charged or any state changes."""
    from sklearn.utils.validation import has_fit_parameter

    ledger = Ledger(tmp_path / "l.json", create=True)
    ledger.create_budget("d", epsilon=10.0, delta=1e-5)
    est = CASES[name]()
    key = "sample_weight"
    if name == "PrivatePipeline":  # routed to the last step; the scaler must not fit first
        est.steps[0][1].set_params(ledger=ledger.budget("d"))
        key = "ssp__sample_weight"
    else:
        est.set_params(ledger=ledger.budget("d"))
    X, y = _data()
    with pytest.raises(ParameterTypeError, match="sample_weight") as info:
        est.fit(X, y, **{key: np.ones(len(y))})
    assert isinstance(info.value, TypeError)
    assert ledger.spent("d").epsilon_spent == 0.0 and ledger.pending("d") == []
    assert not [k for k in vars(est) if k.endswith("_") and not k.startswith("_")]
    if name == "PrivatePipeline":
        assert not hasattr(est.steps[0][1], "mean_")
    else:  # scikit-learn's meta-estimators see an estimator without weights
        assert not has_fit_parameter(est, "sample_weight")


def test_a_pipeline_refuses_an_unrouted_sample_weight_typed_before_any_step_fits(tmp_path):
    """``pipe.fit(X, y, sample_weight=w)``, as a scikit-learn user writes it, is the same
    typed refusal as the steps' own (scikit-learn's Pipeline raised a bare ValueError),
    before the first step is fitted."""
    ledger, scaler = _ledger_scaler(tmp_path)
    pipe = M.PrivatePipeline([("scale", scaler), ("ssp", M.SSPRegressor(random_state=0))])
    X, y = _data()
    with pytest.raises(ParameterTypeError, match="PrivatePipeline.fit does not support "
                                                 "sample_weight"):
        pipe.fit(X, y, sample_weight=np.ones(len(y)))
    assert ledger.spent("d").epsilon_spent == 0.0 and not hasattr(scaler, "mean_")


@pytest.mark.parametrize("name", ["SSPRegressor", "AdaSSPRegressor", "NoisyGDRegressor",
                                  "DPSGDRegressor", "PrivateSearchCV", "PrivatePipeline"])
def test_a_missing_target_stored_as_an_object_is_refused_before_the_release(name, tmp_path):
    """A target read as objects with a missing value (``None``, ``pandas.NA``): scikit-learn's
    ``y_numeric`` converts it to NaN without a check, and the regressors released (and
    spent) before failing on non-finite coefficients, or, DP-SGD, fitted a NaN label (the
    pipeline, which checks y before its first step is fitted, already refused it)."""
    ledger = Ledger(tmp_path / "l.json", create=True)
    ledger.create_budget("d", epsilon=10.0, delta=1e-5)
    est = CASES[name]()
    first = est.steps[0][1] if name == "PrivatePipeline" else est
    first.set_params(ledger=ledger.budget("d"))
    X, y = _data()
    y = y.astype(object)
    y[2] = None
    with pytest.raises(NonFiniteInputError, match="y contains"):
        est.fit(X, y)
    # refused after the reservation (charged in full: it depends on a value)
    assert ledger.spent("d").entries == 1 and ledger.pending("d") == []


def test_a_missing_value_of_a_nullable_pandas_column_is_named_as_missing():
    """A ``pandas.NA`` of a nullable integer column in X is a missing value (the
    NonFiniteInputError's advice), not text to encode."""
    pd = pytest.importorskip("pandas")
    X, y = _data()
    df = pd.DataFrame(X, columns=["a", "b", "c"])
    df["d"] = pd.array([1] * (len(y) - 1) + [None], dtype="Int64")
    with pytest.raises(NonFiniteInputError, match="X contains a missing value") as info:
        M.SSPRegressor(random_state=0).fit(df, y)
    assert "encode text" not in str(info.value)


def test_an_unknown_fit_keyword_is_typed_and_names_what_fit_takes():
    X, y = _data()
    with pytest.raises(ParameterTypeError, match=r"'n_jobs'.*X, y"):
        M.SSPRegressor().fit(X, y, n_jobs=2)
    with pytest.raises(ParameterTypeError, match=r"X_val, y_val"):
        M.PrivateSearchCV(M.SSPRegressor(), {"epsilon": [1.0]}, loss_bound=4.0).fit(
            X, y, groups=np.zeros(len(y)))


@pytest.mark.parametrize("name", ["SSPRegressor", "AdaSSPRegressor", "NoisyGDRegressor",
                                  "DPSGDRegressor"])
def test_a_string_target_of_a_regressor_is_typed(name, tmp_path):
    """scikit-learn's y_numeric converts an object y only; an array of strings reached
    the release and failed there with a NumPy ufunc error."""
    ledger = Ledger(tmp_path / "l.json", create=True)
    ledger.create_budget("d", epsilon=10.0, delta=1e-5)
    X, y = _data()
    est = CASES[name]().set_params(ledger=ledger.budget("d"))
    with pytest.raises(ParameterTypeError, match=r"y must be numeric.*astype\(float\)"):
        est.fit(X, y.astype(str))
    assert ledger.spent("d").epsilon_spent == 0.0
    assert not hasattr(est, "n_features_in_")


def test_scaler_inverse_transform_checks_its_input():
    X, _ = _data()
    sc = CASES["PrivateStandardScaler"]().fit(X)
    np.testing.assert_allclose(sc.inverse_transform(sc.transform(X)), X, atol=1e-12)
    with pytest.raises(ParameterValueError, match="has 2 features.*fitted on 3"):
        sc.inverse_transform(X[:, :2])
    with pytest.raises(ParameterValueError, match="2D array"):
        sc.inverse_transform(X[:, 0])


def test_knn_without_labels_is_typed():
    X, _ = _data()
    with pytest.raises(ParameterValueError, match="needs the private labels"):
        CASES["PrivateKNN"]().fit(X, None)


@pytest.mark.parametrize("make, error", [
    (lambda X, y: M.SSPRegressor(budget_split="ab").fit(X, y), ParameterValueError),
    (lambda X, y: M.AdaSSPRegressor(budget_split=["1", "x", "2"]).fit(X, y),
     ParameterValueError),
    (lambda X, y: M.PrivateStandardScaler(feature_range="ab").fit(X), ParameterValueError),
    (lambda X, y: M.PrivateStandardScaler(feature_range=[(0, "x")] * 3).fit(X),
     ParameterValueError),
    (lambda X, y: M.PATE().release(np.full((5, 20), "a"), n_classes=2), ParameterTypeError),
    (lambda X, y: M.PATE().release(sp.csr_matrix(np.zeros((5, 20), int)), n_classes=2),
     ParameterTypeError),
], ids=["ssp-split-text", "adassp-split-text", "scaler-range-text", "scaler-range-entry",
        "pate-text-votes", "pate-sparse-votes"])
def test_malformed_values_are_typed_refusals_naming_the_input(make, error):
    """Text where numbers are expected used to escape as NumPy's or Python's own
    ``ValueError`` / ``TypeError`` (``could not convert string to float``, ``ufunc
    'isfinite' not supported``), naming neither the parameter nor what to pass."""
    X, y = _data()
    name = re.compile("budget_split|feature_range|teacher_outputs")
    with pytest.raises(error, match=name):
        make(X, y)


@pytest.mark.parametrize("make", [
    lambda: M.DPSGDClassifier(n_iter=3, classes=[0, 1], random_state=0),
    lambda: M.DPSGDClassifier(n_iter=3, random_state=0),
    lambda: M.PrivateKNN(classes=[0, 1], random_state=0),
    lambda: M.PrivateKNN(random_state=0),
], ids=["dpsgd-classes", "dpsgd", "knn-classes", "knn"])
@pytest.mark.parametrize("bad", [None, "a"], ids=["missing-label", "mixed-types"])
@pytest.mark.filterwarnings("ignore::privlearn.errors.PrivacyLeakWarning")
def test_labels_of_mixed_types_are_a_typed_refusal(make, bad, tmp_path):
    """A missing label (None) or a string among numbers used to escape as scikit-learn's
    ``Unknown label type`` or NumPy's ``'<' not supported`` (untyped)."""
    X, y = _data()
    y = y.astype(int).astype(object)
    y[3] = bad
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=10.0, delta=1e-5)
    est = make().set_params(ledger=led.budget("d"))
    with pytest.raises(ParameterValueError, match="all numbers or all strings"):
        est.fit(X, y)
    # a value among the labels: DP-SGD's reservation is charged (PrivateKNN.fit spends
    # nothing)
    assert led.spent("d").entries == isinstance(est, M.DPSGDClassifier)
    assert led.pending("d") == []


@pytest.mark.parametrize("call, name", [
    (lambda R: M.PrivateStandardScaler(feature_range=(0, 1)).fit(R), "X"),
    (lambda R: M.PrivateStandardScaler(feature_range=(0, 1)).planned_mechanism(R), "X"),
    (lambda R: M.PrivatePipeline([("ssp", M.SSPRegressor())]).fit(R, [1.0, 2.0]), "X"),
    (lambda R: M.PATE().release([[0, 1, 1], [1, 0]], 2), "teacher_outputs"),
    (lambda R: M.PrivateKNN(classes=[0, 1]).fit([[0.0, 1.0], [1.0, 0.0]], [0, 1]).release(R),
     "X_query"),
], ids=["scaler", "scaler-planned", "pipeline", "PATE", "PrivateKNN"])
def test_ragged_rows_are_a_typed_error_naming_the_input(call, name):
    """Rows of different lengths (a list of lists) reached NumPy's conversion error, a
    bare ValueError, wherever the plan read the input's shape first; they are a
    ParameterValueError naming the input and what to do."""
    from privlearn.errors import ParameterValueError

    with pytest.raises(ParameterValueError, match=rf"^{name} must be a rectangular array"):
        call([[1.0, 2.0], [3.0]])


@pytest.mark.parametrize("make, fit, match", [
    (lambda: M.SSPRegressor(budget_split=[1.0]), "regress",
     r"budget_split must be .* 2 .* got \[1\.0\]; e\.g\. budget_split=\(2, 3\)"),
    (lambda: M.AdaSSPRegressor(budget_split="abc"), "regress",
     r"budget_split must be .* 3 .* got 'abc'; e\.g\. budget_split=\(2, 3, 5\)"),
    (lambda: M.NoisyGDRegressor(learning_rate="fast"), "regress",
     r"learning_rate must be 'theory' .* got 'fast'; leave 'theory'"),
    (lambda: M.PrivateKNN(classes=[0, 0]), "classify",
     r"classes must be .* got \[0, 0\]; pass the public label set"),
], ids=["SSP-split", "AdaSSP-split", "NoisyGD-learning_rate", "PrivateKNN-classes"])
def test_unchecked_parameters_say_what_to_pass(make, fit, match):
    """Parameters checked by the estimator itself (not a declared constraint) name the
    value received and what to pass instead (they stopped at the value)."""
    rng = np.random.default_rng(0)
    X = rng.uniform(-0.5, 0.5, size=(20, 2))
    y = (X[:, 0] > 0).astype(int) if fit == "classify" else X[:, 0]
    with pytest.raises(ParameterValueError, match=match):
        make().fit(X, y)
