"""PrivatePipeline(..., ledger=...) and PrivatePipeline(..., epsilon=...): every private
estimator takes these keywords, the pipeline does not (its steps do). The refusal is a
typed error that names the keyword, the value received and where it goes, and the
pipeline's signature, which scikit-learn's get_params reads, is unchanged."""

import inspect

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.preprocessing import Normalizer

from privlearn.errors import ParameterTypeError
from privlearn.ledger import Ledger
from privlearn.models import AdaSSPRegressor, PrivatePipeline


def _steps():
    return [
        ("rows", Normalizer()),
        (
            "regression",
            AdaSSPRegressor(epsilon=0.5, delta=1e-7, x_bound=1.0, y_bound=1.0, random_state=0),
        ),
    ]


def test_ledger_keyword_says_to_give_it_to_the_steps(tmp_path):
    ledger = Ledger(tmp_path / "p.db", create=True)
    ledger.create_budget("d", epsilon=1.0, delta=1e-5)
    budget = ledger.budget("d")
    with pytest.raises(ParameterTypeError, match=r"takes no ledger=") as err:
        PrivatePipeline(_steps(), ledger=budget)
    message = str(err.value)
    assert "AdaSSPRegressor(..., ledger=budget)" in message  # where it goes
    assert "got ledger=" in message  # the value received


def test_epsilon_keyword_says_to_split_it_between_the_steps():
    with pytest.raises(ParameterTypeError, match=r"takes no epsilon= \(got epsilon=1\.0\)") as err:
        PrivatePipeline(_steps(), epsilon=1.0, delta=1e-6)
    assert "split your target between the steps" in str(err.value)


def test_signature_and_other_keywords_are_unchanged():
    params = inspect.signature(PrivatePipeline.__init__).parameters
    assert "ledger" not in params and "epsilon" not in params
    assert {"steps", "delta", "public_steps", "accountant"} <= set(params)
    with pytest.raises(TypeError, match="no_such_keyword"):
        PrivatePipeline(_steps(), no_such_keyword=1)
    pipe = PrivatePipeline(_steps(), delta=1e-6)
    assert clone(pipe).get_params()["delta"] == 1e-6
    rng = np.random.default_rng(0)
    X, y = rng.random((200, 3)), rng.random(200)
    assert clone(pipe).fit(X, y).epsilon_ <= 0.5 + 1e-12
