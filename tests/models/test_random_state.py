"""A released model carries no seed or generator state that regenerates its noise.

What leaves a fit -- the fitted object, its ``get_params()``, its attributes, its pickle --
is a release. If it held the seed (or the generator state) its noise was drawn from,
anyone could refit with it, regenerate the noise exactly and subtract it: a refit on the
dataset with and without a record reproduces the release on the right one, deciding
membership every time. A user-given ``random_state`` is the user's choice (documented:
whoever knows it can do this); the library must never create one and release it.

The tests: the membership attack on :class:`PrivateSearchCV` (a search that fits its
candidates with integer seeds kept in ``best_estimator_`` loses it every time), and a
sweep over every estimator with ``random_state=None``: no generator object anywhere in
the released object or its pickle, and a refit with the released parameters draws
different noise.
"""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest

from privlearn.models import (
    PATE,
    AdaSSPRegressor,
    DPSGDClassifier,
    DPSGDRegressor,
    NoisyGDRegressor,
    PrivateKNN,
    PrivatePipeline,
    PrivateSearchCV,
    PrivateStandardScaler,
    SSPRegressor,
)

_GENERATOR_TYPES = (np.random.Generator, np.random.RandomState, np.random.BitGenerator,
                    np.random.SeedSequence)


def _data(n=400, d=3, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.uniform(-0.5, 0.5, size=(n, d))
    y = X @ np.arange(1.0, d + 1) + 0.1 * rng.normal(size=n)
    return X, y


def _generators_in(obj, seen=None, path="obj") -> list[str]:
    """Paths of every NumPy generator, bit generator, seed sequence or RandomState
    reachable from ``obj`` through attributes, dicts, lists and tuples."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, str | bytes | int | float | np.ndarray):
        return []
    seen.add(id(obj))
    if isinstance(obj, _GENERATOR_TYPES):
        return [path]
    found: list[str] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            found += _generators_in(v, seen, f"{path}[{k!r}]")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            found += _generators_in(v, seen, f"{path}[{i}]")
    elif hasattr(obj, "__dict__"):
        for k, v in vars(obj).items():
            found += _generators_in(v, seen, f"{path}.{k}")
    return found


def test_generator_walk_can_fail():
    """The walk is not vacuous: a generator stored anywhere, however deep, is found."""
    est = SSPRegressor(random_state=np.random.default_rng(0))
    assert _generators_in(est) == ["obj.random_state"]
    nested = PrivateSearchCV(SSPRegressor(), {"epsilon": [1.0]})
    nested.best_estimator_ = SSPRegressor()
    nested.best_estimator_._kept = [{"rng": np.random.default_rng(1).bit_generator}]
    assert _generators_in(nested) == ["obj.best_estimator_._kept[0]['rng']"]
    assert b"numpy.random" in pickle.dumps(est)


# --- the membership attack on the search ----------------------------------------------

def _search(**kw):
    return PrivateSearchCV(
        SSPRegressor(epsilon=1.0, delta=1e-6, x_bound=1.0, y_bound=3.0),
        {"budget_split": [None, (1.0, 1.0)], "matrix_noise": ["frobenius", "upper_triangle"]},
        loss_bound=36.0, **kw)


def test_search_release_lets_no_refit_decide_membership():
    """The attack: the released ``best_estimator_`` was trained on D or on D plus a target
    record. Refit its class with its released parameters on both; if exactly one refit
    reproduces ``coef_`` bit for bit, that decides membership. With the seed released
    this decided 5 times of 5; now no refit reproduces the release."""
    X, y = _data()
    target_x, target_y = np.array([[0.5, -0.5, 0.5]]), np.array([3.0])
    with_t = (np.vstack([X, target_x]), np.concatenate([y, target_y]))
    decided = 0
    for trial in range(5):
        Xt, yt = with_t if trial % 2 == 0 else (X, y)
        search = pickle.loads(pickle.dumps(_search().fit(Xt, yt)))  # what is shared
        best = search.best_estimator_
        refits = [type(best)(**best.get_params()).fit(*d).coef_ for d in (with_t, (X, y))]
        matches = [np.array_equal(c, best.coef_) for c in refits]
        decided += matches[0] != matches[1]
        assert not any(matches)
        assert _generators_in(search) == []
    assert decided == 0


def test_search_keeps_the_declared_random_state():
    """``best_estimator_`` keeps the candidate's declared ``random_state`` (the user's
    value, which did not produce the noise), never one made up by the search."""
    X, y = _data()
    for declared in (None, 7):
        search = PrivateSearchCV(
            SSPRegressor(epsilon=1.0, y_bound=3.0, random_state=declared),
            {"matrix_noise": ["frobenius", "upper_triangle"]}, method="composition",
            loss_bound=36.0).fit(X, y)
        assert search.best_estimator_.random_state == declared
        refit = SSPRegressor(**search.best_estimator_.get_params()).fit(X, y)
        assert not np.array_equal(refit.coef_, search.best_estimator_.coef_)


def test_search_with_a_user_seed_is_reproducible():
    """A user-given seed is the user's choice: the whole search is reproducible by
    whoever knows it (documented), and the seed is the one the user gave."""
    X, y = _data()
    a = _search(random_state=3).fit(X, y)
    b = _search(random_state=3).fit(X, y)
    np.testing.assert_array_equal(a.best_estimator_.coef_, b.best_estimator_.coef_)
    assert a.random_state == 3


# --- every estimator, random_state=None -----------------------------------------------

def _linear(cls, **kw):
    def build():
        return cls(epsilon=1.0, delta=1e-6, x_bound=1.0, y_bound=3.0, **kw).fit(*_data())

    def refit(released):
        return type(released)(**released.get_params()).fit(*_data())

    return build, refit, lambda m: m.coef_


def _dpsgd(cls):
    def xy():
        X, y = _data()
        return (X, (y > 0).astype(int)) if cls is DPSGDClassifier else (X, y)

    extra = {"classes": [0, 1]} if cls is DPSGDClassifier else {}

    def build():
        return cls(epsilon=1.0, n_iter=20, **extra).fit(*xy())

    def refit(released):
        return type(released)(**released.get_params()).fit(*xy())

    return build, refit, lambda m: m.coef_


def _votes():
    return np.random.default_rng(0).integers(0, 3, size=(20, 40))


def _pate():
    def build():
        p = PATE(epsilon=1.0, delta=1e-6)
        p.release(_votes(), 3, n_teachers=20)
        return p

    def refit(released):
        p = PATE(**released.get_params())
        p.release(_votes(), 3, n_teachers=20)
        return p

    return build, refit, lambda p: p.noisy_votes_


def _knn():
    def fitted(params):
        X, y = _data()
        knn = PrivateKNN(**params).fit(X, (y > 0).astype(int))
        knn.release(X[:10])
        return knn

    params = dict(n_neighbors=5, epsilon=1.0, classes=[0, 1])
    return (lambda: fitted(params), lambda r: fitted(r.get_params()),
            lambda k: k.noisy_votes_)


def _scaler():
    def build():
        return PrivateStandardScaler(feature_range=(-1, 1)).fit(_data()[0])

    def refit(released):
        return PrivateStandardScaler(**released.get_params()).fit(_data()[0])

    return build, refit, lambda s: s.mean_


def _pipeline():
    def build():
        return PrivatePipeline([("scale", PrivateStandardScaler(feature_range=(-1, 1))),
                                ("ssp", SSPRegressor(y_bound=3.0))]).fit(*_data())

    def refit(released):
        from sklearn.base import clone

        return clone(released).fit(*_data())

    return build, refit, lambda p: p[-1].coef_


def _search_case(method):
    def build():
        return _search(method=method).fit(*_data())

    def refit(released):
        best = released.best_estimator_
        return type(best)(**best.get_params()).fit(*_data())

    def noisy(obj):
        return obj.best_estimator_.coef_ if isinstance(obj, PrivateSearchCV) else obj.coef_

    return build, refit, noisy


CASES = {
    "SSPRegressor": _linear(SSPRegressor),
    "AdaSSPRegressor": _linear(AdaSSPRegressor),
    "NoisyGDRegressor": _linear(NoisyGDRegressor, noise_multiplier=None, n_iter=30),
    "DPSGDClassifier": _dpsgd(DPSGDClassifier),
    "DPSGDRegressor": _dpsgd(DPSGDRegressor),
    "PATE": _pate(),
    "PrivateKNN": _knn(),
    "PrivateStandardScaler": _scaler(),
    "PrivatePipeline": _pipeline(),
    "PrivateSearchCV-random_stopping": _search_case("random_stopping"),
    "PrivateSearchCV-composition": _search_case("composition"),
}


def test_every_estimator_is_swept():
    from estimators import assert_covers

    assert_covers({k.split("-")[0] for k in CASES}, "CASES")


@pytest.mark.parametrize("case", list(CASES))
def test_nothing_released_regenerates_the_noise(case):
    build, refit, noisy = CASES[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fitted = build()
        blob = pickle.dumps(fitted)
        released = pickle.loads(blob)
        assert b"numpy.random" not in blob, "the pickle holds a NumPy generator"
        assert _generators_in(released) == []
        params = released.get_params()
        assert params["random_state"] is None if "random_state" in params else True
        again = refit(released)
    np.testing.assert_array_equal(noisy(released), noisy(fitted))
    assert not np.array_equal(noisy(again), noisy(released)), (
        "a refit with the released parameters reproduced the noise")
