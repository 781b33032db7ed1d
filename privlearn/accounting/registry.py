"""The mechanism registry: how each *kind* of mechanism is represented, in one place.

Every accountant (``"pld"``, ``"rdp"``, ``"analytic"``) and the autodp facade
(:mod:`privlearn.compat.autodp`) look up what they need about a mechanism here, so adding a
mechanism is one frozen dataclass plus one :func:`register_mechanism` call -- no accountant
changes::

    @dataclass(frozen=True)
    class DiscreteLaplace(Mechanism):
        scale: float

    register_mechanism(
        DiscreteLaplace,
        pure_epsilon=lambda m: 1.0 / m.scale,
        pld_pair=lambda m: my_pair(m.scale),          # a privlearn.accounting.pairs.Pair
        rdp=lambda m, alphas: my_rdp(m.scale, alphas),
        scale_sensitivity=lambda m, f: DiscreteLaplace(m.scale / f),
    )

after which ``compose(subsample(DiscreteLaplace(2.0), 0.01), 1000).epsilon(1e-6)`` works
with ``accountant="pld"`` and ``"rdp"``, and ``Mechanism.from_privlearn`` hands it to
autodp-style code (tests/accounting/test_extension.py does exactly this).

Representations
---------------
One function per (kind, representation); all are optional except ``pure_epsilon``.
An accountant that needs a representation the kind lacks raises
:class:`~privlearn.accounting.UnsupportedMechanismError`.

``pure_epsilon(m) -> float``
    Epsilon at delta = 0 of one run (``inf`` if none), at the sensitivity the
    mechanism's parameters are stated for; exact or rounded up (:func:`pure_epsilon`
    rounds every finite result up by a few ulps on top).
``pld_pair(m) -> Pair``
    A dominating pair of one run with scalar privacy loss and exact tails
    (:class:`privlearn.accounting.pairs.Pair`; Zhu, Dong & Wang 2022, Definition 7).
    Used by ``"pld"``, which derives subsampled pairs from it ([ZDW22] Theorem 9).
``rdp(m, alphas) -> ndarray``
    Renyi-DP upper bound at finite orders ``alphas > 1`` (a 1-D float array). Used by
    ``"rdp"``, which derives subsampled bounds from it (Zhu & Wang 2019, Theorem 6;
    Wang, Balle & Kasiviswanathan 2019, Theorem 9).
``equivalent_gaussian(m) -> float | None``
    Noise multiplier of a Gaussian mechanism with *exactly* the same privacy curve
    (compositions of such kinds are then evaluated exactly by ``"analytic"``; Dong, Roth
    & Su 2022, Corollary 3.3).
``scale_sensitivity(m, factor) -> Mechanism``
    The same mechanism when one record can move its output ``factor`` times further than
    the parameters assume (noise multiplier ``/ factor``; ``factor * epsilon`` for a
    generic pure-DP mechanism by group privacy, and ``(2 eps, (1 + e^eps) delta)`` at
    ``factor = 2`` for an (eps, delta)-DP one; unchanged for a local randomiser). Needed
    for fixed-size sampling under add/remove and, when ``replace_one_doubles_sensitivity``,
    for replace-one neighbouring.
``pld_replace_one_pair(m, rate) -> Pair``
    The tight pair of ``subsample(m, rate)`` (Poisson sampling) under replace-one for
    ``0 < rate < 1`` (a record's contribution moving from ``+c`` to ``-c``); without it,
    and always for fixed-size sampling, the PLD accountant uses the symmetrised
    remove/add profile (Dong, Roth & Su 2022, Theorem 9).
``rdp_poisson_subsampled(m, rate, alphas) -> ndarray``
    A Poisson-subsampled (add/remove) RDP bound tighter than Zhu & Wang's general one.
``pld_atoms(m) -> Atoms``
    The finitely many outcomes of one run's dominating pair, in the log domain
    (:class:`privlearn.accounting.closed_form.Atoms`: losses, ``log P``, ``log Q``, and
    the P-mass at loss ``+inf`` of an (eps, delta) pair, which only composes unsampled).
    Compositions of such kinds (bare or Poisson-subsampled under add/remove) are then
    evaluated exactly by :mod:`privlearn.accounting.closed_form` (Kairouz, Oh &
    Viswanath 2015; Murtagh & Vadhan 2016), which the ``"pld"`` accountant consults first.
``exact_epsilon(m, delta) -> (lower, upper)`` and ``exact_delta(m, epsilon) -> (lower, upper)``
    A closed form of one run's privacy profile, bracketed by its rounding error (the
    Laplace mechanism's), used by ``"pld"`` for a mechanism that is one run of the kind.

``replace_one_doubles_sensitivity`` (a flag, not a function): True when the parameters
are relative to the add/remove bound ``C`` under every relation (Gaussian, Laplace), so
that under replace-one a record's contribution moves by ``2 C``; False when the kind
states its guarantee for the relation in use (PureDP, randomized response).

Further representations are declared with :func:`declare_representation` and attached with
:func:`register_representation`.

Serialisation hooks (the documented place): ``"to_dict"`` (``fn(m) -> dict`` of JSON
types, the kind's fields) and ``"from_dict"`` (``fn(dict) -> Mechanism``) are declared
here so that a new kind can pass them to :func:`register_mechanism` today.
``privlearn.accounting.serialization`` (built separately, with its own
``register_serializer`` table keyed by type) reads them with
``representation_of(m, "to_dict")`` / ``representation_of(cls, "from_dict")`` for kinds it
has no encoder for. The closed forms of :mod:`privlearn.accounting.closed_form` are
representations like the others (``pld_atoms``, ``exact_epsilon``, ``exact_delta``).

Structural mechanisms (:class:`~privlearn.accounting.Subsampled`,
:class:`~privlearn.accounting.Composed`) are not registered: the description-level
functions below (:func:`pure_epsilon`, :func:`equivalent_gaussian`,
:func:`relation_base`, :func:`supports`) and each accountant handle them from the kinds'
functions. Lookups follow the class's MRO, so a subclass inherits its parent's functions.

References
----------
.. [1] Zhu, Dong & Wang (2022), Optimal Accounting of Differential Privacy via
       Characteristic Function, AISTATS, Definition 7 and Theorem 9.
.. [2] Balle, Barthe & Gaboardi (2018), Privacy Amplification by Subsampling, NeurIPS,
       Theorems 8 and 9 (pure epsilon of a subsampled mechanism).
.. [3] Dong, Roth & Su (2022), Gaussian Differential Privacy, JRSS-B, Corollary 3.3.
.. [4] Dwork & Roth (2014), The Algorithmic Foundations of Differential Privacy,
       Theorem 3.14 (basic composition) and Section 2.3 (group privacy).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from types import MappingProxyType
from typing import Any

from privlearn._type_registry import TypeRegistry
from privlearn.accounting.accountants import install_relation_reader
from privlearn.accounting.mechanisms import (
    Composed,
    Mechanism,
    Neighbouring,
    Sampling,
    Subsampled,
    compose,
)
from privlearn.errors import ParameterTypeError, ParameterValueError, UnsupportedMechanismError

__all__ = [
    "MechanismKind",
    "REPRESENTATIONS",
    "register_mechanism",
    "register_representation",
    "declare_representation",
    "kind_of",
    "registered_kinds",
    "lookup",
    "representation_of",
    "doubles_on_replace_one",
    "supports",
    "pure_epsilon",
    "equivalent_gaussian",
    "combine_gaussians",
    "relation_base",
    "stated_relations",
    "as_replace_one",
    "read_relation",
    "scaled",
    "upper_float",
]

#: Known representations and their signatures (see the module docstring).
REPRESENTATIONS: dict[str, str] = {
    "pure_epsilon": "fn(m) -> float",
    # a kind known only through an (epsilon, delta) statement, for basic composition
    "stated_dp": "fn(m) -> (epsilon, delta)",
    "pld_pair": "fn(m) -> Pair",
    "rdp": "fn(m, alphas: ndarray) -> ndarray",
    "equivalent_gaussian": "fn(m) -> float | None",
    "scale_sensitivity": "fn(m, factor: float) -> Mechanism",
    "pld_replace_one_pair": "fn(m, rate: float) -> Pair",
    "rdp_poisson_subsampled": "fn(m, rate: float, alphas: ndarray) -> ndarray",
    # closed forms, read by privlearn.accounting.closed_form
    "pld_atoms": "fn(m) -> closed_form.Atoms (the finite dominating pair of one run)",
    "exact_epsilon": "fn(m, delta: float) -> (lower, upper) for one run",
    "exact_delta": "fn(m, epsilon: float) -> (lower, upper) for one run",
    # serialisation hooks, read by privlearn.accounting.serialization (see the docstring)
    "to_dict": "fn(m) -> dict (JSON types: the kind's fields)",
    "from_dict": "fn(d: dict) -> Mechanism",
}

_STRUCTURAL = (Composed, Subsampled)


@dataclass(frozen=True)
class MechanismKind:
    """What privlearn knows about one mechanism class (see :func:`register_mechanism`)."""

    cls: type
    functions: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    replace_one_doubles_sensitivity: bool = False

    def get(self, representation: str) -> Callable[..., Any] | None:
        return self.functions.get(representation)


_KINDS: TypeRegistry[MechanismKind] = TypeRegistry("mechanism kinds",
                                                    register_with="register_mechanism")


def declare_representation(name: str, signature: str) -> None:
    """Declare a new representation name (e.g. serialisation hooks) with its signature."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ParameterValueError(f"name must be an identifier, got {name!r}")
    REPRESENTATIONS.setdefault(name, signature)


