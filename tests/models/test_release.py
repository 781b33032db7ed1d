"""Every fitted / released object carries only attributes on the documented allow-list
(privlearn.models._release.RELEASED_ATTRIBUTES), its pickle holds no raw training data,
and docs/trust-model.md shows the same list."""

import inspect
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest

import privlearn.models as models
from privlearn.models import (
    PATE,
    AdaSSPRegressor,
    DPSGDClassifier,
    DPSGDRegressor,
    LabelRelease,
    NoisyGDRegressor,
    PrivateKNN,
    PrivatePipeline,
    PrivateSearchCV,
    PrivateStandardScaler,
    PublicRangeScaler,
    SSPRegressor,
)
from privlearn.models._release import (
    CATEGORIES,
    RELEASED_ATTRIBUTES,
    attribute_table_markdown,
)

SECRET = 0.7071234567890123  # a distinctive private value planted in the training data
SECRET_BYTES = [np.float64(SECRET).tobytes(), np.float32(SECRET).tobytes(),
                repr(SECRET).encode()]


def _data(n=300, d=3, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.uniform(-0.5, 0.5, size=(n, d))
    y = X @ np.arange(1.0, d + 1) + 0.1 * rng.normal(size=n)
    X[7, 1] = SECRET
    y[11] = SECRET
    return X, y


def _fit_linear(cls, **kw):
    X, y = _data()
    return cls(epsilon=1.0, delta=1e-6, x_bound=1.0, y_bound=3.0, random_state=0,
               **kw).fit(X, y)


def _fit_dpsgd(cls, **kw):
    X, y = _data()
    if cls is DPSGDClassifier:
        y = (y > 0).astype(int)
        kw.setdefault("classes", [0, 1])
    return cls(epsilon=1.0, n_iter=20, random_state=0, **kw).fit(X, y)


def _pate(soft=False, noise="gaussian", twice=False):
    rng = np.random.default_rng(0)
    p = PATE(epsilon=1.0, delta=0.0 if noise == "laplace" else 1e-6, noise=noise,
             random_state=0)
    for _ in range(2 if twice else 1):
        if soft:
            T = rng.dirichlet(np.ones(3), size=(20, 40))
            T[3, 5] = [SECRET, 1 - SECRET, 0.0]
            p.release(T, n_teachers=20)
        else:
            p.release(rng.integers(0, 3, size=(20, 40)), 3, n_teachers=20)
    return p


def _knn(twice=False, X=None):
    X_array, y = _data()
    X = X_array if X is None else X
    yc = (y > 0).astype(int)
    knn = PrivateKNN(n_neighbors=5, epsilon=1.0, classes=[0, 1], random_state=0).fit(X, yc)
    for _ in range(2 if twice else 1):
        knn.release(X[:10])
    return knn


def _warn_free(fn):
    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn()
    return run


# (id, builder, shareable): every estimator type and every configuration that changes
# which attributes exist.
CONFIGS = [
    ("ssp", lambda: _fit_linear(SSPRegressor), True),
    ("ssp-no-intercept", lambda: _fit_linear(SSPRegressor, fit_intercept=False), True),
    ("ssp-seed", lambda: _fit_linear(SSPRegressor, matrix_noise="upper_triangle",
                                     project_psd=False), True),
    ("ssp-interval", lambda: SSPRegressor(y_bound=(-1.0, 4.0), random_state=0)
     .fit(*_data()), True),
    ("adassp", lambda: _fit_linear(AdaSSPRegressor), True),
    ("adassp-ridge", lambda: _fit_linear(AdaSSPRegressor, regularization="ridge"), True),
    ("noisygd", lambda: _fit_linear(NoisyGDRegressor, noise_multiplier=None, n_iter=50),
     True),
    ("noisygd-path", lambda: _fit_linear(NoisyGDRegressor, noise_multiplier=None,
                                         n_iter=50, log_every=10), True),
    ("noisygd-lr", lambda: _fit_linear(NoisyGDRegressor, noise_multiplier=None, n_iter=50,
                                       learning_rate=1e-3), True),
    ("noisygd-float-smoothness", lambda: _fit_linear(
        NoisyGDRegressor, noise_multiplier=None, n_iter=50, smoothness=300.0), True),
    ("noisygd-data", _warn_free(lambda: _fit_linear(
        NoisyGDRegressor, noise_multiplier=None, n_iter=50, smoothness="data")), True),
    ("dpsgd-clf", lambda: _fit_dpsgd(DPSGDClassifier), True),
    ("dpsgd-clf-inferred-classes", _warn_free(
        lambda: _fit_dpsgd(DPSGDClassifier, classes=None)), True),
    ("dpsgd-clf-laplace-path", lambda: _fit_dpsgd(
        DPSGDClassifier, noise="laplace", delta=0.0, record_path=True,
        fit_intercept=False), True),
    ("dpsgd-clf-subsampled", lambda: _fit_dpsgd(DPSGDClassifier, sampling_rate=0.1), True),
    ("dpsgd-clf-multinomial", lambda: DPSGDClassifier(
        epsilon=1.0, n_iter=20, sampling_rate=0.3, record_path=True, classes=[0, 1, 2],
        random_state=0).fit(_data()[0], np.digitize(_data()[1], [-1.0, 1.0])), True),
    ("dpsgd-reg", lambda: _fit_dpsgd(DPSGDRegressor), True),
    ("dpsgd-reg-path", lambda: _fit_dpsgd(DPSGDRegressor, record_path=True,
                                          trajectory_accountant="rdp"), True),
    ("pate", lambda: _pate(), True),
    ("pate-soft-twice", lambda: _pate(soft=True, twice=True), True),
    ("pate-laplace", lambda: _pate(noise="laplace"), True),
    ("pate-public-release", lambda: _pate(soft=True, twice=True).public_release(), True),
    ("knn", lambda: _knn(), False),  # holds the private data by design (documented)
    ("knn-inferred-classes", _warn_free(
        lambda: PrivateKNN(n_neighbors=3, random_state=0).fit(*_data()[:1],
                                                              np.arange(300) % 2)), False),
    ("knn-public-release", lambda: _knn(twice=True).public_release(), True),
    ("knn-public-release-once", lambda: _knn().public_release(), True),
    ("scaler", lambda: PrivateStandardScaler(feature_range=(-1, 1), random_state=0)
     .fit(_data()[0]), True),
    ("scaler-public-bounds", lambda: PrivateStandardScaler(
        feature_range=(-1, 1), quantile=None, random_state=0).fit(_data()[0]), True),
    ("private-pipeline", lambda: PrivatePipeline([
        ("scale", PrivateStandardScaler(feature_range=(-1, 1), random_state=0)),
        ("ssp", SSPRegressor(y_bound=3.0, random_state=0))]).fit(*_data()), True),
    ("public-range-scaler", lambda: PublicRangeScaler(bounds=(-1, 1)).fit(_data()[0]), True),
    ("private-pipeline-public-scaler", lambda: PrivatePipeline([
        ("scale", PublicRangeScaler(bounds=(-1, 1))),
        ("ssp", SSPRegressor(y_bound=3.0, random_state=0))]).fit(*_data()), True),
    ("search-random-stopping", lambda: PrivateSearchCV(
        AdaSSPRegressor(y_bound=3.0), {"regularization": ["ridge", "eigenvalue_floor"]},
        loss_bound=36.0, random_state=0).fit(*_data()), True),
    ("search-composition", lambda: PrivateSearchCV(
        AdaSSPRegressor(y_bound=3.0), {"regularization": ["ridge", "eigenvalue_floor"]},
        method="composition", loss_bound=36.0, random_state=0).fit(*_data()), True),
]


try:  # feature_names_in_ appears only when X is a DataFrame
    import pandas as pd
except ImportError:  # pragma: no cover - pandas is optional
    pd = None
else:
    CONFIGS.append(("ssp-dataframe", lambda: SSPRegressor(y_bound=3.0, random_state=0).fit(
        pd.DataFrame(_data()[0], columns=["a", "b", "c"]), _data()[1]), True))
    CONFIGS.append(("search-dataframe", lambda: PrivateSearchCV(
        SSPRegressor(y_bound=3.0), {"matrix_noise": ["frobenius", "upper_triangle"]},
        loss_bound=36.0).fit(pd.DataFrame(_data()[0], columns=["a", "b", "c"]), _data()[1]),
        True))
    for _cls in (AdaSSPRegressor, NoisyGDRegressor):
        CONFIGS.append((f"{_cls.__name__}-dataframe", lambda c=_cls: c(
            y_bound=3.0, random_state=0, **({"noise_multiplier": None, "n_iter": 50}
                                            if c is NoisyGDRegressor else {})).fit(
            pd.DataFrame(_data()[0], columns=["a", "b", "c"]), _data()[1]), True))
    CONFIGS.append(("dpsgd-reg-dataframe", lambda: _fit_dpsgd(DPSGDRegressor).fit(
        pd.DataFrame(_data()[0], columns=["a", "b", "c"]), _data()[1]), True))
    CONFIGS.append(("knn-dataframe", lambda: _knn(
        X=pd.DataFrame(_data()[0], columns=["a", "b", "c"])), False))
    CONFIGS.append(("dpsgd-clf-dataframe", lambda: _fit_dpsgd(DPSGDClassifier).fit(
        pd.DataFrame(_data()[0], columns=["a", "b", "c"]), (_data()[1] > 0).astype(int)),
        True))
    CONFIGS.append(("public-range-scaler-dataframe", lambda: PublicRangeScaler(
        bounds=(-1, 1)).fit(pd.DataFrame(_data()[0], columns=["a", "b", "c"])), True))
    CONFIGS.append(("scaler-dataframe", lambda: PrivateStandardScaler(
        feature_range=(-1, 1), random_state=0).fit(
        pd.DataFrame(_data()[0], columns=["a", "b", "c"])), True))


def _released_names(obj) -> list[str]:
    """Every attribute that is not a constructor parameter (or a field, for dataclasses)."""
    if isinstance(obj, LabelRelease):
        return list(vars(obj))
    params = set(inspect.signature(type(obj).__init__).parameters) - {"self"}
    return [k for k in vars(obj) if k not in params or k.endswith("_")]


def _unlisted(obj) -> list[str]:
    return sorted(set(_released_names(obj)) - set(RELEASED_ATTRIBUTES[type(obj).__name__]))


def test_walk_flags_a_new_attribute():
    """The walk cannot pass vacuously: an unlisted attribute (fitted-style or private)
    is reported."""
    m = _fit_linear(SSPRegressor)
    assert _unlisted(m) == []
    m.n_samples_seen_ = 300
    m._cache = np.zeros(3)
    assert _unlisted(m) == ["_cache", "n_samples_seen_"]


@pytest.fixture(scope="module")
def built():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", models.DataClippedWarning)
        return {cid: (build(), shareable) for cid, build, shareable in CONFIGS}


def test_every_public_type_is_listed_and_built(built):
    from estimators import ESTIMATORS

    # the estimators, the labels PATE releases, and the scaler fitted on the schema only
    public_types = [*ESTIMATORS, LabelRelease, PublicRangeScaler]
    built_types = {type(obj).__name__ for obj, _ in built.values()}
    for t in public_types:
        assert t.__name__ in RELEASED_ATTRIBUTES, f"{t.__name__} missing from the list"
        assert t.__name__ in built_types, f"no configuration builds {t.__name__}"


@pytest.mark.parametrize("cid", [c[0] for c in CONFIGS])
def test_attributes_are_on_the_allow_list(built, cid):
    obj, shareable = built[cid]
    allowed = RELEASED_ATTRIBUTES[type(obj).__name__]
    names = _released_names(obj)
    assert names, "nothing walked"
    unlisted = _unlisted(obj)
    assert not unlisted, (
        f"{type(obj).__name__} carries attributes not on RELEASED_ATTRIBUTES: {unlisted}; "
        "add each with the reason it is covered (or remove it)"
    )
    held = [n for n in names if allowed[n][0] == "held-private"]
    assert not (shareable and held), f"shareable object holds private data: {held}"


def test_allow_list_is_tight_and_well_formed(built):
    seen: dict[str, set] = {}
    for obj, _ in built.values():
        seen.setdefault(type(obj).__name__, set()).update(_released_names(obj))
    for cls, attrs in RELEASED_ATTRIBUTES.items():
        for cat, why in attrs.values():
            assert cat in CATEGORIES and why
        stale = set(attrs) - seen.get(cls, set())
        if pd is None:
            stale.discard("feature_names_in_")
        assert not stale, f"{cls}: listed but never produced by any configuration: {stale}"
    held = {c for c, a in RELEASED_ATTRIBUTES.items()
            if any(cat == "held-private" for cat, _ in a.values())}
    assert held == {"PrivateKNN"}


@pytest.mark.parametrize("cid", [c[0] for c in CONFIGS if c[2]])
def test_pickle_of_shareable_objects_holds_no_training_data(built, cid):
    obj, _ = built[cid]
    blob = pickle.dumps(obj)
    for b in SECRET_BYTES:
        assert b not in blob, f"{cid}: the pickle contains a raw training value"
    pickle.loads(blob)  # and it round-trips


def test_pickle_check_detects_raw_data(built):
    """The check above can fail: PrivateKNN's fitted object holds the data (documented)."""
    X, y = _data()
    knn = PrivateKNN(classes=[0, 1]).fit(X, (y > 0).astype(int))
    assert SECRET_BYTES[0] in pickle.dumps(knn)


def test_docs_table_is_generated_from_the_list():
    doc = Path(__file__).resolve().parents[2] / "docs" / "trust-model.md"
    assert attribute_table_markdown() in doc.read_text(), (
        "docs/trust-model.md is out of date: paste privlearn.models._release."
        "attribute_table_markdown() into it"
    )
