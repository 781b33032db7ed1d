"""The ledger's value objects (a budget, an entry, what was spent, a verify report) and
the checks of what an entry records (names, labels, the mechanism, who and when)."""

from __future__ import annotations

import getpass
import math
import numbers
import operator
import os
import socket
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from privlearn.accounting import Mechanism, Neighbouring
from privlearn.accounting.serialization import dumps
from privlearn.errors import ParameterTypeError, ParameterValueError

__all__ = ["Budget", "Entry", "Spent", "VerifyReport"]


@dataclass(frozen=True, slots=True)
class Budget:
    """The cap on one dataset (and privacy unit).

    Attributes
    ----------
    dataset, privacy_unit : str
    epsilon, delta : float
        The cap: every admitted history is ``(epsilon, delta)``-DP.
    accountant : str
        Accountant composing the stored releases (default ``"pld"``).
    adaptive : bool
        Enforce the cap with the Renyi filter (valid under fully adaptive composition)
        instead of the tight non-adaptive composition (see :mod:`privlearn.ledger`).
    adaptive_order : float or None
        The filter's Renyi order ``alpha`` (None when not adaptive).
    neighbouring : Neighbouring or None
        The neighbouring relation the cap holds under, when set at creation; None: the
        relation of the budget's first release (see :meth:`Ledger.create_budget`).
    """

    dataset: str
    privacy_unit: str
    epsilon: float
    delta: float
    accountant: str
    adaptive: bool = False
    adaptive_order: float | None = None
    neighbouring: Neighbouring | None = None


@dataclass(frozen=True, slots=True)
class Entry:
    """One row of the ledger (immutable once written).

    ``kind`` is ``"budget"`` (the cap was set), ``"spend"``, ``"reserve"`` (a planned
    release, counted in full until settled) or ``"settle"`` (what a reservation actually
    ran; ``ref`` is the reservation's ``seq``; ``mechanism`` None means nothing ran).
    ``metadata``: what the spender recorded beside the mechanism to say what ran (e.g.
    ``{"noise_strategy": "BandedToeplitz(bands=8, sha256=...)"}`` for a correlated-noise
    training run; a settle entry repeats its reservation's), as text keys and values;
    None when nothing was (and for every entry of a ledger written before it existed).
    """

    seq: int
    kind: str
    dataset: str
    privacy_unit: str
    mechanism: Mechanism | None
    label: str | None
    who: str | None
    time: str
    ref: int | None
    hash: str
    metadata: dict[str, str] | None = field(default=None, hash=False)


