"""Private hyperparameter search: its epsilon covers every fit it ran."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from sklearn.model_selection import ParameterGrid

from privlearn.accounting import Laplace, compose
from privlearn.errors import (
    BudgetExceededError,
    ConfigurationError,
    NonFiniteInputError,
    ParameterTypeError,
    ParameterValueError,
)
from privlearn.ledger import Ledger
from privlearn.models import (
    PATE,
    AdaSSPRegressor,
    DPSGDClassifier,
    PrivateKNN,
    PrivatePipeline,
    PrivateStandardScaler,
)
from privlearn.models.model_selection import PrivateSearchCV, planned_mechanism

FITS: list[dict] = []


class CountingAdaSSP(AdaSSPRegressor):
    """AdaSSP that records every fit (i.e. every read of the private data)."""

    def fit(self, X, y):
        FITS.append(self.get_params())
        return super().fit(X, y)


GRID = {"regularization": ["ridge", "eigenvalue_floor"], "budget_split": [None, (1, 1, 1)],
        "matrix_noise": ["frobenius", "upper_triangle"]}


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(2000, 4))
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    y = np.clip(X @ [1.0, -2.0, 0.5, 0.0] + 0.1 * rng.normal(size=2000), -3, 3)
    return X, y


def _est():
    return CountingAdaSSP(epsilon=0.5, delta=1e-7, x_bound=1.0, y_bound=3.0,
                          fit_intercept=False)


def test_composition_epsilon_is_the_composition_of_every_fit_and_score(data):
    X, y = data
    FITS.clear()
    s = PrivateSearchCV(_est(), GRID, method="composition", loss_bound=36.0,
                        score_epsilon=0.2, delta=1e-6, random_state=0).fit(X, y)
    assert len(FITS) == s.n_fits_ == 8 == len(s.fit_mechanisms_) == len(s.scores_)
    every = compose([compose([m, compose(Laplace(2 / 0.2), steps=2)]) for m in s.fit_mechanisms_])
    assert s.mechanism_ == every
    assert s.epsilon_ == every.epsilon(1e-6)
    # covers each fit, and more than any single one
    assert s.epsilon_ > max(m.epsilon(1e-6) for m in s.fit_mechanisms_)


@pytest.mark.parametrize("eta", [0.0, 1.0])
def test_random_stopping_epsilon_covers_every_run(data, eta):
    X, y = data
    planned = {planned_mechanism(_est().set_params(**p), X, y)
               for p in ParameterGrid(GRID)}
    score = compose(Laplace(20.0), steps=2)
    single = max(compose([m, score]).epsilon(1e-6, "rdp") for m in planned)
    counts = []
    for seed in range(5):
        FITS.clear()
        s = PrivateSearchCV(_est(), GRID, eta=eta, loss_bound=36.0, delta=1e-6,
                            random_state=seed).fit(X, y)
        counts.append(len(FITS))
        assert len(FITS) >= 1
        # every fit that ran was a candidate whose run is inside the accounted base Q
        ran = {planned_mechanism(_est().set_params(**{k: p[k] for k in GRID}), X, y)
               for p in FITS}
        assert ran <= planned
        assert s.epsilon_ > single  # covers one run's cost and the selection on top
        assert s.best_params_ in [{k: p[k] for k in GRID} for p in FITS]
        # nothing on the object reveals how many runs there were
        for attr in ("n_fits_", "runs_", "scores_", "fit_mechanisms_"):
            assert not hasattr(s, attr)
    # the number of runs is random (Papernot & Steinke's guarantee needs it hidden)
    assert len(set(counts)) > 1


def test_random_stopping_bound_against_a_naive_evaluation(data):
    """Papernot & Steinke (2022), Theorem 2 with the geometric distribution (eta = 1,
    E[K] = 1/gamma), evaluated by brute force (dense lambda_hat grid). Renyi divergence is
    non-decreasing in the order, so the bound at ``lam`` is the minimum of the theorem's
    value over orders ``>= lam``; the tabulated curve must lie between that envelope and
    the theorem's value at ``lam`` itself."""
    X, y = data
    s = PrivateSearchCV(_est(), {"regularization": ["ridge"]}, expected_runs=5.0,
                        loss_bound=36.0, delta=1e-6, random_state=0).fit(X, y)
    q = compose([planned_mechanism(_est().set_params(regularization="ridge"), X, y),
                 compose(Laplace(20.0), steps=2)])
    gamma = 1 / 5.0
    lh = np.geomspace(1.001, 1e4, 4000)
    c = min(2 * ((1 - 1 / h) * q.rdp(h) + math.log(1 / gamma) / h) for h in lh)

    def theorem(lam):
        return q.rdp(lam) + c + math.log(5.0) / (lam - 1)

    for lam in (2.0, 8.0, 32.0):
        envelope = min(theorem(a) for a in np.linspace(lam, 600.0, 3000))
        got = s.mechanism_.rdp(lam)
        assert envelope * (1 - 1e-2) <= got <= theorem(lam) * (1 + 1e-2)
    assert s.epsilon_ > q.epsilon(1e-6, "rdp")