def _check_class(cls: object) -> type:
    if not (isinstance(cls, type) and issubclass(cls, Mechanism)):
        raise ParameterTypeError(
            f"cls must be a subclass of privlearn.accounting.Mechanism, got {cls!r}")
    if issubclass(cls, _STRUCTURAL):
        raise ParameterValueError(
            f"cls must be a mechanism kind, not the structural {cls.__name__} (subsampling "
            "and composition are derived from the kinds' functions)"
        )
    return cls


def _check_functions(functions: Mapping[str, object]) -> dict[str, Callable[..., Any]]:
    out: dict[str, Callable[..., Any]] = {}
    for name, fn in functions.items():
        if name not in REPRESENTATIONS:
            raise ParameterValueError(
                f"representation must be one of {', '.join(map(repr, REPRESENTATIONS))}, got "
                f"{name!r}; declare new ones with declare_representation"
            )
        if fn is None:
            continue
        if not callable(fn):
            raise ParameterTypeError(f"{name} must be callable, got {fn!r}")
        out[name] = fn
    return out


def register_mechanism(
    cls: type,
    *,
    pure_epsilon: Callable[[Any], float],
    pld_pair: Callable[[Any], Any] | None = None,
    rdp: Callable[[Any, Any], Any] | None = None,
    equivalent_gaussian: Callable[[Any], float | None] | None = None,
    scale_sensitivity: Callable[[Any, float], Any] | None = None,
    pld_replace_one_pair: Callable[[Any, float], Any] | None = None,
    rdp_poisson_subsampled: Callable[[Any, float, Any], Any] | None = None,
    replace_one_doubles_sensitivity: bool = False,
    **other: Callable[..., Any],
) -> MechanismKind:
    """Register (or replace) the representations of a mechanism kind.

    Parameters
    ----------
    cls : type
        A subclass of :class:`~privlearn.accounting.Mechanism` (a frozen dataclass).
    pure_epsilon, pld_pair, rdp, equivalent_gaussian, scale_sensitivity, \
pld_replace_one_pair, rdp_poisson_subsampled : callable, optional
        The representations (module docstring); ``pure_epsilon`` is required (return
        ``math.inf`` for a mechanism without a pure-DP guarantee).
    replace_one_doubles_sensitivity : bool
        Whether the parameters are relative to the add/remove sensitivity under every
        relation (module docstring).
    **other : callable
        Declared further representations (:func:`declare_representation`).

    Returns
    -------
    MechanismKind
    """
    cls = _check_class(cls)
    functions = _check_functions(
        {
            "pure_epsilon": pure_epsilon,
            "pld_pair": pld_pair,
            "rdp": rdp,
            "equivalent_gaussian": equivalent_gaussian,
            "scale_sensitivity": scale_sensitivity,
            "pld_replace_one_pair": pld_replace_one_pair,
            "rdp_poisson_subsampled": rdp_poisson_subsampled,
            **other,
        }
    )
    if "pure_epsilon" not in functions:
        raise ParameterTypeError(
            "pure_epsilon must be callable (return math.inf when there is none)")
    kind = MechanismKind(
        cls, MappingProxyType(functions), bool(replace_one_doubles_sensitivity)
    )
    _KINDS[cls] = kind
    return kind


