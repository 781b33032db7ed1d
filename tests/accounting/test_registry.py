"""The mechanism registry (privlearn.accounting.registry): API contract and built-ins.

The end-to-end "add a mechanism" acceptance test is tests/accounting/test_extension.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

import privlearn.accounting as acc
from privlearn.accounting import registry


def test_builtin_kinds_have_their_representations():
    expect = {
        acc.Gaussian: {"pure_epsilon", "pld_pair", "rdp", "equivalent_gaussian",
                       "scale_sensitivity", "pld_replace_one_pair", "rdp_poisson_subsampled"},
        acc.Laplace: {"pure_epsilon", "pld_pair", "rdp", "scale_sensitivity",
                      "pld_replace_one_pair", "rdp_poisson_subsampled", "exact_epsilon",
                      "exact_delta"},
        acc.RandomizedResponse: {"pure_epsilon", "pld_pair", "rdp", "scale_sensitivity",
                                 "pld_atoms", "rdp_poisson_subsampled"},
        acc.PureDP: {"pure_epsilon", "pld_pair", "rdp", "scale_sensitivity", "pld_atoms",
                     "stated_dp", "rdp_poisson_subsampled"},
        acc.ApproxDP: {"pure_epsilon", "pld_pair", "stated_dp", "pld_atoms",
                       "scale_sensitivity"},
        acc.RDPMechanism: {"pure_epsilon", "rdp"},
    }
    for cls, reps in expect.items():
        kind = registry.kind_of(cls)
        assert kind is not None and set(kind.functions) == reps, cls
    assert registry.kind_of(acc.Gaussian).replace_one_doubles_sensitivity
    assert not registry.kind_of(acc.PureDP).replace_one_doubles_sensitivity


def test_registration_is_validated():
    @dataclass(frozen=True)
    class K(acc.Mechanism):
        x: float

    with pytest.raises(TypeError, match="pure_epsilon must be callable"):
        registry.register_mechanism(K, pure_epsilon=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="rdp must be callable"):
        registry.register_mechanism(K, pure_epsilon=lambda m: 1.0, rdp=3)  # type: ignore
    with pytest.raises(ValueError, match="representation must be one of"):
        registry.register_mechanism(K, pure_epsilon=lambda m: 1.0, plot=lambda m: None)
    with pytest.raises(ValueError, match="structural Composed"):
        registry.register_mechanism(acc.Composed, pure_epsilon=lambda m: 1.0)
    with pytest.raises(TypeError, match="subclass of privlearn.accounting.Mechanism"):
        registry.register_mechanism(int, pure_epsilon=lambda m: 1.0)
    with pytest.raises(ValueError, match="not registered"):
        registry.register_representation(K, "rdp", lambda m, a: a)


def test_declared_representation_and_mro_lookup():
    registry.declare_representation("test_only_describe", "fn(m) -> str")

    @dataclass(frozen=True)
    class Base(acc.Mechanism):
        eps: float

    @dataclass(frozen=True)
    class Child(Base):
        pass

    registry.register_mechanism(Base, pure_epsilon=lambda m: m.eps,
                                test_only_describe=lambda m: f"eps={m.eps}")
    assert registry.lookup("test_only_describe", Child(0.5))(Child(0.5)) == "eps=0.5"
    assert registry.pure_epsilon(acc.compose(Child(0.25), 4)) == 1.0
    with pytest.raises(acc.UnsupportedMechanismError,
                       match="'pld_pair' for Child.*register_mechanism"):
        Child(0.5).epsilon(1e-5, accountant="pld")


def test_unregistered_kind_is_refused_by_name():
    @dataclass(frozen=True)
    class Unknown(acc.Mechanism):
        x: float

    for name in ("pld", "rdp"):
        with pytest.raises(acc.UnsupportedMechanismError, match="Unknown"):
            Unknown(1.0).epsilon(1e-5, accountant=name)


def test_pure_epsilon_is_certified_and_exact_where_representable():
    assert registry.pure_epsilon(acc.PureDP(0.5)) == 0.5
    assert registry.pure_epsilon(acc.Laplace(2.0)) == 0.5
    assert registry.pure_epsilon(acc.Laplace(3.0)) >= 1 / 3  # rounded up, not to nearest
    from fractions import Fraction

    assert Fraction(registry.pure_epsilon(acc.compose(acc.Laplace(3.0), 5))) >= Fraction(5, 3)
    assert registry.pure_epsilon(acc.Gaussian(1.0)) == math.inf
    q, e = 0.1, 1.0
    m = acc.subsample(acc.PureDP(e), q)
    assert registry.pure_epsilon(m) >= math.log1p(q * math.expm1(e))
    assert registry.pure_epsilon(m) == pytest.approx(math.log1p(q * math.expm1(e)), rel=1e-15)


def test_equivalent_gaussian_is_exact_or_rounded_down():
    assert registry.equivalent_gaussian(acc.compose(acc.Gaussian(2.0), 4)) == 1.0
    s = registry.equivalent_gaussian(acc.compose([acc.Gaussian(1.1), acc.Gaussian(2.0)], [3, 4]))
    exact = (3 / 1.1**2 + 4 / 4.0) ** -0.5
    assert s <= exact and s == pytest.approx(exact, rel=1e-15)
    assert registry.equivalent_gaussian(acc.subsample(acc.Gaussian(1.0), 0.5)) is None
    assert registry.combine_gaussians([(1.0, 0.0)]) == math.inf


@pytest.mark.parametrize("eps0", [1.0, 30.0, 699.0, 701.0, 1000.0, 1e5])
@pytest.mark.parametrize("q", [1e-300, 1e-9, 0.01, 0.5, 1.0])
def test_subsampled_pure_epsilon_is_finite_and_rounded_up(eps0, q):
    """log(1 + q (e^eps - 1)) (Balle, Barthe & Gaboardi 2018, Thm 8) for any finite eps:
    never an OverflowError (math.expm1 overflows above 709.78), never below the exact
    value (mpmath), within 1e-12 relative of it."""
    import mpmath

    got = registry.pure_epsilon(acc.subsample(acc.PureDP(eps0), q))
    with mpmath.workdps(60):
        exact = mpmath.log1p(mpmath.mpf(q) * mpmath.expm1(mpmath.mpf(eps0)))
        assert exact <= got <= exact * (1 + mpmath.mpf(1e-12))


@pytest.mark.parametrize("bad", [3, None, "gaussian", [acc.Gaussian(1.0)]])
def test_as_replace_one_refuses_what_is_not_a_mechanism(bad):
    from privlearn.accounting import as_replace_one
    from privlearn.errors import ParameterTypeError

    with pytest.raises(ParameterTypeError, match=r"^mechanism must be .*got"):
        as_replace_one(bad)
