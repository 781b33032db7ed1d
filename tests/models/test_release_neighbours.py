"""Every released field is either public or passed through the noise: each estimator is
fitted on a data set and on its neighbours (one row replaced by an extreme value; one row
removed) with the same ``random_state``, and again on the data set with another seed. A
field that changes between the neighbours but not between the seeds depends on the data
deterministically (an exact count, a bound, a statistic), which no mechanism covers."""

import dataclasses
import warnings

import numpy as np
import pytest
from sklearn.compose import ColumnTransformer
from sklearn.preprocessing import OneHotEncoder

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


def _fields(obj, path="", out=None, seen=None) -> dict:
    """Every value reachable from ``obj`` (attributes, dataclass fields, containers), by
    path; generators are skipped (a fixed seed is the caller's, see test_random_state)."""
    out = {} if out is None else out
    seen = set() if seen is None else seen
    if isinstance(obj, int | float | str | bool | np.generic | np.ndarray) or obj is None:
        out[path] = obj
        return out
    if id(obj) in seen or isinstance(obj, np.random.Generator | np.random.RandomState):
        return out
    seen.add(id(obj))
    if isinstance(obj, dict):
        out[path + ".keys"] = sorted(map(repr, obj))
        items = obj.items()
    elif isinstance(obj, list | tuple):
        out[path + ".len"] = len(obj)
        items = enumerate(obj)
    elif dataclasses.is_dataclass(obj):
        items = ((f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj))
    elif hasattr(obj, "__dict__"):
        items = vars(obj).items()
    else:
        out[path] = repr(obj)
        return out
    for k, v in items:
        _fields(v, f"{path}.{k}", out, seen)
    return out


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=a.dtype.kind == "f"))
    return repr(a) == repr(b)


def _deterministic_in_the_data(build, D, neighbour) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f0, f1, f2 = (_fields(build(X, y, seed)) for (X, y), seed in
                      ((D, 0), (neighbour, 0), (D, 1)))
    # the changed record took part: some released value differs between the neighbours
    assert any(not _same(f0[k], f1[k]) for k in f0 if k in f1)
    return sorted(k for k in set(f0) | set(f1)
                  if k not in f0 or k not in f1
                  or (not _same(f0[k], f1[k]) and k in f2 and _same(f0[k], f2[k])))


def _regression(n=200):
    rng = np.random.default_rng(0)
    X = rng.uniform(-0.5, 0.5, size=(n, 3))
    return X, X @ np.array([1.0, 2.0, 3.0]) + 0.1 * rng.normal(size=n)


def _linear(cls, **kw):
    return lambda X, y, s: cls(x_bound=1.0, y_bound=3.0, random_state=s, **kw).fit(X, y)


def _pipeline(X, y, s):
    encode = ColumnTransformer(
        [("cat", OneHotEncoder(categories=[[0.0, 1.0]], drop="first"), [0])],
        remainder="passthrough", sparse_threshold=0)
    Xc = np.column_stack([X[:, 0] > 0, X[:, 1:]]).astype(float)
    return PrivatePipeline(
        [("encode", encode),
         ("scale", PrivateStandardScaler(feature_range=(-1, 1), random_state=s)),
         ("model", SSPRegressor(y_bound=3.0, random_state=s + 10))],
        public_steps=("encode",)).fit(Xc, y)


def _knn(X, y, s):
    knn = PrivateKNN(n_neighbors=5, epsilon=1.0, classes=[0, 1], random_state=s)
    knn.fit(X, (y > 0).astype(int)).release(np.vstack([X[:1], np.zeros((4, 3))]))
    return knn.public_release()  # the fitted object holds the data (documented)


def _pate(X, y, s):
    votes = np.tile((y[:40] > 0).astype(int), (20, 1))  # teachers x queries
    p = PATE(epsilon=1.0, random_state=s)
    p.release(votes, 2, n_teachers=20)
    return p


BUILDERS = {
    "ssp": _linear(SSPRegressor),
    "ssp-upper-triangle": _linear(SSPRegressor, matrix_noise="upper_triangle",
                                  project_psd=False),
    "adassp": _linear(AdaSSPRegressor),
    "adassp-ridge": _linear(AdaSSPRegressor, regularization="ridge"),
    "noisygd-path": _linear(NoisyGDRegressor, noise_multiplier=None, n_iter=30,
                            log_every=10),
    "dpsgd-reg": lambda X, y, s: DPSGDRegressor(n_iter=20, record_path=True,
                                                random_state=s).fit(X, y),
    "dpsgd-clf-subsampled": lambda X, y, s: DPSGDClassifier(
        epsilon=10.0, noise_multiplier=1.0, n_iter=20, sampling_rate=0.2,
        trajectory_points=2, classes=[0, 1], random_state=s).fit(X, y > 0),
    "dpsgd-clf-multinomial": lambda X, y, s: DPSGDClassifier(
        epsilon=10.0, noise_multiplier=1.0, n_iter=20, sampling_rate=0.2,
        trajectory_points=2, record_path=True, classes=[0, 1, 2],
        random_state=s).fit(X, np.digitize(y, [-1.0, 1.0])),
    "scaler": lambda X, y, s: PrivateStandardScaler(feature_range=(-1, 1),
                                                    random_state=s).fit(X),
    "pipeline": _pipeline,
    "search": lambda X, y, s: PrivateSearchCV(
        AdaSSPRegressor(y_bound=3.0), {"regularization": ["ridge", "eigenvalue_floor"]},
        loss_bound=36.0, random_state=s).fit(X, y),
    "search-composition": lambda X, y, s: PrivateSearchCV(
        DPSGDClassifier(n_iter=10, classes=[0, 1]), {"learning_rate": [0.1, 0.5]},
        method="composition", random_state=s).fit(X, y > 0),
    "knn-release": _knn,
    "pate": _pate,
}


def _neighbours():
    X, y = _regression()
    Xr, yr = X.copy(), y.copy()
    Xr[0], yr[0] = 1e6, -1e6 if y[0] > 0 else 1e6  # clipped to the public bounds
    return (X, y), {"replace-one": (Xr, yr), "remove-one": (X[1:], y[1:])}


@pytest.mark.parametrize("relation", ["replace-one", "remove-one"])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_no_released_field_follows_the_data_without_noise(name, relation):
    D, neighbours = _neighbours()
    leaks = _deterministic_in_the_data(BUILDERS[name], D, neighbours[relation])
    assert not leaks, f"{name}: released without noise, yet data-dependent: {leaks}"


@pytest.mark.parametrize("smoothness", ["data", "public"])
def test_the_check_finds_a_documented_exact_release(smoothness):
    """The check can fail: NoisyGD's opt-in exact smoothness (announced by a
    PrivacyLeakWarning) sets the learning rate from lambda_max(X^T X) (``"data"``) or
    from the number of rows (``"public"``, which add/remove neighbours change)."""
    D, neighbours = _neighbours()
    build = _linear(NoisyGDRegressor, noise_multiplier=None, n_iter=30,
                    smoothness=smoothness)
    relation = "replace-one" if smoothness == "data" else "remove-one"
    assert _deterministic_in_the_data(build, D, neighbours[relation]) == [
        ".learning_rate_", ".smoothness_"]
