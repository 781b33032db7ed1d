"""Planning helpers: steps per epoch and the large-delta warning refuse bad input with a
typed error naming the parameter, the valid range and the value received."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from privlearn.accounting import steps_per_epoch, warn_if_delta_large
from privlearn.errors import ParameterTypeError, ParameterValueError, PrivacyLeakWarning


@pytest.mark.parametrize("delta, n, name", [
    (-1e-5, 100, "delta"), (math.nan, 100, "delta"), (1.5, 100, "delta"), ("1e-5", 100, "delta"),
    (None, 100, "delta"), (1e-5, math.nan, "n"), (1e-5, math.inf, "n"), (1e-5, -1, "n"),
    (1e-5, 10.7, "n"), (1e-5, "100", "n"), (1e-5, None, "n")])
def test_warn_if_delta_large_refuses_bad_input(delta, n, name):
    with pytest.raises((ParameterTypeError, ParameterValueError), match=rf"^{name}\b.*got"):
        warn_if_delta_large(delta, n)


def test_warn_if_delta_large_names_the_callers_parameter():
    with pytest.raises(ParameterValueError, match=r"^target_delta must be in \[0, 1\], got 2"):
        warn_if_delta_large(2.0, 100, name="target_delta")


@pytest.mark.parametrize("n", [10, np.int64(10), 10.0])
def test_warn_if_delta_large_warns_at_one_over_n(n):
    with pytest.warns(PrivacyLeakWarning, match="1/n"):
        warn_if_delta_large(0.1, n)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_delta_large(0.099, n)


def test_steps_per_epoch_refuses_a_rate_whose_inverse_overflows():
    assert steps_per_epoch(1e-300) == round(1 / 1e-300)
    with pytest.raises(ParameterValueError, match=r"^sampling_rate .*got 1e-320"):
        steps_per_epoch(1e-320)
