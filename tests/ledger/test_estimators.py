"""Every estimator spends on a ledger (``ledger=ledger.budget(name)``) before it reads
the data, and is refused -- with nothing recorded and nothing read -- when over budget."""

from __future__ import annotations

import inspect
import warnings

import numpy as np
import pytest
from sentinels import Untouchable
from sklearn.base import clone
from sklearn.model_selection import GridSearchCV

import privlearn.models as M
from privlearn.accounting import Gaussian, compose
from privlearn.errors import BudgetExceededError, LedgerConflictError
from privlearn.ledger import Ledger
from privlearn.models import (
    PATE,
    AdaSSPRegressor,
    DPSGDClassifier,
    DPSGDRegressor,
    NoisyGDRegressor,
    PrivateEstimator,
    PrivateKNN,
    PrivateSearchCV,
    PrivateStandardScaler,
    SSPRegressor,
)
from privlearn.models.model_selection import planned_mechanism


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    X = rng.uniform(-0.5, 0.5, size=(300, 3))
    y = X @ [1.0, 2.0, 3.0] + 0.1 * rng.normal(size=300)
    return X, y


@pytest.fixture
def ledger(tmp_path):
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=3.0, delta=1e-5)
    return led


LINEAR = [
    lambda h: SSPRegressor(epsilon=1.0, delta=1e-6, y_bound=3.0, random_state=0, ledger=h),
    lambda h: AdaSSPRegressor(epsilon=1.0, delta=1e-6, y_bound=3.0, random_state=0, ledger=h),
    lambda h: NoisyGDRegressor(epsilon=1.0, delta=1e-6, y_bound=3.0, n_iter=20,
                               noise_multiplier=None, random_state=0, ledger=h),
    lambda h: DPSGDRegressor(epsilon=1.0, delta=1e-6, n_iter=20, random_state=0, ledger=h),
    lambda h: DPSGDClassifier(epsilon=1.0, delta=1e-6, n_iter=20, classes=[0, 1],
                              random_state=0, ledger=h),
]


@pytest.mark.parametrize("make", LINEAR)
def test_fit_spends_its_mechanism(make, data, ledger):
    X, y = data
    if isinstance(make(None), DPSGDClassifier):
        y = (y > 0).astype(int)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = make(ledger.budget("d")).fit(X, y)
    reserve, settle = [e for e in ledger.history("d") if e.kind != "budget"]
    assert (reserve.kind, settle.kind, settle.ref) == ("reserve", "settle", reserve.seq)
    assert reserve.mechanism == settle.mechanism == est.mechanism_
    assert reserve.label == type(est).__name__
    assert ledger.pending("d") == []
    assert ledger.spent("d").epsilon_spent == est.mechanism_.epsilon(1e-5)


@pytest.mark.parametrize("make", LINEAR)
def test_over_budget_fit_is_refused_before_reading_the_data(make, tmp_path):
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=0.5, delta=1e-5)
    est = make(led.budget("d"))
    assert planned_mechanism(est, np.zeros((300, 3)), None).epsilon(1e-5) > 0.5
    with pytest.raises(BudgetExceededError):
        est.fit(Untouchable(300), np.zeros(300))
    assert not hasattr(est, "mechanism_")
    assert led.spent("d").entries == 0


def test_an_over_budget_refusal_says_what_lowers_the_cost(tmp_path):
    """The refusal names what to lower: an estimator's epsilon; a search's expected runs,
    candidates' epsilons and score epsilon (its cost is not one fit's)."""
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=0.5, delta=1e-5)
    X, y = np.zeros((300, 3)), np.zeros(300)
    with pytest.raises(BudgetExceededError, match="smaller epsilon") as err:
        SSPRegressor(epsilon=1.0, delta=1e-6, y_bound=3.0, ledger=led.budget("d")).fit(X, y)
    assert "spent('d')" in str(err.value)
    search = PrivateSearchCV(SSPRegressor(delta=1e-7, y_bound=3.0),
                             {"epsilon": [0.2, 0.4]}, loss_bound=9.0, delta=1e-6,
                             ledger=led.budget("d"))
    with pytest.raises(BudgetExceededError, match="expected_runs") as err:
        search.fit(Untouchable(300), y)
    assert "score_epsilon" in str(err.value)
    assert led.spent("d").entries == 0


