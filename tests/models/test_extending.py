"""The estimator recipe of docs/guides/extending.md ("A new estimator") is the test: its
code block is extracted from the page and executed, and the class it defines passes
scikit-learn's check suite, spends on a ledger before reading the data, and draws noise of
the calibrated scale."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from sentinels import Untouchable
from sklearn.utils.estimator_checks import parametrize_with_checks

from privlearn.accounting import Gaussian
from privlearn.errors import BudgetExceededError
from privlearn.ledger import Ledger
from privlearn.models import PrivateEstimator

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "extending.md"


def _recipe_block() -> str:
    text = GUIDE.read_text()
    section = text.split("\n## A new estimator\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    return next(b for b in blocks if "class " in b and "PrivateEstimator" in b)


def _recipe_class() -> type:
    """Run the block as the body of a module (so that its class pickles)."""
    module = types.ModuleType("privlearn_extending_recipe")
    sys.modules[module.__name__] = module
    exec(compile(_recipe_block(), str(GUIDE), "exec"), module.__dict__)
    classes = [v for v in vars(module).values() if isinstance(v, type)
               and issubclass(v, PrivateEstimator) and v is not PrivateEstimator]
    assert len(classes) == 1, classes
    return classes[0]


Recipe = _recipe_class()


def test_the_recipe_is_on_the_base():
    assert issubclass(Recipe, PrivateEstimator)
    assert set(Recipe._parameter_constraints) >= {"epsilon", "delta", "random_state", "ledger"}


@parametrize_with_checks([Recipe(random_state=0)], xfail_strict=True)
def test_recipe_is_sklearn_compatible(estimator, check):
    check(estimator)


def test_recipe_budgets_a_fit_on_a_ledger(tmp_path):
    X = np.random.default_rng(0).normal(0.2, 0.1, size=(1000, 3))
    led = Ledger(tmp_path / "l.db", create=True)
    led.create_budget("d", epsilon=1.0, delta=1e-5)
    est = Recipe(epsilon=1.0, delta=1e-6, ledger=led.budget("d")).fit(X)
    reserve, settle = [e for e in led.history("d") if e.kind != "budget"]
    assert (reserve.kind, settle.kind, settle.ref) == ("reserve", "settle", reserve.seq)
    assert reserve.mechanism == settle.mechanism == est.mechanism_
    assert led.spent("d").epsilon_spent == est.mechanism_.epsilon(1e-5)
    # closed form: one Gaussian, calibrated to (1, 1e-6) and never above it
    assert isinstance(est.mechanism_, Gaussian)
    assert est.epsilon_ == est.mechanism_.epsilon(1e-6) <= 1.0
    assert Gaussian(est.mechanism_.noise_multiplier * 0.99).epsilon(1e-6) > 1.0
    # a second fit would exceed the budget: refused before the data is read
    again = Recipe(epsilon=1.0, delta=1e-6, ledger=led.budget("d"))
    with pytest.raises(BudgetExceededError):
        again.fit(Untouchable(1000))
    assert not hasattr(again, "mean_") and len(led.history("d")) == 3


def test_recipe_noise_has_the_calibrated_scale():
    """The released mean's spread matches the calibrated Gaussian: the sum of clipped
    rows gets std ``sigma sqrt(2) bound`` per coordinate, so with n rows the mean's std
    is about ``sigma sqrt(2) bound / n`` (the count's noise is negligible at n=2000).
    Each fit is seeded: with fresh entropy the std of 400 draws leaves 15% in 4e-5 of the
    runs."""
    X = np.random.default_rng(1).normal(0.0, 0.05, size=(2000, 2))
    means = np.array([Recipe(epsilon=1.0, delta=1e-6, random_state=k).fit(X).mean_
                      for k in range(400)])
    sigma = Recipe(epsilon=1.0, delta=1e-6).planned_mechanism(X).noise_multiplier
    expected = sigma * np.sqrt(2.0) / 2000
    assert np.std(means - X.mean(0), axis=0) == pytest.approx([expected] * 2, rel=0.15)