@dataclass(frozen=True, slots=True)
class Spent:
    """What has been spent on one budget.

    Attributes
    ----------
    epsilon_spent : float
        Certified upper bound on epsilon at ``delta`` of the tight composition of every
        counted release (spends, settled reservations, and pending reservations in full),
        treated as a sequence whose mechanisms were fixed in advance, under
        ``neighbouring``. Never lower than the total reported after the last spend or
        reservation (the PLD bound is not monotone in the releases; the running maximum
        of upper bounds is one), so it never decreases with a new release; a settle that
        ran less than planned may lower it. With a release the budget's accountant has no
        representation for (an ``RDPMechanism`` on a PLD budget), the Renyi DP bound of
        every release.
    epsilon_lower : float or None
        Certified lower bound of the same composition (the accountant's, where it has one):
        the true epsilon of that composition lies in ``[epsilon_lower, epsilon_spent]``.
    epsilon_budget, delta : float
        The cap.
    epsilon_remaining : float
        ``max(0, epsilon_budget - epsilon_spent)``; for an adaptive budget the larger
        of ``epsilon_spent`` and ``adaptive_epsilon`` (both are capped) is subtracted.
        Informative only: a release's epsilon does not add to the total.
    entries : int
        Number of releases: spends, and reserved runs that released something or are
        still pending (a reservation settled with nothing -- a fit that failed before
        touching the data -- is not one; a reservation with those that extend it is one).
    pending : int
        Reservations not yet settled (counted as their whole plan).
    adaptive : bool
        Whether the cap is enforced with the Renyi filter.
    adaptive_epsilon, adaptive_order : float or None
        The epsilon the Renyi filter certifies for the releases so far at ``delta`` (valid
        under fully adaptive composition), and its order; None for non-adaptive budgets.
    neighbouring : Neighbouring or None
        The neighbouring relation every number here holds under (None: nothing spent on
        a budget whose relation is fixed by its first release).
    """

    dataset: str
    privacy_unit: str
    epsilon_spent: float
    epsilon_lower: float | None
    epsilon_budget: float
    delta: float
    epsilon_remaining: float
    entries: int
    pending: int
    accountant: str
    adaptive: bool
    adaptive_epsilon: float | None
    adaptive_order: float | None
    neighbouring: Neighbouring | None = None

    def __str__(self) -> str:
        """The summary ``privlearn budget show`` prints: the total with its certified
        lower bound, the cap, the number of releases (and the Renyi filter's epsilon for
        an adaptive budget)."""
        relation = ("neighbouring relation to be fixed by the first release"
                    if self.neighbouring is None
                    else self.neighbouring.value)
        lower = ("" if self.epsilon_lower is None
                 else f" (certified lower bound {self.epsilon_lower:.6g})")
        text = (f"dataset {self.dataset} ({self.privacy_unit}, {relation}): epsilon spent "
                f"{self.epsilon_spent:.6g}{lower} of {self.epsilon_budget:g} at delta "
                f"{self.delta:g}, {self.entries} release(s)"
                + (f", {self.pending} pending reservation(s)" if self.pending else ""))
        if self.adaptive:
            text += (f"\n  adaptive rule (Renyi filter, order {self.adaptive_order:.4g}): "
                     f"epsilon {self.adaptive_epsilon:.6g}")
        return text

    def as_dict(self) -> dict:
        """The fields as JSON types (``neighbouring`` by its value, inf as None)."""
        d = {k: getattr(self, k) for k in self.__slots__}
        d["neighbouring"] = None if self.neighbouring is None else self.neighbouring.value
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in d.items()}


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """Result of :meth:`Ledger.verify`; truthy when the ledger is intact."""

    ok: bool
    entries: int
    problems: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.ok


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


def _default_who() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no login name in some containers
        user = f"uid{os.getuid()}" if hasattr(os, "getuid") else "unknown"
    return f"{user}@{socket.gethostname()}"


def _check_name(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise ParameterTypeError(f"{name} must be a string, got {value!r}")
    if not value.strip():
        raise ParameterValueError(f"{name} must be a non-empty string, got {value!r}")
    return value


def _check_opt_str(name: str, value: object) -> str | None:
    """A one-line text (a label, who spent) or None: a line break or another control
    character would break the one-line-per-entry listing of ``privlearn budget history``
    (or write terminal escapes into it), so it is refused before anything is recorded."""
    if value is not None and not isinstance(value, str):
        raise ParameterTypeError(f"{name} must be a string or None, got {value!r}")
    if value is not None:
        bad = next((c for c in value if unicodedata.category(c) in ("Cc", "Zl", "Zp")),
                   None)
        if bad is not None:
            raise ParameterValueError(
                f"{name} must be one line of printable text, got {value!r} (holding "
                f"{bad!r}, a line break or control character); replace it, e.g. with a "
                "space or ' / '")
    return value


def check_metadata(value: object) -> dict[str, str] | None:
    """An entry's ``metadata``: None, or a mapping of non-empty one-line texts to one-line
    texts (each as :func:`_check_opt_str`: ``privlearn budget history`` lists them on the
    entry's line), copied into a dict; an empty mapping is None (nothing recorded)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ParameterTypeError(
            f"metadata must be a mapping of text to text or None, got {value!r}; e.g. "
            "metadata={'noise_strategy': 'BandedToeplitz(bands=8, ...)'}")
    out = {}
    for k, v in value.items():
        _check_name("a metadata key", k)
        if not isinstance(v, str):
            raise ParameterTypeError(
                f"metadata[{k!r}] must be a string, got {v!r}; pass its text, e.g. str(v)")
        out[_check_opt_str("a metadata key", k)] = _check_opt_str(f"metadata[{k!r}]", v)
    return out or None


def _check_who(name: str, value: object) -> str | None:
    """Who made an entry (``user@host`` when None): one line of text, as
    :func:`_check_opt_str`, and not empty or blank (which would be recorded as no one,
    or silently replaced by ``user@host``)."""
    value = _check_opt_str(name, value)
    if value is not None and not value.strip():
        raise ParameterValueError(
            f"{name} must name who makes the entry (e.g. 'alice' or 'team-a'), got "
            f"{value!r}; pass None for the default, user@host")
    return value


def _check_mechanism(mechanism: object) -> tuple[Mechanism, str]:
    if not isinstance(mechanism, Mechanism):
        number = isinstance(mechanism, numbers.Real) and not isinstance(mechanism, bool)
        raise ParameterTypeError(
            f"mechanism must be a privlearn Mechanism, got {mechanism!r}; describe the "
            "release with privlearn.accounting (e.g. Gaussian(noise_multiplier))"
            + (f"; an epsilon alone does not say what ran: a pure-DP release at epsilon "
               f"{mechanism!r} is PureDP({mechanism!r}) (Laplace(noise_multiplier=b), which "
               f"composes more tightly, if it added Laplace noise of scale b times its L1 "
               f"sensitivity), an (epsilon, delta)-DP one ApproxDP({mechanism!r}, delta)"
               if number else ""))
    return mechanism, dumps(mechanism)


def _check_seq(name: str, value: object) -> int:
    """The ``seq`` of an entry (a reservation or its number), as an int."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise ParameterTypeError(
            f"{name} must be a Reservation or its seq (an int), got {value!r}") from None