def register_representation(cls: type, representation: str, fn: Callable[..., Any]) -> None:
    """Attach one representation to a registered kind (or replace it)."""
    cls = _check_class(cls)
    kind = _KINDS.get(cls)
    if kind is None:
        raise ParameterValueError(
            f"cls {cls.__name__} is not registered; call register_mechanism first"
        )
    functions = dict(kind.functions)
    functions.update(_check_functions({representation: fn}))
    _KINDS[cls] = MechanismKind(
        cls, MappingProxyType(functions), kind.replace_one_doubles_sensitivity
    )


def registered_kinds() -> list[type]:
    """The registered mechanism classes."""
    return list(_KINDS)


def kind_of(mechanism: Mechanism | type) -> MechanismKind | None:
    """The registered kind of a mechanism (or class), following the MRO; None if none."""
    return _KINDS.lookup(mechanism)


def representation_of(
    mechanism: Mechanism | type, representation: str
) -> Callable[..., Any] | None:
    """The registered ``representation`` function of ``mechanism``'s kind (or class's),
    following the MRO; None if the kind is not registered or registers none (see
    :func:`lookup` for the refusing form)."""
    kind = kind_of(mechanism)
    return kind.get(representation) if kind is not None else None


def doubles_on_replace_one(mechanism: Mechanism | type) -> bool:
    """Whether ``mechanism``'s kind is registered with ``replace_one_doubles_sensitivity``
    (its parameters are relative to the add/remove bound under every relation, so a
    replacement moves its output twice as far; module docstring); False if unregistered."""
    kind = kind_of(mechanism)
    return kind is not None and kind.replace_one_doubles_sensitivity