def test_more_expected_runs_cost_more(data):
    X, y = data
    e = [PrivateSearchCV(_est(), GRID, expected_runs=k, loss_bound=36.0,
                         random_state=0).fit(X, y).epsilon_ for k in (2, 8, 32)]
    assert e[0] < e[1] < e[2]


def test_search_spends_on_the_ledger_before_reading_data(data, tmp_path):
    X, y = data
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=1.0, delta=1e-6)
    FITS.clear()
    with pytest.raises(BudgetExceededError):
        PrivateSearchCV(_est(), GRID, method="composition", loss_bound=36.0,
                        ledger=led.budget("d")).fit(X, y)
    assert FITS == [] and led.spent("d").entries == 0
    led2 = Ledger(tmp_path / "l2.db", create=True)
    led2.create_budget("d", epsilon=5.0, delta=1e-6)
    s = PrivateSearchCV(_est(), GRID, method="composition", loss_bound=36.0,
                        ledger=led2.budget("d")).fit(X, y)
    assert led2.mechanism("d") == compose([s.mechanism_])


def test_a_candidate_without_predict_is_refused_before_the_data_is_read(data, tmp_path):
    """A scaler has nothing to score: refused while planning, nothing charged (it used
    to fit the first run, then fail on ``predict`` with the search's budget spent)."""
    X, y = data
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=50.0, delta=1e-5)
    search = PrivateSearchCV(PrivateStandardScaler(feature_range=(-1, 1)),
                             {"quantile": [None, 0.01]}, method="composition",
                             loss_bound=1.0, ledger=led.budget("d"))
    with pytest.raises(ParameterTypeError, match=r"PrivateStandardScaler has no predict"):
        search.fit(X, y)
    assert led.spent("d").entries == 0


def test_public_validation_scores_cost_nothing(data):
    X, y = data
    s = PrivateSearchCV(_est(), GRID, method="composition",
                        random_state=0).fit(X[100:], y[100:], X_val=X[:100], y_val=y[:100])
    assert s.mechanism_ == compose(s.fit_mechanisms_)


def test_bad_parameters(data):
    X, y = data
    with pytest.raises(ValueError, match="loss_bound"):
        PrivateSearchCV(_est(), GRID).fit(X, y)
    with pytest.raises(ValueError, match="method"):
        PrivateSearchCV(_est(), GRID, method="bayes", loss_bound=1.0).fit(X, y)
    with pytest.raises(ValueError, match="eta"):
        PrivateSearchCV(_est(), GRID, eta=-0.5, loss_bound=1.0).fit(X, y)


def test_one_expected_run(data):
    X, y = data
    FITS.clear()
    s = PrivateSearchCV(_est(), {"regularization": ["ridge"]}, loss_bound=36.0,
                        random_state=0).fit(X, y)
    assert len(FITS) == 1 and s.epsilon_ > 0


# -- pipelines, ledgers and the released model ------------------------------------------------

def _pipe(**scaler):
    from privlearn.models import PrivatePipeline, PrivateStandardScaler

    return PrivatePipeline([
        ("scale", PrivateStandardScaler(epsilon=0.5, delta=1e-7, feature_range=(-2, 2),
                                        **scaler)),
        ("model", AdaSSPRegressor(epsilon=0.5, delta=1e-7, x_bound=3.0, y_bound=3.0)),
    ])


def test_a_pipeline_plans_the_composition_of_its_steps(data):
    X, y = data
    pipe = _pipe()
    steps = [planned_mechanism(s, X, y) for _, s in pipe.steps]
    assert planned_mechanism(pipe, X, y) == compose(steps)
    assert pipe.fit(X, y).mechanism_ == planned_mechanism(pipe, X, y)


def test_a_pipeline_step_without_a_planned_mechanism_is_refused(data):
    from sklearn.preprocessing import StandardScaler

    from privlearn.models import PrivatePipeline

    X, y = data
    pipe = PrivatePipeline([("scale", StandardScaler()), ("model", _est())])
    with pytest.raises(TypeError, match="'scale'.*PrivateStandardScaler"):
        planned_mechanism(pipe, X, y)


