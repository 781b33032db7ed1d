"""A failed fit never spends what it need not, and never corrupts state.

The rule (:mod:`privlearn.models.base`, :mod:`privlearn.models._charge`): a mistake that
the data's shape and type decide alone (sparse where dense is needed, 1-D or 3-D ``X``,
no row or no column, ``y`` of another length, complex numbers, a fit parameter the
release cannot account, labels whose type no declared class can have) is refused with
a typed error naming the input *before* anything is reserved on a ledger: the ledger is
unchanged. A refusal that depends on the private values (a NaN or an infinity, text in
an object column, a label outside the declared ``classes``) comes after the
reservation and is charged in full, the documented convention: a cancelled entry would
tell the ledger's readers that one record held such a value. Public data (PrivateKNN's
queries) is checked whole before the reservation. Either way a failed refit or release
leaves the estimator with its previous state, bit for bit.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import scipy.sparse as sp
from estimators import assert_covers

import privlearn.errors as E
import privlearn.models as M
from privlearn.ledger import Ledger

pytestmark = pytest.mark.filterwarnings(
    "ignore::privlearn.errors.DataClippedWarning", "ignore::privlearn.errors.PrivacyLeakWarning"
)

_RNG = np.random.default_rng(0)
X = _RNG.uniform(-1, 1, size=(12, 2))
Y2 = (X[:, 0] > 0).astype(int)  # binary labels, and a regression target
Y3 = np.arange(12) % 3
VOTES = _RNG.integers(0, 3, size=(5, 8))  # 5 teachers' hard votes on 8 queries, 3 classes


@dataclass(frozen=True)
class Case:
    """An estimator with a ledger, its good data and the call that spends."""

    make: Callable[[Any], Any]  # budget handle -> estimator
    X: Any
    y: Any = None  # None: the call takes no y
    spend: Callable[..., Any] = lambda est, X, y, **kw: est.fit(X, y, **kw)
    data: str = "X"  # how the messages name the data
    public: bool = False  # the data is public: its values are checked before reserving
    labels: bool = False  # a classifier with declared classes
    ignores_y: bool = False  # a transformer (scikit-learn ignores its y)
    fit_first: bool = False  # fitted on (X, y) before spending (PrivateKNN)


#: a given noise multiplier (checked against epsilon, not calibrated): quicker
_NOISE = {"noise_multiplier": 5.0, "epsilon": 10.0, "random_state": 0}


def _ssp(h):
    return M.SSPRegressor(random_state=0, ledger=h)


def _dpsgd(h, classes):
    return M.DPSGDClassifier(n_iter=3, classes=classes, ledger=h, **_NOISE)


def _search(h, estimator, loss_bound):
    return M.PrivateSearchCV(
        estimator,
        {"epsilon": [10.0]},
        method="composition",
        loss_bound=loss_bound,
        random_state=0,
        ledger=h,
    )


CASES = {
    "SSPRegressor": Case(lambda h: _ssp(h), X, Y2),
    "AdaSSPRegressor": Case(lambda h: M.AdaSSPRegressor(random_state=0, ledger=h), X, Y2),
    "NoisyGDRegressor": Case(
        lambda h: M.NoisyGDRegressor(n_iter=3, random_state=0, ledger=h), X, Y2
    ),
    "DPSGDClassifier": Case(lambda h: _dpsgd(h, [0, 1]), X, Y2, labels=True),
    "DPSGDClassifier-multinomial": Case(lambda h: _dpsgd(h, [0, 1, 2]), X, Y3, labels=True),
    "DPSGDRegressor": Case(lambda h: M.DPSGDRegressor(n_iter=3, ledger=h, **_NOISE), X, Y2),
    "PrivateStandardScaler": Case(
        lambda h: M.PrivateStandardScaler(feature_range=(-1, 1), random_state=0, ledger=h),
        X,
        Y2,
        ignores_y=True,
    ),
    "PrivatePipeline-PublicRangeScaler": Case(
        lambda h: M.PrivatePipeline(
            [("range", M.PublicRangeScaler(bounds=(-1, 1))), ("m", _ssp(h))]
        ),
        X,
        Y2,
    ),
    "PrivatePipeline": Case(
        lambda h: M.PrivatePipeline(
            [
                ("s", M.PrivateStandardScaler(feature_range=(-1, 1), random_state=0, ledger=h)),
                ("m", _dpsgd(h, [0, 1, 2])),
            ]
        ),
        X,
        Y3,
        labels=True,
    ),
    "PrivateSearchCV": Case(lambda h: _search(h, M.SSPRegressor(), 4.0), X, Y2),
    "PrivateSearchCV-classifier": Case(
        lambda h: _search(h, _dpsgd(None, [0, 1]), 1.0), X, Y2, labels=True
    ),
    "PATE": Case(
        lambda h: M.PATE(ledger=h, **_NOISE),
        VOTES,
        spend=lambda est, X, y, **kw: est.release(X, n_classes=3, n_teachers=5, **kw),
        data="teacher_outputs|teacher votes",
    ),
    "PrivateKNN": Case(
        lambda h: M.PrivateKNN(n_neighbors=3, classes=[0, 1], ledger=h, **_NOISE),
        X[:3],
        spend=lambda est, X, y, **kw: est.release(X, **kw),
        data="X_query|X",
        public=True,
        fit_first=True,
    ),
}


def _nan(A):
    A = np.array(A, dtype=float)
    A[1, 1] = np.nan
    return A


def _text(A):
    A = np.array(A, dtype=object)
    A[1, 1] = "north"
    return A


def _dates(A):
    return (np.asarray(A) * 1000).astype(np.int64).astype("datetime64[s]")


def _x(kind: str, bad: Callable[[Case], Any], votes: str | None = None):
    """A family replacing the data input by ``bad(case)``; ``votes`` is the kind of the
    same mistake in PATE's votes ("skip": no such mistake there)."""

    def family(c: Case):
        if c.data.startswith("teacher") and votes == "skip":
            return None
        return bad(c), c.y, {}, votes if c.data.startswith("teacher") and votes else kind

    return family


