"""Every built-in accountant checks its query (the delta of ``epsilon``, the epsilon of
``delta``) at the public boundary: a NaN, out-of-range or non-numeric query is refused
with a typed error naming it -- never answered (the PLD accountant answered a NaN delta
with epsilon 0) -- and a NumPy scalar is read as its float."""

from __future__ import annotations

import math

import numpy as np
import pytest

from privlearn.accounting.accountants import BUILTIN_ACCOUNTANTS
from privlearn.accounting.mechanisms import (
    Composed,
    Gaussian,
    Laplace,
    Sampling,
    get_accountant,
    subsample,
)
from privlearn.errors import ParameterTypeError, ParameterValueError

MECHANISMS = {
    "gaussian x3": Composed(((Gaussian(1.0), 3),)),
    "poisson": Composed(((subsample(Gaussian(1.0), 0.01), 20),)),
    "fixed size": Composed(((subsample(Gaussian(1.0), 0.01, scheme=Sampling.FIXED), 20),)),
    "laplace": Laplace(1.0),
}
BAD_DELTAS = ["x", -1.0, math.nan, 2.0, np.array([1e-5, 1e-6])]
BAD_EPSILONS = ["x", -1.0, math.nan, np.array([1.0, 2.0])]


def _answers(name, mechanism):
    """Whether ``name`` answers for ``mechanism`` at all (the analytic accountant is
    exact for Gaussians only and refuses the rest: nothing to check there)."""
    try:
        get_accountant(name).epsilon(mechanism, 1e-5)
    except Exception as e:  # noqa: BLE001 - the accountant's own refusal
        return type(e).__name__ != "UnsupportedMechanismError"
    return True


CASES = [
    (n, k) for n in sorted(BUILTIN_ACCOUNTANTS) for k in MECHANISMS if _answers(n, MECHANISMS[k])
]


@pytest.mark.parametrize(("name", "kind"), CASES)
@pytest.mark.parametrize("delta", BAD_DELTAS, ids=repr)
def test_a_bad_delta_is_refused_naming_it(name, kind, delta):
    with pytest.raises((ParameterValueError, ParameterTypeError), match="delta"):
        get_accountant(name).epsilon(MECHANISMS[kind], delta)


@pytest.mark.parametrize(("name", "kind"), CASES)
@pytest.mark.parametrize("epsilon", BAD_EPSILONS, ids=repr)
def test_a_bad_epsilon_is_refused_naming_it(name, kind, epsilon):
    with pytest.raises((ParameterValueError, ParameterTypeError), match="epsilon"):
        get_accountant(name).delta(MECHANISMS[kind], epsilon)


@pytest.mark.parametrize(("name", "kind"), CASES)
def test_a_numpy_scalar_query_is_answered_as_its_float(name, kind):
    acc, m = get_accountant(name), MECHANISMS[kind]
    assert acc.epsilon(m, np.asarray(1e-5)).upper == acc.epsilon(m, 1e-5).upper
    assert acc.delta(m, np.float64(1.0)).upper == acc.delta(m, 1.0).upper