def lookup(representation: str, mechanism: Mechanism, *, accountant: str = "") -> Callable:
    """The registered ``representation`` function of ``mechanism``'s kind.

    Raises :class:`UnsupportedMechanismError` (naming the accountant, the kind and how to
    register one) when there is none.
    """
    fn = representation_of(mechanism, representation)
    if fn is None:
        who = f"accountant {accountant!r}" if accountant else "privlearn"
        have = ", ".join(c.__name__ for c in _KINDS if representation in _KINDS[c].functions)
        name = type(mechanism).__name__
        if (accountant not in ("", "rdp") and representation != "rdp"
                and representation_of(mechanism, "rdp") is not None):
            # a kind the RDP accountant evaluates (RDPMechanism, a private selection's
            # bound): that is the first thing to try, not registering a new function
            raise UnsupportedMechanismError(
                f"{who} has no {representation!r} for {name} (kinds with one: "
                f"{have or 'none'}); {name} is evaluated by its Renyi-DP curve: pass "
                f"accountant='rdp' (e.g. mechanism.epsilon(delta, accountant='rdp')), or "
                f"register one with privlearn.accounting.register_mechanism(..., "
                f"{representation}=...)")
        raise UnsupportedMechanismError(
            f"{who} has no {representation!r} for {name} "
            f"(kinds with one: {have or 'none'}); register it with "
            f"privlearn.accounting.register_mechanism(..., {representation}=...)"
            + ("" if accountant == "rdp" or representation == "rdp" else
               " or use another accountant, e.g. accountant='rdp'")
        )
    return fn


# ----------------------------------------------------------------------------------------
# description-level functions shared by the accountants and the facade
# ----------------------------------------------------------------------------------------
def _leaves(mechanism: Mechanism) -> Iterable[Mechanism]:
    parts = mechanism.parts if isinstance(mechanism, Composed) else ((mechanism, 1),)
    for m, _ in parts:
        yield m.base if isinstance(m, Subsampled) else m


def supports(mechanism: Mechanism, representation: str) -> bool:
    """Whether every kind inside ``mechanism`` has ``representation``."""
    return all(representation_of(leaf, representation) is not None
               for leaf in _leaves(mechanism))


def scaled(mechanism: Mechanism, factor: float, *, accountant: str = "") -> Mechanism:
    """``mechanism`` when one record can move its output ``factor`` times further (the
    kind's ``scale_sensitivity``; ``factor == 1`` returns it unchanged)."""
    if factor == 1.0:
        return mechanism
    return lookup("scale_sensitivity", mechanism, accountant=accountant)(mechanism, factor)


