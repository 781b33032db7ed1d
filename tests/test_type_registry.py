"""privlearn._type_registry: class-keyed registries looked up along the MRO, checked
against functools.singledispatch (the standard library's MRO dispatch) as the peer."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from privlearn._type_registry import TypeRegistry, first_in_mro
from privlearn.errors import ParameterTypeError


class A:
    pass


class B(A):
    pass


class C(A):
    pass


class D(B, C):  # a diamond: MRO D, B, C, A, object
    pass


class E(D):
    pass


class F(C):
    pass


CLASSES = [A, B, C, D, E, F]


@settings(max_examples=60, deadline=None)
@given(st.sets(st.sampled_from(CLASSES)), st.sampled_from(CLASSES))
def test_lookup_is_singledispatchs_choice(registered, query):
    """The value found for a class (or an instance) is the one singledispatch dispatches
    to with the same registrations; None where singledispatch falls back on object."""
    registry: TypeRegistry[str] = TypeRegistry("test entries")

    @functools.singledispatch
    def peer(obj):
        return None

    for cls in registered:
        registry.register(cls, value=cls.__name__)
        peer.register(cls)(lambda obj, _n=cls.__name__: _n)
    assert registry.lookup(query) == peer(query())
    assert registry.lookup(query()) == peer(query())
    owner = registry.owner(query)
    assert owner is None or owner.__name__ == peer(query())
    assert registry.lookup_all(query) == [c.__name__ for c in query.__mro__
                                          if c in registered]


def test_predicates_come_after_the_classes_and_only_for_objects():
    registry: TypeRegistry[str] = TypeRegistry("test entries")
    registry.register(B, value="B")
    registry.register_predicate(lambda obj: getattr(obj, "tag", None) == 1, "tagged")
    tagged_c, tagged_d = C(), D()
    tagged_c.tag = tagged_d.tag = 1
    assert registry.lookup(tagged_c) == "tagged"   # no class entry: the predicate
    assert registry.lookup(tagged_d) == "B"        # a class entry wins
    assert registry.lookup(C) is None              # classes are not given to predicates
    assert registry.lookup(C(), default="none") == "none"


def test_it_is_a_mapping_with_exact_keys():
    registry: TypeRegistry[int] = TypeRegistry("test entries")
    registry[B] = 1
    registry.setdefault(C, 2)
    assert dict(registry) == {B: 1, C: 2} and len(registry) == 2
    assert D not in registry and registry.get(D) is None and registry.lookup(D) == 1
    assert registry.pop(B) == 1 and registry.lookup(D) == 2
    del registry[C]
    assert registry.lookup(D) is None


@pytest.mark.parametrize("key", ["A", A(), None])
def test_keys_that_are_not_classes_are_refused_by_name(key):
    registry: TypeRegistry[int] = TypeRegistry("test entries", register_with="register_x")
    with pytest.raises(ParameterTypeError, match=r"register_x: the test entries are keyed "
                                                 r"by class, got"):
        registry[key] = 1
    with pytest.raises(ParameterTypeError, match="keyed by class"):
        registry.register(B, key, value=1)
    assert len(registry) == 0  # nothing registered when one key is refused


def test_first_in_mro():
    assert first_in_mro(E(), lambda c: c.__name__ in ("C", "A")) is C
    assert first_in_mro(E, lambda c: c is F) is None


def test_no_hand_written_mro_loops_in_the_package():
    """Type-dependent lookups go through TypeRegistry / first_in_mro: no module of
    privlearn walks ``__mro__`` itself."""
    import pathlib

    import privlearn

    root = pathlib.Path(privlearn.__file__).parent
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if p.name != "_type_registry.py" and "__mro__" in p.read_text()]
    assert offenders == []
