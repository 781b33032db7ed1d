"""Mechanism descriptions as versioned JSON, so a release can be stored and re-accounted.

A mechanism (:mod:`privlearn.accounting.mechanisms`) says *what ran*; this module turns it
into a plain ``dict`` of JSON types and back, so that it can be written to a file or a
database (:mod:`privlearn.ledger`) today and evaluated with any accountant later.

>>> from privlearn.accounting import Gaussian, compose, subsample
>>> from privlearn.accounting.serialization import dumps, loads
>>> m = compose(subsample(Gaussian(1.1), rate=256 / 60000), steps=14040)
>>> loads(dumps(m)) == m
True

Form
----
Every node is an object with a ``"kind"`` naming the mechanism type and that type's
fields; the outermost object also carries ``"format"``, the version of this form
(:data:`FORMAT_VERSION`). Floats are written with Python's shortest round-tripping repr,
so a value read back is bit-identical to the value written (and so is every epsilon an
accountant computes from it). Non-finite floats are written as the strings ``"inf"`` /
``"-inf"`` (JSON has no infinity).

========================  =========================================================
kind                      fields
========================  =========================================================
``gaussian``              ``noise_multiplier``
``laplace``               ``noise_multiplier``
``randomized_response``   ``truth_probability``, ``num_categories``
``pure_dp``               ``pure_epsilon``
``approx_dp``             ``dp_epsilon``, ``dp_delta``
``rdp``                   ``name``, ``pure_epsilon``, ``curve`` (a tabulated curve:
                          ``{"kind": "tabulated", "orders": [...], "values": [...]}``)
``subsampled``            ``base`` (a node), ``rate``, ``scheme`` (``"poisson"`` /
                          ``"fixed"``), ``neighbouring`` (``"add_remove"`` /
                          ``"replace_one"``)
``composed``              ``parts``: a list of ``{"mechanism": node, "count": int}``
========================  =========================================================

Compatibility contract
----------------------
* Format 1 is read by every later release: a kind is never renamed or removed and a field
  never changes meaning; new kinds may be added, and new *optional* fields may be added
  with defaults that keep the old meaning (they bump :data:`FORMAT_VERSION`).
* A reader refuses (``ValueError``) a document whose ``format`` is newer than its own, an
  unknown kind, or an unknown field: silently ignoring a field written by a newer release
  could under-state the privacy loss.
* A :class:`~privlearn.accounting.mechanisms.RDPMechanism` whose RDP function is an
  arbitrary Python callable cannot be stored (its code is not data); it is refused with
  ``TypeError``. Tabulate it first with :class:`TabulatedRDP` (``TabulatedRDP.from_function(f,
  orders)``), which is a conservative, storable RDP curve.

New mechanism types register their encoders with :func:`register_serializer` (a registry
keyed by type, so nothing here needs editing), or pass ``to_dict=`` / ``from_dict=`` hooks
to :func:`privlearn.accounting.registry.register_mechanism`; such a kind is written as
``{"kind": "registered", "class": "module.Class", "fields": to_dict(m)}`` and read back
by the class's ``from_dict`` (the registering module must be imported before loading; the
class path is part of the stored form, so keep it stable).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from privlearn.accounting.mechanisms import (
    ApproxDP,
    Composed,
    Gaussian,
    Laplace,
    Mechanism,
    Neighbouring,
    PureDP,
    RandomizedResponse,
    RDPMechanism,
    Sampling,
    Subsampled,
)
from privlearn.errors import ParameterTypeError, ParameterValueError

__all__ = [
    "FORMAT_VERSION",
    "TabulatedRDP",
    "dumps",
    "loads",
    "mechanism_from_dict",
    "mechanism_to_dict",
    "register_serializer",
]

FORMAT_VERSION = 1
"""Version of the JSON form written by :func:`mechanism_to_dict`."""

Encoder = Callable[[Any], dict[str, Any]]
Decoder = Callable[[dict[str, Any]], Mechanism]

_ENCODERS: dict[type, tuple[str, Encoder]] = {}
_DECODERS: dict[str, tuple[Decoder, frozenset[str]]] = {}


def register_serializer(
    cls: type, kind: str, to_dict: Encoder, from_dict: Decoder, fields: Sequence[str]
) -> None:
    """Register the JSON form of a mechanism type.

    Parameters
    ----------
    cls : type
        The :class:`Mechanism` subclass (exact type; subclasses register separately).
    kind : str
        Stable name written in the ``"kind"`` field; never reuse or rename one.
    to_dict : callable
        ``mechanism -> dict`` of the fields (without ``"kind"``); nested mechanisms are
        encoded with :func:`_node`.
    from_dict : callable
        ``dict -> mechanism``, the inverse.
    fields : sequence of str
        Every field name ``to_dict`` may write (others are refused when reading).
    """
    if kind in _DECODERS and _ENCODERS.get(cls, (None,))[0] != kind:
        raise ParameterValueError(f"kind {kind!r} is already registered for another type")
    _ENCODERS[cls] = (kind, to_dict)
    _DECODERS[kind] = (from_dict, frozenset(fields))


# ----------------------------------------------------------------------------------
# scalars
# ----------------------------------------------------------------------------------


def _num(x: float) -> float | str:
    x = float(x)
    if math.isnan(x):
        raise ParameterValueError("a mechanism parameter is NaN; it cannot be stored")
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def _read_num(name: str, v: object) -> float:
    if isinstance(v, str):
        if v in ("inf", "-inf"):
            return float(v)
        raise ParameterValueError(f"field {name!r} must be a number or 'inf', got {v!r}")
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ParameterValueError(f"field {name!r} must be a number, got {v!r}")
    return float(v)


def _read_int(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ParameterValueError(f"field {name!r} must be an integer, got {v!r}")
    return v


# ----------------------------------------------------------------------------------
# tabulated RDP curves
# ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TabulatedRDP:
    """A Renyi-DP curve known at finitely many orders: a storable ``rdp_function``.

    Evaluated at an order ``alpha`` it returns the tabulated value at the smallest
    tabulated order ``>= alpha`` (and ``inf`` above the largest order). This is a valid
    upper bound because Renyi divergence is non-decreasing in its order (van Erven &
    Harremoes 2014, Renyi Divergence and Kullback-Leibler Divergence, Theorem 3), so the
    curve is conservative between the tabulated points.

    Parameters
    ----------
    orders : sequence of float > 1, strictly increasing
    values : sequence of float in [0, inf], non-decreasing (an RDP curve is)

    Examples
    --------
    >>> from privlearn.accounting import RDPMechanism
    >>> curve = TabulatedRDP.from_function(lambda a: a / 2.0, orders=[2, 4, 8, 16, 32])
    >>> m = RDPMechanism(curve, name="unit gaussian")
    """

    orders: tuple[float, ...]
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        orders = tuple(float(a) for a in self.orders)
        values = tuple(float(v) for v in self.values)
        if not orders or len(orders) != len(values):
            raise ParameterValueError(
                f"orders and values must be non-empty and of equal length, got "
                f"{len(orders)} orders and {len(values)} values"
            )
        if any(not (a > 1.0 and math.isfinite(a)) for a in orders):
            raise ParameterValueError(f"orders must be finite and > 1, got {orders!r}")
        if any(b <= a for a, b in zip(orders, orders[1:], strict=False)):
            raise ParameterValueError(f"orders must be strictly increasing, got {orders!r}")
        if any(math.isnan(v) or v < 0 for v in values):
            raise ParameterValueError(f"values must be in [0, inf], got {values!r}")
        if any(b < a for a, b in zip(values, values[1:], strict=False)):
            raise ParameterValueError(
                "values must be non-decreasing in the order (an RDP curve is; van Erven & "
                f"Harremoes 2014, Theorem 3), got {values!r}"
            )
        object.__setattr__(self, "orders", orders)
        object.__setattr__(self, "values", values)

    @classmethod
    def from_function(
        cls, rdp_function: Callable[[float], float], orders: Sequence[float]
    ) -> TabulatedRDP:
        """Tabulate ``rdp_function`` (a valid, non-decreasing RDP bound) at ``orders``."""
        orders = sorted(float(a) for a in orders)
        return cls(tuple(orders), tuple(float(rdp_function(a)) for a in orders))

    def __call__(self, alpha: float) -> float:
        i = int(np.searchsorted(self.orders, float(alpha), side="left"))
        return math.inf if i >= len(self.orders) else self.values[i]


# ----------------------------------------------------------------------------------
# encoders / decoders
# ----------------------------------------------------------------------------------


def _node(m: Mechanism) -> dict[str, Any]:
    if not isinstance(m, Mechanism):
        raise ParameterTypeError(f"mechanism must be a privlearn Mechanism, got {m!r}")
    try:
        kind, enc = _ENCODERS[type(m)]
    except KeyError:
        return _registry_node(m)
    out = {"kind": kind}
    out.update(enc(m))
    return out


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _registry_node(m: Mechanism) -> dict[str, Any]:
    """A kind registered with :func:`privlearn.accounting.registry.register_mechanism`
    and its ``to_dict`` hook: ``{"kind": "registered", "class": "module.Class",
    "fields": to_dict(m)}``."""
    from privlearn.accounting import registry

    fn = registry.representation_of(m, "to_dict")
    if fn is None:
        raise ParameterTypeError(
            f"no serializer is registered for {type(m).__name__}; register one with "
            "privlearn.accounting.serialization.register_serializer, or pass to_dict= and "
            "from_dict= to privlearn.accounting.register_mechanism"
        )
    fields = fn(m)
    if not isinstance(fields, dict):
        raise ParameterTypeError(
            f"to_dict of {type(m).__name__} must return a dict, got {fields!r}")
    return {"kind": "registered", "class": _class_path(registry.kind_of(m).cls),
            "fields": fields}


def _registry_from(d: dict[str, Any]) -> Mechanism:
    from privlearn.accounting import registry

    path = d["class"]
    for cls in registry.registered_kinds():
        if _class_path(cls) == path:
            fn = registry.representation_of(cls, "from_dict")
            if fn is None:
                raise ParameterValueError(f"mechanism kind {path} has no from_dict hook registered")
            m = fn(d["fields"])
            if not isinstance(m, cls):
                raise ParameterValueError(
                    f"from_dict of {path} returned {m!r}, not a {cls.__name__}")
            return m
    raise ParameterValueError(
        f"mechanism kind {path!r} is not registered in this process; import the module "
        "that registers it (privlearn.accounting.register_mechanism) before loading"
    )


def _read_node(d: object) -> Mechanism:
    if not isinstance(d, dict):
        raise ParameterValueError(f"a mechanism node must be a JSON object, got {d!r}")
    kind = d.get("kind")
    if kind not in _DECODERS:
        valid = ", ".join(sorted(_DECODERS))
        raise ParameterValueError(f"unknown mechanism kind {kind!r}; known kinds: {valid}")
    dec, fields = _DECODERS[kind]
    extra = set(d) - fields - {"kind", "format"}
    if extra:
        raise ParameterValueError(
            f"unknown field(s) {sorted(extra)} for kind {kind!r} (written by a newer "
            "privlearn?); refusing rather than ignoring them"
        )
    missing = fields - set(d)
    if missing:
        raise ParameterValueError(f"missing field(s) {sorted(missing)} for kind {kind!r}")
    return dec(d)


def _rdp_to(m: RDPMechanism) -> dict[str, Any]:
    f = m.rdp_function
    if not isinstance(f, TabulatedRDP):
        raise ParameterTypeError(
            f"RDPMechanism {m.name!r} has an arbitrary callable rdp_function ({f!r}), which "
            "cannot be serialised; build it with rdp_function=TabulatedRDP.from_function("
            "f, orders) to store a conservative tabulated curve"
        )
    return {
        "name": m.name,
        "pure_epsilon": _num(m.pure_epsilon),
        "curve": {
            "kind": "tabulated",
            "orders": [_num(a) for a in f.orders],
            "values": [_num(v) for v in f.values],
        },
    }


def _rdp_from(d: dict[str, Any]) -> RDPMechanism:
    c = d["curve"]
    if not isinstance(c, dict) or c.get("kind") != "tabulated" or set(c) != {
        "kind",
        "orders",
        "values",
    }:
        raise ParameterValueError(f"field 'curve' must be a tabulated curve object, got {c!r}")
    if not isinstance(d["name"], str):
        raise ParameterValueError(f"field 'name' must be a string, got {d['name']!r}")
    curve = TabulatedRDP(
        tuple(_read_num("orders", a) for a in c["orders"]),
        tuple(_read_num("values", v) for v in c["values"]),
    )
    pure = _read_num("pure_epsilon", d["pure_epsilon"])
    return RDPMechanism(curve, name=d["name"], pure_epsilon=pure)


def _composed_from(d: dict[str, Any]) -> Composed:
    parts = d["parts"]
    if not isinstance(parts, list):
        raise ParameterValueError(f"field 'parts' must be a list, got {parts!r}")
    out = []
    for p in parts:
        if not isinstance(p, dict) or set(p) != {"mechanism", "count"}:
            raise ParameterValueError(
                f"each part must be {{'mechanism': ..., 'count': ...}}, got {p!r}")
        out.append((_read_node(p["mechanism"]), _read_int("count", p["count"])))
    return Composed(tuple(out))


#: How a scalar field is written and read back: a number (``inf`` as a string) or an int.
_NUMBER = (_num, _read_num)
_INTEGER = (int, _read_int)


def _register_scalars(cls: type, kind: str, **fields: tuple[Callable, Callable]) -> None:
    """Register a mechanism type whose fields are all scalars, each given as
    ``name=(write, read)`` (:data:`_NUMBER` or :data:`_INTEGER`)."""
    register_serializer(
        cls,
        kind,
        lambda m: {f: write(getattr(m, f)) for f, (write, _) in fields.items()},
        lambda d: cls(**{f: read(f, d[f]) for f, (_, read) in fields.items()}),
        list(fields),
    )


_register_scalars(Gaussian, "gaussian", noise_multiplier=_NUMBER)
_register_scalars(Laplace, "laplace", noise_multiplier=_NUMBER)
_register_scalars(RandomizedResponse, "randomized_response",
                  truth_probability=_NUMBER, num_categories=_INTEGER)
_register_scalars(PureDP, "pure_dp", pure_epsilon=_NUMBER)
_register_scalars(ApproxDP, "approx_dp", dp_epsilon=_NUMBER, dp_delta=_NUMBER)
register_serializer(RDPMechanism, "rdp", _rdp_to, _rdp_from, ["name", "pure_epsilon", "curve"])
register_serializer(
    Subsampled,
    "subsampled",
    lambda m: {
        "base": _node(m.base),
        "rate": _num(m.rate),
        "scheme": m.scheme.value,
        "neighbouring": m.neighbouring.value,
    },
    lambda d: Subsampled(
        _read_node(d["base"]),
        _read_num("rate", d["rate"]),
        Sampling(d["scheme"]),
        Neighbouring(d["neighbouring"]),
    ),
    ["base", "rate", "scheme", "neighbouring"],
)
_DECODERS["registered"] = (_registry_from, frozenset(["class", "fields"]))
register_serializer(
    Composed,
    "composed",
    lambda m: {"parts": [{"mechanism": _node(mm), "count": int(k)} for mm, k in m.parts]},
    _composed_from,
    ["parts"],
)


# ----------------------------------------------------------------------------------
# public entry points
# ----------------------------------------------------------------------------------


def mechanism_to_dict(mechanism: Mechanism) -> dict[str, Any]:
    """The versioned JSON form of ``mechanism`` (a dict of JSON types).

    Raises
    ------
    TypeError
        For an object that is not a mechanism, a mechanism type with no registered
        serializer, or an :class:`RDPMechanism` with an arbitrary callable curve.
    """
    d = _node(mechanism)
    return {"format": FORMAT_VERSION, **d}


def mechanism_from_dict(data: dict[str, Any]) -> Mechanism:
    """Inverse of :func:`mechanism_to_dict`; validates every field (``ValueError``)."""
    if not isinstance(data, dict):
        raise ParameterTypeError(
            f"data must be a dict (the JSON form of a mechanism), got {data!r}")
    fmt = data.get("format")
    if isinstance(fmt, bool) or not isinstance(fmt, int) or fmt < 1:
        raise ParameterValueError(f"field 'format' must be an integer >= 1, got {fmt!r}")
    if fmt > FORMAT_VERSION:
        raise ParameterValueError(
            f"mechanism format {fmt} is newer than this privlearn reads ({FORMAT_VERSION}); "
            "upgrade privlearn"
        )
    try:
        return _read_node(data)
    except (KeyError, TypeError) as exc:  # malformed nested content
        raise ParameterValueError(f"malformed mechanism document: {exc}") from exc


def dumps(mechanism: Mechanism) -> str:
    """Canonical JSON text (sorted keys, no spaces) of ``mechanism``; equal mechanisms
    give equal text, so it can be hashed."""
    return json.dumps(
        mechanism_to_dict(mechanism), sort_keys=True, separators=(",", ":"), allow_nan=False
    )


def loads(text: str | bytes) -> Mechanism:
    """Inverse of :func:`dumps`.

    Raises
    ------
    ParameterTypeError
        For ``text`` that is not a ``str``, ``bytes`` or ``bytearray``.
    ParameterValueError
        For text that is not a JSON document (the parser's message says where), or a
        JSON document that is not a mechanism (as :func:`mechanism_from_dict`).
    """
    if not isinstance(text, str | bytes | bytearray):
        raise ParameterTypeError(
            f"text must be str or bytes (the JSON text of a mechanism, as written by "
            f"dumps), got {type(text).__name__}; pass dumps(mechanism) or the contents "
            "of a file it was saved to")
    try:
        data = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8/16/32
        more = "..." if len(text) > 60 else ""
        raise ParameterValueError(
            f"malformed mechanism document: expected the JSON text of a mechanism (an "
            f"object with 'format' and 'kind', as written by dumps), got "
            f"{text[:60]!r}{more}, which is not valid JSON ({exc}); pass the text dumps "
            "returned, unchanged"
        ) from exc
    return mechanism_from_dict(data)