def test_search_over_a_pipeline_with_a_ledger_charges_the_search_once(data, tmp_path):
    X, y = data
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=20.0, delta=1e-5)
    led.create_budget("steps", epsilon=20.0, delta=1e-5)
    pipe = _pipe(ledger=led.budget("steps"))
    grid = {"scale__epsilon": [0.3, 0.6], "model__regularization": ["ridge", "eigenvalue_floor"]}
    s = PrivateSearchCV(pipe, grid, method="composition", loss_bound=9.0, score_epsilon=0.2,
                        ledger=led.budget("d")).fit(X, y)
    every = compose([compose([planned_mechanism(_pipe().set_params(**p), X, y),
                              compose(Laplace(2 / 0.2), steps=2)]) for p in ParameterGrid(grid)])
    assert s.mechanism_ == every and s.n_fits_ == 4
    assert led.mechanism("d") == compose([every])
    assert led.spent("steps").entries == 0  # the steps' own budget is not charged too
    assert s.best_estimator_.mechanism_ == planned_mechanism(
        _pipe().set_params(**s.best_params_), X, y)
    # a refit of the released pipeline spends on the search's budget
    assert s.best_estimator_.get_params()["scale__ledger"] is s.ledger


def test_pipeline_steps_get_hidden_noise_and_keep_their_declared_seed(data):
    X, y = data
    s = PrivateSearchCV(_pipe(random_state=7), {"scale__epsilon": [0.5]},
                        method="composition", loss_bound=9.0).fit(X, y)
    best = s.best_estimator_
    assert best.get_params()["scale__random_state"] == 7
    refit = _pipe(random_state=7).fit(X, y)  # the declared seed did not make its noise
    assert not np.allclose(best.named_steps["scale"].mean_, refit.named_steps["scale"].mean_)


def test_a_public_scikit_learn_step_keeps_its_seed_in_a_searched_pipeline(data):
    """The hidden child streams replace the private steps' seeds only: a scikit-learn
    step's ``random_state`` draws no privacy noise and its validation refuses a numpy
    Generator, which failed every run of the search (after the search was charged)."""
    from sklearn.random_projection import GaussianRandomProjection

    X, y = data
    pipe = PrivatePipeline([("rank", GaussianRandomProjection(3, random_state=3)),
                            ("ada", AdaSSPRegressor(epsilon=0.5, delta=1e-7, x_bound=2.0,
                                                    y_bound=3.0))],
                           public_steps=("rank",))
    s = PrivateSearchCV(pipe, {"ada__epsilon": [0.5, 1.0]}, method="composition",
                        loss_bound=9.0, random_state=0).fit(X, y)
    best = s.best_estimator_
    assert best.get_params()["rank__random_state"] == 3
    assert best.get_params()["ada__random_state"] is None
    assert s.mechanism_ == compose([compose([m, compose(Laplace(2.0 / 0.1), steps=2)])
                                    for m in s.fit_mechanisms_])


def test_random_stopping_on_a_default_pld_budget_is_charged_its_epsilon_delta(data, tmp_path):
    """The default budget composes with the PLD accountant, which cannot read Papernot &
    Steinke's RDP curve: the search is charged the curve's (epsilon, delta) guarantee."""
    from privlearn.accounting import ApproxDP

    X, y = data
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=10.0, delta=1e-5)  # accountant "pld", the default
    kw = dict(loss_bound=36.0, delta=1e-6, random_state=0)
    s = PrivateSearchCV(_est(), GRID, ledger=led.budget("d"), **kw).fit(X, y)
    curve = PrivateSearchCV(_est(), GRID, **kw).fit(X, y).mechanism_
    assert isinstance(s.mechanism_, ApproxDP)
    assert s.mechanism_.dp_delta < 1e-6
    assert s.mechanism_.dp_epsilon == curve.epsilon(s.mechanism_.dp_delta, "rdp")
    assert s.epsilon_ >= curve.epsilon(1e-6, "rdp")  # never below the RDP conversion
    assert led.mechanism("d") == compose([s.mechanism_])
    # the budget's delta (1e-5) buys back a little epsilon: the (epsilon, delta) pair's
    # profile is d0 + (1 - d0) (e^eps - e^t) / (1 + e^eps) below eps (closed form)
    e, d0 = s.mechanism_.dp_epsilon, s.mechanism_.dp_delta
    exact = math.log(math.exp(e) - (1e-5 - d0) * (1 + math.exp(e)) / (1 - d0))
    assert exact <= led.spent("d").epsilon_spent <= exact + 1e-3


def test_random_stopping_on_an_rdp_budget_is_charged_the_curve(data, tmp_path):
    X, y = data
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=10.0, delta=1e-5, accountant="rdp")
    s = PrivateSearchCV(_est(), GRID, loss_bound=36.0, ledger=led.budget("d")).fit(X, y)
    assert led.mechanism("d") == compose([s.mechanism_])
    assert s.mechanism_.rdp(8.0) > 0


