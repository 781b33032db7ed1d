"""Mechanism descriptions: validation at the public boundary, composition algebra."""

from __future__ import annotations

import math

import pytest

from privlearn.accounting import (
    Composed,
    Gaussian,
    Laplace,
    Neighbouring,
    PureDP,
    RandomizedResponse,
    RDPMechanism,
    Sampling,
    compose,
    subsample,
)


def _raises(match_all: list[str]):
    """Context manager: ValueError whose message contains every given fragment."""

    class _Ctx:
        def __enter__(self):
            self._cm = pytest.raises(ValueError)
            self._info = self._cm.__enter__()
            return self._info

        def __exit__(self, *exc):
            out = self._cm.__exit__(*exc)
            msg = str(self._info.value)
            for frag in match_all:
                assert frag in msg, f"{frag!r} not in {msg!r}"
            return out

    return _Ctx()


# ---------------------------------------------------------------------------------------
# validation: parameter name, valid range and received value in the message
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [Gaussian, Laplace])
@pytest.mark.parametrize("bad", [0.0, -1.5, math.inf, -math.inf, math.nan])
def test_noise_multiplier_must_be_positive_finite(cls, bad):
    with _raises(["noise_multiplier", "(0, inf)", repr(bad)]):
        cls(bad)


@pytest.mark.parametrize("bad", [-0.1, 1.5, math.nan, math.inf])
def test_delta_range(bad):
    with _raises(["delta", "[0, 1]", repr(bad)]):
        Gaussian(1.0).epsilon(bad, accountant="analytic")


@pytest.mark.parametrize("accountant", ["analytic", "pld", "rdp"])
def test_delta_one_gives_epsilon_zero(accountant):
    # every mechanism is (0, 1)-DP (autodp returns 0 too; loops over
    # 10.0**-np.linspace(0, ...) hit delta = 1)
    assert Gaussian(1.0).epsilon(1.0, accountant=accountant) == 0.0
    assert Gaussian(0.3).epsilon_bounds(1, accountant=accountant).lower == 0.0


@pytest.mark.parametrize("bad", [-0.5, math.nan, math.inf])
def test_epsilon_range(bad):
    with _raises(["epsilon", "[0, inf)", repr(bad)]):
        Gaussian(1.0).delta(bad, accountant="analytic")


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.01, math.nan, math.inf])
def test_rate_range(bad):
    with _raises(["rate", "(0, 1]", repr(bad)]):
        subsample(Gaussian(1.0), bad)


@pytest.mark.parametrize("bad", [2.5, -1, math.nan])
def test_steps_must_be_nonnegative_integer(bad):
    with _raises(["steps", "integer >= 0", repr(bad)]):
        compose(Gaussian(1.0), steps=bad)


def test_steps_of_wrong_type_is_type_error():
    # one rule (privlearn._validation): wrong type -> TypeError, bad value -> ValueError
    with pytest.raises(TypeError, match=r"steps must be an integer >= 0, got '3' \(str\)"):
        compose(Gaussian(1.0), steps="3")


def test_steps_list_validated():
    with _raises(["steps", "integer >= 0", "-2"]):
        compose([Gaussian(1.0), Laplace(1.0)], steps=[1, -2])
    with _raises(["steps", "one entry per mechanism", "3 entries"]):
        compose([Gaussian(1.0), Laplace(1.0)], steps=[1, 2, 3])


def test_unknown_accountant_and_scheme():
    with _raises(["accountant", "'rdp'", "'nope'"]):
        Gaussian(1.0).epsilon(1e-5, accountant="nope")
    with _raises(["scheme", "'poisson'", "'bogus'"]):
        subsample(Gaussian(1.0), 0.1, scheme="bogus")
    with _raises(["neighbouring", "'add_remove'", "'bogus'"]):
        subsample(Gaussian(1.0), 0.1, neighbouring="bogus")


def test_other_constructors_validate():
    with _raises(["truth_probability", "[0.5, 1)", "1.0"]):
        RandomizedResponse(1.0)
    with _raises(["truth_probability", "0.2"]):
        RandomizedResponse(0.2, num_categories=3)
    with _raises(["num_categories", "integer >= 2", "1"]):
        RandomizedResponse(0.9, num_categories=1)
    with _raises(["pure_epsilon", "(0, inf)", "-1.0"]):
        PureDP(-1.0)
    with _raises(["pure_epsilon", "(0, inf]", "0.0"]):
        RDPMechanism(lambda a: a, pure_epsilon=0.0)
    with pytest.raises(TypeError, match="rdp_function"):
        RDPMechanism(3.0)
    with pytest.raises(TypeError, match="real number"):
        Gaussian("1.0")
    with pytest.raises(TypeError, match="Mechanism"):
        compose([Gaussian(1.0), 3.0])


