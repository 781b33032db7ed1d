"""A classifier given three classes fits them, or says how to.

``DPSGDClassifier`` fits binary logistic regression for two public classes and
multinomial (softmax) logistic regression for three or more, as a data scientist used
to scikit-learn's (and diffprivlib's) ``LogisticRegression`` expects. A third label in
``y`` outside a public pair ``classes=[0, 1]`` is refused with scikit-learn's binary
message and says to pass the whole label set (never to drop a class).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from privlearn.errors import ParameterValueError
from privlearn.models import PATE, DPSGDClassifier, PrivateKNN

X = np.random.default_rng(0).random((60, 3))
Y3 = np.arange(60) % 3


@pytest.mark.parametrize(
    "classes, k",
    [([0, 1, 2], 3), (range(10), 10), (None, 3)],
    ids=["three-classes", "range-10", "inferred"],
)
def test_more_than_two_classes_fit_a_multinomial_model(classes, k) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clf = DPSGDClassifier(epsilon=1.0, n_iter=5, classes=classes,
                              random_state=0).fit(X, Y3)
    assert clf.classes_.tolist() == list(range(k))
    assert clf.coef_.shape == (k, 3) and clf.intercept_.shape == (k,)
    assert clf.decision_function(X).shape == (60, k)


def test_y_outside_the_public_pair_says_to_pass_every_class() -> None:
    with pytest.raises(ParameterValueError) as err:
        DPSGDClassifier(epsilon=1.0, classes=[0, 1]).fit(X, Y3)
    message = str(err.value)
    assert "Only binary classification is supported" in message, message
    assert "classes=[0, 1, 2]" in message, message


def test_the_named_paths_take_three_classes() -> None:
    """PrivateKNN takes classes=, PATE takes n_classes= in release (it has no classes)."""
    knn = PrivateKNN(n_neighbors=5, sampling_rate=0.5, classes=[0, 1, 2]).fit(X, Y3)
    assert set(knn.release(X[:4])) <= {0, 1, 2}
    votes = np.arange(80).reshape(20, 4) % 3  # 20 teachers' labels for 4 queries
    labels = PATE(epsilon=1.0).release(votes, n_classes=3, n_teachers=20)
    assert set(labels) <= {0, 1, 2}


def test_two_labels_of_a_wrong_pair_keep_the_pair_hint() -> None:
    with pytest.raises(ParameterValueError) as err:
        DPSGDClassifier(epsilon=1.0, classes=[0]).fit(X, Y3 % 2)
    assert "e.g. classes=[0, 1]" in str(err.value)


def test_one_vs_rest_warning_names_pates_own_parameter() -> None:
    """PATE has no classes= (its release takes n_classes=): the warning says so."""
    from sklearn.multiclass import OneVsRestClassifier

    from privlearn.errors import PrivacyLeakWarning

    ovr = OneVsRestClassifier(DPSGDClassifier(epsilon=1.0, classes=[0, 1], n_iter=5))
    with pytest.warns(PrivacyLeakWarning) as record:
        ovr.fit(X, Y3)
    message = " ".join(str(w.message) for w in record)
    assert "n_classes=" in message and "PrivateKNN(classes=" in message, message
    assert "DPSGDClassifier(classes=" in message, message