def relation_base(m: Subsampled, *, accountant: str = "") -> Mechanism:
    """The base mechanism of ``m`` at the sensitivity its neighbouring relation implies.

    * replace-one: a kind with ``replace_one_doubles_sensitivity`` at twice its
      sensitivity (a record's contribution moves from ``+c`` to ``-c``); other kinds state
      their guarantee for the relation (unchanged);
    * fixed-size sampling under add/remove: the batches with and without the record differ
      by a replacement, whose sensitivity is at most twice the add/remove one (triangle
      inequality), so the base is taken at twice its sensitivity (group privacy);
    * Poisson sampling under add/remove: the base itself.
    """
    base = m.base
    if m.neighbouring is Neighbouring.REPLACE_ONE:
        return scaled(base, 2.0, accountant=accountant) if doubles_on_replace_one(base) else base
    if m.scheme is Sampling.FIXED:
        return scaled(base, 2.0, accountant=accountant)
    return base


def stated_relations(mechanism: Mechanism) -> frozenset[Neighbouring]:
    """The neighbouring relations under which the parts of ``mechanism`` state their
    guarantees.

    A :class:`~privlearn.accounting.Subsampled` part states its ``neighbouring``. Every
    other part is read as an add/remove guarantee: Gaussian, Laplace and matrix mechanisms
    are parameterised by the add/remove bound ``C`` (module docstring of
    :mod:`privlearn.accounting.mechanisms`), and a kind that states its own epsilon or
    curve (PureDP, randomized response, RDPMechanism) is taken at add/remove, privlearn's
    default relation and the reading :func:`as_replace_one` can only make more costly. A
    replace-one guarantee of such a kind is stated as
    ``subsample(m, 1.0, scheme="fixed")`` (replace-one, the whole dataset).
    """
    if not isinstance(mechanism, Mechanism):
        raise ParameterTypeError(f"mechanism must be a privlearn Mechanism, got {mechanism!r}")
    if isinstance(mechanism, Composed):
        if len(mechanism.parts) != 1:
            return frozenset(_stated(m) for m, _ in mechanism.parts)
        mechanism = mechanism.parts[0][0]
    return _ONLY[_stated(mechanism)]


def _stated(part: Mechanism) -> Neighbouring:
    return part.neighbouring if isinstance(part, Subsampled) else Neighbouring.ADD_REMOVE


#: the one-relation sets (shared: a ledger asks for each stored release's relations)
_ONLY = {r: frozenset({r}) for r in Neighbouring}


