"""Opacus 1.6's accountant registry tests (opacus/tests/accountants_test.py,
``AccountantRegistryTest``), through :func:`privlearn.accounting.register_accountant`.

Registering an accountant under the name of a built-in one ('rdp' there; 'analytic',
'pld' and 'rdp' here) raises a ValueError unless ``force=True``: the built-ins are the
certified accountants every epsilon, calibration and training run uses by default, and
they were replaced silently (the default 'pld' of ``make_private`` included) -- by a
user's registration, or, when registered before the built-in module was first imported,
by that import replacing the user's. A new name registers, and registers again, freely.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from privlearn.accounting import Gaussian, PrivacyBound, get_accountant, register_accountant
from privlearn.accounting import accountants as registry


class _Dummy:
    """An accountant that answers 0 (Opacus's DummyAccountant): never to be trusted."""

    def __init__(self, name: str) -> None:
        self.name = name

    def epsilon(self, mechanism, delta):
        return PrivacyBound(upper=0.0, accountant=self.name)

    def delta(self, mechanism, epsilon):
        return PrivacyBound(upper=0.0, accountant=self.name)


@pytest.fixture
def own_registry(monkeypatch):
    for name in registry.BUILTIN_ACCOUNTANTS:  # loaded into the registry that is copied
        get_accountant(name)
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


def test_register_accountant(own_registry) -> None:
    # test_register_accountant / test_force_register_existing_accountant
    dummy = register_accountant(_Dummy("dummy"))
    assert get_accountant("dummy") is dummy
    other = register_accountant(_Dummy("dummy"), force=True)
    assert get_accountant("dummy") is other
    assert register_accountant(_Dummy("dummy")) is get_accountant("dummy")  # re-run a cell


def test_create_accountant_not_registered(own_registry) -> None:
    with pytest.raises(ValueError, match="not_registered"):
        get_accountant("not_registered")


@pytest.mark.parametrize("name", ["rdp", "PLD", "analytic"])
def test_register_existing_accountant(own_registry, name: str) -> None:
    # test_register_existing_accountant: register_accountant("rdp", Dummy) raises
    builtin = get_accountant(name)
    with pytest.raises(ValueError, match="force=True"):
        register_accountant(_Dummy(name))
    assert get_accountant(name) is builtin
    assert Gaussian(1.0).epsilon(1e-5, name) > 0


def test_force_register_over_a_builtin(own_registry) -> None:
    # test_force_register_existing_accountant, on a built-in name
    forced = register_accountant(_Dummy("rdp"), force=True)
    assert get_accountant("rdp") is forced


_FRESH = textwrap.dedent("""
    import pytest
    from privlearn.accounting import PrivacyBound, get_accountant, register_accountant

    class Dummy:
        name = "pld"
        def epsilon(self, mechanism, delta):
            return PrivacyBound(upper=0.0, accountant="pld")
        def delta(self, mechanism, epsilon):
            return PrivacyBound(upper=0.0, accountant="pld")

    # before privlearn.accounting.pld is first imported
    with pytest.raises(ValueError, match="force=True"):
        register_accountant(Dummy())
    assert type(get_accountant("pld")).__name__ == "PLDAccountant"
    forced = register_accountant(Dummy(), force=True)
    import privlearn.accounting.pld  # noqa: F401 (its import registered the built-in)
    assert get_accountant("pld") is forced
    print("ok")
""")


def test_a_builtin_is_not_replaced_before_its_first_import() -> None:
    # in a fresh process, the built-in module not yet imported: the registration was
    # kept, then silently replaced by the built-in when its module was first imported
    out = subprocess.run(
        [sys.executable, "-c", _FRESH],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"