def _y(kind: str, bad: Callable[[np.ndarray], Any], *, labels: bool = False):
    """A family replacing ``y`` by ``bad(y)`` (for the calls that take one; ``labels``:
    for the classifiers with declared classes only)."""

    def family(c: Case):
        if c.y is None or c.ignores_y or (labels and not c.labels):
            return None
        return c.X, bad(c.y), {}, kind

    return family


def _empty(c: Case):
    if c.y is None:  # no query (PATE: axis 1; PrivateKNN: the rows)
        return (np.asarray(c.X)[:, :0] if c.data.startswith("teacher") else c.X[:0]), None, {}
    return c.X[:0], c.y[:0], {}


def _sample_weight(c: Case):
    return None if c.y is None else (c.X, c.y, {"sample_weight": np.ones(12)}, "schema")


#: family -> (case -> (X, y, fit keywords, "schema" | "values"), or None where it does
#: not apply; the parameter the message must name, "data" for the case's data input)
BAD = {
    "sparse X": (_x("schema", lambda c: sp.csr_matrix(c.X)), "data"),
    "NaN in X": (_x("values", lambda c: _nan(c.X)), "data"),
    "1-D X": (_x("schema", lambda c: np.asarray(c.X)[0]), "data"),
    # a 3-D X (4-D votes: PATE takes soft votes of 3 dimensions)
    "3-D X": (
        _x(
            "schema",
            lambda c: (
                np.asarray(c.X)[..., None, None]
                if c.data.startswith("teacher")
                else np.asarray(c.X)[..., None]
            ),
        ),
        "data",
    ),
    "text in an object X": (_x("values", lambda c: _text(c.X)), "data"),
    # numbers written as strings are numbers: refused by the values, except for votes
    "string dtype X": (_x("values", lambda c: np.full(np.shape(c.X), "a"), votes="schema"), "data"),
    "complex X": (_x("schema", lambda c: np.asarray(c.X).astype(complex)), "data"),
    "dates in X": (_x("schema", lambda c: _dates(c.X)), "data"),
    "empty X": (lambda c: (*_empty(c), "schema"), "data"),
    "X with 0 features": (_x("schema", lambda c: np.asarray(c.X)[:, :0], votes="skip"), "data"),
    "NaN in y": (_y("values", lambda y: np.where(np.arange(12) == 2, np.nan, y)), "y"),
    "y of another length": (_y("schema", lambda y: y[:-1]), "X and y"),
    "complex y": (_y("schema", lambda y: y.astype(complex)), "y"),
    "y outside the public classes": (
        _y("values", lambda y: np.where(np.arange(12) == 2, 7, y), labels=True),
        "y",
    ),
    "text y for numeric classes": (
        _y("schema", lambda y: np.where(y == 0, "no", "yes"), labels=True),
        "y",
    ),
    "sample_weight": (_sample_weight, "sample_weight"),
}


def test_cases_cover_every_estimator_that_spends():
    """Every public estimator (LabelRelease is the record PATE and PrivateKNN return: it
    spends nothing, and has no ledger)."""
    assert_covers({name.split("-")[0] for name in CASES}, "CASES")


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """Each case's estimator, fitted (or released once) on good data, with its ledger."""
    out = {}
    for name, case in CASES.items():
        book = Ledger(str(tmp_path_factory.mktemp("nocharge") / "l.db"), create=True)
        book.create_budget("d", epsilon=1e6, delta=1e-3)
        est = case.make(book.budget("d"))
        if case.fit_first:
            est.fit(X, Y2)
        case.spend(est, case.X, case.y)
        out[name] = (est, book)
    return out


