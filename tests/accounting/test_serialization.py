"""Mechanisms round-trip through their versioned JSON form and keep their epsilon."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from privlearn.accounting import (
    Composed,
    Gaussian,
    Laplace,
    Mechanism,
    PureDP,
    RandomizedResponse,
    RDPMechanism,
    Subsampled,
    available_accountants,
    compose,
    subsample,
)
from privlearn.accounting.registry import register_mechanism
from privlearn.accounting.serialization import (
    FORMAT_VERSION,
    TabulatedRDP,
    dumps,
    loads,
    mechanism_from_dict,
    mechanism_to_dict,
)

pos = st.floats(min_value=0.3, max_value=20.0, allow_nan=False, allow_infinity=False)


@st.composite
def randomized_response(draw):
    k = draw(st.integers(2, 6))
    p = draw(st.floats(min_value=1.0 / k, max_value=0.95))
    return RandomizedResponse(p, k)


@st.composite
def tabulated_rdp(draw):
    sigma = draw(pos)
    orders = sorted(draw(st.sets(st.floats(1.5, 256.0), min_size=1, max_size=12)))
    pure = draw(st.one_of(st.just(math.inf), pos))
    return RDPMechanism(
        TabulatedRDP.from_function(lambda a: a / (2 * sigma**2), orders),
        name=draw(st.text(max_size=8)),
        pure_epsilon=pure,
    )


bases = st.one_of(
    pos.map(Gaussian),
    pos.map(Laplace),
    randomized_response(),
    st.floats(0.05, 5.0).map(PureDP),
    tabulated_rdp(),
)


@st.composite
def subsampled(draw):
    return subsample(
        draw(bases),
        rate=draw(st.floats(1e-4, 1.0)),
        scheme=draw(st.sampled_from(["poisson", "fixed"])),
        neighbouring=draw(st.sampled_from([None, "add_remove", "replace_one"])),
    )


steps_ = st.one_of(bases, subsampled())


@st.composite
def composed(draw):
    ms = draw(st.lists(steps_, min_size=1, max_size=3))
    counts = draw(st.lists(st.integers(1, 30), min_size=len(ms), max_size=len(ms)))
    return compose(ms, steps=counts)


mechanisms = st.one_of(steps_, composed())


def _outcome(m, delta, accountant):
    try:
        b = m.epsilon_bounds(delta, accountant)
    except Exception as exc:  # refusal: the copy must refuse the same way
        return ("refused", type(exc).__name__)
    return ("ok", b.upper, b.lower)


@settings(max_examples=60, deadline=None)
@given(m=mechanisms, delta=st.sampled_from([1e-5, 1e-3]))
def test_round_trip_identical_epsilon_under_every_accountant(m, delta):
    text = dumps(m)
    json.loads(text)  # valid strict JSON (no NaN/Infinity literals)
    copy = loads(text)
    assert copy == m
    assert type(copy) is type(m)
    assert dumps(copy) == text  # canonical form is stable
    for acc in available_accountants():
        assert _outcome(copy, delta, acc) == _outcome(m, delta, acc), acc


@pytest.mark.parametrize(
    "m",
    [
        Gaussian(1.1),
        Laplace(2.0),
        RandomizedResponse(0.75, 3),
        PureDP(0.5),
        subsample(Gaussian(1.1), 0.01),
        subsample(Laplace(1.0), 0.1, scheme="fixed"),
        compose([Gaussian(2.0), subsample(PureDP(1.0), 0.2, neighbouring="replace_one")], [2, 7]),
        RDPMechanism(TabulatedRDP((2.0, 8.0), (0.1, 0.5)), name="t", pure_epsilon=3.0),
    ],
)
def test_every_kind_has_a_kind_and_format(m):
    d = mechanism_to_dict(m)
    assert d["format"] == FORMAT_VERSION
    assert d["kind"] in {
        "gaussian", "laplace", "randomized_response", "pure_dp", "rdp", "subsampled",
        "composed",
    }
    assert mechanism_from_dict(d) == m


def test_format_1_documents_stay_readable():
    # Written by hand in format 1: the compatibility contract says this always loads.
    doc = {
        "format": 1,
        "kind": "composed",
        "parts": [
            {
                "count": 14063,
                "mechanism": {
                    "kind": "subsampled",
                    "base": {"kind": "gaussian", "noise_multiplier": 1.1},
                    "rate": 0.004266666666666667,
                    "scheme": "poisson",
                    "neighbouring": "add_remove",
                },
            }
        ],
    }
    m = mechanism_from_dict(doc)
    assert m == compose(subsample(Gaussian(1.1), 256 / 60000), steps=14063)
    assert isinstance(m, Composed) and isinstance(m.parts[0][0], Subsampled)


def test_arbitrary_callable_rdp_is_refused_with_a_hint():
    m = RDPMechanism(lambda a: a / 2.0, name="opaque")
    with pytest.raises(TypeError, match="TabulatedRDP.from_function"):
        dumps(m)


def test_newer_format_unknown_kind_and_unknown_field_are_refused():
    d = mechanism_to_dict(Gaussian(1.0))
    with pytest.raises(ValueError, match="newer"):
        mechanism_from_dict({**d, "format": FORMAT_VERSION + 1})
    with pytest.raises(ValueError, match="unknown mechanism kind"):
        mechanism_from_dict({**d, "kind": "exponential"})
    with pytest.raises(ValueError, match="unknown field"):
        mechanism_from_dict({**d, "sensitivity": 2.0})
    with pytest.raises(ValueError, match="missing field"):
        mechanism_from_dict({"format": 1, "kind": "gaussian"})
    with pytest.raises(ValueError, match="noise_multiplier"):
        mechanism_from_dict({"format": 1, "kind": "gaussian", "noise_multiplier": -1.0})
    with pytest.raises(TypeError):
        mechanism_to_dict("gaussian")


def test_tabulated_rdp_is_conservative_between_orders():
    f = TabulatedRDP.from_function(lambda a: a / 2.0, [2, 4, 8])
    assert f(2) == 1.0
    assert f(3) == 2.0 >= 3 / 2.0  # the next tabulated value bounds the true one
    assert f(1.2) == 1.0
    assert f(9) == math.inf
    with pytest.raises(ValueError, match="non-decreasing"):
        TabulatedRDP((2.0, 4.0), (1.0, 0.5))
    with pytest.raises(ValueError, match="> 1"):
        TabulatedRDP((1.0,), (0.5,))


@dataclass(frozen=True)
class _ToyPure(Mechanism):
    """An extension kind registered through the mechanism registry's hooks."""

    eps: float