def test_an_adaptive_budget_accounts_the_random_stopping_search_under_renyi_dp(data, tmp_path):
    """The random-stopping search's release is known by its RDP curve only (Papernot &
    Steinke 2022); an adaptive PLD budget, which refused it before any fit, now composes
    it under Renyi DP (and its filter reads the same curve): the ledger's total is that
    release's RDP epsilon at the budget's delta."""
    X, y = data
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=10.0, delta=1e-5, adaptive=True)
    FITS.clear()
    s = PrivateSearchCV(_est(), GRID, loss_bound=36.0, ledger=led.budget("d")).fit(X, y)
    assert FITS  # it ran
    spent = led.spent("d")
    assert spent.entries == 1
    assert spent.epsilon_spent == pytest.approx(s.mechanism_.epsilon(1e-5, "rdp"), rel=1e-9)
    assert spent.epsilon_spent >= s.mechanism_.epsilon(1e-5, "rdp")


def test_the_search_delegates_to_the_released_model_and_scores_like_sklearn(data):
    from privlearn.models import DPSGDClassifier, PrivatePipeline, PrivateStandardScaler

    X, y = data
    labels = (y > 0).astype(int)
    clf = PrivatePipeline([
        ("scale", PrivateStandardScaler(epsilon=0.5, delta=1e-7, feature_range=(-2, 2))),
        ("model", DPSGDClassifier(epsilon=1.0, delta=1e-7, n_iter=20, classes=[0, 1])),
    ])
    Xtr, ytr, Xte, yte = X[:1500], labels[:1500], X[1500:], labels[1500:]
    # seeded: the score's Laplace noise (scale 1 / (0.1 n)) exceeds the 20 scales allowed
    # below with probability e^-20 = 2e-9 per run of the search
    s = PrivateSearchCV(clf, {"model__learning_rate": [0.5, 1.0]}, random_state=0).fit(Xtr, ytr)
    best = s.best_estimator_
    np.testing.assert_array_equal(s.predict(Xte), best.predict(Xte))
    np.testing.assert_array_equal(s.predict_proba(Xte), best.predict_proba(Xte))
    np.testing.assert_array_equal(s.classes_, [0, 1])
    assert s.score(Xte, yte) == np.mean(best.predict(Xte) == yte)  # accuracy
    # best_score_: the noisy training accuracy, within a few noise scales of the exact one
    exact = np.mean(best.predict(Xtr) == ytr)
    assert abs(s.best_score_ - exact) < 20 * (1 / 0.1) / len(ytr)
    # with public validation data it is the exact score on it, the scale of score()
    p = PrivateSearchCV(clf, {"model__learning_rate": [0.5, 1.0]}, method="composition")
    p.fit(Xtr, ytr, X_val=Xte, y_val=yte)
    assert p.best_score_ == p.score(Xte, yte) == max(p.scores_)

    reg = PrivateSearchCV(_est(), {"regularization": ["ridge"]}, method="composition")
    reg.fit(X[:1500], y[:1500], X_val=X[1500:], y_val=y[1500:])
    assert not hasattr(reg, "predict_proba")
    mse = np.mean((reg.best_estimator_.predict(X[1500:]) - y[1500:]) ** 2)
    assert reg.score(X[1500:], y[1500:]) == pytest.approx(-mse) == reg.best_score_


@pytest.mark.parametrize("seed", range(4))
def test_best_score_stays_in_the_scores_range_whatever_the_noise(data, seed):
    X, y = data
    s = PrivateSearchCV(_est(), GRID, method="composition", loss_bound=36.0,
                        score_epsilon=1e-4, random_state=seed).fit(X, y)
    assert s.best_score_ <= 0.0 and all(v <= 0.0 for v in s.scores_)  # minus a mean square
    labels = (y > 0).astype(int)
    from privlearn.models import DPSGDClassifier

    c = PrivateSearchCV(DPSGDClassifier(n_iter=5, classes=[0, 1], delta=1e-7),
                        {"learning_rate": [0.5, 1.0]}, score_epsilon=1e-4,
                        random_state=seed).fit(X, labels)
    assert 0.0 <= c.best_score_ <= 1.0  # an accuracy


def test_random_stopping_on_a_budget_with_a_smaller_delta_is_charged_below_it(data, tmp_path):
    X, y = data
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=10.0, delta=1e-7)  # below the search's delta (1e-6)
    s = PrivateSearchCV(_est(), GRID, loss_bound=36.0, delta=1e-6,
                        ledger=led.budget("d")).fit(X, y)
    assert s.mechanism_.dp_delta < 1e-7
    spent = led.spent("d")
    # certified at the budget's delta, within the grid's precision of the charged epsilon
    assert spent.epsilon_spent == pytest.approx(s.mechanism_.dp_epsilon, abs=1e-3)