def _state(obj: Any) -> Any:
    """Everything an estimator holds but its parameters (fitted attributes, private
    state, nested estimators' and pipeline steps' too), as bytes to compare exactly."""
    if hasattr(obj, "get_params") and hasattr(obj, "__dict__") and not isinstance(obj, type):
        params = set(obj.get_params(deep=False))
        held = {k: _state(v) for k, v in vars(obj).items() if k not in params}
        if "steps" in params:
            held["steps"] = [(n, _state(s)) for n, s in obj.steps]
        return type(obj).__name__, held
    if isinstance(obj, list | tuple):
        return [_state(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.dtype.str, obj.shape, obj.tobytes()
    return pickle.dumps(obj)


def _ledger(book: Ledger) -> tuple:
    return len(book.history("d")), book.pending("d")


#: every (case, family) where the family's mistake can be made
PAIRS = [(n, f) for n in sorted(CASES) for f in sorted(BAD) if BAD[f][0](CASES[n]) is not None]


@pytest.mark.parametrize(("name", "family"), PAIRS)
def test_bad_input_is_typed_charged_only_by_its_values_and_keeps_the_state(fitted, name, family):
    case = CASES[name]
    make_bad, names = BAD[family]
    Xb, yb, kw, kind = make_bad(case)
    est, book = fitted[name]
    before, state = _ledger(book), _state(est)
    with pytest.raises((ValueError, TypeError)) as info:
        case.spend(est, Xb, yb, **kw)
    err = info.value
    assert type(err).__module__ == E.__name__, f"untyped {type(err).__name__}: {err}"
    pattern = case.data if names == "data" else names
    assert re.search(rf"\b({pattern})\b", str(err)), f"{pattern!r} not named: {err}"
    assert _state(est) == state, "a failed call changed the estimator's state"
    after = _ledger(book)
    if kind == "schema" or case.public:
        assert after == before, f"charged for a mistake of schema: {err}"
    else:  # charged in full, settled (the documented convention)
        assert after[0] > before[0] and after[1] == [], err


def test_sparse_x_reaching_a_public_range_scaler_is_refused_before_the_reservation(tmp_path):
    """A sparse X for a pipeline whose first step is a PublicRangeScaler (which takes
    dense data) was refused by the scaler's own fit, after the private model's plan was
    reserved: the user paid for a type mistake."""
    book = Ledger(str(tmp_path / "l.db"), create=True)
    book.create_budget("d", epsilon=10.0, delta=1e-5)
    model = _ssp(book.budget("d"))
    pipe = M.PrivatePipeline([("range", M.PublicRangeScaler(bounds=(-1, 1))), ("m", model)])
    with pytest.raises(E.ParameterTypeError, match=r"'range' \(PublicRangeScaler\).*X is sparse"):
        pipe.fit(sp.csr_matrix(X), Y2)
    assert book.history("d")[-1].kind == "budget" and book.pending("d") == []
    assert not hasattr(model, "coef_")
    pipe.fit(X, Y2)  # dense: fitted and charged
    assert len(book.history("d")) > 1


def test_one_class_without_declared_classes_is_refused_and_charged_in_full(fitted):
    """With classes=None, whether y holds two classes is the data's: refused after the
    reservation, which is charged in full (the documented convention); the previous fit
    stays."""
    est, book = fitted["DPSGDClassifier"]
    est = M.DPSGDClassifier(n_iter=3, ledger=est.ledger, **_NOISE).fit(X, Y2)
    before, state = _ledger(book), _state(est)
    with pytest.raises(E.ParameterValueError, match="y has only one class"):
        est.fit(X, np.zeros(12))
    assert _state(est) == state
    after = _ledger(book)
    assert after[0] > before[0] and after[1] == []


#: the methods of a fitted estimator that read new data (nothing is spent)
_READERS = (
    "predict",
    "predict_proba",
    "predict_log_proba",
    "decision_function",
    "transform",
    "inverse_transform",
    "score",
)


@pytest.mark.parametrize("name", sorted(set(CASES) - {"PATE", "PrivateKNN"}))  # they release
def test_a_fitted_estimator_refuses_wrong_width_or_non_finite_data_typed(fitted, name):
    """predict, transform and the like on a fitted estimator: another number of
    features, or a NaN, is a typed error naming X (no budget involved)."""
    est, _book = fitted[name]
    readers = [m for m in _READERS if hasattr(est, m)]
    assert readers
    wide, nan = np.c_[X, X], _nan(X)
    for method in readers:
        call = getattr(est, method)
        args = (lambda A: (A, CASES[name].y)) if method == "score" else (lambda A: (A,))
        with pytest.raises(E.ParameterValueError, match=r"\bX\b.*4 features|4 features"):
            call(*args(wide))
        with pytest.raises(E.NonFiniteInputError, match=r"\bX\b contains NaN"):
            call(*args(nan))