def _check_head(value: object) -> tuple[int, str] | None:
    """An ``expected_head`` for :meth:`Ledger.verify`: None, or ``(count, hash)`` as
    :meth:`Ledger.head` returns it (a count >= 0 and 64 hexadecimal digits, in either
    case: returned in lower case, as the entries' hashes are stored)."""
    if value is None:
        return None
    if not (isinstance(value, tuple | list) and len(value) == 2):
        raise ParameterTypeError(
            f"expected_head must be None or (count, hash) as Ledger.head() returns it, got "
            f"{value!r}")
    count, h = value
    if not (isinstance(count, int) and not isinstance(count, bool) and count >= 0
            and isinstance(h, str) and len(h) == 64
            and all(c in "0123456789abcdef" for c in h.lower())):
        raise ParameterValueError(
            f"expected_head must be (count, hash) as Ledger.head() returns it (a count >= 0 "
            f"and 64 hexadecimal digits), got {value!r}")
    return int(count), h.lower()


#: How :func:`budget_conflict` names a setting a budget was created without.
_UNSET_SETTING = {"neighbouring": "to be fixed by the first release",
                  "adaptive_order": "not set"}


def budget_conflict(path: str, existing: Budget, asked: Budget, exist_ok: bool, *,
                    shell: bool = False) -> str:
    """The message of :meth:`Ledger.create_budget` refusing a budget already set: the
    settings that differ, and what to do instead, in Python's words or (``shell=True``,
    for ``privlearn budget init``) in the command line's."""
    def shown(value: object) -> str:
        return "none" if value is None else repr(getattr(value, "value", value))

    def setting(name: str) -> str:  # a setting left unset reads as words, not 'None'
        value, wanted = getattr(existing, name), getattr(asked, name)
        if value is None:
            return f"{name} {_UNSET_SETTING.get(name, 'not set')} (asked {shown(wanted)})"
        return f"{name}={shown(value)} (asked {shown(wanted)})"

    names = ("epsilon", "delta", "accountant", "adaptive", "adaptive_order", "neighbouring")
    differ = [setting(n) for n in names if getattr(existing, n) != getattr(asked, n)]
    head = (f"dataset {existing.dataset!r} (privacy unit {existing.privacy_unit!r}) already "
            f"has a budget in {path}")
    unit = ("" if existing.privacy_unit == "record"
            else f" --privacy-unit {existing.privacy_unit}")
    spend = (f"`privlearn budget spend {path} --dataset {existing.dataset}{unit} ...`"
             if shell else "ledger.budget(dataset)")
    if exist_ok:
        return (f"{head} with other settings: {', '.join(differ)}; budgets are never "
                "changed (the budget is the privacy of the data, not a quota to raise). "
                f"Spend from the existing one with {spend}, or name other data another "
                "dataset")
    rerun = ("pass --exist-ok, which accepts the budget when its settings are the ones "
             "given" if shell else "create_budget(..., exist_ok=True) returns the budget "
             "when its settings are the ones given")
    return (f"{head} (epsilon={existing.epsilon:g}, delta={existing.delta:g}); budgets "
            f"are never changed. Spend from it with {spend}; in a script that runs more "
            f"than once, {rerun}")
