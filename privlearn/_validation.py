"""The one validation vocabulary of privlearn (accounting, models, torch, CLI).

A leaf module: it imports only the standard library and the leaf :mod:`privlearn.errors`
(no NumPy), so every layer can use it without import cycles or heavy imports.

The rule for exception types
----------------------------
* :class:`~privlearn.errors.ParameterTypeError` (a :class:`TypeError`) -- the value has
  the wrong *type*: a string, ``None``, a bool, a list where a number is expected; a
  non-integral type where a count is expected; a non-callable where a function is expected.
* :class:`~privlearn.errors.ParameterValueError` (a :class:`ValueError`) -- the type is
  right but the *value* is not allowed: out of range, NaN, infinite where a finite number
  is needed, ``10.5`` steps, an unknown choice.

Every message names the parameter, the valid range, the value received and what to try
instead, e.g.::

    noise_multiplier must be in (0, inf) and finite, got -1.0; pass a positive number
    (the noise standard deviation divided by the sensitivity, e.g. 1.0)

Callers pass ``hint=`` for a domain-specific suggestion; without one a generic
suggestion derived from the range is appended. NumPy scalars are real numbers
(``numpy.float64`` registers with :class:`numbers.Real`), so ``check_real`` accepts them,
and so are 0-d NumPy arrays of a real dtype (``numpy.array(1.5)``, what array arithmetic
such as ``np.sqrt(np.array(x))`` gives), read as the number they hold; a boolean array,
an array of several values and a 0-d array of objects are refused as any non-number is.

Who uses it
-----------
Every layer: ``privlearn.accounting``, the estimators of ``privlearn.models``
(through the declarative constraints of :mod:`privlearn.models.constraints`), the PyTorch
engine (``make_private``, the optimizer's live ``noise_multiplier``/``max_grad_norm``,
the samplers) and the CLI, which maps both error types to exit status 2.
:class:`~privlearn.errors.ParameterTypeError` is a :class:`TypeError` and also a
:class:`ValueError` (as scikit-learn's ``InvalidParameterError`` is).
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Iterable
from enum import Enum
from typing import TypeVar

from privlearn.errors import ParameterTypeError, ParameterValueError

__all__ = [
    "check_real",
    "check_positive",
    "check_nonnegative",
    "check_delta",
    "check_gaussian_delta",
    "check_epsilon",
    "check_rate",
    "check_probability",
    "check_count",
    "check_steps",
    "MAX_STEPS",
    "check_repetitions",
    "MAX_REPETITIONS",
    "check_enum",
    "check_choice",
    "check_callable",
    "check_unit_ids",
]

E = TypeVar("E", bound=Enum)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _unwrap_0d(value: object) -> object:
    """A 0-d NumPy array of integers or floats as the Python number it holds (duck-typed:
    this module does not import NumPy); anything else unchanged."""
    if (type(value).__name__ == "ndarray" and type(value).__module__ == "numpy"
            and getattr(value, "ndim", None) == 0
            and getattr(getattr(value, "dtype", None), "kind", None) in ("i", "u", "f")):
        return value.item()  # type: ignore[attr-defined]
    return value


def _show(value: object) -> str:
    """``repr`` of a value, NumPy scalars as the Python number they hold (``1.5``, not
    ``np.float64(1.5)``)."""
    if type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(
            value, "ndim", None) == 0:
        return repr(value.item())
    return repr(value)


def _msg(name: str, expected: str, value: object, hint: str | None) -> str:
    text = f"{name} must be {expected}, got {_show(value)}"
    return f"{text}; {hint}" if hint else text


def check_real(name: str, value: object, *, hint: str | None = None) -> float:
    """A real number (bool excluded; a 0-d NumPy array of a real dtype is read as its
    number), returned as ``float``; :class:`TypeError` otherwise."""
    value = _unwrap_0d(value)
    if not _is_real(value):
        raise ParameterTypeError(
            f"{name} must be a real number, got {value!r} ({type(value).__name__}); "
            + (hint or "pass an int or a float")
        )
    return float(value)  # type: ignore[arg-type]


def check_positive(
    name: str, value: object, *, allow_inf: bool = False, hint: str | None = None
) -> float:
    """A finite (or, if ``allow_inf``, possibly infinite) number > 0."""
    x = check_real(name, value, hint=hint)
    rng = "in (0, inf]" if allow_inf else "in (0, inf) and finite"
    if math.isnan(x) or x <= 0 or (math.isinf(x) and not allow_inf):
        raise ParameterValueError(_msg(name, rng, value, hint or "pass a positive number"))
    return x


def check_nonnegative(
    name: str, value: object, *, allow_inf: bool = False, hint: str | None = None
) -> float:
    """A finite (or, if ``allow_inf``, possibly infinite) number >= 0."""
    x = check_real(name, value, hint=hint)
    rng = "in [0, inf]" if allow_inf else "in [0, inf) and finite"
    if math.isnan(x) or x < 0 or (math.isinf(x) and not allow_inf):
        raise ParameterValueError(_msg(name, rng, value, hint or "pass a number >= 0"))
    return x


#: What a refusal of a delta suggests: the common choices, and the rule that a delta of
#: 1 / n or more is no guarantee (publishing one random record of n in the clear is
#: (0, 1/n)-DP), so a delta is chosen well below it.
DELTA_HINT = "typical values are 1e-5 or smaller, well below 1 / dataset size"


def check_delta(
    name: str, value: object, *, allow_one: bool = False, hint: str | None = None
) -> float:
    """A privacy parameter delta in [0, 1) (or [0, 1] with ``allow_one``)."""
    x = check_real(name, value, hint=hint)
    if math.isnan(x) or not (0.0 <= x < 1.0 or (allow_one and x == 1.0)):
        rng = "in [0, 1]" if allow_one else "in [0, 1)"
        raise ParameterValueError(
            _msg(name, rng, value, hint or DELTA_HINT)
        )
    return x


def check_gaussian_delta(
    name: str, value: object, *, pure_dp_alternative: str | None = None,
    hint: str | None = None,
) -> float:
    """A delta for a mechanism with Gaussian noise: in (0, 1).

    ``delta = 0`` asks for pure DP, which Gaussian noise never gives (its epsilon at
    delta 0 is infinite: the privacy loss of a Gaussian pair is unbounded; Balle & Wang
    2018, Theorem 8), so it is refused here, once for every layer, rather than answered
    with an infinite epsilon. ``pure_dp_alternative`` names the switch to a pure-DP
    mechanism in the caller's vocabulary (``"--mechanism laplace"``,
    ``"noise='laplace'"``) for the message.
    """
    x = check_delta(name, value, hint=hint)
    if x == 0.0:
        instead = (f"try {pure_dp_alternative} for pure DP, or a positive {name}"
                   if pure_dp_alternative else f"pass a positive {name}")
        raise ParameterValueError(
            f"{name} must be in (0, 1) with Gaussian noise, got 0: pure DP (delta 0) is "
            f"impossible with Gaussian noise, whose epsilon at delta 0 is infinite; "
            f"{instead} such as 1e-5"
        )
    return x


def check_epsilon(name: str, value: object, *, hint: str | None = None) -> float:
    """A privacy parameter epsilon in [0, inf)."""
    return check_nonnegative(name, value, hint=hint or "typical values are 0.1 to 10")


def check_rate(name: str, value: object, *, hint: str | None = None) -> float:
    """A sampling rate in (0, 1]."""
    x = check_real(name, value, hint=hint)
    if math.isnan(x) or not 0.0 < x <= 1.0:
        raise ParameterValueError(
            _msg(name, "in (0, 1]", value, hint or "use batch size / dataset size")
        )
    return x


def check_probability(name: str, value: object, *, hint: str | None = None) -> float:
    """A probability in [0, 1] (callers narrow the range, e.g. randomized response)."""
    x = check_real(name, value, hint=hint)
    if math.isnan(x) or not 0.0 <= x <= 1.0:
        raise ParameterValueError(_msg(name, "in [0, 1]", value, hint or "pass a probability"))
    return x


def check_count(name: str, value: object, *, minimum: int = 0, hint: str | None = None,
                integral_floats: bool = True, maximum: int | None = None,
                max_hint: str | None = None) -> int:
    """An integer count >= ``minimum`` (steps, compositions, categories).

    Integral floats such as ``10.0`` are accepted (unless ``integral_floats=False``, as
    the estimators' scikit-learn parameters want: then a float is a wrong type);
    ``10.5`` is a :class:`ValueError` (a real number, but not a count) and ``"10"`` a
    :class:`TypeError`. A 0-d NumPy array is read as the number it holds.
    """
    value = _unwrap_0d(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if not _is_real(value) or not integral_floats:
            raise ParameterTypeError(
                f"{name} must be an integer >= {minimum}, got {value!r} "
                f"({type(value).__name__}); " + (hint or "pass an int")
            )
        f = float(value)  # type: ignore[arg-type]
        if not (math.isfinite(f) and f.is_integer()):
            raise ParameterValueError(
                _msg(name, f"an integer >= {minimum}", value, hint or "round it to an integer")
            )
        value = int(f)
    v = int(value)  # type: ignore[call-overload]
    if v < minimum:
        raise ParameterValueError(
            _msg(name, f"an integer >= {minimum}", value, hint or f"pass at least {minimum}")
        )
    if maximum is not None and v > maximum:
        raise ParameterValueError(
            _msg(name, f"an integer in [{minimum}, {maximum:,}]", value,
                 max_hint or hint or f"pass at most {maximum:,}")
        )
    return v


#: The most steps one training run may ask for (an estimator's ``n_iter``, the PyTorch
#: engine's ``steps`` and ``epochs``): 2**31 - 1, the int32 step counters of NumPy and the
#: accountants' compositions, and days of training at any real step time. A larger count
#: (``2**63``, ``2**70``) reached the run as a bare ``OverflowError``, an accountant
#: calibration without end, or a plan that never finished.
MAX_STEPS = 2**31 - 1


def check_steps(name: str, value: object, *, integral_floats: bool = True,
                example: str = "1000") -> int:
    """A count of training steps (iterations, epochs): an integer in [1, :data:`MAX_STEPS`].

    ``example`` is the suggestion of the message when the count is too large (e.g.
    ``"n_iter=1000"``).
    """
    return check_count(
        name, value, minimum=1, integral_floats=integral_floats, maximum=MAX_STEPS,
        max_hint=(f"more than 2**31 - 1 is days of training at any step time, more than "
                  f"any real run; pass fewer, e.g. {example}"))


#: The most repetitions of one experiment (``privlearn reproduce --reps``,
#: :func:`privlearn.experiments.run_experiment`): 10**6, as many as a search's
#: ``expected_runs``; ``--reps 2**70`` ended in a traceback (NumPy's "Maximum allowed
#: dimension exceeded").
MAX_REPETITIONS = 10**6


def check_repetitions(name: str, value: object) -> int:
    """A number of independent repetitions: an ``int`` in [1, :data:`MAX_REPETITIONS`]."""
    return check_count(
        name, value, minimum=1, integral_floats=False, maximum=MAX_REPETITIONS,
        max_hint="each repetition is a full run of the experiment and 10**6 already "
                 "average out its noise; pass fewer, e.g. 100")


def check_enum(name: str, value: object, enum_type: type[E], *, hint: str | None = None) -> E:
    """An enum member or its string value / name (case-insensitive, ``-`` as ``_``)."""
    if isinstance(value, enum_type):
        return value
    valid = ", ".join(repr(m.value) for m in enum_type)
    if not isinstance(value, str):
        raise ParameterTypeError(
            f"{name} must be one of {valid}, got {value!r} ({type(value).__name__}); "
            + (hint or f"pass a string or a {enum_type.__name__} member")
        )
    key = value.strip().lower().replace("-", "_")
    for member in enum_type:
        if key in (str(member.value).lower(), member.name.lower()):
            return member
    raise ParameterValueError(_msg(name, f"one of {valid}", value, hint))


def check_choice(
    name: str, value: object, choices: Iterable[str], *, hint: str | None = None
) -> str:
    """One of ``choices`` (case-insensitive); returned lower-case."""
    opts = tuple(choices)
    valid = ", ".join(repr(c) for c in opts)
    if not isinstance(value, str):
        raise ParameterTypeError(
            f"{name} must be one of {valid}, got {value!r} ({type(value).__name__})"
            + (f"; {hint}" if hint else "")
        )
    key = value.strip().lower()
    if key not in {c.lower() for c in opts}:
        if hint is None:
            close = difflib.get_close_matches(key, [c.lower() for c in opts], n=1)
            hint = f"did you mean {close[0]!r}?" if close else None
        raise ParameterValueError(_msg(name, f"one of {valid}", value, hint))
    return key


def check_callable(name: str, value: object, *, hint: str | None = None) -> object:
    """A callable; :class:`TypeError` otherwise."""
    if not callable(value):
        raise ParameterTypeError(_msg(name, "callable", value, hint or "pass a function"))
    return value


def _missing_id(value: object) -> bool:
    """Whether a unit id is a missing value: None, a float NaN (also NumPy's), pandas'
    ``NA`` / ``NaT``, or anything else that is not equal to itself."""
    if value is None:
        return True
    try:
        return bool(value != value)  # NaN, NaT; pd.NA's comparison is ambiguous
    except (TypeError, ValueError):
        return type(value).__name__ in ("NAType", "NaTType")


def _id_kind(value: object) -> str:
    """The kind of a unit id, for the one-kind rule: numbers (ints and floats, NumPy's
    too, compare equal across types: 1 == 1.0) form one kind; any other type is its own."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, numbers.Number):
        return "number"
    return type(value).__name__


def check_unit_ids(name: str, values: Iterable, *, show: int = 5) -> list:
    """The privacy-unit ids (users, groups) of every row, checked by the one rule of
    privlearn for unit ids.

    Two rows belong to the same unit exactly when their ids are equal, so an id must be
    equal to itself and comparable with the others:

    * a missing id (``None``, NaN -- what NumPy and pandas make of an integer column
      with gaps --, ``pd.NA``, ``NaT``) is refused: ``nan != nan`` would make every NaN
      row a unit of its own, so one person's rows would count as several units and the
      per-unit guarantee would not cover them;
    * ids of more than one kind (numbers and strings, say) are refused: ``1`` and ``"1"``
      would be two units, which is rarely what the column means.

    Numbers of any type are one kind (an integral float id ``2.0`` is the unit ``2``).

    Parameters
    ----------
    name : str
        What the ids are, for the message (``"users"``, ``"user_column='user'"``).
    values : iterable
        One id per row (a list, a NumPy array, a pandas Series, a tensor).

    Returns
    -------
    list
        The ids as Python objects (NumPy scalars as the Python numbers they hold).

    Raises
    ------
    ParameterValueError
        A missing id or ids of several kinds, naming the first rows concerned and what to
        do (fill or drop them, or give every row an explicit id).
    ParameterTypeError
        An id that cannot be a key (unhashable).
    """
    kind = getattr(getattr(values, "dtype", None), "kind", None)  # a NumPy array's
    if kind in ("i", "u") and getattr(values, "ndim", 1) == 1:
        return values.tolist()  # integers: never missing, one kind
    ids = list(values.tolist() if hasattr(values, "tolist") else values)
    if kind == "f" and getattr(values, "ndim", 1) == 1:
        bad = [i for i, v in enumerate(ids) if v != v]
    else:
        bad = [i for i, v in enumerate(ids) if _missing_id(v)]
    if bad:
        rows = ", ".join(str(i) for i in bad[:show]) + (", ..." if len(bad) > show else "")
        raise ParameterValueError(
            f"{name} has a missing id (None, NaN, NA or NaT) in {len(bad)} of its "
            f"{len(ids)} rows (rows {rows}; first value {ids[bad[0]]!r}). A missing id names "
            "no unit: NaN ids are all different from each other, so one person's rows would "
            "count as several units and the per-unit guarantee would not cover them. Fill "
            "them with the right ids, drop those rows, or give each such row an explicit "
            "id of its own")
    if kind == "f" and getattr(values, "ndim", 1) == 1:
        return ids  # finite floats: one kind
    kinds: dict[str, list[int]] = {}
    for i, v in enumerate(ids):
        try:
            hash(v)
        except TypeError:
            raise ParameterTypeError(
                f"{name} must hold one hashable id per row (an int or a str), got "
                f"{type(v).__name__} {_show(v)} at row {i}") from None
        kinds.setdefault(_id_kind(v), []).append(i)
    if len(kinds) > 1:
        main = max(kinds, key=lambda k: len(kinds[k]))
        parts = []
        for k, rows in kinds.items():
            if k != main:
                shown = ", ".join(str(i) for i in rows[:show]) + (
                    ", ..." if len(rows) > show else "")
                parts.append(f"{len(rows)} of type {k} (rows {shown})")
        raise ParameterValueError(
            f"{name} mixes id types: most ids are of type {main}, and "
            + "; ".join(parts) + ". Ids of different types never match (1 != '1'), so "
            "one unit could be split in two; convert the column to one type (e.g. all "
            "str, or all int)")
    return [v.item() if type(v).__module__ == "numpy" and hasattr(v, "item") else v
            for v in ids]
