"""PrivateSearchCV(..., cv=...) and PrivateSearchCV(..., scoring=...): GridSearchCV takes
these keywords, the private search does not (it scores each run once, with noise). The
refusal is a typed error naming the keyword and the value received, and saying how the
search scores instead; the signature, which get_params reads, is unchanged."""

import inspect

import numpy as np
import pytest
from sklearn.base import clone

from privlearn.errors import ParameterTypeError
from privlearn.models import AdaSSPRegressor, PrivateSearchCV


def _estimator():
    return AdaSSPRegressor(delta=1e-7, x_bound=2.0, y_bound=1.0)


@pytest.mark.parametrize("keyword, value", [("cv", 5), ("scoring", "r2")])
def test_fold_keywords_say_how_the_search_scores(keyword, value):
    with pytest.raises(ParameterTypeError, match=rf"takes no {keyword}= \(got {keyword}=") as err:
        PrivateSearchCV(_estimator(), {"epsilon": [0.5, 1.0]}, loss_bound=4.0, **{keyword: value})
    message = str(err.value)
    assert "does not cross-validate" in message
    assert "X_val=" in message and "search.score" in message


def test_search_signature_and_fit_are_unchanged():
    params = inspect.signature(PrivateSearchCV.__init__).parameters
    assert "cv" not in params and "scoring" not in params
    assert {"estimator", "param_grid", "score_epsilon", "loss_bound"} <= set(params)
    search = PrivateSearchCV(_estimator(), {"epsilon": [0.5, 1.0]}, loss_bound=4.0, random_state=0)
    assert clone(search).get_params()["loss_bound"] == 4.0
    rng = np.random.default_rng(0)
    X, y = rng.random((300, 3)), rng.random(300)
    assert np.isfinite(clone(search).fit(X, y).epsilon_)
