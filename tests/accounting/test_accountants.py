"""The accountant registry: a registered accountant is found by its name, whatever its
case, and what is not an accountant is refused at registration."""

from __future__ import annotations

import pytest

from privlearn.accounting import (
    Gaussian,
    PrivacyBound,
    available_accountants,
    get_accountant,
    register_accountant,
)
from privlearn.accounting import accountants as registry
from privlearn.errors import ParameterTypeError


class _Basic:
    """Basic composition of the analytic Gaussian epsilon (a valid, loose accountant)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def epsilon(self, mechanism, delta):
        return PrivacyBound(upper=mechanism.epsilon(delta, "analytic"), accountant=self.name)

    def delta(self, mechanism, epsilon):
        return PrivacyBound(upper=mechanism.delta(epsilon, "analytic"), accountant=self.name)


@pytest.fixture
def own_registry(monkeypatch):
    for name in registry.BUILTIN_ACCOUNTANTS:  # loaded into the registry that is copied
        get_accountant(name)
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


@pytest.mark.parametrize("name", ["Basic", " basic ", "BASIC"])
def test_a_registered_name_is_found_in_any_case(own_registry, name):
    acc = register_accountant(_Basic(name))
    assert get_accountant("Basic") is acc and get_accountant("basic") is acc
    assert "basic" in available_accountants()
    g = Gaussian(2.0)
    assert g.epsilon(1e-5, name) == g.epsilon(1e-5, "analytic")


@pytest.mark.parametrize("bad", [3, "pld", None, _Basic(""), _Basic(3)])
def test_what_is_not_an_accountant_is_refused(own_registry, bad):
    before = dict(registry._REGISTRY)
    with pytest.raises(ParameterTypeError, match=r"^accountant must .*got"):
        register_accountant(bad)
    assert registry._REGISTRY == before
