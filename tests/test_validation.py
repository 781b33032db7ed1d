"""privlearn._validation: one rule for exception types, messages that say what to try."""

from __future__ import annotations

import math
from enum import Enum

import numpy as np
import pytest

from privlearn import _validation as v


@pytest.mark.parametrize(
    "fn,args",
    [
        (v.check_real, ()),
        (v.check_positive, ()),
        (v.check_nonnegative, ()),
        (v.check_delta, ()),
        (v.check_epsilon, ()),
        (v.check_rate, ()),
        (v.check_probability, ()),
        (v.check_count, ()),
    ],
)
@pytest.mark.parametrize("bad", ["1.0", None, True, [1.0]])
def test_wrong_type_is_type_error(fn, args, bad):
    with pytest.raises(TypeError) as info:
        fn("param", bad, *args)
    msg = str(info.value)
    assert msg.startswith("param must be") and repr(bad) in msg and type(bad).__name__ in msg


@pytest.mark.parametrize(
    "fn,bad,rng",
    [
        (v.check_positive, -1.0, "(0, inf)"),
        (v.check_positive, math.inf, "(0, inf)"),
        (v.check_positive, math.nan, "(0, inf)"),
        (v.check_nonnegative, -0.5, "[0, inf)"),
        (v.check_delta, 1.0, "[0, 1)"),
        (v.check_epsilon, -1.0, "[0, inf)"),
        (v.check_rate, 0.0, "(0, 1]"),
        (v.check_probability, 1.5, "[0, 1]"),
        (v.check_count, 2.5, "integer >= 0"),
        (v.check_count, -3, "integer >= 0"),
    ],
)
def test_bad_value_is_value_error_naming_range_value_and_hint(fn, bad, rng):
    with pytest.raises(ValueError) as info:
        fn("param", bad)
    msg = str(info.value)
    assert msg.startswith(f"param must be in {rng}") or msg.startswith(f"param must be an {rng}")
    assert f"got {bad!r}; " in msg  # the value, then what to try
    assert len(msg.split("; ", 1)[1]) > 5


def test_custom_hint_replaces_the_generic_one():
    with pytest.raises(ValueError, match=r"got -1; use noise_multiplier > 0\.5$"):
        v.check_positive("sigma", -1, hint="use noise_multiplier > 0.5")


def test_accepts_numpy_scalars_and_integral_floats():
    assert v.check_positive("x", np.float64(2.0)) == 2.0
    assert v.check_rate("q", np.float32(0.5)) == 0.5
    assert v.check_count("steps", 10.0) == 10 and isinstance(v.check_count("steps", 10.0), int)
    assert v.check_count("steps", np.int64(7), minimum=1) == 7
    assert v.check_positive("x", math.inf, allow_inf=True) == math.inf
    assert v.check_delta("delta", 1.0, allow_one=True) == 1.0


class _Color(Enum):
    RED = "red"
    DARK_BLUE = "dark_blue"


def test_enum_and_choice():
    assert v.check_enum("c", "Dark-Blue", _Color) is _Color.DARK_BLUE
    assert v.check_enum("c", _Color.RED, _Color) is _Color.RED
    with pytest.raises(ValueError, match="c must be one of 'red', 'dark_blue', got 'green'"):
        v.check_enum("c", "green", _Color)
    with pytest.raises(TypeError, match="c must be one of"):
        v.check_enum("c", 3, _Color)
    assert v.check_choice("mode", "MEAN", ("mean", "sum")) == "mean"
    with pytest.raises(ValueError, match="mode must be one of 'mean', 'sum', got 'avg'"):
        v.check_choice("mode", "avg", ("mean", "sum"))
    with pytest.raises(TypeError):
        v.check_choice("mode", None, ("mean", "sum"))
    with pytest.raises(TypeError, match="fn must be callable"):
        v.check_callable("fn", 3)


def test_value_errors_are_parameter_value_errors():
    from privlearn.errors import ParameterTypeError, ParameterValueError

    for call in (lambda: v.check_positive("x", -1.0), lambda: v.check_delta("d", 1.0),
                 lambda: v.check_rate("q", 0.0), lambda: v.check_count("n", 2.5),
                 lambda: v.check_choice("c", "z", ("a", "b"))):
        with pytest.raises(ParameterValueError):
            call()
    with pytest.raises(ParameterTypeError):
        v.check_positive("x", "1")


def test_gaussian_delta_refuses_pure_dp_once_for_every_layer():
    """delta = 0 with Gaussian noise asks for pure DP, which the Gaussian mechanism never
    gives (its epsilon at delta 0 is infinite): the one shared refusal names the
    parameter, the range, the value and what to use instead."""
    from privlearn.accounting import Gaussian
    from privlearn.errors import ParameterValueError

    assert math.isinf(Gaussian(10.0).epsilon(0.0))  # why it is refused
    assert v.check_gaussian_delta("delta", 1e-6) == 1e-6
    with pytest.raises(ParameterValueError) as info:
        v.check_gaussian_delta("--delta", 0.0, pure_dp_alternative="--mechanism laplace")
    msg = str(info.value)
    assert msg.startswith("--delta must be in (0, 1) with Gaussian noise, got 0")
    assert msg.endswith("try --mechanism laplace for pure DP, or a positive --delta such as "
                        "1e-5")
    with pytest.raises(ParameterValueError, match="pass a positive delta such as 1e-5$"):
        v.check_gaussian_delta("delta", 0)
    with pytest.raises(ParameterValueError, match=r"in \[0, 1\)"):
        v.check_gaussian_delta("delta", 1.0)
