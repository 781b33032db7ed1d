"""PATE as a pipeline step is refused saying what to do.

``PATE`` has no ``fit`` (it releases labels from the votes of teachers the caller
trained): as a ``PrivatePipeline`` step its fit raised a bare ``AttributeError`` ("type
object 'PATE' has no attribute 'fit'"), and the pipeline's ``planned_mechanism`` read the
training data as teacher votes ("teacher_outputs of shape (200, 2) is ambiguous").
"""

from __future__ import annotations

import numpy as np
import pytest

from privlearn.errors import ParameterTypeError
from privlearn.models import PATE, PrivatePipeline, PrivateStandardScaler

X = np.random.default_rng(0).normal(size=(50, 2)) / 3.0
Y = (X[:, 0] > 0).astype(int)


def _pipe():
    return PrivatePipeline(
        [("scale", PrivateStandardScaler(feature_range=(-2, 2))), ("pate", PATE())]
    )


CALLS = {
    "fit": lambda: _pipe().fit(X, Y),
    "planned_mechanism": lambda: _pipe().planned_mechanism(X),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_pate_is_refused_as_a_step_naming_release(call):
    assert not hasattr(PATE, "fit")  # the premise
    with pytest.raises(ParameterTypeError, match=r"\(PATE\) cannot be a step") as info:
        CALLS[call]()
    assert "release(teacher_outputs" in str(info.value)