def as_replace_one(mechanism: Mechanism) -> Mechanism:
    """``mechanism`` read under replace-one neighbouring: a description whose guarantee
    under replace-one covers the release that ``mechanism`` describes under the relations
    it states (:func:`stated_relations`), and that states replace-one for every part.

    Replacing a record is removing it and adding another, so a replace-one pair of
    datasets is two add/remove steps apart (group privacy of size 2; Dwork & Roth 2014,
    Section 2.3, e.g. ``(eps, delta)`` becomes ``(2 eps, (1 + e^eps) delta)``). Part by
    part, more tightly:

    * a replace-one part is unchanged;
    * a subsampled add/remove part is the same sampling analysed under replace-one
      (Balle, Barthe & Gaboardi 2018, Section 5): the base as it is when its kind counts
      a replacement as twice the add/remove bound itself
      (``replace_one_doubles_sensitivity``), else the base at twice its sensitivity
      (``scale_sensitivity``: ``2 eps`` for a pure-DP mechanism, ``(2 eps, (1 + e^eps)
      delta)`` for an :class:`~privlearn.accounting.ApproxDP`);
    * any other part ``m`` (read as add/remove) likewise, stated as
      ``subsample(m', 1.0, scheme="fixed", neighbouring="replace_one")`` (the whole
      dataset, replace-one): a replacement moves a contribution by at most twice the
      add/remove bound (triangle inequality), e.g. ``Gaussian(s)`` costs what
      ``Gaussian(s / 2)`` does under add/remove, ``PureDP(e)`` becomes
      ``PureDP(2 e)`` and ``ApproxDP(e, d)`` becomes ``ApproxDP(2 e, (1 + e^e) d)``
      stated under replace-one. The accountants evaluate a part at rate
      1 exactly as its base at the sensitivity its relation implies
      (:func:`relation_base`).

    Every part of the result states replace-one, so the reading is idempotent:
    ``as_replace_one(as_replace_one(m)) == as_replace_one(m)``, and a composition of the
    result with other replace-one parts is never read again (:func:`read_relation`).

    Raises
    ------
    UnsupportedMechanismError
        For a one-sided part (add-only or remove-only bound one direction only, which
        implies nothing about a replacement) or a kind without ``scale_sensitivity``
        whose parameters do not double on replace-one (e.g. an ``RDPMechanism``).
    """
    if not isinstance(mechanism, Mechanism):
        raise ParameterTypeError(
            f"mechanism must be a privlearn.accounting Mechanism, got {mechanism!r} "
            f"({type(mechanism).__name__}); pass e.g. subsample(Gaussian(1.0), rate=0.01)")
    if isinstance(mechanism, Composed):
        return compose([as_replace_one(m) for m, _ in mechanism.parts],
                       steps=[k for _, k in mechanism.parts])
    if not isinstance(mechanism, Subsampled):
        mechanism = Subsampled(mechanism, 1.0, Sampling.FIXED, Neighbouring.ADD_REMOVE)
    if mechanism.neighbouring is Neighbouring.REPLACE_ONE:
        return mechanism
    if mechanism.neighbouring is not Neighbouring.ADD_REMOVE:
        raise UnsupportedMechanismError(
            f"a subsampled mechanism under one-sided neighbouring "
            f"{mechanism.neighbouring.value!r} bounds one direction only and has no "
            "replace-one guarantee; describe the release under 'add_remove' or "
            "'replace_one'")
    base = mechanism.base if doubles_on_replace_one(mechanism.base) else _doubled(mechanism.base)
    return Subsampled(base, mechanism.rate, mechanism.scheme, Neighbouring.REPLACE_ONE)


def read_relation(mechanism: Mechanism) -> Mechanism:
    """``mechanism`` with every part read under one neighbouring relation: the description
    every accountant evaluates (:meth:`Mechanism.epsilon
    <privlearn.accounting.Mechanism.epsilon>` and the built-in accountants' ``epsilon``,
    ``delta`` and ``rdp`` call this first, so a direct ``get_accountant("pld").epsilon(m,
    delta)`` reads ``m`` the same way).

    Each part states its relation (:func:`stated_relations`: a subsampled part its
    ``neighbouring``, any other part add/remove). A composition whose parts state one
    relation holds under it and is returned unchanged, as is one that mixes add/remove
    with one one-sided relation (add/remove implies both one-sided bounds). A
    composition that mixes replace-one parts (e.g. fixed-size sampling) with add/remove
    parts (Poisson sampling, or a bare Gaussian, Laplace, PureDP or ApproxDP) has no
    guarantee when each part is evaluated under its own relation -- a replace-one
    guarantee says nothing about add/remove neighbours, and an add/remove part costs more
    under replace-one --
    so it is read under replace-one: :func:`as_replace_one` (group privacy of size 2;
    Balle, Barthe & Gaboardi 2018, Section 5 for subsampled parts), which states every
    part under replace-one, so reading the result again changes nothing.

    Raises
    ------
    UnsupportedMechanismError
        Parts under add-only and under remove-only neighbouring (opposite directions: no
        common guarantee); a one-sided part with a replace-one part (a one-sided bound
        implies nothing about a replacement); or a mixed composition with an add/remove
        part that has no replace-one reading (:func:`as_replace_one`).
    """
    if not isinstance(mechanism, Composed) or len(mechanism.parts) < 2:
        return mechanism
    relations = {_stated(m) for m, _ in mechanism.parts}
    if len(relations) < 2:
        return mechanism
    if {Neighbouring.ADD_ONLY, Neighbouring.REMOVE_ONLY} <= relations:
        raise UnsupportedMechanismError(
            "this composition mixes subsampled parts under add-only and under remove-only "
            "neighbouring, which bound opposite directions: its total holds under no "
            "relation; describe every part under 'add_remove' (or all under one one-sided "
            "relation)")
    if Neighbouring.REPLACE_ONE not in relations:
        return mechanism  # add/remove with one one-sided relation: holds under the latter
    one_sided = relations & {Neighbouring.ADD_ONLY, Neighbouring.REMOVE_ONLY}
    if one_sided:
        raise UnsupportedMechanismError(
            "this composition mixes replace-one parts (e.g. fixed-size sampling) with "
            f"subsampled parts under {', '.join(sorted(r.value for r in one_sided))} "
            "neighbouring, which bound one direction only and imply nothing about a "
            "replacement: its total holds under no relation; describe those parts under "
            "'add_remove' or 'replace_one'")
    try:
        return as_replace_one(mechanism)
    except UnsupportedMechanismError as err:
        raise UnsupportedMechanismError(
            "this composition mixes replace-one parts (e.g. fixed-size sampling) with "
            "add/remove parts (Poisson sampling, or a part that is not subsampled), so it "
            f"is read under replace-one, and a part has no replace-one reading ({err})"
        ) from err


