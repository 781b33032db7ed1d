"""Declarative parameter constraints of the private estimators (scikit-learn style).

Each estimator declares, next to its ``__init__``, what every constructor parameter may
be::

    class DPSGDClassifier(ClassifierMixin, PrivateEstimator):
        _parameter_constraints = {
            "epsilon": EPSILON,
            "delta": Delta(),
            "n_iter": Integer(1),
            "noise": Options("gaussian", "laplace"),
            "random_state": RANDOM_STATE,
            ...
        }

and :meth:`privlearn.models.PrivateEstimator._validate_params` checks them all when
``fit`` starts, before any data is read and before any attribute is set (scikit-learn
convention: ``__init__`` only stores). The checks are those of
:mod:`privlearn._validation`, the one validation vocabulary of privlearn: a wrong type
raises :class:`~privlearn._validation.ParameterTypeError` (a TypeError that is also a
ValueError), a wrong value :class:`ValueError`, each message naming the parameter, the
valid range, the value received and what to try. Checks that relate several parameters
(e.g. Gaussian noise needs ``delta > 0``) belong to the estimator's ``_plan``.

``tests/models/test_params.py`` checks that every constructor parameter of every
estimator in :mod:`privlearn.models` is declared, and that each declared constraint
refuses a wrong type and a wrong value with the parameter's name in the message.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from privlearn import _validation as _v
from privlearn.errors import ParameterValueError

__all__ = [
    "Constraint",
    "Real",
    "Integer",
    "Options",
    "Boolean",
    "Delta",
    "Seed",
    "Unchecked",
    "PublicClasses",
    "Verbosity",
    "EPSILON",
    "ACCOUNTANT",
    "RANDOM_STATE",
    "LEDGER",
    "NOISE_MULTIPLIER",
    "VERBOSE",
    "MAX_ITERATIONS",
    "N_ITER",
    "N_BINS",
    "TRAJECTORY_POINTS",
]


class Constraint:
    """What one constructor parameter may be; :meth:`check` returns the normalised
    value or raises."""

    allow_none: bool = False

    def check(self, name: str, value: object) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, name: str, value: object) -> Any:
        if value is None and self.allow_none:
            return None
        return self.check(name, value)


@dataclass(frozen=True)
class Real(Constraint):
    """A real number in ``[low, high]`` (``None``: unbounded; ``*_open``: excluded)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    allow_none: bool = False
    allow_inf: bool = False
    hint: str | None = None
    #: said instead of ``hint`` when an infinity is refused
    inf_hint: str | None = None

    def check(self, name: str, value: object) -> float:
        x = _v.check_real(name, value, hint=self.hint)
        lo = "-inf" if self.low is None else f"{self.low:g}"
        hi = "inf" if self.high is None else f"{self.high:g}"
        rng = f"{'(' if self.low_open or self.low is None else '['}{lo}, {hi}" \
              f"{')' if self.high_open or self.high is None else ']'}"
        bad = math.isnan(x) or (math.isinf(x) and not self.allow_inf)
        if self.low is not None:
            bad |= x < self.low or (self.low_open and x == self.low)
        if self.high is not None:
            bad |= x > self.high or (self.high_open and x == self.high)
        if bad:
            fin = "" if self.allow_inf else " and finite"
            none = " or None" if self.allow_none else ""
            hint = self.inf_hint if math.isinf(x) and self.inf_hint else self.hint
            raise ParameterValueError(_v._msg(name, f"in {rng}{fin}{none}", value,
                                     hint or "see the estimator's docstring"))
        return x


@dataclass(frozen=True)
class Integer(Constraint):
    """An ``int`` >= ``minimum`` and, with ``maximum``, <= ``maximum`` (``max_hint``
    says why the bound and what to try); floats are refused, as scikit-learn refuses
    them."""

    minimum: int = 1
    allow_none: bool = False
    hint: str | None = None
    maximum: int | None = None
    max_hint: str | None = None

    def check(self, name: str, value: object) -> int:
        return _v.check_count(name, value, minimum=self.minimum, hint=self.hint,
                              integral_floats=False, maximum=self.maximum,
                              max_hint=self.max_hint)


