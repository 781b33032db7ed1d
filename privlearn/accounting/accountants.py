"""Accountant registry and the result type shared by all accountants.

An accountant turns a :class:`~privlearn.accounting.mechanisms.Mechanism` description
into privacy parameters. Each registered accountant implements

* ``epsilon(mechanism, delta) -> PrivacyBound``
* ``delta(mechanism, epsilon) -> PrivacyBound``

where ``PrivacyBound.upper`` is a certified upper bound (never optimistic) and
``PrivacyBound.lower`` a certified lower bound where the method provides one (else None).

Accountants are looked up by name (:func:`get_accountant`); new ones are added with
:func:`register_accountant`. The mechanism classes never need to change; how an
accountant evaluates each *kind* of mechanism is looked up in
:mod:`privlearn.accounting.registry`.

A composition is evaluated under one neighbouring relation:
:func:`privlearn.accounting.registry.read_relation` reads it (a composition that mixes
replace-one and add/remove parts is read under replace-one). ``Mechanism.epsilon`` and
``Mechanism.delta`` read it before calling any accountant, and the built-in accountants'
``epsilon``, ``delta`` and ``rdp`` read it too, so calling one directly gives the same
answer; an accountant of your own that may be called directly should call it first
(reading twice changes nothing).

Built-in accountants are listed in a lazy name-to-module table (:data:`BUILTIN_ACCOUNTANTS`):
the module is imported on first use (so ``import privlearn.accounting`` stays light) and
registers its accountant. An error while importing it propagates -- a broken module is
never silently dropped from the list.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from privlearn.accounting._types import Accountant, PrivacyBound
from privlearn.errors import (
    ConfigurationError,
    ParameterTypeError,
    ParameterValueError,
    PlanMismatchError,
)

__all__ = [
    "PrivacyBound",
    "Accountant",
    "BUILTIN_ACCOUNTANTS",
    "register_accountant",
    "get_accountant",
    "available_accountants",
]

#: Built-in accountants: name -> module that registers it when imported.
BUILTIN_ACCOUNTANTS: dict[str, str] = {
    "analytic": "privlearn.accounting.analytic",
    "pld": "privlearn.accounting.pld",
    "rdp": "privlearn.accounting.rdp",
}

_REGISTRY: dict[str, Accountant] = {}

#: :func:`privlearn.accounting.registry.read_relation`, installed by that module when it is
#: imported (which ``import privlearn.accounting`` always does): the registry imports the
#: mechanism classes, which read a description's relation before calling an accountant,
#: so they reach it through this slot rather than importing the registry (no import cycle)
_RELATION_READER: list[Callable[[Any], Any]] = []


def install_relation_reader(reader: Callable[[Any], Any]) -> None:
    """Install the function every description is read through before an accountant
    evaluates it (:func:`privlearn.accounting.registry.read_relation`; called once, by
    that module)."""
    _RELATION_READER[:] = [reader]


def read_relation(mechanism: Any) -> Any:
    """``mechanism`` read under one neighbouring relation by the installed reader
    (:func:`privlearn.accounting.registry.read_relation`)."""
    if not _RELATION_READER:  # pragma: no cover - the package's __init__ installs it
        raise ConfigurationError(
            "privlearn.accounting.registry has not been imported, so no relation reader is "
            "installed; import privlearn.accounting (which imports it) first")
    return _RELATION_READER[0](mechanism)


def register_accountant(accountant: Accountant, *, force: bool = False) -> Accountant:
    """Register an accountant under ``accountant.name`` (names are case-insensitive:
    ``get_accountant("Basic")`` finds one named ``"basic"``).

    ``accountant`` must have a string ``name`` and ``epsilon(mechanism, delta)`` and
    ``delta(mechanism, epsilon)`` methods (:class:`Accountant`). A name of your own may
    be registered again (the new accountant replaces the old). The name of a built-in
    accountant (:data:`BUILTIN_ACCOUNTANTS`: the certified accountants every epsilon and
    calibration uses by default) is refused unless ``force=True``, as Opacus's
    ``register_accountant`` refuses an existing name; a forced one stays registered when
    the built-in's module is imported later.

    Raises
    ------
    ParameterTypeError
        ``accountant`` is not an accountant.
    ConfigurationError
        Its name is a built-in accountant's and ``force`` is False.
    """
    if not isinstance(accountant, Accountant) or not isinstance(accountant.name, str) or (
            not accountant.name.strip()):
        raise ParameterTypeError(
            f"accountant must have a non-empty string name and epsilon(mechanism, delta) "
            f"and delta(mechanism, epsilon) methods, got {accountant!r} "
            f"({type(accountant).__name__}); see privlearn.accounting.accountants.Accountant")
    # looked up case-insensitively (get_accountant), so stored under the same key
    key = accountant.name.strip().lower()
    if key in BUILTIN_ACCOUNTANTS and type(accountant).__module__ != BUILTIN_ACCOUNTANTS[key]:
        if not force:
            raise ConfigurationError(
                f"accountant name {accountant.name!r} is privlearn's built-in {key!r} "
                "accountant, which every epsilon and calibration asking for it uses; "
                "register yours under another name, or pass force=True to replace it")
        _load_builtin(key)  # imported now, so that its import cannot replace yours later
    elif key in BUILTIN_ACCOUNTANTS and key in _REGISTRY and type(_REGISTRY[key]).__module__ \
            != BUILTIN_ACCOUNTANTS[key]:
        return _REGISTRY[key]  # the built-in's module imported after a forced replacement
    _REGISTRY[key] = accountant
    return accountant


def _load_builtin(name: str) -> None:
    """Import the module of built-in accountant ``name`` (errors propagate)."""
    if name in _REGISTRY or name not in BUILTIN_ACCOUNTANTS:
        return
    module = BUILTIN_ACCOUNTANTS[name]
    importlib.import_module(module)
    if name not in _REGISTRY:
        raise PlanMismatchError(
            f"accountant {name!r}: module {module} was imported but did not register it; "
            "the module must call register_accountant for this name (available: "
            f"{sorted(_REGISTRY)})")


def available_accountants() -> list[str]:
    """Names of the registered and built-in accountants (imports nothing)."""
    return sorted(set(_REGISTRY) | set(BUILTIN_ACCOUNTANTS))


def get_accountant(name: str | Accountant) -> Accountant:
    """Look up an accountant by name; raises ValueError listing valid names."""
    if not isinstance(name, str):
        if isinstance(name, Accountant):
            return name
        raise ParameterTypeError(
            f"accountant must be a name ({', '.join(map(repr, available_accountants()))}) "
            f"or an Accountant object, got {name!r} ({type(name).__name__})"
        )
    key = name.strip().lower()
    _load_builtin(key)
    try:
        return _REGISTRY[key]
    except KeyError:
        valid = ", ".join(repr(k) for k in available_accountants())
        raise ParameterValueError(
            f"accountant must be one of {valid}, got {name!r}; register a new one with "
            "privlearn.accounting.register_accountant"
        ) from None