def _assert_charged_as_released(led, search, X, y):
    """A refused search recorded what its release would have (the planned search, in
    full) when the labels were refused, and nothing for a mistake of type."""
    assert led.pending("d") == [] and not hasattr(search, "best_estimator_")
    history = [e for e in led.history("d") if e.kind in ("reserve", "settle")]
    if y is not None and y.dtype.kind in "iu":  # a label outside classes: charged
        planned = search.planned_mechanism(X, np.where(y == 2, 0, y))
        assert [(e.kind, e.mechanism) for e in history] == [("reserve", planned),
                                                             ("settle", planned)]
    else:
        assert history == []

@pytest.mark.parametrize("estimator, y_of", [
    (lambda: AdaSSPRegressor(y_bound=3.0), lambda y: y.astype(str)),
    (lambda: AdaSSPRegressor(y_bound=3.0), lambda y: None),
    (lambda: DPSGDClassifier(n_iter=5, classes=[0, 1]), lambda y: np.where(y > 0, 1, 2)),
], ids=["string-target", "no-target", "label-outside-classes"])
def test_data_a_candidate_refuses_is_refused_before_the_search_runs(estimator, y_of, tmp_path):
    """The search runs every candidate's data checks before its release (a candidate used
    to refuse inside a run). A mistake of type (a regressor's target of strings) or a
    missing target is refused before the reservation and records nothing; a label
    outside ``classes`` depends on the values, so the reservation is charged in full,
    as a release would be (a cancelled entry would tell the ledger's readers that the
    data held such a label)."""
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=50.0, delta=1e-5)
    rng = np.random.default_rng(0)
    X = rng.uniform(-0.5, 0.5, size=(100, 2))
    search = PrivateSearchCV(estimator(), {"epsilon": [0.5, 1.0]}, loss_bound=9.0,
                             ledger=led.budget("d"), random_state=0)
    with pytest.raises(ValueError):
        search.fit(X, y_of(X[:, 0]))
    _assert_charged_as_released(led, search, X, y_of(X[:, 0]))



_X_VAL_REFUSALS = {
    "X_val-width": (lambda X, y: {"X_val": X[:50, :1], "y_val": y[:50]}, ParameterValueError,
                    "X_val has 1 features but X has 2"),
    "X_val-nan": (lambda X, y: {"X_val": np.full((50, 2), np.nan), "y_val": y[:50]},
                  NonFiniteInputError, "X_val"),
    "y_val-length": (lambda X, y: {"X_val": X[:50], "y_val": y[:10]}, ParameterValueError,
                     "inconsistent numbers of samples"),
    "y_val-alone": (lambda X, y: {"y_val": y[:50]}, ParameterValueError,
                    "give X_val with y_val"),
}


@pytest.mark.parametrize("case", sorted(_X_VAL_REFUSALS))
def test_validation_data_the_runs_cannot_be_scored_on_is_refused_before_the_ledger(
        case, tmp_path):
    """Public validation data is read only to score the runs, after every fit: data it
    cannot score on is refused (typed, naming it) before the search is reserved, not
    after all the fits were charged."""
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=50.0, delta=1e-5)
    rng = np.random.default_rng(0)
    X = rng.uniform(-0.5, 0.5, size=(100, 2))
    y = X[:, 0]
    val, error, match = _X_VAL_REFUSALS[case]
    search = PrivateSearchCV(AdaSSPRegressor(y_bound=3.0), {"epsilon": [0.5, 1.0]},
                             ledger=led.budget("d"), random_state=0)
    with pytest.raises(error, match=match):
        search.fit(X, y, **val(X, y))
    assert led.spent("d").entries == 0 and led.pending("d") == []
    assert not hasattr(search, "best_estimator_")


def test_validation_columns_other_than_the_training_columns_are_refused(tmp_path):
    pd = pytest.importorskip("pandas")
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=50.0, delta=1e-5)
    X = pd.DataFrame(np.random.default_rng(0).uniform(-0.5, 0.5, size=(100, 2)),
                     columns=["a", "b"])
    search = PrivateSearchCV(AdaSSPRegressor(y_bound=3.0), {"epsilon": [0.5, 1.0]},
                             ledger=led.budget("d"), random_state=0)
    with pytest.raises(ParameterValueError, match=r"X_val's columns \['b', 'a'\]"):
        search.fit(X, X["a"], X_val=X[["b", "a"]], y_val=X["a"])
    assert led.spent("d").entries == 0 and led.pending("d") == []


