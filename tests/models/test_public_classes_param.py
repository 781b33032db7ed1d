"""A classifier's public ``classes`` is checked with its other parameters, before the
data is read: a NaN or infinite label (which no ``y`` can hold), a repeated label and
labels of different kinds (numbers and strings) are refused with a typed error naming
``classes``."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from privlearn.errors import ParameterTypeError, ParameterValueError
from privlearn.models import DPSGDClassifier, PrivateKNN

ESTIMATORS = [lambda cl: DPSGDClassifier(classes=cl, n_iter=2), lambda cl: PrivateKNN(classes=cl)]
IDS = ["DPSGDClassifier", "PrivateKNN"]


class _Unreadable:
    """Data that fails the test if anything reads it."""

    shape = (10, 2)

    def __array__(self, *args, **kwargs):
        raise AssertionError("the data was read before classes was checked")

    def __len__(self):
        raise AssertionError("the data was read before classes was checked")


@pytest.mark.parametrize("make", ESTIMATORS, ids=IDS)
@pytest.mark.parametrize(
    "classes, why",
    [
        ([0, math.nan], "NaN"),
        ([math.nan, 1], "NaN"),
        ([0, math.inf], "infinite"),
        ([1, 1], "more than once"),
        ([1, 1.0], "more than once"),
        # np.asarray made them the strings ["0", "a"]: refused after the ledger, blaming y
        ([0, "a"], "one kind"),
        ([0, None], "one kind"),  # PrivateKNN's sort raised a bare TypeError
        ([b"a", "b"], "one kind"),
    ],
)
def test_bad_public_classes_refused_before_data_is_read(make, classes, why):
    est = make(classes)
    with pytest.raises(ParameterValueError, match="classes") as info:
        est.fit(_Unreadable(), _Unreadable())
    assert why in str(info.value) and repr(classes) in str(info.value)
    assert not isinstance(info.value, TypeError)
    assert not hasattr(est, "classes_")


@pytest.mark.parametrize("make", ESTIMATORS, ids=IDS)
def test_non_sequence_classes_refused_typed(make):
    with pytest.raises(ParameterTypeError, match="classes"):
        make(3).fit(_Unreadable(), _Unreadable())


@pytest.mark.parametrize("make", ESTIMATORS, ids=IDS)
def test_valid_public_classes_still_fit(make):
    rng = np.random.default_rng(0)
    X, y = rng.random((20, 2)), np.r_[np.zeros(10), np.ones(10)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = make([0, 1]).fit(X, y)
    assert est.classes_.tolist() == [0, 1]


def test_classifier_needs_at_least_two_classes():
    with pytest.raises(ParameterValueError, match="classes.*at least 2"):
        DPSGDClassifier(classes=[0]).fit(_Unreadable(), _Unreadable())
