"""PureDP and ApproxDP take the keywords users write (``epsilon=``, ``delta=``) as well
as their field names, without changing what the objects are."""

import dataclasses
import math
import pickle

import pytest

from privlearn.accounting import ApproxDP, PureDP, compose
from privlearn.accounting.serialization import dumps, loads
from privlearn.errors import ParameterTypeError, ParameterValueError


def test_puredp_takes_epsilon_keyword():
    m = PureDP(epsilon=0.3)
    assert m == PureDP(0.3) == PureDP(pure_epsilon=0.3)
    assert hash(m) == hash(PureDP(0.3))
    assert m.pure_epsilon == 0.3
    assert repr(m) == repr(PureDP(0.3))
    # an epsilon-DP mechanism is (epsilon, 0)-DP and no better (Dwork & Roth 2014, Def. 2.4)
    assert m.epsilon(0.0) == pytest.approx(0.3, rel=1e-9)


def test_approxdp_takes_epsilon_and_delta_keywords():
    m = ApproxDP(epsilon=1.0, delta=1e-6)
    assert m == ApproxDP(1.0, 1e-6) == ApproxDP(dp_epsilon=1.0, dp_delta=1e-6)
    assert m == ApproxDP(1.0, delta=1e-6) == ApproxDP(epsilon=1.0, dp_delta=1e-6)
    assert hash(m) == hash(ApproxDP(1.0, 1e-6))
    assert (m.dp_epsilon, m.dp_delta) == (1.0, 1e-6)
    assert repr(m) == repr(ApproxDP(1.0, 1e-6))


@pytest.mark.parametrize(
    "build", [lambda: PureDP(epsilon=0.3), lambda: ApproxDP(epsilon=1.0, delta=1e-6)]
)
def test_keyword_built_mechanisms_round_trip(build):
    m = build()
    assert pickle.loads(pickle.dumps(m)) == m
    assert loads(dumps(m)) == m
    assert loads(dumps(compose(m, steps=3))) == compose(m, steps=3)
    field = dataclasses.fields(m)[0].name
    assert dataclasses.replace(m, **{field: 0.5}) != m


@pytest.mark.parametrize(
    "build, names",
    [
        (lambda: PureDP(0.3, epsilon=0.3), ("pure_epsilon", "epsilon")),
        (lambda: PureDP(pure_epsilon=0.3, epsilon=0.4), ("pure_epsilon", "epsilon")),
        (lambda: ApproxDP(1.0, 1e-6, delta=1e-6), ("dp_delta", "delta")),
        (lambda: ApproxDP(dp_epsilon=1.0, epsilon=1.0, delta=1e-6), ("dp_epsilon", "epsilon")),
    ],
)
def test_both_spellings_at_once_is_a_typed_error_naming_both(build, names):
    with pytest.raises(ParameterTypeError) as info:
        build()
    assert all(f"{n}=" in str(info.value) for n in names)


def test_missing_value_is_a_typed_error():
    with pytest.raises(ParameterTypeError, match="epsilon"):
        PureDP()
    with pytest.raises(ParameterTypeError, match="delta"):
        ApproxDP(epsilon=1.0)


def test_keyword_values_are_validated_under_the_name_given():
    with pytest.raises(ParameterValueError, match="^epsilon must"):
        PureDP(epsilon=-1.0)
    with pytest.raises(ParameterValueError, match="^delta must"):
        ApproxDP(epsilon=1.0, delta=0.0)
    with pytest.raises(ParameterValueError, match="^pure_epsilon must"):
        PureDP(math.nan)