@pytest.mark.parametrize("estimator", [
    lambda: PrivateStandardScaler(feature_range=(-1, 1)),
    lambda: PrivateKNN(classes=[0, 1]),
    lambda: PATE(),
], ids=["scaler", "knn", "pate"])
def test_an_estimator_without_predict_is_refused_before_the_ledger(estimator, tmp_path):
    """The search scores every run by its predictions: an estimator without ``predict``
    is refused (typed) before anything is reserved, not with an AttributeError after
    the fits were charged."""
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=50.0, delta=1e-5)
    X = np.random.default_rng(0).uniform(-0.5, 0.5, size=(100, 2))
    search = PrivateSearchCV(estimator(), {"epsilon": [0.5, 1.0]}, loss_bound=1.0,
                             ledger=led.budget("d"))
    with pytest.raises(ParameterTypeError, match="has no predict"):
        search.fit(X, (X[:, 0] > 0).astype(int))
    assert led.spent("d").entries == 0 and led.pending("d") == []


@pytest.mark.parametrize("estimator, grid, error, match", [
    (_est, {"epsilonn": [1.0]}, ParameterValueError, "param_grid.*'epsilonn'"),
    (_est, {"epsilon": 1.0}, ParameterTypeError, "param_grid must be a dict"),
    (_est, {"epsilon": []}, ParameterValueError, "param_grid must be a dict"),
    (_est, "epsilon", ParameterTypeError, "param_grid must be a dict"),
    (lambda: AdaSSPRegressor, {"epsilon": [1.0]}, ParameterTypeError,
     "estimator must be an estimator instance"),
], ids=["unknown-key", "scalar-value", "empty-values", "not-a-dict", "a-class"])
def test_a_malformed_grid_or_estimator_is_typed(data, estimator, grid, error, match):
    """scikit-learn's ParameterGrid / set_params / clone refusals, as privlearn's typed
    errors naming the search's parameter."""
    X, y = data
    with pytest.raises(error, match=match):
        PrivateSearchCV(estimator(), grid, loss_bound=9.0).fit(X, y)


def test_a_candidate_s_ledger_is_not_dropped_by_a_search_without_one(data, tmp_path):
    """The search charges its whole cost on its own ledger and none of the candidates':
    without one, a searched estimator (or pipeline step) bound to a budget would fit
    and release with nothing charged. Refused before any fit; with the budget passed
    to the search, it is charged."""
    X, y = data
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=50.0, delta=1e-5)
    FITS.clear()
    for est, grid in ((CountingAdaSSP(y_bound=3.0, ledger=led.budget("d")),
                       {"epsilon": [0.5, 1.0]}),
                      (_pipe(ledger=led.budget("d")), {"scale__epsilon": [0.5, 1.0]})):
        with pytest.raises(ConfigurationError, match="ledger=<that budget>"):
            PrivateSearchCV(est, grid, loss_bound=9.0).fit(X, y)
    with pytest.raises(ConfigurationError):
        PrivateSearchCV(_est(), {"ledger": [led.budget("d")]}, loss_bound=9.0).fit(X, y)
    assert FITS == [] and led.spent("d").entries == 0
    s = PrivateSearchCV(CountingAdaSSP(y_bound=3.0, ledger=led.budget("d")),
                        {"epsilon": [0.5, 1.0]}, loss_bound=9.0, method="composition",
                        ledger=led.budget("d")).fit(X, y)
    assert len(FITS) == 2 and led.mechanism("d") == compose([s.mechanism_])


def _pipe_of(model):
    from privlearn.models import PrivatePipeline

    return PrivatePipeline([("scale", PrivateStandardScaler(feature_range=(-1, 1))),
                            ("model", model)])


@pytest.mark.parametrize("estimator, y_of", [
    (lambda: _pipe_of(AdaSSPRegressor(y_bound=3.0)), lambda y: y.astype(str)),
    (lambda: _pipe_of(AdaSSPRegressor(y_bound=3.0)), lambda y: None),
    (lambda: _pipe_of(DPSGDClassifier(n_iter=5, classes=[0, 1])),
     lambda y: np.where(y > 0, 1, 2)),
], ids=["string-target", "no-target", "label-outside-classes"])
def test_data_a_pipeline_step_refuses_is_refused_before_the_search_runs(estimator, y_of,
                                                                         tmp_path):
    """As for an estimator: a pipeline candidate's steps check the data before the
    search's release (they used to refuse inside a run); a refusal of the values is
    charged in full, one of the type or a missing target records nothing."""
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=50.0, delta=1e-5)
    X = np.random.default_rng(0).uniform(-0.5, 0.5, size=(100, 2))
    search = PrivateSearchCV(estimator(), {"model__epsilon": [0.5, 1.0]}, loss_bound=9.0,
                             ledger=led.budget("d"), random_state=0)
    with pytest.raises(ValueError):
        search.fit(X, y_of(X[:, 0]))
    _assert_charged_as_released(led, search, X, y_of(X[:, 0]))


