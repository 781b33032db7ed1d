"""Input validation at the public boundary of privlearn.accounting.conversion."""

from __future__ import annotations

import math

import numpy as np
import pytest

from privlearn.accounting.conversion import (
    delta_from_rdp,
    epsilon_from_rdp,
    rdp_to_delta,
    rdp_to_epsilon,
)
from privlearn.errors import ParameterTypeError, ParameterValueError


def _gauss(a):  # Gaussian mechanism, noise multiplier 1 (Mironov 2017, Prop. 7)
    return np.asarray(a, dtype=float) / 2.0


@pytest.mark.parametrize("delta, err", [
    (float("nan"), ParameterValueError), (-1e-5, ParameterValueError),
    (1.5, ParameterValueError), ("1e-5", ParameterTypeError), (None, ParameterTypeError),
])
def test_rdp_to_epsilon_refuses_bad_delta(delta, err):
    with pytest.raises(err, match=r"delta must be .*got"):
        rdp_to_epsilon(_gauss, delta)


@pytest.mark.parametrize("eps, err", [
    (float("nan"), ParameterValueError), (-1.0, ParameterValueError),
    ("1", ParameterTypeError),
])
def test_rdp_to_delta_refuses_bad_epsilon(eps, err):
    with pytest.raises(err, match=r"epsilon must be .*got"):
        rdp_to_delta(_gauss, eps)


@pytest.mark.parametrize("fn, arg", [(rdp_to_epsilon, 1e-5), (rdp_to_delta, 1.0)])
def test_rdp_conversions_refuse_other_bad_arguments(fn, arg):
    with pytest.raises(ParameterTypeError, match="rdp_fn"):
        fn("gaussian", arg)
    with pytest.raises(ParameterValueError, match="pure_epsilon"):
        fn(_gauss, arg, pure_epsilon=float("nan"))
    with pytest.raises(ParameterTypeError, match="refine"):
        fn(_gauss, arg, refine="yes")


def test_per_order_conversions_refuse_bad_orders_and_parameters():
    with pytest.raises(ParameterValueError, match="orders"):
        epsilon_from_rdp([1.0, 2.0], [0.5, 1.0], 1e-5)
    with pytest.raises(ParameterValueError, match="orders"):
        delta_from_rdp([float("nan")], [0.5], 1.0)
    with pytest.raises(ParameterTypeError, match="orders"):
        delta_from_rdp(["a"], [0.5], 1.0)
    with pytest.raises(ParameterValueError, match="delta"):
        epsilon_from_rdp([2.0], [1.0], 0.0)
    with pytest.raises(ParameterValueError, match="delta"):
        epsilon_from_rdp([2.0], [1.0], float("nan"))
    with pytest.raises(ParameterValueError, match="epsilon"):
        delta_from_rdp([2.0], [1.0], float("nan"))


def test_valid_inputs_still_convert():
    """Formula (1) of the module at one order, by hand: tau + log(1 - 1/a) - (log d +
    log a) / (a - 1)."""
    a, tau, d = 3.0, 1.5, 1e-5
    expect = tau + math.log(1 - 1 / a) - (math.log(d) + math.log(a)) / (a - 1)
    assert epsilon_from_rdp([a], [tau], d)[0] == pytest.approx(expect, rel=1e-12)
    assert rdp_to_epsilon(_gauss, 0.0) == math.inf
    assert 0 < rdp_to_delta(_gauss, 1.0) < 1
