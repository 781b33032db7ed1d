"""from_dp_event reads the integer fields of dp_accounting events given as NumPy
integers (as dp_accounting itself does), and refuses malformed ones with typed errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from privlearn.accounting import Gaussian, MatrixMechanism, subsample
from privlearn.accounting.rdp import rdp_epsilon
from privlearn.compat.dp_events import from_dp_event
from privlearn.errors import ParameterTypeError, ParameterValueError

E = pytest.importorskip("dp_accounting.dp_event")


@pytest.mark.parametrize("counts", [np.int64(5), [np.int64(3), np.int64(7)], np.array([3, 7])])
def test_tree_step_counts_as_numpy_integers(counts) -> None:
    event = E.SingleEpochTreeAggregationDpEvent(1.3, counts)
    m = from_dp_event(event)
    depth = math.ceil(math.log2(int(np.max(counts)) + 1))
    assert isinstance(m, MatrixMechanism)
    assert m.sensitivity >= math.sqrt(depth)
    # the curve of dp_accounting's RDP accountant for this event: alpha depth / (2 s^2)
    orders = np.array([1.5, 2.0, 8.0, 64.0])
    expected = orders * depth / (2 * 1.3**2)
    assert np.all(rdp_epsilon(m, orders) >= expected * (1 - 1e-12))
    assert np.all(rdp_epsilon(m, orders) <= expected * (1 + 1e-9))


def test_sampling_without_replacement_sizes_as_numpy_integers() -> None:
    event = E.SampledWithoutReplacementDpEvent(np.int64(1000), np.int64(10), E.GaussianDpEvent(1.0))
    m = from_dp_event(event)
    assert m == subsample(Gaussian(1.0), 10 / 1000, scheme="fixed", neighbouring="replace_one")


@pytest.mark.parametrize(
    "event,error",
    [
        (lambda: E.SingleEpochTreeAggregationDpEvent(1.0, 2.5), ParameterTypeError),
        (lambda: E.SingleEpochTreeAggregationDpEvent(1.0, [3, 2.5]), ParameterValueError),
        (lambda: E.SingleEpochTreeAggregationDpEvent(1.0, [True]), ParameterValueError),
        (
            lambda: E.SampledWithoutReplacementDpEvent(100, 2.0, E.GaussianDpEvent(1.0)),
            ParameterValueError,
        ),
    ],
)
def test_malformed_integer_fields_are_refused_with_typed_errors(event, error) -> None:
    with pytest.raises(error):
        from_dp_event(event())


@pytest.mark.parametrize("relation", [["REPLACE_ONE"], {"add_remove"}, 3])
def test_unknown_neighboring_relation_is_a_typed_error(relation) -> None:
    with pytest.raises(ParameterValueError, match="neighboring_relation"):
        from_dp_event(E.GaussianDpEvent(1.0), relation)
