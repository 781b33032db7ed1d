"""scikit-learn meta-estimators wrapped around the private estimators, as users combine
them: a meta-estimator that repeats records within one fit (bagging with bootstrap) or
fits a non-private model on the same private data in the same call (calibration,
stacking, RANSAC, self-training, AdaBoost, gradient boosting from a private init, an
iterative imputer, a target transformer) is refused
before anything is reserved on a ledger; one whose classes_, scores or sibling steps come
from the private data un-noised warns the person fitting; one that only composes private
fits charges every fit on the ledger. The ground truths are scikit-learn's own index
draws, exact statistics of the data (np.nanmean, a fold's squared error) and the number
of fits counted by hand."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from meta_fixtures import LABELS, THREE, N, X, Y, budget
from sklearn.base import clone
from sklearn.calibration import CalibratedClassifierCV
from sklearn.compose import ColumnTransformer, TransformedTargetRegressor
from sklearn.ensemble import (
    AdaBoostRegressor,
    BaggingClassifier,
    BaggingRegressor,
    GradientBoostingClassifier,
    GradientBoostingRegressor,
    StackingClassifier,
    StackingRegressor,
    VotingClassifier,
)
from sklearn.ensemble._bagging import _generate_bagging_indices
from sklearn.feature_selection import RFECV, SelectFromModel, SequentialFeatureSelector
from sklearn.frozen import FrozenEstimator
from sklearn.linear_model import LogisticRegression, RANSACRegressor
from sklearn.model_selection import TunedThresholdClassifierCV
from sklearn.multiclass import OneVsOneClassifier, OneVsRestClassifier, OutputCodeClassifier
from sklearn.multioutput import MultiOutputRegressor
from sklearn.pipeline import FeatureUnion, make_pipeline
from sklearn.preprocessing import FunctionTransformer, StandardScaler
from sklearn.semi_supervised import SelfTrainingClassifier

from privlearn.errors import ConfigurationError, ParameterValueError, PrivacyLeakWarning
from privlearn.models import (
    DPSGDClassifier,
    PrivatePipeline,
    PrivateStandardScaler,
    SSPRegressor,
)

pytestmark = pytest.mark.filterwarnings("ignore::privlearn.errors.DataClippedWarning")

_budget = budget


def _ssp(budget=None):
    return SSPRegressor(epsilon=1.0, ledger=budget)


def _unlabelled():
    y = LABELS.copy()
    y[::3] = -1  # scikit-learn's mark of a row without a label
    return y


def _clf(budget=None):
    return DPSGDClassifier(epsilon=1.0, n_iter=5, classes=[0, 1], ledger=budget)


def test_bagging_with_bootstrap_repeats_records_within_one_fit():
    """The ground truth of the refusal: scikit-learn's own draw for the first estimator
    of BaggingRegressor(random_state=0) puts one record into the fit several times."""
    bag = BaggingRegressor(_ssp(), n_estimators=2, random_state=0)
    seed = np.random.RandomState(0).randint(np.iinfo(np.int32).max, size=2)[0]
    _, indices = _generate_bagging_indices(seed, False, True, 3, N, 3, N, None)
    assert np.bincount(indices).max() >= 3  # a record counted 3 times or more
    with pytest.raises(ParameterValueError, match=r"bootstrap=True.*bootstrap=False"):
        bag.fit(X, Y)


@pytest.mark.parametrize("n_jobs", [None, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "make",
    [
        lambda b, n_jobs: (BaggingRegressor(_ssp(b), n_estimators=3, n_jobs=n_jobs), Y),
        lambda b, n_jobs: (BaggingClassifier(_clf(b), n_estimators=3, n_jobs=n_jobs), LABELS),
        lambda b, n_jobs: (
            BaggingRegressor(PrivatePipeline([("m", _ssp(b))]), n_estimators=2, n_jobs=n_jobs),
            Y,
        ),
    ],
    ids=["regressor", "classifier", "pipeline"],
)
def test_bagging_with_bootstrap_is_refused_before_the_ledger(make, n_jobs, tmp_path):
    budget = _budget(tmp_path)
    bag, y = make(budget, n_jobs)
    with pytest.raises(ParameterValueError, match="drawn with replacement"):
        bag.fit(X, y)
    assert budget.spent().entries == 0


def test_bagging_without_replacement_charges_every_fit(tmp_path):
    budget = _budget(tmp_path)
    bag = BaggingRegressor(_ssp(budget), n_estimators=3, bootstrap=False, max_samples=0.5)
    bag.fit(X, Y)
    assert budget.spent().entries == 3
    assert all(e.epsilon_ == _ssp().fit(X, Y).epsilon_ for e in bag.estimators_)


def _seeds(bag):
    """The random_state of every private estimator fitted by ``bag``."""
    return [
        v
        for est in bag.estimators_
        for k, v in est.get_params(deep=True).items()
        if k == "random_state" or k.endswith("__random_state")
    ]


@pytest.mark.parametrize("n_jobs", [None, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "make",
    [
        lambda: _ssp(),
        lambda: PrivatePipeline(
            [("s", PrivateStandardScaler(feature_range=(-1, 1))), ("m", _ssp())]
        ),
        lambda: make_pipeline(FunctionTransformer(), _ssp()),
    ],
    ids=["estimator", "private-pipeline", "pipeline"],
)
def test_bagging_leaves_no_seed_on_the_fits_that_regenerates_their_noise(make, n_jobs):
    """BaggingRegressor(random_state=None) seeded each copy with an int it drew and
    stored on estimators_: refitting a copy's rows (estimators_samples_) with that seed
    gave its coefficients exactly, so the released ensemble regenerated its noise."""
    bag = BaggingRegressor(
        make(), n_estimators=2, bootstrap=False, max_samples=0.5, n_jobs=n_jobs
    ).fit(X, Y)
    assert _seeds(bag) and all(seed is None for seed in _seeds(bag))
    # what a reader of the released copy can do: refit its rows with its parameters
    first, rows = bag.estimators_[0], bag.estimators_samples_[0]
    refit = clone(first).fit(X[rows], Y[rows])
    assert not np.allclose(refit.predict(X), first.predict(X))


def test_bagging_leaves_no_seed_on_a_private_step_nested_deep_in_pipelines():
    """The ensemble's seeding reaches a private step through every container's nested
    set_params (three frames per container): a step four containers deep (a FeatureUnion in
    a ColumnTransformer in a Pipeline, as preprocessing is composed) kept the int seed
    the ensemble drew, stored on estimators_."""
    scaler = PrivateStandardScaler(feature_range=(-1, 1))
    union = FeatureUnion([("u", make_pipeline(scaler))])
    model = make_pipeline(ColumnTransformer([("c", union, [0, 1, 2])]), _ssp())
    bag = BaggingRegressor(model, n_estimators=2, bootstrap=False, max_samples=0.5)
    bag.fit(X, Y)
    assert len(_seeds(bag)) == 4 and all(seed is None for seed in _seeds(bag))


def test_a_bagging_seed_the_user_fixed_still_seeds_every_fit():
    """The ensemble's own random_state is the person's choice: its seeds stay, and two
    fits give the same ensemble."""
    fits = [
        BaggingRegressor(
            _ssp(), n_estimators=2, bootstrap=False, max_samples=0.5, random_state=3
        ).fit(X, Y)
        for _ in range(2)
    ]
    assert all(isinstance(seed, int) for seed in _seeds(fits[0]))
    assert _seeds(fits[0]) == _seeds(fits[1])
    np.testing.assert_array_equal(fits[0].predict(X), fits[1].predict(X))


@pytest.mark.parametrize(
    "make, y, match",
    [
        (lambda b: SelfTrainingClassifier(_clf(b)), _unlabelled(), "transduction_"),
        (lambda b: CalibratedClassifierCV(_clf(b), cv=3), LABELS, "calibrators"),
        # refused when it clones the classifier, before worker processes start
        (lambda b: CalibratedClassifierCV(_clf(b), cv=3, n_jobs=2), LABELS, "calibrators"),
        (lambda b: CalibratedClassifierCV(_clf(b), cv=3, ensemble=False), LABELS, "calibr"),
        (lambda b: StackingClassifier([("a", _clf(b))], cv=3), LABELS, "VotingClassifier"),
        (lambda b: StackingRegressor([("a", _ssp(b))], cv=3), Y, "VotingRegressor"),
        (lambda b: RANSACRegressor(_ssp(b), min_samples=20, max_trials=3), Y, "inlier_mask_"),
        # resamples the rows with replacement by weights from the un-noised errors
        (lambda b: AdaBoostRegressor(_ssp(b), n_estimators=3), Y, "with replacement"),
        # fits its trees to the private residuals of the private init's predictions
        (lambda b: GradientBoostingRegressor(init=_ssp(b), n_estimators=3), Y, "residuals"),
        (
            lambda b: GradientBoostingClassifier(init=_clf(b), n_estimators=3),
            LABELS,
            "residuals",
        ),
        (
            lambda b: GradientBoostingRegressor(init=PrivatePipeline([("m", _ssp(b))])),
            Y,
            "residuals",
        ),
        (
            lambda b: TransformedTargetRegressor(_ssp(b), transformer=StandardScaler()),
            Y,
            "StandardScaler",
        ),
        (
            lambda b: TransformedTargetRegressor(
                PrivatePipeline(
                    [("s", PrivateStandardScaler(feature_range=(-1, 1))), ("m", _ssp(b))]
                ),
                transformer=StandardScaler(),
            ),
            Y,
            "StandardScaler",
        ),
    ],
    ids=[
        "self-training",
        "calibrated",
        "calibrated-jobs",
        "calibrated-one",
        "stacking",
        "stacking-reg",
        "ransac",
        "adaboost",
        "boosting-init",
        "boosting-init-clf",
        "boosting-init-pipeline",
        "target-scaler",
        "target-scaler-pipeline",
    ],
)
def test_a_non_private_fit_on_the_same_data_is_refused_before_the_ledger(make, y, match, tmp_path):
    budget = _budget(tmp_path)
    with pytest.raises(ConfigurationError, match=match):
        make(budget).fit(X, y)
    assert budget.spent().entries == 0


@pytest.mark.parametrize(
    "transformer",
    [
        dict(func=np.tanh, inverse_func=np.arctanh),
        dict(transformer=FunctionTransformer(np.tanh, np.arctanh)),
        "private",
    ],
    ids=["functions", "stateless", "private"],
)
def test_a_target_transformer_that_learns_nothing_is_accepted(transformer, tmp_path):
    budget = _budget(tmp_path)
    fits = 1
    if transformer == "private":  # a private fit on y: charged too
        scaler = PrivateStandardScaler(feature_range=(-1, 1), ledger=budget)
        transformer, fits = dict(transformer=scaler), 2
    TransformedTargetRegressor(_ssp(budget), check_inverse=False, **transformer).fit(X, Y)
    assert budget.spent().entries == fits


def test_calibrating_a_fitted_private_classifier_on_public_data_is_accepted():
    clf = _clf().fit(X, LABELS)
    CalibratedClassifierCV(FrozenEstimator(clf)).fit(X[:40], LABELS[:40])  # "public"


@pytest.mark.parametrize(
    "make, fits",
    [
        (lambda b: OneVsRestClassifier(_clf(b)), 3),  # one per class found
        (lambda b: OneVsOneClassifier(_clf(b)), 3),  # one per pair of classes found
    ],
    ids=["ovr", "ovo"],
)
def test_one_vs_rest_warns_that_its_classes_and_fits_follow_the_labels(make, fits, tmp_path):
    """Neighbouring label sets: without the only record of class 2, the meta-estimator's
    classes_ and the number of entries it puts on the ledger change."""
    budget = _budget(tmp_path)
    with pytest.warns(PrivacyLeakWarning, match="classes_ from the labels"):
        meta = make(budget).fit(X, THREE)
    assert budget.spent().entries == fits
    lone = THREE.copy()
    lone[lone == 2] = 0
    lone[0] = 2
    other = tmp_path / "other"
    other.mkdir()
    budget2 = _budget(other)
    with pytest.warns(PrivacyLeakWarning):
        neighbour = make(budget2).fit(X[1:], lone[1:])  # record 0 removed
    assert meta.classes_.tolist() == [0, 1, 2]
    assert neighbour.classes_.tolist() == [0, 1]
    assert budget2.spent().entries == 1  # one binary fit: the ledger shows it


def test_voting_warns_once_that_its_classes_follow_the_labels():
    """Two estimators fitted (one inside a PrivatePipeline, whose checks run before its
    own fit), through two of VotingClassifier's fit frames: one warning per call."""
    voting = VotingClassifier([("a", PrivatePipeline([("m", _clf())])), ("b", _clf())])
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            voting.fit(X, LABELS)
        leaks = [w for w in caught if issubclass(w.category, PrivacyLeakWarning)]
        assert len(leaks) == 1 and "VotingClassifier" in str(leaks[0].message)


