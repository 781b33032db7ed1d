"""PrivatePipeline's ``steps`` parameter: stored as given (scikit-learn convention, so
``clone`` and ``get_params`` work), refused with a typed error when fitted or planned."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.base import clone

from privlearn.errors import ParameterTypeError, ParameterValueError
from privlearn.models import PrivatePipeline, PrivateStandardScaler

X = np.zeros((8, 2))


def test_empty_steps_constructs_and_clones():
    pipe = PrivatePipeline([])
    assert clone(pipe).get_params()["steps"] == []


@pytest.mark.parametrize("call", ["fit", "planned_mechanism"])
def test_empty_steps_refused_typed_naming_steps(call):
    pipe = PrivatePipeline([])
    with pytest.raises(ParameterValueError, match=r"steps.*non-empty.*got \[\]") as info:
        getattr(pipe, call)(X)
    assert "PrivateStandardScaler" in str(info.value)  # what to pass instead


@pytest.mark.parametrize(
    "steps",
    [None, "scale", [("scale",)], [PrivateStandardScaler()], [(1, PrivateStandardScaler())]],
)
def test_malformed_steps_refused_typed(steps):
    with pytest.raises(ParameterTypeError, match="steps"):
        PrivatePipeline(steps).fit(X)


def test_valid_steps_still_fit():
    pipe = PrivatePipeline(
        [("scale", PrivateStandardScaler(epsilon=1.0, feature_range=(0.0, 1.0)))]
    )
    pipe.fit(X)
    assert pipe.epsilon_ > 0
