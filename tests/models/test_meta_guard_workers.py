"""The meta-estimator checks of test_sklearn_meta_misuse.py when the meta-estimator runs
its inner fits in joblib's workers (``n_jobs=2``): a worker's frames do not show the
meta-estimator, so the checks also run when the meta-estimator clones the private
estimator in its own fit (``sklearn.base.clone`` calls ``__sklearn_clone__``), in the
calling thread or in the joblib thread that takes the next tasks for it. A refusal comes
before any fit is charged on the ledger (the entries counted), a warning reaches the
person fitting once, and the meta-estimators that only compose private fits charge every
fit, unrefused. The threading backend shares the ledger with the caller; loky starts
worker processes (about 1-2 s, more on a loaded machine), so few tests use it."""

from __future__ import annotations

import pickle
import warnings

import joblib
import numpy as np
import pytest
from meta_fixtures import LABELS, THREE, X, Y, budget
from sklearn.base import clone
from sklearn.calibration import CalibratedClassifierCV
from sklearn.ensemble import BaggingRegressor, StackingRegressor, VotingClassifier
from sklearn.linear_model import LinearRegression, Ridge
from sklearn.model_selection import GridSearchCV, KFold, cross_val_predict, cross_validate
from sklearn.multiclass import OneVsRestClassifier
from sklearn.multioutput import MultiOutputRegressor

from privlearn.errors import ConfigurationError, ParameterValueError, PrivacyLeakWarning
from privlearn.models import (
    DPSGDClassifier,
    PrivatePipeline,
    PrivateStandardScaler,
    SSPRegressor,
)

pytestmark = pytest.mark.filterwarnings("ignore::privlearn.errors.DataClippedWarning")

_budget = budget


def _ssp(budget=None, epsilon=1.0):
    return SSPRegressor(epsilon=epsilon, ledger=budget)


def _clf(budget=None, classes=(0, 1)):
    return DPSGDClassifier(epsilon=1.0, n_iter=5, classes=list(classes), ledger=budget)


def _leaks(caught):
    return [str(w.message) for w in caught if issubclass(w.category, PrivacyLeakWarning)]


@pytest.mark.parametrize("backend", ["threading", "loky"])
@pytest.mark.parametrize(
    "make, y, error, match",
    [
        (
            lambda b: StackingRegressor(
                [("a", _ssp(b)), ("b", _ssp(b, 2.0))],
                final_estimator=LinearRegression(),
                cv=3,
                n_jobs=2,
            ),
            Y,
            ConfigurationError,
            "final_estimator",
        ),
        (
            lambda b: StackingRegressor(
                [
                    (
                        "p",
                        PrivatePipeline(
                            [("s", PrivateStandardScaler(feature_range=(-1, 1))), ("m", _ssp(b))]
                        ),
                    )
                ],
                cv=3,
                n_jobs=2,
            ),
            Y,
            ConfigurationError,
            "final_estimator",
        ),
        (
            lambda b: CalibratedClassifierCV(_clf(b), cv=3, n_jobs=2),
            LABELS,
            ConfigurationError,
            "calibrators",
        ),
    ],
    ids=["stacking", "stacking-pipeline", "calibrated"],
)
def test_a_non_private_fit_with_workers_is_refused_before_the_ledger(
    make, y, error, match, backend, tmp_path
):
    """With n_jobs=None these are refused (test_sklearn_meta_misuse.py); with workers
    the copies are refused when the meta-estimator clones them, before any is fitted."""
    budget = _budget(tmp_path)
    with joblib.parallel_config(backend=backend), pytest.raises(error, match=match):
        make(budget).fit(X, y)
    assert budget.spent().entries == 0


@pytest.mark.parametrize("backend", ["threading", pytest.param("loky", marks=pytest.mark.slow)])
def test_a_private_estimator_cloned_by_a_joblib_callback_thread_is_refused(backend, tmp_path):
    """joblib takes the first 2 * n_jobs tasks in the calling thread and the next ones in
    a callback thread as tasks complete: the private estimator after six public ones is
    cloned there, away from StackingRegressor's fit, and is still refused before it is
    fitted."""
    budget = _budget(tmp_path)
    stack = StackingRegressor(
        [(f"r{i}", Ridge(alpha=1.0 + i)) for i in range(6)] + [("a", _ssp(budget))],
        final_estimator=LinearRegression(),
        cv=2,
        n_jobs=2,
    )
    with joblib.parallel_config(backend=backend):
        with pytest.raises(ConfigurationError, match="StackingRegressor"):
            stack.fit(X, Y)
    assert budget.spent().entries == 0