def test_label_releases_spend_each_call(ledger):
    rng = np.random.default_rng(0)
    p = PATE(epsilon=1.0, delta=1e-6, random_state=0, ledger=ledger.budget("d"))
    p.release(rng.integers(0, 3, size=(20, 40)), 3, n_teachers=20)
    p.release(rng.integers(0, 3, size=(20, 40)), 3, n_teachers=20)
    spends = [e.mechanism for e in ledger.history("d") if e.kind == "settle"]
    assert len(spends) == 2 and compose(spends) == p.mechanism_
    X = rng.uniform(size=(200, 2))
    knn = PrivateKNN(n_neighbors=5, epsilon=0.5, delta=1e-6, classes=[0, 1], random_state=0,
                     ledger=ledger.budget("d")).fit(X, (X[:, 0] > 0.5).astype(int))
    knn.release(X[:10])
    last = ledger.history("d")[-1]
    assert last.kind == "settle" and last.mechanism == knn.last_mechanism_
    assert last.label == "PrivateKNN.release"
    over = PATE(epsilon=5.0, delta=1e-6, random_state=0, ledger=ledger.budget("d"))
    before = ledger.history("d")
    with pytest.raises(BudgetExceededError):
        over.release(rng.integers(0, 3, size=(20, 40)), 3, n_teachers=20)
    assert ledger.history("d") == before and not hasattr(over, "labels_")


def test_a_shape_mistake_is_refused_before_the_reservation(data, ledger):
    """Lengths that differ are a mistake of the data's public shape: refused before
    anything is reserved, so the ledger records nothing."""
    X, y = data
    est = AdaSSPRegressor(epsilon=1.0, delta=1e-6, y_bound=3.0, ledger=ledger.budget("d"))
    with pytest.raises(ValueError, match="inconsistent numbers of samples"):
        est.fit(X, y[:10])
    assert [e.kind for e in ledger.history("d")] == ["budget"]


def test_invalid_values_after_the_reservation_are_charged_in_full(data, ledger):
    """A NaN is a refusal of one record's value, after the reservation: the plan is
    charged in full, so the ledger reads as for a fit that ran (a reservation settled as
    "nothing ran" would tell its readers that the data held a NaN)."""
    X, y = data
    X = X.copy()
    X[3, 0] = np.nan
    est = AdaSSPRegressor(epsilon=1.0, delta=1e-6, y_bound=3.0, ledger=ledger.budget("d"))
    with pytest.raises(ValueError, match="NaN") as e:
        est.fit(X, y)
    assert any("charged in full" in note for note in e.value.__notes__)
    plan = est.planned_mechanism(X, y)
    assert [(k.kind, k.mechanism) for k in ledger.history("d")[1:]] == [
        ("reserve", plan), ("settle", plan)]
    assert ledger.pending("d") == [] and not hasattr(est, "coef_")


