"""Cross-validation splits that list a training row more than once are refused.

scikit-learn's cross-validation functions and searches fit each copy of the estimator on
``X[train]`` for the training indices of a split, and accept any ``cv`` iterable of
``(train, test)`` indices: a bootstrap split (rows drawn with replacement, the ".632
bootstrap" validation) lists a record several times. That record then enters one fit as
often as it is listed, and the fit's noise, calibrated to one record counted once, no
longer covers it (the case of ``BaggingRegressor(bootstrap=True)``, refused already).
These fits ran, each returned copy claiming ``epsilon_ = epsilon`` and the ledger
charged as for distinct rows.
"""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.feature_selection import RFECV
from sklearn.model_selection import (
    GridSearchCV,
    KFold,
    TunedThresholdClassifierCV,
    cross_val_predict,
    cross_validate,
    learning_curve,
    permutation_test_score,
)

from privlearn.errors import ParameterValueError
from privlearn.ledger import Ledger
from privlearn.models import DPSGDClassifier, SSPRegressor

N = 120
RNG = np.random.default_rng(0)
X = RNG.uniform(-1.0, 1.0, size=(N, 3)) / np.sqrt(3.0)  # rows of norm <= 1
Y = X @ [0.3, -0.2, 0.1]
Y_CLF = (Y > 0).astype(int)


def _bootstrap_splits(n_splits: int = 2, seed: int = 0):
    """Training rows drawn with replacement, the rows never drawn as the test set."""
    rng = np.random.default_rng(seed)
    splits = []
    for _ in range(n_splits):
        train = rng.integers(0, N, size=N)
        splits.append((train, np.setdiff1d(np.arange(N), train)))
    return splits


SPLITS = _bootstrap_splits()
MOST = max(int(np.bincount(train).max()) for train, _ in SPLITS)


def _ssp(ledger=None):
    return SSPRegressor(epsilon=1.0, delta=1e-5, ledger=ledger)


CALLS = {
    "cross_validate": lambda cv, led: cross_validate(
        _ssp(led), X, Y, cv=cv, error_score="raise", return_estimator=True
    ),
    "cross_val_predict": lambda cv, led: cross_val_predict(
        _ssp(led), X, Y, cv=[(cv[0][0], np.arange(N))]
    ),
    "learning_curve": lambda cv, led: learning_curve(
        _ssp(led), X, Y, cv=cv, train_sizes=[1.0], error_score="raise"
    ),
    "permutation_test_score": lambda cv, led: permutation_test_score(
        _ssp(led), X, Y, cv=cv, n_permutations=1, random_state=0
    ),
    "GridSearchCV": lambda cv, led: GridSearchCV(
        _ssp(led), {"epsilon": [1.0]}, cv=cv, error_score="raise"
    ).fit(X, Y),
    "RFECV": lambda cv, led: RFECV(_ssp(led), cv=cv).fit(X, Y),
    "TunedThresholdClassifierCV": lambda cv, led: TunedThresholdClassifierCV(
        DPSGDClassifier(n_iter=5, classes=[0, 1], ledger=led), cv=cv
    ).fit(X, Y_CLF),
}


def test_a_bootstrap_split_lists_rows_several_times():
    """The premise, counted naively: one record listed ``k`` times moves the training
    set's ``X^T X`` by ``k x x^T``, ``k`` times the sensitivity SSP is calibrated to."""
    train = SPLITS[0][0]
    r = int(np.argmax(np.bincount(train)))
    k = int(np.sum(train == r))
    assert MOST >= k >= 2
    Xt = X[train]
    without = Xt[train != r]
    moved = np.linalg.norm(Xt.T @ Xt - without.T @ without)
    assert moved == pytest.approx(k * np.linalg.norm(X[r]) ** 2)


@pytest.mark.filterwarnings("ignore::privlearn.errors.PrivacyLeakWarning")
@pytest.mark.parametrize("call", list(CALLS))
def test_a_split_with_repeated_rows_is_refused_before_the_ledger_is_charged(call, tmp_path):
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=50.0, delta=1e-3)
    with pytest.raises((ParameterValueError, ValueError)) as info:
        CALLS[call](SPLITS, led.budget("d"))
    # directly, or in the details of scikit-learn's "fits failed" error
    assert "lists a row up to" in str(info.value)
    # TunedThresholdClassifierCV first refits on every row (each once): that fit stands
    assert led.spent("d").entries == (1 if call == "TunedThresholdClassifierCV" else 0)


@pytest.mark.parametrize("call", ["cross_validate", "GridSearchCV", "RFECV"])
def test_splits_without_repeated_rows_still_fit_and_charge_every_fit(call, tmp_path):
    """KFold, and rows drawn without replacement given as an explicit split."""
    rng = np.random.default_rng(1)
    train = rng.choice(N, size=N // 2, replace=False)
    for i, cv in enumerate((KFold(3), [(train, np.setdiff1d(np.arange(N), train))])):
        led = Ledger(tmp_path / f"l{i}.db", create=True)
        led.create_budget("d", epsilon=50.0, delta=1e-3)
        CALLS[call](cv, led.budget("d"))
        assert led.spent("d").entries >= (3 if i == 0 else 1)
