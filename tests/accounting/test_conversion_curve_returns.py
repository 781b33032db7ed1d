"""What ``rdp_to_epsilon`` / ``rdp_to_delta`` / ``rdp_to_epsilon_and_order`` do with the
values a user's RDP function returns.

A constant curve written as ``lambda a: c`` (one number for every order) is the same
curve as its vectorised spelling ``lambda a: np.full(np.shape(a), c)`` and must give the
same answer; a function that is not vectorised, one returning ``None``, or one returning
the wrong number of values is a typed error naming ``rdp_fn`` (never an IndexError or a
bare NumPy error). A NaN value is "no guarantee" (``inf``), so the answer is the
conservative one.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from privlearn.accounting.conversion import (
    rdp_to_delta,
    rdp_to_epsilon,
    rdp_to_epsilon_and_order,
)
from privlearn.errors import ParameterTypeError, ParameterValueError


def _eps(fn):
    return rdp_to_epsilon(fn, 1e-5)


def _eps_order(fn):
    return rdp_to_epsilon_and_order(fn, 1e-5)[0]


def _delta(fn):
    return rdp_to_delta(fn, 0.5)


_QUERIES = [_eps, _eps_order, _delta]


@pytest.mark.parametrize("query", _QUERIES)
@pytest.mark.parametrize("c", [1e-6, 0.3, 1.0, 40.0])
def test_a_constant_curve_returned_as_one_number(query, c: float) -> None:
    vectorised = query(lambda a: np.full(np.shape(a), c))
    assert query(lambda a: c) == vectorised
    assert query(lambda a: [c]) == vectorised
    assert query(lambda a: np.float64(c)) == vectorised


@pytest.mark.parametrize("query", _QUERIES)
def test_a_nan_curve_is_no_guarantee(query) -> None:
    value = query(lambda a: math.nan)
    assert value == (1.0 if query is _delta else math.inf)


@pytest.mark.parametrize("query", _QUERIES)
def test_a_function_of_one_order_is_a_typed_error(query) -> None:
    with pytest.raises(ParameterTypeError, match="rdp_fn must be vectorised"):
        query(lambda a: math.exp(a) / 1e10)


@pytest.mark.parametrize("query", _QUERIES)
def test_none_is_a_typed_error(query) -> None:
    with pytest.raises(ParameterTypeError, match="rdp_fn returned None"):
        query(lambda a: None)


@pytest.mark.parametrize("query", _QUERIES)
def test_the_wrong_number_of_values_is_a_typed_error(query) -> None:
    with pytest.raises(ParameterValueError, match="one value per order"):
        query(lambda a: np.array([1.0, 2.0]))