def test_plain_grid_search_records_every_fit(data, tmp_path):
    """scikit-learn's GridSearchCV over an estimator with a ledger: every fit (candidates
    x folds + the refit) is spent, so the ledger holds the search's real cost."""
    X, y = data
    led = Ledger(tmp_path / "g.db", create=True)
    led.create_budget("d", epsilon=50.0, delta=1e-5)
    est = AdaSSPRegressor(epsilon=0.5, delta=1e-7, y_bound=3.0, random_state=0,
                          ledger=led.budget("d"))
    assert clone(est).ledger is est.ledger
    gs = GridSearchCV(est, {"regularization": ["ridge", "eigenvalue_floor"]}, cv=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gs.fit(X, y)
    n_fits = 2 * 3 + 1
    s = led.spent("d")
    assert s.entries == n_fits and s.pending == 0
    assert s.epsilon_spent == compose(gs.best_estimator_.mechanism_, steps=n_fits).epsilon(1e-5)
    assert s.epsilon_spent > 2 * gs.best_estimator_.epsilon_


# ----------------------------------------------------------------------------------
# privacy units: an estimator's guarantee is per record
# ----------------------------------------------------------------------------------
def _public_estimator_classes():
    return [getattr(M, n) for n in M.__all__
            if inspect.isclass(getattr(M, n)) and issubclass(getattr(M, n), PrivateEstimator)
            and getattr(M, n) is not PrivateEstimator]


def _knn_release(h):
    X = np.random.default_rng(0).uniform(size=(50, 3))
    knn = PrivateKNN(n_neighbors=3, epsilon=0.5, delta=1e-6, classes=[0, 1], ledger=h)
    knn.fit(X, (X[:, 0] > 0.5).astype(int))  # stores the data; spends nothing
    return knn, lambda: knn.release(X[:5])


#: one spending call per estimator: ``make(handle) -> (estimator, call)``; the data of
#: the fits cannot be read (the refusal comes before the data check).
SPENDS = {
    "SSPRegressor": lambda h: (e := SSPRegressor(y_bound=3.0, ledger=h),
                               lambda: e.fit(Untouchable(300), np.zeros(300))),
    "AdaSSPRegressor": lambda h: (e := AdaSSPRegressor(y_bound=3.0, ledger=h),
                                  lambda: e.fit(Untouchable(300), np.zeros(300))),
    "NoisyGDRegressor": lambda h: (e := NoisyGDRegressor(y_bound=3.0, n_iter=5, ledger=h),
                                   lambda: e.fit(Untouchable(300), np.zeros(300))),
    "DPSGDRegressor": lambda h: (e := DPSGDRegressor(n_iter=5, ledger=h),
                                 lambda: e.fit(Untouchable(300), np.zeros(300))),
    "DPSGDClassifier": lambda h: (e := DPSGDClassifier(n_iter=5, classes=[0, 1], ledger=h),
                                  lambda: e.fit(Untouchable(300), np.zeros(300, dtype=int))),
    "PrivateStandardScaler": lambda h: (e := PrivateStandardScaler(
        feature_range=(-1, 1), ledger=h), lambda: e.fit(Untouchable(300))),
    "PrivateSearchCV": lambda h: (e := PrivateSearchCV(
        SSPRegressor(y_bound=3.0), {"epsilon": [0.5, 1.0]}, loss_bound=10.0, ledger=h),
        lambda: e.fit(Untouchable(300), np.zeros(300))),
    "PATE": lambda h: (e := PATE(epsilon=1.0, delta=1e-6, ledger=h),
                       lambda: e.release(np.zeros((20, 40), dtype=int), 3, n_teachers=20)),
    "PrivateKNN": _knn_release,
}


def test_every_estimator_has_a_unit_check_below():
    assert {c.__name__ for c in _public_estimator_classes()} == set(SPENDS)


@pytest.mark.parametrize("name", sorted(SPENDS))
@pytest.mark.parametrize("unit", ["user", "patient"])
def test_estimators_refuse_a_budget_per_another_unit_than_the_record(name, unit, tmp_path):
    """An estimator counts every row as one record: a per-user budget would be charged
    the per-record epsilon, a fraction of the per-user one."""
    led = Ledger(tmp_path / "u.db", create=True)
    led.create_budget("people", epsilon=100.0, delta=1e-5, privacy_unit=unit)
    est, spend = SPENDS[name](led.budget("people", privacy_unit=unit))
    fitted = {k for k in vars(est) if k.endswith("_")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(LedgerConflictError,
                           match=f"per '{unit}' but {name} gives a guarantee per 'record'"
                                 ".*per-record budget.*make_private"):
            spend()
    assert led.history("people", privacy_unit=unit)[-1].kind == "budget"
    assert {k for k in vars(est) if k.endswith("_")} == fitted  # nothing (new) fitted


def test_the_torch_engine_and_the_estimators_share_one_unit_rule():
    """Both spend paths call privlearn.ledger.check_privacy_unit (one rule, not copies)."""
    import privlearn.ledger as ledger_pkg
    import privlearn.models.base as base

    assert base.check_privacy_unit is ledger_pkg.check_privacy_unit
    torch_accountant = pytest.importorskip("privlearn.torch.accountant")
    assert torch_accountant.check_privacy_unit is ledger_pkg.check_privacy_unit


def test_a_fitted_model_loads_where_its_ledger_is_not(tmp_path, monkeypatch):
    # a fitted estimator keeps its ledger= handle, and its pickle is a release: whoever
    # receives it (without the ledger file) can load it and predict; only a spend fails,
    # with the path and what to do
    import pickle

    from privlearn.errors import LedgerNotFoundError

    X = np.random.default_rng(0).uniform(-1, 1, (200, 3)) / np.sqrt(3)
    y = X @ np.array([1.0, -1.0, 0.5])
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    with Ledger("privacy.db", create=True) as led:  # a relative path, as in the tutorials
        led.create_budget("d", epsilon=5.0, delta=1e-6)
        est = M.AdaSSPRegressor(epsilon=1.0, delta=1e-7, y_bound=2.0, random_state=0,
                                ledger=led.budget("d")).fit(X, y)
        blob = pickle.dumps(est)
    monkeypatch.chdir(tmp_path)
    project.rename(tmp_path / "moved")  # the recipient has no ledger at the path
    loaded = pickle.loads(blob)
    np.testing.assert_array_equal(loaded.predict(X), est.predict(X))
    assert loaded.epsilon_ == est.epsilon_
    with pytest.raises(LedgerNotFoundError, match="privacy.db.*set_params"):
        loaded.fit(X, y)
    assert not project.exists()  # no empty ledger (or folder) created in its place
    np.testing.assert_array_equal(loaded.predict(X), est.predict(X))  # fit left it as it was
    loaded.ledger.ledger.close()
    (tmp_path / "moved").rename(project)  # where the ledger is, the same pickle spends
    again = pickle.loads(blob)
    again.fit(X, y)
    with Ledger(project / "privacy.db") as led:
        assert led.spent("d").entries == 2
    again.ledger.ledger.close()


def test_a_fitted_model_refuses_another_ledger_at_its_ledgers_path(tmp_path):
    # the pickle of a model fitted with ledger= loaded where another ledger sits at the
    # same path (another machine, another user's project): it loads and predicts, but
    # neither reads nor spends that ledger (whose budget never counted the first fit)
    import pickle

    from privlearn.errors import LedgerNotFoundError

    X = np.random.default_rng(0).uniform(-1, 1, (200, 3)) / np.sqrt(3)
    y = X @ np.array([1.0, -1.0, 0.5])
    path = tmp_path / "privacy.db"
    with Ledger(path, create=True) as led:
        led.create_budget("d", epsilon=5.0, delta=1e-6)
        est = M.AdaSSPRegressor(epsilon=1.0, delta=1e-7, y_bound=2.0, random_state=0,
                                ledger=led.budget("d")).fit(X, y)
        blob = pickle.dumps(est)
    path.rename(tmp_path / "first.db")
    with Ledger(path, create=True) as other:  # same path, same budget name
        other.create_budget("d", epsilon=5.0, delta=1e-6)
        head = other.head()
    loaded = pickle.loads(blob)
    np.testing.assert_array_equal(loaded.predict(X), est.predict(X))
    with pytest.raises(LedgerNotFoundError, match="not the one this handle was pickled"):
        loaded.fit(X, y)
    with pytest.raises(LedgerNotFoundError) as info:
        loaded.ledger.spent()
    assert info.value.reason == "other_ledger" and info.value.path == str(path)
    with Ledger(path) as other:
        assert other.head() == head and other.verify().ok  # nothing written
    again = pickle.loads(pickle.dumps(loaded))  # pickled again there: still refused
    with pytest.raises(LedgerNotFoundError, match="not the one this handle was pickled"):
        again.ledger.spent()
    loaded.ledger.ledger.close()
    path.rename(tmp_path / "other.db")
    (tmp_path / "first.db").rename(path)  # its own ledger, grown since: the pickle spends
    with Ledger(path) as led:
        led.spend("d", Gaussian(50.0))
    again = pickle.loads(blob)
    again.fit(X, y)
    with Ledger(path) as led:
        assert led.spent("d").entries == 3
    again.ledger.ledger.close()