# -- verbose: a progress bar over the runs, counts and times only ---------------------------
@pytest.mark.parametrize("method", ["composition", "random_stopping"])
def test_verbose_shows_a_progress_bar_of_the_runs_and_changes_nothing(data, capfd, method):
    import re

    from sklearn.base import clone

    X, y = data
    kw = dict(method=method, loss_bound=36.0, score_epsilon=0.2, random_state=3)
    FITS.clear()
    quiet = PrivateSearchCV(_est(), GRID, **kw).fit(X, y)
    n_quiet = len(FITS)
    out, err = capfd.readouterr()
    assert out == err == ""  # verbose=0 (the default) writes nothing
    FITS.clear()
    loud = clone(PrivateSearchCV(_est(), GRID, verbose=1, **kw))  # a parameter: cloned
    assert loud.get_params()["verbose"] == 1
    loud.fit(X, y)
    out, err = capfd.readouterr()
    assert out == ""
    # the bar counts the fits that ran (K for random stopping) on stderr, and says nothing
    # about their scores
    assert re.search(rf"PrivateSearchCV: 100%.*\b{len(FITS)}/{len(FITS)}\b", err), err
    assert len(FITS) == n_quiet
    assert all(f"{v:.3f}" not in err for v in getattr(loud, "scores_", []) + [loud.best_score_])
    # the same search, the same release
    assert loud.best_params_ == quiet.best_params_ and loud.best_score_ == quiet.best_score_
    np.testing.assert_array_equal(loud.best_estimator_.coef_, quiet.best_estimator_.coef_)
    assert loud.mechanism_ == quiet.mechanism_ and loud.epsilon_ == quiet.epsilon_


def test_verbose_is_validated_naming_the_parameter(data):
    from privlearn.errors import ParameterTypeError, ParameterValueError

    X, y = data
    for bad, err in ((-1, ParameterValueError), (1.5, ParameterTypeError),
                     ("yes", ParameterTypeError)):
        s = PrivateSearchCV(_est(), GRID, verbose=bad)
        with pytest.raises(err, match="verbose"):
            s.fit(X, y)
        assert not hasattr(s, "best_estimator_")
    assert PrivateSearchCV(_est(), GRID, verbose=True)._validate_params()["verbose"] == 1


def _clipping_pipe():
    from privlearn.models import PrivatePipeline

    # labels in [-3, 3] clipped to [-1, 1]: the same count in every run (rows are not
    # clipped, whatever the scaler's noise)
    return PrivatePipeline([
        ("scale", PrivateStandardScaler(epsilon=0.5, delta=1e-7, feature_range=(-2, 2))),
        ("model", AdaSSPRegressor(epsilon=0.5, delta=1e-7, x_bound=1e3, y_bound=1.0)),
    ])


def _clipping_warnings(fit) -> list[str]:
    """The DataClippedWarnings a user sees under Python's default filter."""
    from privlearn.models import DataClippedWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        fit()
    return [str(w.message) for w in caught if issubclass(w.category, DataClippedWarning)]


@pytest.mark.parametrize("search", [False, True])
def test_a_clipping_is_reported_once_per_fit_of_a_pipeline_or_a_search(data, search):
    """Under Python's default filter a user sees the clipping once per fit, not once
    per run of the search (nor again for the checks made before the first run)."""
    X, y = data
    n_labels = int(np.count_nonzero(np.abs(y) > 1.0))
    grid = {"scale__epsilon": [0.3, 0.6], "model__regularization": ["ridge", "eigenvalue_floor"]}
    est = (PrivateSearchCV(_clipping_pipe(), grid, method="composition", loss_bound=9.0)
           if search else _clipping_pipe())
    seen = _clipping_warnings(lambda: est.fit(X, y))
    assert len(seen) == 1 and f"and {n_labels} labels" in seen[0], seen
    if search:
        assert est.n_fits_ == 4


def test_the_search_has_its_estimator_s_type_as_grid_search_cv():
    """scikit-learn reads a meta-estimator's type from its tags (``GridSearchCV`` takes
    its estimator's): a classifier search is stratified by ``cross_val_score`` and
    scored by accuracy, a regressor search by R^2."""
    from sklearn.base import is_classifier, is_regressor

    clf = PrivateSearchCV(DPSGDClassifier(classes=[0, 1]), {"epsilon": [1.0]})
    reg = PrivateSearchCV(_est(), {"epsilon": [1.0]}, loss_bound=9.0)
    assert is_classifier(clf) and not is_regressor(clf)
    assert is_regressor(reg) and not is_classifier(reg)