def test_bagging_with_bootstrap_and_worker_threads_is_refused_before_the_ledger(tmp_path):
    budget = _budget(tmp_path)
    bag = BaggingRegressor(_ssp(budget), n_estimators=4, n_jobs=2)
    with joblib.parallel_config(backend="threading"):
        with pytest.raises(ParameterValueError, match="drawn with replacement"):
            bag.fit(X, Y)
    assert budget.spent().entries == 0


@pytest.mark.parametrize("backend", ["threading", pytest.param("loky", marks=pytest.mark.slow)])
def test_a_search_with_workers_warns_once_in_the_calling_thread(backend, tmp_path):
    """refit=False: no fit of the search runs in the calling process, and 2 x 3 runs are
    more than joblib takes at first (4), so copies are cloned in the callback thread
    too. One warning of the search, one of its copies seeded alike (random_state=0 on
    every fold's copy: seen as they are cloned), every fit charged."""
    budget = _budget(tmp_path)
    grid = GridSearchCV(
        SSPRegressor(random_state=0, ledger=budget),
        {"epsilon": [0.5, 1.0]},
        cv=KFold(3),
        refit=False,
        n_jobs=2,
    )
    with joblib.parallel_config(backend=backend), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grid.fit(X, Y)
    leaks = _leaks(caught)
    assert len(leaks) == 2 and sum("PrivateSearchCV" in m for m in leaks) == 1
    assert sum("starts alike" in m for m in leaks) == 1
    assert budget.spent().entries == 2 * 3


def test_voting_with_worker_threads_warns_once_that_its_classes_follow_the_labels(tmp_path):
    budget = _budget(tmp_path)
    voting = VotingClassifier([("a", _clf(budget)), ("b", _clf(budget))], n_jobs=2)
    with (
        joblib.parallel_config(backend="threading"),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        voting.fit(X, LABELS)
    leaks = _leaks(caught)
    assert len(leaks) == 1 and "VotingClassifier" in leaks[0]
    assert budget.spent().entries == 2


@pytest.mark.parametrize(
    "run, fits",
    [
        (lambda b: cross_validate(_ssp(b), X, Y, cv=5, n_jobs=2), 5),
        (lambda b: cross_val_predict(_ssp(b), X, Y, cv=5, n_jobs=2), 5),
        (lambda b: MultiOutputRegressor(_ssp(b), n_jobs=2).fit(X, np.c_[Y, -Y]), 2),
        (
            lambda b: cross_validate(PrivatePipeline([("m", _ssp(b))]), X, Y, cv=5, n_jobs=2),
            5,
        ),
    ],
    ids=["cross-validate", "cross-val-predict", "multi-output", "pipeline"],
)
def test_composing_with_worker_threads_charges_every_fit_without_warning(run, fits, tmp_path):
    """5 folds: the last ones are cloned in joblib's callback thread, whose frames are
    followed into the caller's (a function, not a meta-estimator): nothing is refused."""
    budget = _budget(tmp_path)
    with joblib.parallel_config(backend="threading"), warnings.catch_warnings():
        warnings.simplefilter("error", PrivacyLeakWarning)
        run(budget)
    assert budget.spent().entries == fits


def test_one_vs_rest_with_worker_threads_charges_every_fit(tmp_path):
    """OneVsRestClassifier clones in its workers (its classes_ warning is not seen
    there): fitted, one charged fit per class found."""
    budget = _budget(tmp_path)
    with joblib.parallel_config(backend="threading"), warnings.catch_warnings():
        warnings.simplefilter("ignore", PrivacyLeakWarning)
        OneVsRestClassifier(_clf(budget), n_jobs=2).fit(X, THREE)
    assert budget.spent().entries == 3


@pytest.mark.parametrize(
    "make",
    [
        lambda: _ssp(),
        lambda: PrivatePipeline(
            [("s", PrivateStandardScaler(feature_range=(-1, 1))), ("m", _ssp())]
        ),
    ],
    ids=["estimator", "pipeline"],
)
def test_a_clone_outside_a_meta_estimator_is_a_plain_copy(make):
    """clone() called by the user: the parameters, unfitted, silently; a fitted
    estimator's pickle predicts as it does."""
    fitted = make().fit(X, Y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copy = clone(fitted)
    assert type(copy) is type(fitted)
    assert set(copy.get_params()) == set(fitted.get_params())
    assert not hasattr(copy, "mechanism_")
    copy.set_params(**fitted.get_params(deep=False))
    restored = pickle.loads(pickle.dumps(fitted))
    np.testing.assert_array_equal(restored.predict(X), fitted.predict(X))