def test_mechanisms_are_frozen_and_validated_once():
    g = Gaussian(2)
    assert isinstance(g.noise_multiplier, float)
    with pytest.raises(AttributeError):
        g.noise_multiplier = 3.0  # type: ignore[misc]


def test_subsample_defaults_and_no_composed_base():
    assert subsample(Gaussian(1.0), 0.1).neighbouring is Neighbouring.ADD_REMOVE
    s = subsample(Gaussian(1.0), 0.1, scheme="fixed")
    assert s.scheme is Sampling.FIXED and s.neighbouring is Neighbouring.REPLACE_ONE
    with pytest.raises(ValueError, match="composition"):
        subsample(compose(Gaussian(1.0), 3), 0.1)


# ---------------------------------------------------------------------------------------
# composition algebra
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "m", [Gaussian(1.0), subsample(Laplace(2.0), 0.05), RandomizedResponse(0.75, 3)]
)
@pytest.mark.parametrize("k", [1, 2, 17])
def test_compose_steps_equals_list(m, k):
    a, b = compose(m, steps=k), compose([m] * k)
    assert a == b and hash(a) == hash(b)
    assert a.parts == ((m, k),) and a.total_steps == k
    assert a.epsilon(1e-5, accountant="rdp") == b.epsilon(1e-5, accountant="rdp")


def test_flattening_and_merging():
    g, lap = Gaussian(1.0), Laplace(3.0)
    inner = compose([g, lap], steps=[2, 1])
    outer = compose([inner, g], steps=[3, 4])
    assert isinstance(outer, Composed)
    assert dict(outer.parts) == {g: 10, lap: 3}
    assert all(not isinstance(m, Composed) for m, _ in outer.parts)
    assert compose(inner, steps=2) == compose([g, g, lap] * 2)
    assert inner.compose(2) == compose(inner, steps=2)


def test_heterogeneous_list_values():
    ms = [Gaussian(5.0), Gaussian(3.0), Laplace(4.0), subsample(Gaussian(1.0), 0.01)]
    c = compose(ms, steps=[1, 2, 3, 100])
    assert len(c.parts) == 4 and c.total_steps == 106
    # RDP of a heterogeneous composition is the sum of its parts (Mironov 2017, Prop. 1)
    expect = sum(k * m.rdp(4.0) for m, k in zip(ms, [1, 2, 3, 100], strict=True))
    assert c.rdp(4.0) == pytest.approx(expect, rel=1e-13)
    # composing zero times contributes nothing
    assert compose([Gaussian(1.0), Laplace(1.0)], steps=[0, 2]) == compose(Laplace(1.0), 2)


def test_equal_parameters_are_equal_mechanisms():
    assert Gaussian(1.0) == Gaussian(1)
    assert compose([Gaussian(1.0), Gaussian(1)]) == compose(Gaussian(1.0), 2)
    assert subsample(Gaussian(1.0), 0.5) != subsample(Gaussian(1.0), 0.5, scheme="fixed")


@pytest.mark.parametrize("accountant", ["pld", "rdp", "analytic"])
def test_empty_composition_is_zero_dp(accountant: str) -> None:
    # zero steps: nothing ran, so the release is exactly (0, 0)-DP under every accountant
    from privlearn.accounting import Gaussian, compose

    m = compose(Gaussian(1.0), steps=0)
    assert m.epsilon(1e-5, accountant=accountant) == 0.0
    assert m.delta(0.0, accountant=accountant) == 0.0
    assert m.epsilon_bounds(0.0, accountant=accountant).lower == 0.0


def test_compose_two_positional_mechanisms_points_to_list():
    # autodp-style compose(m1, m2): the second mechanism lands in ``steps``
    with pytest.raises(TypeError) as info:
        compose(Gaussian(5.0), Gaussian(3.0))
    msg = str(info.value)
    assert "compose([m1, m2])" in msg and "Gaussian(noise_multiplier=3.0)" in msg
    # the suggested call composes both
    c = compose([Gaussian(5.0), Gaussian(3.0)])
    assert c.rdp(4.0) == pytest.approx(Gaussian(5.0).rdp(4.0) + Gaussian(3.0).rdp(4.0))
