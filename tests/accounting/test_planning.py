"""Planning helpers: steps per epoch and the large-delta warning refuse bad input with a
typed error naming the parameter, the valid range and the value received."""

from __future__ import annotations

import math
import warnings

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import assume, given, settings

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


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 10**9), st.integers(1, 10**6), st.integers(1, 64))
def test_steps_per_epoch_is_round_n_over_b_exactly(n, b, c):
    """Batches of ``b`` of ``n`` examples (rate ``b c / n`` in ``c`` groups) run
    ``round(n / b)`` steps an epoch, ties to even as Python's exact rounding: the float
    ``c / q`` used to land either side of an exact tie (n = 49, b = 2: 25, not 24)."""
    from fractions import Fraction

    q = b * c / n
    assume(q <= 1)
    assert steps_per_epoch(q, c) == max(1, round(Fraction(n, b)))


@pytest.mark.parametrize("n,b,c", [(49, 2, 1), (49, 2, 2), (51, 2, 7), (98, 4, 1)])
def test_steps_per_epoch_at_a_tie(n, b, c):
    assert steps_per_epoch(b * c / n, c) == round(n / b)  # 24, 26, 24: half to even