@dataclass(frozen=True)
class Verbosity(Integer):
    """scikit-learn's ``verbose``: an ``int`` >= ``minimum`` (0: silent), or a bool
    (``True`` is 1)."""

    minimum: int = 0
    hint: str | None = "0: silent, 1: a progress bar"

    def check(self, name: str, value: object) -> int:
        if isinstance(value, bool) or type(value).__name__ == "bool_":
            return int(value)  # type: ignore[call-overload]
        return super().check(name, value)


@dataclass(frozen=True, init=False)
class Options(Constraint):
    """One of the given strings (case-insensitive)."""

    choices: tuple[str, ...]
    allow_none: bool = False
    hint: str | None = None

    def __init__(self, *choices: str, allow_none: bool = False, hint: str | None = None):
        object.__setattr__(self, "choices", tuple(choices))
        object.__setattr__(self, "allow_none", allow_none)
        object.__setattr__(self, "hint", hint)

    def check(self, name: str, value: object) -> str:
        return _v.check_choice(name, value, self.choices, hint=self.hint)


@dataclass(frozen=True)
class Boolean(Constraint):
    """``True`` or ``False`` (NumPy bools too)."""

    def check(self, name: str, value: object) -> bool:
        if isinstance(value, bool) or type(value).__name__ == "bool_":
            return bool(value)
        raise _v.ParameterTypeError(
            f"{name} must be True or False, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class Delta(Constraint):
    """A privacy parameter delta in [0, 1)."""

    allow_none: bool = False
    hint: str | None = "use a value well below 1 / n_samples, e.g. 1e-6"

    def check(self, name: str, value: object) -> float:
        return _v.check_delta(name, value, hint=self.hint)


@dataclass(frozen=True)
class Seed(Constraint):
    """The source of a release's noise: ``None`` (fresh OS entropy, the default), a
    non-negative int seed, or a NumPy ``Generator`` / ``RandomState`` (see
    :func:`privlearn.models.base.make_rng`)."""

    def check(self, name: str, value: object) -> object:
        if value is None or isinstance(value, np.random.Generator | np.random.RandomState):
            return value
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            if int(value) < 0:
                raise ParameterValueError(_v._msg(name, "None, an int >= 0, a numpy Generator or "
                                         "RandomState", value, "leave it None in production"))
            return int(value)
        raise _v.ParameterTypeError(
            f"{name} must be None, an int >= 0, a numpy Generator or RandomState, got "
            f"{value!r} ({type(value).__name__}); leave it None in production")


@dataclass(frozen=True)
class AccountantName(Constraint):
    """An accountant: a registered name or an ``Accountant`` object
    (:func:`privlearn.accounting.get_accountant`), returned as given. Checked here, with
    the other parameters: a list or a dict reached the calibration's cache as a bare
    ``TypeError`` ("unhashable type")."""

    allow_none: bool = False

    def check(self, name: str, value: object) -> object:
        from privlearn.accounting import get_accountant

        try:
            get_accountant(value)  # type: ignore[arg-type]
        except ValueError as e:  # ParameterTypeError and ParameterValueError
            raise type(e)(str(e).replace("accountant must", f"{name} must", 1)) from None
        return value


@dataclass(frozen=True)
class Unchecked(Constraint):
    """A parameter checked elsewhere (``reason`` says where), e.g. a ledger by the
    ledger layer."""

    reason: str = ""

    def check(self, name: str, value: object) -> object:
        return value


def _label_kind(label: object) -> str:
    """``"number"``, ``"str"``, ``"bytes"`` or ``"other"`` (None, an object)."""
    if isinstance(label, numbers.Number | np.bool_):
        return "number"
    if isinstance(label, str):  # numpy's str_ included
        return "str"
    return "bytes" if isinstance(label, bytes) else "other"


@dataclass(frozen=True)
class PublicClasses(Constraint):
    """A classifier's public label set: ``None`` (inferred from ``y``, with a warning) or
    a 1-D sequence of distinct labels, none of them NaN or infinite (no ``y`` can hold
    such a label: ``y`` with NaN or inf is refused), of exactly ``size`` labels (``None``:
    at least 2). :meth:`check` returns it as an array."""

    allow_none: bool = True
    size: int | None = None
    #: what to try instead when more than ``size`` labels are given (a binary model
    #: given a multi-class label set)
    too_many: str = ""

    def check(self, name: str, value: object) -> np.ndarray:
        want = f"exactly {self.size}" if self.size is not None else "at least 2"
        example = "classes=[0, 1]" if self.size == 2 else "classes=[0, 1] or classes=range(10)"
        hint = f"pass the public label set, e.g. {example}"
        if self.too_many and self.size is not None and hasattr(value, "__len__") and not (
                isinstance(value, str | bytes | dict)) and len(value) > self.size:
            hint = self.too_many
        if isinstance(value, str | bytes | dict | set | frozenset) or not (
                hasattr(value, "__len__") or hasattr(value, "__iter__")):
            raise _v.ParameterTypeError(
                f"{name} must be None or a sequence of {want} distinct labels, got "
                f"{value!r} ({type(value).__name__}); {hint}")
        try:
            cl = np.asarray(value if isinstance(value, np.ndarray) else list(value))
        except (TypeError, ValueError):  # ragged nested sequences
            cl = None
        if cl is None or cl.ndim != 1 or cl.size < 2 or (
                self.size is not None and cl.size != self.size):
            raise ParameterValueError(_v._msg(
                name, f"a 1-D sequence of {want} distinct labels", value, hint))
        # of one kind, read from the labels as given: np.asarray turns [0, "a"] into the
        # strings ["0", "a"] (and None makes an object array that cannot be sorted)
        given = value.tolist() if isinstance(value, np.ndarray) else list(value)
        kinds = {_label_kind(v) for v in given}
        if len(kinds) > 1 or "other" in kinds:
            raise ParameterValueError(_v._msg(
                name, "labels of one kind (all numbers or all strings)", value,
                f"{hint}, or all strings, e.g. classes=['no', 'yes']"))
        labels = cl.tolist()
        bad = [v for v in labels if isinstance(v, numbers.Real)
               and not isinstance(v, numbers.Integral) and not math.isfinite(float(v))]
        if bad:
            raise ParameterValueError(_v._msg(
                name, "labels that are not NaN or infinite (no y holds one: a y with NaN "
                "or inf is refused)", value, f"{hint}, without {bad[0]!r}"))
        seen: set = set()
        for v in labels:
            if v in seen:
                raise ParameterValueError(_v._msg(
                    name, f"{want} distinct labels", value,
                    f"pass the public label set with each label once ({v!r} appears "
                    f"more than once), e.g. {example}"))
            seen.add(v)
        return cl


#: Constraints shared by most estimators.
EPSILON = Real(0, None, low_open=True,
               hint="it is the privacy budget, typically between 0.1 and 10",
               inf_hint="epsilon=inf would be a non-private fit, which no accountant "
                        "covers: for a non-private baseline fit the scikit-learn estimator "
                        "instead (e.g. sklearn.linear_model.LinearRegression)")
ACCOUNTANT = AccountantName()
RANDOM_STATE = Seed()
LEDGER = Unchecked("a budget handle, checked by the ledger layer")
NOISE_MULTIPLIER = Real(0, None, low_open=True, allow_none=True,
                        hint="leave it None to calibrate from (epsilon, delta)")
VERBOSE = Verbosity()

#: The most iterations an iterative estimator's ``n_iter`` may ask for: the shared bound
#: of every training-step count, :data:`privlearn._validation.MAX_STEPS` (2**31 - 1).
MAX_ITERATIONS = _v.MAX_STEPS
#: ``n_iter``: at least one iteration, at most :data:`MAX_ITERATIONS`.
N_ITER = Integer(1, maximum=MAX_ITERATIONS,
                 max_hint="more than 2**31 - 1 is days of training at any step time, more "
                          "than any real run; pass fewer, e.g. n_iter=1000")
#: A histogram's ``n_bins`` (:class:`~privlearn.models.PrivateStandardScaler`): at least
#: 2, at most 10**6 per feature; 2**70 bins ran out of memory allocating the edges.
N_BINS = Integer(2, maximum=10**6,
                 max_hint="more than 10**6 bins per feature costs memory for bins whose "
                          "counts the noise swamps; pass fewer, e.g. n_bins=64 (the "
                          "default)")
#: A DP-SGD estimator's ``trajectory_points``: at least 1, at most 10**4 points of
#: ``epsilon_trajectory_``; each is one accountant evaluation after the fit, so 2**70
#: points with a long run evaluated epsilon at every step (hours, then out of memory for
#: the step grid).
TRAJECTORY_POINTS = Integer(1, maximum=10**4,
                            max_hint="each point is one accountant evaluation after the "
                                     "fit and more than 10**4 draw no finer curve; pass "
                                     "fewer, e.g. trajectory_points=20 (the default)")
