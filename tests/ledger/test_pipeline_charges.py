"""A PrivatePipeline's ledger entries must not depend on the values of the data: once
its steps' plans are reserved (before any value is read), they are charged in full
whatever happens; mistakes of shape are refused before anything is reserved."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
from sklearn.preprocessing import OneHotEncoder

from privlearn.accounting import compose
from privlearn.ledger import Ledger
from privlearn.models import (
    DPSGDClassifier,
    PrivatePipeline,
    PrivateStandardScaler,
    SSPRegressor,
)


def _records(led: Ledger) -> list[tuple]:
    """Every field of every entry the ledger's readers see, but the sequence numbers,
    times and hashes (a reference to another entry as that entry's position)."""
    history = led.history("d")
    position = {e.seq: i for i, e in enumerate(history)}
    skip = {"seq", "time", "hash", "ref"}
    return [
        (
            *(getattr(e, f.name) for f in dataclasses.fields(e) if f.name not in skip),
            position.get(e.ref),
        )
        for e in history
    ]


def _ledger(path) -> Ledger:
    led = Ledger(path, create=True)
    led.create_budget("d", epsilon=50.0, delta=1e-5)
    return led


def _case(case: str):
    """``(pipeline factory, X, y, X', y')``: a clean data set and its neighbour that the
    pipeline refuses because of one record's value."""
    rng = np.random.default_rng(0)
    X = rng.uniform(-1, 1, size=(120, 2))
    y = np.clip(X @ [0.5, -0.5], -1, 1)
    if case == "nan in y":
        bad_y = y.copy()
        bad_y[7] = np.nan
        return (
            lambda h: PrivatePipeline(
                [
                    (
                        "scale",
                        PrivateStandardScaler(feature_range=(-1, 1), random_state=0, ledger=h),
                    ),
                    ("ssp", SSPRegressor(y_bound=1.0, random_state=1, ledger=h)),
                ]
            ),
            X,
            y,
            X,
            bad_y,
        )
    if case == "label outside classes":
        labels = (y > 0).astype(int)
        bad = labels.copy()
        bad[7] = 2
        return (
            lambda h: PrivatePipeline(
                [
                    (
                        "scale",
                        PrivateStandardScaler(feature_range=(-1, 1), random_state=0, ledger=h),
                    ),
                    ("clf", DPSGDClassifier(n_iter=5, classes=[0, 1], random_state=1, ledger=h)),
                ]
            ),
            X,
            labels,
            X,
            bad,
        )
    # a public encoder with its categories given refuses a record's unknown category
    codes = rng.integers(0, 2, size=(120, 1)).astype(float)
    bad_codes = codes.copy()
    bad_codes[7, 0] = 2.0
    return (
        lambda h: PrivatePipeline(
            [
                ("onehot", OneHotEncoder(categories=[[0.0, 1.0]], sparse_output=False)),
                ("ssp", SSPRegressor(x_bound=2.0, y_bound=1.0, random_state=1, ledger=h)),
            ],
            public_steps=("onehot",),
        ),
        codes,
        y,
        bad_codes,
        y,
    )


@pytest.mark.parametrize("case", ["nan in y", "label outside classes", "unknown category"])
def test_a_refused_neighbour_leaves_the_same_ledger_entries(case, tmp_path):
    """The pipeline checked ``y`` and its steps' data (and fitted its public steps)
    before any step reserved: a NaN in ``y``, a label outside a step's ``classes`` or a
    category its public encoder does not know refused the fit with nothing recorded,
    where the clean neighbour left a reservation per private step, so the ledger's
    readers learned that the data held such a record. Both now leave the same entries:
    every step's plan, charged in full."""
    make, X, y, bad_X, bad_y = _case(case)
    records = {}
    for which, (A, b) in {"clean": (X, y), "refused": (bad_X, bad_y)}.items():
        led = _ledger(tmp_path / f"{which}.db")
        pipe = make(led.budget("d"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # clipping: not what is tested
            if which == "clean":
                pipe.fit(A, b)
                planned = [s.mechanism_ for _, s in pipe.steps if hasattr(s, "ledger")]
                assert led.mechanism("d") == compose(planned)
            else:
                with pytest.raises(ValueError) as e:
                    pipe.fit(A, b)
                assert any("charged in full" in n for n in e.value.__notes__)
                assert not hasattr(pipe, "mechanism_")
        assert led.pending("d") == []
        records[which] = _records(led)
    assert records["refused"] == records["clean"]
    assert any(r[0] == "settle" for r in records["clean"])


@pytest.mark.parametrize("bad", ["y length", "1-D X"])
def test_a_pipeline_shape_mistake_records_nothing(bad, tmp_path):
    """Mistakes of shape are public: refused before any step reserves."""
    make, X, y, _, _ = _case("nan in y")
    X, y = {"y length": (X, y[:10]), "1-D X": (X[:, 0], y)}[bad]
    led = _ledger(tmp_path / "l.db")
    with pytest.raises(ValueError):
        make(led.budget("d")).fit(X, y)
    assert [e.kind for e in led.history("d")] == ["budget"]


def test_a_nested_pipeline_is_reserved_once_before_any_value_is_read(tmp_path):
    """A pipeline inside a pipeline: its steps are reserved by the outer fit, before
    the outer one reads a value, and not again when the inner pipeline is fitted."""
    make, X, y, _, bad_y = _case("nan in y")
    led = _ledger(tmp_path / "l.db")
    h = led.budget("d")
    inner = PrivatePipeline(
        [("scale", PrivateStandardScaler(feature_range=(-1, 1), random_state=0, ledger=h))]
    )
    outer = PrivatePipeline(
        [("inner", inner), ("ssp", SSPRegressor(y_bound=1.0, random_state=1, ledger=h))]
    )
    with pytest.raises(ValueError, match="NaN"):
        outer.fit(X, bad_y)
    refused = [(e.kind, e.mechanism) for e in led.history("d")[1:]]
    plan = [inner.planned_mechanism(X), outer[-1].planned_mechanism(X, y)]
    assert refused == [
        ("reserve", plan[0]),
        ("reserve", plan[1]),
        ("settle", plan[0]),
        ("settle", plan[1]),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outer.fit(X, y)
    assert [(e.kind, e.mechanism) for e in led.history("d")[1:]] == refused * 2
    assert outer.mechanism_ == compose(plan)


def test_a_search_whose_validation_data_equals_x_is_charged_as_its_neighbour(tmp_path):
    """``PrivateSearchCV`` refuses public validation data equal to the private ``X``; it
    compared the values before reserving, so the ledger showed whether ``X`` equalled
    the public ``X_val`` or differed from it in one record. The comparison now follows
    the reservation: both leave the same entries."""
    from privlearn.models import PrivateSearchCV

    _, X, y, _, _ = _case("nan in y")
    X_val = X.copy()
    neighbour = X.copy()
    neighbour[7] = [0.25, -0.25]
    records = {}
    for which, A in {"equal": X, "neighbour": neighbour}.items():
        led = _ledger(tmp_path / f"{which}.db")
        search = PrivateSearchCV(
            SSPRegressor(y_bound=1.0, random_state=0),
            {"epsilon": [1.0]},
            delta=1e-6,
            random_state=0,
            ledger=led.budget("d"),
        )
        if which == "equal":
            with pytest.raises(ValueError, match="X_val is the private training data"):
                search.fit(A, y, X_val=X_val, y_val=y)
        else:
            search.fit(A, y, X_val=X_val, y_val=y)
        records[which] = _records(led)
    assert records["equal"] == records["neighbour"]
    assert [r[0] for r in records["equal"]] == ["budget", "reserve", "settle"]


def test_a_step_with_a_ledger_that_cannot_be_planned_is_refused_before_reserving(tmp_path):
    """A step after a public step whose output width its parameters do not give could
    not be reserved before a value is read (the spline's fit or transform may refuse a
    value first): refused, nothing recorded; without a ledger it still fits."""
    from sklearn.preprocessing import SplineTransformer

    from privlearn.errors import ConfigurationError

    _, X, y, _, _ = _case("nan in y")
    led = _ledger(tmp_path / "l.db")
    knots = np.linspace(-1.0, 1.0, 3)[:, None] * np.ones((1, 2))  # public knots

    def pipe(ledger):
        return PrivatePipeline(
            [
                ("spline", SplineTransformer(knots=knots, degree=1)),
                ("ssp", SSPRegressor(y_bound=1.0, random_state=0, ledger=ledger)),
            ],
            public_steps=("spline",),
        )

    with pytest.raises(ConfigurationError, match="cannot be planned before the fit"):
        pipe(led.budget("d")).fit(X, y)
    assert [e.kind for e in led.history("d")] == ["budget"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert pipe(None).fit(X, y).named_steps["ssp"].coef_.shape == (6,)
