"""feature_range given as a dict by column name (what a DataFrame user writes) is refused,
as before, by a ParameterValueError; the message now says the dict is not read by name
and how to pass its rows in the order of the columns. The suggested fix works."""

import numpy as np
import pytest

from privlearn.errors import ParameterValueError
from privlearn.models import PrivateStandardScaler

RANGES = {"age": (0.0, 120.0), "income": (0.0, 15.0), "rooms": (0.0, 20.0)}


def test_dict_feature_range_says_how_to_order_it():
    X = np.random.default_rng(0).random((100, 3))
    scaler = PrivateStandardScaler(epsilon=1.0, delta=1e-6, feature_range=RANGES)
    with pytest.raises(ParameterValueError, match=r"feature_range must be") as err:
        scaler.fit(X)
    message = str(err.value)
    assert "a dict is not read by column name" in message
    assert "[ranges[c] for c in X.columns]" in message
    assert "(3, 2)" in message  # the shape expected


def test_the_suggested_rows_are_accepted():
    X = np.random.default_rng(0).random((100, 3))
    rows = [RANGES[c] for c in ["age", "income", "rooms"]]
    scaler = PrivateStandardScaler(epsilon=1.0, delta=1e-6, feature_range=rows, random_state=0).fit(
        X
    )
    assert scaler.mean_.shape == (3,)
