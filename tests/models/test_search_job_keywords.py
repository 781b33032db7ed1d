"""PrivateSearchCV(..., n_jobs=-1) and PrivateSearchCV(..., refit=True): scikit-learn's
searches take these keywords and data scientists pass them out of habit. They were a
bare ``TypeError`` ("unexpected keyword argument"); they are a typed refusal naming the
keyword, the value received and what the private search does instead. The signature,
which get_params reads, is unchanged."""

import pytest

from privlearn.errors import ParameterTypeError
from privlearn.models import DPSGDClassifier, PrivateSearchCV


def _estimator():
    return DPSGDClassifier(delta=1e-7, classes=[0, 1], n_iter=5)


@pytest.mark.parametrize(
    "keyword, value, says",
    [("n_jobs", -1, "expected_runs"), ("refit", True, "best_estimator_")],
)
def test_job_keywords_say_what_the_search_does(keyword, value, says):
    with pytest.raises(ParameterTypeError, match=rf"takes no {keyword}= \(got {keyword}=") as err:
        PrivateSearchCV(_estimator(), {"epsilon": [0.5, 1.0]}, **{keyword: value})
    assert says in str(err.value)