def _doubled(m: Mechanism) -> Mechanism:
    """``m`` when one record moves its output twice as far (group privacy of size 2)."""
    fn = representation_of(m, "scale_sensitivity")
    if fn is None:
        raise UnsupportedMechanismError(
            f"{type(m).__name__} has no replace-one reading: its kind registers no "
            "scale_sensitivity (its guarantee when one record moves the output twice as "
            "far); register one with privlearn.accounting.register_mechanism(..., "
            "scale_sensitivity=...), or describe the release under replace-one")
    return fn(m, 2.0)


def _round_up(x: float, ulps: int = 2) -> float:
    """``x`` moved up by ``ulps`` units in the last place (0 and inf unchanged)."""
    if x == 0.0 or not math.isfinite(x):
        return x
    for _ in range(ulps):
        x = math.nextafter(x, math.inf)
    return x


def upper_float(value: Fraction) -> float:
    """The smallest float >= ``value`` (an exact rational): for kinds whose pure epsilon
    is a ratio, e.g. ``upper_float(Fraction(1) / Fraction(b))`` for the Laplace ``1/b``."""
    x = float(value)
    if Fraction(x) < value:
        x = math.nextafter(x, math.inf)
    return x


_RATE_ULPS = 4.0 * sys.float_info.epsilon


def _amplified(eps: float, q: float) -> float:
    """``log(1 + q (e^eps - 1))`` (to a few ulps; the caller rounds up) without overflow.

    Above ``eps = 700`` (``e^eps`` near the float limit) it is evaluated as
    ``eps + log(q + (1 - q) e^-eps)`` (``e^eps`` factored out) plus the rounding error of
    that sum, bounded by 4 ulps of each term (the two terms can cancel for rates near
    ``e^-eps``)."""
    if eps <= 700.0:
        return math.log1p(q * math.expm1(eps))
    tail = math.log(q + (1.0 - q) * math.exp(-eps))
    return eps + tail + 4.0 * sys.float_info.epsilon * (eps + abs(tail))


def _step_pure_epsilon(m: Mechanism) -> float:
    """Pure epsilon of one (possibly subsampled) step; see :func:`pure_epsilon`."""
    if isinstance(m, Subsampled):
        if (m.neighbouring is Neighbouring.REPLACE_ONE and m.rate < 1.0
                and m.scheme is Sampling.POISSON):  # (fixed size: not that pair)
            fn = representation_of(m.base, "pld_replace_one_pair")
            if fn is not None:  # the supremum of the tight pair's privacy loss
                e = float(fn(m.base, m.rate).pure_epsilon)
                return e * (1.0 + _RATE_ULPS) if math.isfinite(e) else math.inf
        try:
            base = relation_base(m)
        except UnsupportedMechanismError:  # no scaled version of the base is known:
            return math.inf  # claim no pure-DP guarantee (conservative)
        e = _step_pure_epsilon(base)
        if math.isinf(e) or m.rate >= 1.0:  # rate 1: one run of the base, exactly
            return e
        # Balle, Barthe & Gaboardi 2018, Theorems 8 and 9: log(1 + q (e^eps - 1))
        return _amplified(e, m.rate) * (1.0 + _RATE_ULPS)
    return float(lookup("pure_epsilon", m)(m))


