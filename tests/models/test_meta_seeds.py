"""A scikit-learn meta-estimator (or cross-validation function) fitting several copies of
a private estimator seeded alike: ``clone`` copies the seed, every copy draws the same
noise, and a combination of their releases cancels it. The ground truth is the copies
themselves: fitted on the same target, copies with shared noise give the very same
coefficients (independent noise would not)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from joblib import parallel_config
from meta_fixtures import X, Y
from sklearn.ensemble import BaggingRegressor
from sklearn.feature_selection import SelectFromModel
from sklearn.model_selection import GridSearchCV, ShuffleSplit, cross_val_predict
from sklearn.multioutput import MultiOutputRegressor
from sklearn.pipeline import make_pipeline

from privlearn.errors import PrivacyLeakWarning
from privlearn.models import PrivatePipeline, PrivateStandardScaler, SSPRegressor

pytestmark = pytest.mark.filterwarnings("ignore::privlearn.errors.DataClippedWarning")


def _alike(fit) -> tuple[list[str], object]:
    """The 'starts alike' warnings given while ``fit()`` runs, and its result."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fit()
    return [
        str(w.message)
        for w in caught
        if issubclass(w.category, PrivacyLeakWarning) and "starts alike" in str(w.message)
    ], out


@pytest.mark.parametrize(
    "seed", [42, lambda: np.random.default_rng(1)], ids=["int", "generator-copies"]
)
def test_copies_seeded_alike_draw_the_same_noise_and_are_warned_of_once(seed):
    seed = seed() if callable(seed) else seed
    messages, multi = _alike(
        lambda: MultiOutputRegressor(SSPRegressor(random_state=seed)).fit(X, np.c_[Y, Y, Y])
    )
    first, *others = multi.estimators_
    for other in others:  # the same noise: identical releases
        np.testing.assert_array_equal(other.coef_, first.coef_)
    assert len(messages) == 1 and "MultiOutputRegressor" in messages[0]


def test_copies_with_fresh_noise_are_not_warned_of():
    messages, multi = _alike(lambda: MultiOutputRegressor(SSPRegressor()).fit(X, np.c_[Y, Y]))
    assert not np.allclose(multi.estimators_[0].coef_, multi.estimators_[1].coef_)
    assert messages == []


@pytest.mark.parametrize(
    "fit",
    [
        # one copy only
        lambda: SelectFromModel(SSPRegressor(random_state=0)).fit(X, Y),
        # the ensemble gives each copy its own seed
        lambda: BaggingRegressor(
            SSPRegressor(random_state=0),
            n_estimators=3,
            bootstrap=False,
            max_samples=0.5,
            random_state=0,
        ).fit(X, Y),
        # steps seeded apart, fitted once
        lambda: PrivatePipeline(
            [
                ("s", PrivateStandardScaler(feature_range=(-1, 1), random_state=1)),
                ("m", SSPRegressor(random_state=2)),
            ]
        ).fit(X, Y),
    ],
    ids=["one-copy", "ensemble-seeds", "pipeline"],
)
def test_fits_whose_noise_starts_apart_are_not_warned_of(fit):
    assert _alike(fit)[0] == []


def test_cross_validation_copies_of_a_pipeline_step_are_warned_of():
    """cross_val_predict is a function, not a meta-estimator: its folds' copies of a
    step (seeded 1) share that step's noise."""
    pipe = PrivatePipeline(
        [
            ("s", PrivateStandardScaler(feature_range=(-1, 1), random_state=1)),
            ("m", SSPRegressor(random_state=2)),
        ]
    )
    messages, _ = _alike(lambda: cross_val_predict(pipe, X, Y, cv=3))
    assert len(messages) == 1 and "cross_val_predict" in messages[0]


def _same_seed_pipeline() -> PrivatePipeline:
    return PrivatePipeline(
        [
            ("s", PrivateStandardScaler(feature_range=(-1, 1), random_state=1)),
            ("m", SSPRegressor(random_state=1)),
        ]
    )


def _leaks(fit) -> list[str]:
    """Every PrivacyLeakWarning given while ``fit()`` runs."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit()
    return [str(w.message) for w in caught if issubclass(w.category, PrivacyLeakWarning)]


@pytest.mark.parametrize(
    "fit",
    [
        lambda: _same_seed_pipeline().fit(X, Y),
        lambda: make_pipeline(_same_seed_pipeline()).fit(X, Y),
    ],
    ids=["alone", "in-a-pipeline"],
)
def test_steps_of_one_private_pipeline_fit_are_not_copies(fit):
    """A PrivatePipeline fits each step once and warns of its steps seeded alike
    itself: it was warned of a second time as fitting SSPRegressor 'several times' (it
    fits it once) and told to seed an ensemble."""
    messages = _leaks(fit)
    assert len(messages) == 1 and "share random_state=1" in messages[0]


def test_folds_of_a_private_pipeline_whose_steps_share_a_seed_are_still_copies():
    messages, _ = _alike(lambda: cross_val_predict(_same_seed_pipeline(), X, Y, cv=3))
    assert len(messages) == 1 and "cross_val_predict" in messages[0]


def test_two_private_steps_of_a_plain_pipeline_seeded_alike_are_named():
    """Not copies of one estimator: the warning names both (it said the pipeline
    fitted SSPRegressor 'several times')."""
    pipe = make_pipeline(
        PrivateStandardScaler(feature_range=(-1, 1), random_state=1),
        SSPRegressor(random_state=1),
    )
    messages, _ = _alike(lambda: pipe.fit(X, Y))
    assert len(messages) == 1
    assert "PrivateStandardScaler and SSPRegressor" in messages[0]
    assert "several times" not in messages[0]


@pytest.mark.parametrize(
    "fit",
    [
        lambda: cross_val_predict(SSPRegressor(random_state=0), X, Y, cv=3, n_jobs=2),
        lambda: GridSearchCV(SSPRegressor(random_state=0), {"epsilon": [1.0]}, cv=2, n_jobs=2).fit(
            X, Y
        ),
    ],
    ids=["cross_val_predict", "grid-search"],
)
def test_copies_fitted_in_worker_threads_are_warned_of_when_cloned(fit):
    """With n_jobs=2 the copies are fitted in joblib's workers, whose frames do not show
    the call: the copies were not compared. They are cloned in the calling thread,
    where two copies of one estimator seeded alike are seen; the ground truth is that
    the folds' copies draw the very same noise (equal noise on overlapping rows)."""
    with parallel_config(backend="threading"):
        messages, _ = _alike(fit)
    assert len(messages) == 1 and "starts alike" in messages[0]


@pytest.mark.parametrize("n_jobs", [None, 2])
def test_a_single_split_search_over_seeds_is_not_warned_of(n_jobs):
    """The candidates' copies are seeded after the clone (random_state is in the grid),
    each fitted once: their noise starts apart."""
    search = GridSearchCV(
        SSPRegressor(random_state=0),
        {"random_state": [1, 2]},
        cv=ShuffleSplit(n_splits=1, test_size=0.3, random_state=0),
        refit=False,
        n_jobs=n_jobs,
    )
    with parallel_config(backend="threading"):
        messages, _ = _alike(lambda: search.fit(X, Y))
    assert messages == []