@pytest.mark.parametrize("method", ["composition", "random_stopping"])
def test_losses_clipped_by_the_private_score_are_reported_to_the_person_fitting(data, method):
    """The private score clips each record's loss to loss_bound (a declared bound, as the
    linear models' x_bound): the person fitting is told how many (the largest count of a
    run; naive count of the released run's losses here, one candidate), nothing stored;
    silent when no loss exceeds it, and with public validation data (nothing clipped)."""
    from privlearn.errors import DataClippedWarning

    X, y = data
    kw = dict(method=method, delta=1e-6, random_state=0)  # one candidate: E[K] = 1
    grid = {"epsilon": [1.0]}
    with pytest.warns(DataClippedWarning, match="loss_bound=0.05") as record:
        s = PrivateSearchCV(_est(), grid, loss_bound=0.05, **kw).fit(X, y)
    n_over = int(np.sum((s.best_estimator_.predict(X) - y) ** 2 > 0.05))
    assert 0 < n_over < len(y)
    (w,) = [r for r in record if issubclass(r.category, DataClippedWarning)]
    assert f"up to {n_over} of {len(y)} records" in str(w.message)
    assert w.filename == __file__
    assert n_over not in [v for v in vars(s).values() if isinstance(v, int)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DataClippedWarning)
        PrivateSearchCV(_est(), grid, loss_bound=1e6, **kw).fit(X, y)
        PrivateSearchCV(_est(), grid, **kw).fit(X[50:], y[50:], X_val=X[:50], y_val=y[:50])


def test_the_private_training_data_as_validation_data_is_refused_before_any_fit(data):
    """X_val must be public: the training X itself (the same array, a view of its rows, or
    an equal copy) would have every run scored exactly on the private data, the selection
    uncovered by epsilon_. Refused before any fit; a held-out part of the same base array
    (disjoint rows) is fine."""
    X_all, y_all = data
    X, y = X_all[:1500], y_all[:1500]
    kw = dict(method="composition", delta=1e-6, random_state=0)
    FITS.clear()
    for X_val, y_val in ((X, y), (X[:200], y[:200]), (X.copy(), y.copy())):
        with pytest.raises(ParameterValueError, match="X_val is the private training data"):
            PrivateSearchCV(_est(), {"epsilon": [1.0]}, **kw).fit(X, y, X_val=X_val,
                                                                  y_val=y_val)
    assert FITS == []
    s = PrivateSearchCV(_est(), {"epsilon": [1.0]}, **kw).fit(X, y, X_val=X_all[1500:],
                                                              y_val=y_all[1500:])
    assert len(FITS) == 1 and hasattr(s, "best_estimator_")


def test_expected_runs_with_composition_is_refused_naming_it(data, tmp_path):
    """``expected_runs`` sizes random stopping only; with ``method="composition"`` (every
    candidate fitted) it was ignored without a word. Refused before any fit or charge."""
    X, y = data
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=100.0, delta=1e-5)
    FITS.clear()
    search = PrivateSearchCV(_est(), GRID, method="composition", expected_runs=3.0,
                             loss_bound=36.0, ledger=led.budget("d"))
    with pytest.raises(ConfigurationError, match=r"expected_runs=3\.0.*random_stopping"):
        search.fit(X, y)
    assert FITS == [] and led.budget("d").spent().entries == 0


@pytest.mark.parametrize("method", ["composition", "random_stopping"])
def test_the_search_plans_its_cost_from_X_alone(data, method):
    # a budget is planned before the labels are loaded: the plan reads no label, so
    # planned_mechanism(X) must not ask for y (it was refused with y=None)
    X, y = data
    grid = {"regularization": ["ridge", "eigenvalue_floor"]}
    s = PrivateSearchCV(_est(), grid, method=method, loss_bound=36.0, score_epsilon=0.2,
                        delta=1e-6, random_state=0)
    without = s.planned_mechanism(X)
    assert without == planned_mechanism(s, X) == s.planned_mechanism(X, y)
    assert s.fit(X, y).mechanism_ == without  # what the fit then records
    clf = PrivateSearchCV(DPSGDClassifier(epsilon=1.0, delta=1e-6, n_iter=5),
                          {"max_grad_norm": [0.5, 1.0]}, delta=1e-6)
    assert clf.planned_mechanism(X) == clf.planned_mechanism(X, (y > 0).astype(int))
    with pytest.raises(ParameterValueError, match="needs y"):  # fitting still needs y
        clf.fit(X, None)