def test_composing_meta_estimators_charge_every_fit_without_warning(tmp_path):
    budget = _budget(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyLeakWarning)
        MultiOutputRegressor(_ssp(budget)).fit(X, np.c_[Y, -Y])
    assert budget.spent().entries == 2


def test_grid_search_warns_once_that_its_scores_on_private_rows_are_not_accounted(tmp_path):
    """Neighbouring data sets differing in one record of the first test fold: with a
    fixed seed the fold's model is the same fit of the same rows with the same noise, and
    split0_test_score still moves with that one record, by its exact squared error: an
    un-noised release that no ledger entry covers."""
    from sklearn.model_selection import GridSearchCV, KFold

    budget = _budget(tmp_path)
    grid = GridSearchCV(
        SSPRegressor(random_state=0, ledger=budget),
        {"epsilon": [0.5, 1.0]},
        cv=KFold(3),
        scoring="neg_mean_squared_error",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grid.fit(X, Y)
    leaks = [w for w in caught if issubclass(w.category, PrivacyLeakWarning)]
    scores = [w for w in leaks if "PrivateSearchCV" in str(w.message)]
    assert len(scores) == 1
    # and, once, that its fits share random_state=0 (tests/models/test_meta_seeds.py)
    assert len(leaks) == 2 and "starts alike" in str((set(leaks) - set(scores)).pop().message)
    assert budget.spent().entries == 2 * 3 + 1  # every fit is charged
    Y2 = Y.copy()
    Y2[0] += 0.3  # record 0 is in the first test fold only
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other = GridSearchCV(
            SSPRegressor(random_state=0),
            {"epsilon": [0.5, 1.0]},
            cv=KFold(3),
            scoring="neg_mean_squared_error",
        )
        other.fit(X, Y2)
    fold = SSPRegressor(random_state=0, epsilon=0.5).fit(X[N // 3 :], Y[N // 3 :])
    err = fold.predict(X[:1])[0]
    moved = (err - Y2[0]) ** 2 - (err - Y[0]) ** 2  # record 0's change, exactly
    delta = grid.cv_results_["split0_test_score"][0] - other.cv_results_["split0_test_score"][0]
    assert delta == pytest.approx(moved / (N // 3), rel=1e-9)


def test_a_search_fitted_again_warns_again():
    """Once per call of the search's fit, not once per search object: a second fit (a
    notebook cell run again) is another release on private rows. Its fit frame is a new
    one whose id is usually the first call's, freed when that call returned."""
    from sklearn.model_selection import GridSearchCV

    grid = GridSearchCV(_ssp(), {"epsilon": [0.5, 1.0]}, cv=2)
    counts = []
    for _ in range(3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            grid.fit(X, Y)
        counts.append(sum(issubclass(w.category, PrivacyLeakWarning) for w in caught))
    assert counts == [1, 1, 1]


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: RFECV(_ssp(), cv=2), "RFECV"),
        (lambda: SequentialFeatureSelector(_ssp(), n_features_to_select=1, cv=2), "Sequential"),
        (lambda: TunedThresholdClassifierCV(_clf(), cv=2), "best_threshold_"),
    ],
    ids=["rfecv", "sequential", "threshold"],
)
def test_a_choice_by_scores_on_private_rows_warns(make, match):
    y = LABELS if "threshold" in match else Y
    with pytest.warns(PrivacyLeakWarning, match=match):
        make().fit(X, y)


def test_output_codes_warn_that_their_classes_follow_the_labels():
    with pytest.warns(PrivacyLeakWarning, match="OutputCodeClassifier"):
        # code bits are -1 and 1 for a classifier with a decision_function
        clf = DPSGDClassifier(epsilon=1.0, n_iter=5, classes=[-1, 1])
        OutputCodeClassifier(clf, random_state=0).fit(X, THREE)


@pytest.mark.parametrize(
    "make, y, learning",
    [
        (lambda: make_pipeline(StandardScaler(), _ssp()), Y, "'standardscaler'"),
        (
            lambda: make_pipeline(
                ColumnTransformer([("s", StandardScaler(), [0])], remainder="passthrough"),
                _ssp(),
            ),
            Y,
            "'columntransformer__s'",
        ),
        (
            lambda: make_pipeline(
                PrivateStandardScaler(feature_range=(-1, 1)), LogisticRegression()
            ),
            LABELS,
            "'logisticregression'",
        ),
    ],
    ids=["scaler-first", "column-transformer", "non-private-model-after"],
)
def test_a_plain_pipeline_warns_of_its_steps_that_learn_from_the_data(make, y, learning):
    """A plain scikit-learn pipeline is the user's composition (still fitted), but the
    exact column means of a StandardScaler fitted next to the private step are released
    with it: the person fitting is told, naming the step."""
    with pytest.warns(PrivacyLeakWarning, match=learning):
        pipe = make().fit(X, y)
    first = pipe[0].transformers_[0][1] if hasattr(pipe[0], "transformers_") else pipe[0]
    if type(first) is StandardScaler:
        assert first.mean_[0] == pytest.approx(X[:, 0].mean(), abs=1e-12)  # exact, un-noised


def test_a_plain_pipeline_of_public_or_private_steps_does_not_warn():
    frozen = FrozenEstimator(StandardScaler().fit(np.zeros((3, 3))))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyLeakWarning)
        make_pipeline(frozen, _ssp()).fit(X, Y)
        make_pipeline(PrivateStandardScaler(feature_range=(-1, 1)), _ssp()).fit(X, Y)
        PrivatePipeline([("m", _ssp())]).fit(X, Y)
        # a meta-estimator around a private estimator is not a step learning alone
        make_pipeline(SelectFromModel(_ssp()), _ssp()).fit(X, Y)


def _with_missing():
    Xm = X.copy()
    Xm[::7, 1] = np.nan
    return Xm


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_an_iterative_imputer_with_data_dependent_rounds_is_refused(tmp_path):
    """Its default initial_imputer_ holds the exact column means of the private data
    (nanmean, compared below on a non-private run), and tol > 0 stops it after a
    data-dependent number of rounds: refused before the ledger."""
    from sklearn.experimental import enable_iterative_imputer  # noqa: F401
    from sklearn.impute import IterativeImputer
    from sklearn.linear_model import LinearRegression

    Xm = _with_missing()
    plain = IterativeImputer(estimator=LinearRegression(), max_iter=2).fit(Xm)
    assert np.allclose(plain.initial_imputer_.statistics_, np.nanmean(Xm, axis=0), rtol=1e-12)
    budget = _budget(tmp_path)
    with pytest.raises(ConfigurationError, match="initial_imputer_"):
        IterativeImputer(estimator=_ssp(budget), max_iter=2).fit(Xm)
    assert budget.spent().entries == 0
    fixed = IterativeImputer(
        estimator=_ssp(budget),
        max_iter=2,
        initial_strategy="constant",
        fill_value=0.0,
        tol=0,
        imputation_order="roman",
    )
    fixed.fit(Xm)
    assert budget.spent().entries == 2 * 3  # every round fits every column, charged
