"""One registry keyed by class, looked up along the method resolution order.

Behaviour that depends on a type is registered, not tested inline: the engine's layer
rules, layouts, instrumenters, validators and fixers, the mechanism kinds of the
accountants, the sensitivity rules of the participation schemes and the CLI's messages
per error are each a :class:`TypeRegistry`. A value registered for a class serves its
subclasses (the first class of ``type(obj).__mro__`` that has one wins, as
:func:`functools.singledispatch` and Opacus's grad-sampler registry dispatch). Imports
nothing from privlearn but :mod:`privlearn.errors`, so every layer can use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import Any, Generic, TypeVar

from privlearn.errors import ParameterTypeError

__all__ = ["TypeRegistry", "first_in_mro"]

V = TypeVar("V")


def _class_of(obj_or_cls: Any) -> type:
    return obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)


def first_in_mro(obj_or_cls: Any, predicate: Callable[[type], bool]) -> type | None:
    """The first class of the method resolution order of ``obj_or_cls`` (an object or a
    class) for which ``predicate(cls)`` holds, else None: for classes recognised by name
    and module rather than by identity (libraries privlearn does not import)."""
    for cls in _class_of(obj_or_cls).__mro__:
        if predicate(cls):
            return cls
    return None


class TypeRegistry(MutableMapping[type, V], Generic[V]):
    """A mapping ``class -> value`` whose :meth:`lookup` follows the MRO.

    As a mapping it is exact (``registry[cls]``, ``cls in registry``, iteration in
    registration order), so code that treated the registry as a ``dict`` keeps working;
    :meth:`lookup` and :meth:`lookup_all` are the MRO-aware reads, and :meth:`register`
    the decorator-friendly write.

    Parameters
    ----------
    name : str
        What the registry holds, for messages (``"layer rules"``).
    register_with : str, optional
        The public function that registers into it (``"register_rule"``), named in the
        message that refuses a key that is not a class.

    Examples
    --------
    >>> r = TypeRegistry("sizes")
    >>> r.register(int, value="an int")
    >>> r.lookup(True), r.lookup(1.5)         # bool subclasses int; float has no entry
    ('an int', None)
    """

    def __init__(self, name: str, *, register_with: str | None = None) -> None:
        self.name = name
        self.register_with = register_with
        self._table: dict[type, V] = {}
        #: ``(predicate(obj) -> bool, value)`` pairs, tried in order after the classes
        #: for objects whose classes have no entry (classes of libraries privlearn does
        #: not import, recognised by name and attributes).
        self.predicates: list[tuple[Callable[[Any], bool], V]] = []

    # -- the mapping (exact keys) ---------------------------------------------------
    def _check(self, cls: Any) -> type:
        if not isinstance(cls, type):
            via = f"{self.register_with}: " if self.register_with else ""
            raise ParameterTypeError(
                f"{via}the {self.name} are keyed by class, got {cls!r} (a "
                f"{type(cls).__name__}); pass the class itself, not its name or an instance")
        return cls

    def __getitem__(self, cls: type) -> V:
        return self._table[cls]

    def __setitem__(self, cls: type, value: V) -> None:
        self._table[self._check(cls)] = value

    def __delitem__(self, cls: type) -> None:
        del self._table[cls]

    def __iter__(self) -> Iterator[type]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def __repr__(self) -> str:
        names = ", ".join(c.__qualname__ for c in self._table)
        return f"TypeRegistry({self.name!r}: {names})"

    # -- registration and MRO look-up ----------------------------------------------
    def register(self, *classes: type, value: V) -> None:
        """Register ``value`` for each of ``classes`` (replacing what they had); all are
        checked before any is registered."""
        for cls in classes:
            self._check(cls)
        for cls in classes:
            self._table[cls] = value

    def register_predicate(self, predicate: Callable[[Any], bool], value: V) -> None:
        """Register ``value`` for every object for which ``predicate(obj)`` holds (tried
        after the classes, in registration order)."""
        if not callable(predicate):
            raise ParameterTypeError(
                f"the predicate of an entry of the {self.name} must be callable, got "
                f"{predicate!r}")
        self.predicates.append((predicate, value))

    def owner(self, obj_or_cls: Any) -> type | None:
        """The class of the MRO of ``obj_or_cls`` (an object or a class) whose entry
        :meth:`lookup` returns, else None."""
        return first_in_mro(obj_or_cls, self._table.__contains__)

    def lookup(self, obj_or_cls: Any, default: V | None = None) -> V | None:
        """The value registered for the first class of the MRO of ``obj_or_cls`` (an
        object or a class) that has one, else (for an object) that of the first
        predicate that holds for it, else ``default``."""
        cls = self.owner(obj_or_cls)
        if cls is not None:
            return self._table[cls]
        if not isinstance(obj_or_cls, type):
            for predicate, value in self.predicates:
                if predicate(obj_or_cls):
                    return value
        return default

    def lookup_all(self, obj_or_cls: Any) -> list[V]:
        """The values of every class of the MRO that has one, most derived first (the
        predicates are not consulted)."""
        return [self._table[c] for c in _class_of(obj_or_cls).__mro__ if c in self._table]
