"""Private hyperparameter search: its epsilon covers every fit it ran."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn.model_selection import ParameterGrid

from privlearn.accounting import Laplace, compose
from privlearn.errors import BudgetExceededError
from privlearn.ledger import Ledger
from privlearn.models import AdaSSPRegressor
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
    every = compose([compose([m, Laplace(1 / 0.2)]) for m in s.fit_mechanisms_])
    assert s.mechanism_ == every
    assert s.epsilon_ == every.epsilon(1e-6)
    # covers each fit, and more than any single one
    assert s.epsilon_ > max(m.epsilon(1e-6) for m in s.fit_mechanisms_)


@pytest.mark.parametrize("eta", [0.0, 1.0])
def test_random_stopping_epsilon_covers_every_run(data, eta):
    X, y = data
    planned = {planned_mechanism(_est().set_params(**p), X, y)
               for p in ParameterGrid(GRID)}
    single = max(compose([m, Laplace(10.0)]).epsilon(1e-6, "rdp") for m in planned)
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
                 Laplace(10.0)])
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


def test_public_validation_scores_cost_nothing(data):
    X, y = data
    s = PrivateSearchCV(_est(), GRID, method="composition",
                        random_state=0).fit(X, y, X_val=X[:100], y_val=y[:100])
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