register_mechanism(
    _ToyPure,
    pure_epsilon=lambda m: m.eps,
    rdp=lambda m, alphas: np.minimum(m.eps, 0.5 * alphas * m.eps**2),
    to_dict=lambda m: {"eps": m.eps},
    from_dict=lambda d: _ToyPure(float(d["eps"])),
)


def test_registry_kinds_round_trip_through_their_hooks():
    m = compose([_ToyPure(0.25), subsample(_ToyPure(0.5), 0.1), Gaussian(3.0)], [3, 10, 1])
    d = mechanism_to_dict(m)
    assert d["parts"][0]["mechanism"]["kind"] == "registered"
    copy = loads(dumps(m))
    assert copy == m
    for acc in available_accountants():
        assert _outcome(copy, 1e-6, acc) == _outcome(m, 1e-6, acc)
    bad = json.loads(dumps(_ToyPure(0.1)))
    bad["class"] = "nowhere.Missing"
    with pytest.raises(ValueError, match="not registered"):
        mechanism_from_dict(bad)


@pytest.mark.parametrize("text", ["x", "", '{"format": 1', b"\xff\xfe\x00", "{'kind': 'gaussian'}"])
def test_loads_of_text_that_is_not_json_raises_the_typed_error(text):
    from privlearn.accounting.serialization import loads
    from privlearn.errors import ParameterValueError

    with pytest.raises(ParameterValueError, match="malformed mechanism document") as info:
        loads(text)
    assert "expected the JSON text of a mechanism" in str(info.value)
    assert not isinstance(info.value, json.JSONDecodeError)


def test_loads_of_a_non_text_raises_a_type_error_and_good_text_still_loads():
    from privlearn.accounting.serialization import dumps, loads
    from privlearn.errors import ParameterTypeError

    with pytest.raises(ParameterTypeError, match="text must be str or bytes"):
        loads(5)
    m = compose(Gaussian(1.3), steps=4)
    assert loads(dumps(m)) == m
    assert loads(dumps(m).encode()) == m
