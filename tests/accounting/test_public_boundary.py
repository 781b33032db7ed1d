"""The public numeric functions outside the accountants check their numbers at the
boundary: a NaN, out-of-range, boolean, string or array argument is refused with a
typed error naming the parameter and the value received -- never answered with an
optimistic 0, a NaN, or a bare error from deep inside (``laplace_epsilon`` answered a
NaN delta with (0, 0), ``gdp_delta_bounds`` a NaN mu with (0, 1)). And the extreme but
valid inputs are answered: a huge epsilon, delta 1, delta 0 of pure-DP compositions.

Expected values come from the closed forms (every mechanism is (0, 1)-DP; the epsilon
of a pure-DP composition at delta 0 is the sum of the epsilons; delta at epsilon inf is
0), never from our own outputs.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from privlearn.accounting import (
    BallsInBinsMatrixMechanism,
    Gaussian,
    Laplace,
    compose,
    estimate_epsilon,
    get_accountant,
    subsample,
)
from privlearn.accounting.analytic import gdp_delta_bounds
from privlearn.accounting.closed_form import (
    approx_dp_atoms,
    delta_bounds,
    epsilon_bounds,
    laplace_delta,
    laplace_epsilon,
    pure_dp_atoms,
    pure_dp_composition_epsilon,
    randomized_response_atoms,
)
from privlearn.accounting.conversion import delta_from_rdp
from privlearn.accounting.planning import steps_per_epoch
from privlearn.auditing import accountant_roc
from privlearn.errors import ParameterTypeError, ParameterValueError

NAN = math.nan

# (call, the parameter it gets wrong, the value's text in the message)
CASES = {
    "laplace_epsilon nan delta": (lambda: laplace_epsilon(1.0, NAN), "delta", "nan"),
    "laplace_epsilon delta -1": (lambda: laplace_epsilon(1.0, -1.0), "delta", "-1.0"),
    "laplace_epsilon delta 2": (lambda: laplace_epsilon(1.0, 2.0), "delta", "2.0"),
    "laplace_epsilon str delta": (lambda: laplace_epsilon(1.0, "x"), "delta", "'x'"),
    "laplace_epsilon nan scale": (lambda: laplace_epsilon(NAN, 1e-5), "noise_multiplier", "nan"),
    "laplace_epsilon scale 0": (lambda: laplace_epsilon(0.0, 1e-5), "noise_multiplier", "0.0"),
    "laplace_epsilon scale -1": (lambda: laplace_epsilon(-1.0, 1e-5), "noise_multiplier", "-1.0"),
    "laplace_epsilon bool scale": (lambda: laplace_epsilon(True, 1e-5), "noise_multiplier", "True"),
    "laplace_delta nan epsilon": (lambda: laplace_delta(1.0, NAN), "epsilon", "nan"),
    "laplace_delta epsilon -1": (lambda: laplace_delta(1.0, -1.0), "epsilon", "-1.0"),
    "laplace_delta list epsilon": (lambda: laplace_delta(1.0, [1.0]), "epsilon", "[1.0]"),
    "laplace_delta scale -1": (lambda: laplace_delta(-1.0, 1.0), "noise_multiplier", "-1.0"),
    "pure_dp_atoms nan": (lambda: pure_dp_atoms(NAN), "epsilon", "nan"),
    "pure_dp_atoms -1": (lambda: pure_dp_atoms(-1.0), "epsilon", "-1.0"),
    "pure_dp_atoms array": (lambda: pure_dp_atoms(np.array([1.0, 2.0])), "epsilon", "array"),
    "approx_dp_atoms nan delta": (lambda: approx_dp_atoms(1.0, NAN), "delta", "nan"),
    "approx_dp_atoms delta -1": (lambda: approx_dp_atoms(1.0, -1.0), "delta", "-1.0"),
    "approx_dp_atoms delta 1": (lambda: approx_dp_atoms(1.0, 1.0), "delta", "1.0"),
    "rr_atoms nan p": (lambda: randomized_response_atoms(NAN, 2), "p", "nan"),
    "rr_atoms p 1": (lambda: randomized_response_atoms(1.0, 2), "p", "1.0"),
    "rr_atoms p below 1/k": (lambda: randomized_response_atoms(0.3, 2), "p", "0.3"),
    "rr_atoms k 1": (lambda: randomized_response_atoms(0.7, 1), "k", "1"),
    "rr_atoms k 2.5": (lambda: randomized_response_atoms(0.7, 2.5), "k", "2.5"),
    "rr_atoms str k": (lambda: randomized_response_atoms(0.7, "2"), "k", "'2'"),
    "gdp_delta_bounds nan mu": (lambda: gdp_delta_bounds(NAN, 1.0), "mu", "nan"),
    "gdp_delta_bounds mu -1": (lambda: gdp_delta_bounds(-1.0, 1.0), "mu", "-1.0"),
    "gdp_delta_bounds str mu": (lambda: gdp_delta_bounds("1", 1.0), "mu", "'1'"),
    "gdp_delta_bounds nan epsilon": (lambda: gdp_delta_bounds(1.0, NAN), "epsilon", "nan"),
    "gdp_delta_bounds epsilon -1": (lambda: gdp_delta_bounds(1.0, -1.0), "epsilon", "-1.0"),
    "gdp_delta_bounds bool epsilon": (lambda: gdp_delta_bounds(1.0, True), "epsilon", "True"),
    "epsilon_bounds nan delta": (lambda: epsilon_bounds(Laplace(1.0), NAN), "delta", "nan"),
    "epsilon_bounds delta 2": (lambda: epsilon_bounds(Laplace(1.0), 2.0), "delta", "2.0"),
    "delta_bounds nan epsilon": (lambda: delta_bounds(Laplace(1.0), NAN), "epsilon", "nan"),
    "delta_bounds str epsilon": (lambda: delta_bounds(Laplace(1.0), "1"), "epsilon", "'1'"),
    "pure_dp_composition nan delta": (
        lambda: pure_dp_composition_epsilon([1.0, 1.0], NAN),
        "delta",
        "nan",
    ),
    "pure_dp_composition bool delta": (
        lambda: pure_dp_composition_epsilon([1.0, 1.0], True),
        "delta",
        "True",
    ),
    "pure_dp_composition None delta": (
        lambda: pure_dp_composition_epsilon([1.0, 1.0], None),
        "delta",
        "None",
    ),
    "accountant_roc str fpr": (lambda: accountant_roc(Gaussian(1.0), "0.1"), "fpr", "'0.1'"),
    "accountant_roc bool fpr": (lambda: accountant_roc(Gaussian(1.0), True), "fpr", "True"),
    "estimate_epsilon huge samples": (
        lambda: estimate_epsilon(
            BallsInBinsMatrixMechanism(1.0, (1.0, 0.5), 10, 2), 1e-5, samples=10**308
        ),
        "samples",
        "got 1000",
    ),
    "steps_per_epoch huge cycle": (
        lambda: steps_per_epoch(0.01, 10**400),
        "cycle_length",
        "cycle_length=1000",
    ),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bad_argument_is_refused_naming_it(case):
    call, name, shown = CASES[case]
    with pytest.raises((ParameterTypeError, ParameterValueError)) as info:
        call()
    msg = str(info.value)
    assert name in msg and shown in msg, msg


def test_laplace_epsilon_at_delta_one_is_zero():
    # every mechanism is (0, 1)-DP
    assert laplace_epsilon(1.0, 1.0) == (0.0, 0.0)


def test_pure_dp_composition_at_delta_zero_is_the_sum():
    # the largest privacy loss of the composition is the sum of the epsilons, reached
    # with positive probability: eps(0) is that sum (Kairouz, Oh & Viswanath 2015)
    for eps in ([1.0, 1.0], [0.5, 0.25, 1.0]):
        got = pure_dp_composition_epsilon(eps, 0.0)
        assert math.fsum(eps) <= got <= math.fsum(eps) * (1 + 1e-12)


def test_delta_from_rdp_at_infinite_epsilon_is_zero_not_nan():
    orders, rdp = np.array([2.0, 4.0, 8.0]), np.array([0.1, 0.2, 0.4])
    assert np.array_equal(delta_from_rdp(orders, rdp, math.inf), np.zeros(3))
    huge = delta_from_rdp(orders, rdp, 1e308)
    assert not np.isnan(huge).any() and ((huge >= 0) & (huge <= 1)).all()


def test_pld_delta_at_a_huge_epsilon_is_answered():
    # delta is non-increasing in epsilon: at 1e308 it is at most delta(50), and >= 0
    acc = get_accountant("pld")
    m = compose(subsample(Gaussian(1.0), 0.01), 10)
    far, near = acc.delta(m, 1e308), acc.delta(m, 50.0)
    assert 0.0 <= far.upper <= near.upper
