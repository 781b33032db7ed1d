"""A binary classifier given three classes says where multi-class models are.

``DPSGDClassifier`` is binary logistic regression. A data scientist used to
scikit-learn's (and diffprivlib's) multinomial ``LogisticRegression`` passes
``classes=[0, 1, 2]`` or a three-class ``y``; the refusal used to suggest
``classes=[0, 1]`` (dropping a class) or nothing at all. It names the library's
multi-class paths instead, and those paths accept the label set.
"""

from __future__ import annotations

import numpy as np
import pytest

from privlearn.errors import ParameterValueError
from privlearn.models import PATE, DPSGDClassifier, PrivateKNN

X = np.random.default_rng(0).random((60, 3))
Y3 = np.arange(60) % 3


def _assert_names_the_multiclass_paths(message: str) -> None:
    assert "binary" in message, message
    assert "privlearn.torch.make_private" in message, message
    assert "PrivateKNN" in message and "PATE" in message, message
    assert "e.g. classes=[0, 1]" not in message, message


@pytest.mark.parametrize(
    "classes, y",
    [([0, 1, 2], Y3), (range(10), Y3), (None, Y3), ([0, 1], Y3)],
    ids=["three-classes", "range-10", "inferred", "y-outside-the-pair"],
)
def test_more_than_two_classes_names_the_multiclass_paths(classes, y) -> None:
    with pytest.raises(ParameterValueError) as err:
        DPSGDClassifier(epsilon=1.0, classes=classes).fit(X, y)
    _assert_names_the_multiclass_paths(str(err.value))


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