def pure_epsilon(mechanism: Mechanism) -> float:
    """Pure-DP epsilon (``delta = 0``) of a description; ``inf`` if it has none.

    The kind's ``pure_epsilon`` for one run (exact, or rounded up by the kind);
    ``log(1 + q (e^eps - 1))`` for subsampling of the base at the sensitivity of the
    neighbouring relation (:func:`relation_base`; Balle, Barthe & Gaboardi 2018,
    Theorems 8 and 9), or, for Poisson sampling under replace-one, the supremum of the
    privacy loss of the kind's ``pld_replace_one_pair`` where it has one, each rounded up
    by 4 ulps (at rate 1: the base's own epsilon); the exact sum
    ``sum_i k_i eps_i`` over a composition (basic composition, Dwork & Roth 2014,
    Theorem 3.14, attained by the dominating pairs), rounded up to a float, read under
    one relation first (:func:`read_relation`).
    """
    if not isinstance(mechanism, Mechanism):
        raise ParameterTypeError(f"mechanism must be a privlearn Mechanism, got {mechanism!r}")
    mechanism = read_relation(mechanism)
    if isinstance(mechanism, Composed):
        terms = [(k, _step_pure_epsilon(m)) for m, k in mechanism.parts]
        if any(math.isinf(e) for _, e in terms):
            return math.inf
        return upper_float(sum((Fraction(k) * Fraction(e) for k, e in terms), Fraction(0)))
    return _step_pure_epsilon(mechanism)


def combine_gaussians(sigmas_and_counts: Iterable[tuple[float, float]]) -> float:
    """Noise multiplier of the Gaussian equivalent to composing Gaussians ``sigma_i``
    with (real, >= 0) coefficients ``c_i``: ``(sum_i c_i / sigma_i^2)^(-1/2)``.

    mu-GDP composes as ``mu = sqrt(sum_i mu_i^2)`` (Dong, Roth & Su 2022, Corollary 3.3)
    and a Gaussian with noise multiplier sigma is exactly (1/sigma)-GDP, so the
    composition has exactly this Gaussian's privacy curve. A real coefficient ``c`` means
    the Gaussian ``sigma / sqrt(c)`` (autodp's convention). The sum is exact (rational
    arithmetic) and the result is the float at or just below the exact value (less
    noise is the conservative side), e.g. exactly ``sigma`` for one ``(sigma, 1)``.
    ``inf`` when every coefficient is 0.
    """
    pairs = [(float(s), float(c)) for s, c in sigmas_and_counts]
    total = sum((Fraction(c) / Fraction(s) ** 2 for s, c in pairs if c != 0.0), Fraction(0))
    if total == 0:
        return math.inf
    # (total * 4^-k)^(-1/2) * 2^-k: the float range is kept for every float sigma_i
    # (1 / sigma^2 over- or underflows a float for sigma below 1e-154 or above 1e154)
    k = (total.numerator.bit_length() - total.denominator.bit_length()) // 2
    if abs(k) < 500:
        sigma = 1.0 / math.sqrt(float(total))
    else:
        try:
            sigma = math.ldexp(1.0 / math.sqrt(float(total / Fraction(4) ** k)), -k)
        except OverflowError:  # above the largest float: that float is below (conservative)
            sigma = sys.float_info.max
    # the largest float we can certify: sigma^2 * total <= 1 in exact arithmetic
    while Fraction(sigma) ** 2 * total > 1:
        sigma = math.nextafter(sigma, 0.0)
    return sigma


def equivalent_gaussian(mechanism: Mechanism) -> float | None:
    """Noise multiplier of one Gaussian with exactly the privacy curve of ``mechanism``
    (every part's kind has an ``equivalent_gaussian``; no subsampling, or sampling at
    rate 1, which runs the base at the sensitivity its relation implies:
    :func:`relation_base`), else None. A composition is read under one relation first
    (:func:`read_relation`)."""
    if isinstance(mechanism, Composed):
        mechanism = read_relation(mechanism)
    parts = mechanism.parts if isinstance(mechanism, Composed) else ((mechanism, 1),)
    pairs = []
    for m, k in parts:
        if isinstance(m, Subsampled) and m.rate == 1.0:
            try:
                m = relation_base(m)
            except UnsupportedMechanismError:
                return None
        fn = representation_of(m, "equivalent_gaussian")
        sigma = fn(m) if fn is not None else None
        if sigma is None:
            return None
        pairs.append((sigma, k))
    if not pairs:
        return None
    return combine_gaussians(pairs)


install_relation_reader(read_relation)
